"""The per-layer figures of mixture-of-experts layers in a step's metrics record, from what every router counted
in the step's backward passes (`megamamba.model.moe_router.RouterLoad`) over all ranks.

For the block at index i of the pattern (mamba_ssm's backbone.layers.i):
- moe_layer{i}_load_max_over_mean: the tokens of its busiest expert over the mean tokens per expert (1 = balanced);
- moe_layer{i}_aux_loss: its router losses (load balancing and z, times their coefficients), the mean over the
  micro-batches of every data-parallel rank (under context parallelism the sum of each micro-batch's shares);
  when moe_cfg has a coefficient;
- moe_layer{i}_expert_bias_norm: the L2 norm of its expert bias after the step's update; with expert_bias;
- moe_layer{i}_dropped_tokens: the token copies its experts' capacity dropped over the global batch; with a
  capacity_factor.
"""

import math
import re

import torch
import torch.distributed as dist

from megamamba.config import MOE_LETTER, MambaConfig
from megamamba.observe.metrics import MOE_METRIC_PREFIX
from megamamba.pipelines.loop.agreement import device

_BLOCK = re.compile(r"^backbone\.layers\.(\d+)\.")
_COUNTS = ("dropped", "aux_loss", "micro_batches", "bias_square_norm")  # after the tokens per expert


def moe_metrics(config: MambaConfig, trainer) -> dict:
    """The figures of every MoE layer of the model for the last step (collective: one all-reduce on every rank,
    one host synchronization); {} without MoE layers. Each stage fills its own layers: the tokens and losses
    from every data-parallel rank (tensor rank 0), the bias from the stage's first data rank."""
    layers = [i for i, symbol in enumerate(config.layer_pattern) if symbol == MOE_LETTER]
    if not layers:
        return {}
    options = config.moe_options
    experts, width = options.num_experts, options.num_experts + len(_COUNTS)
    table = torch.zeros(len(layers), width, dtype=torch.float64, device=device())
    counts_here = trainer.tensor_rank == 0
    bias_here = counts_here and trainer.dp_rank == 0 and trainer.context_rank == 0
    for name, load, bias in trainer.router_states():
        row = table[layers.index(_block_of(name))]
        if counts_here and load is not None:
            row[:experts] = load.tokens_per_expert
            row[experts : experts + 3] = torch.stack(
                [load.dropped.double(), load.aux_loss.double(), torch.tensor(float(load.micro_batches)).to(row)]
            )
        if bias_here and bias is not None:
            row[-1] = bias.double().square().sum()
    dist.all_reduce(table)
    context = 1 if trainer.cp is None else trainer.cp.size  # every rank of a CP group counted each micro-batch
    record = {}
    for layer, row in zip(layers, table.tolist()):
        tokens, (dropped, aux_loss, micro_batches, bias_square_norm) = row[:experts], row[experts:]
        key = f"{MOE_METRIC_PREFIX}{layer}_"
        mean = sum(tokens) / experts
        record[key + "load_max_over_mean"] = max(tokens) / mean if mean else None
        if options.aux_loss_coeff or options.z_loss_coeff:
            record[key + "aux_loss"] = aux_loss * context / micro_batches if micro_batches else None
        if options.expert_bias:
            record[key + "expert_bias_norm"] = math.sqrt(bias_square_norm)
        if options.capacity_factor is not None:
            record[key + "dropped_tokens"] = int(dropped)
    return record


def _block_of(router_weight: str) -> int:
    """The block index in a router weight's mamba_ssm name (backbone.layers.i.mixer.gate.weight)."""
    match = _BLOCK.match(router_weight)
    if match is None:
        raise ValueError(f"{router_weight!r} is not a block's parameter (backbone.layers.<i>.…)")
    return int(match.group(1))
