"""Which layers of the layer list (`megamamba.model.layers`) each pipeline stage runs.

- "cost" (the default): each block weighs its forward FLOPs per token at the run's sequence length
  (`megamamba.model.flops.layer_flops`; attention's QK^T and AV grow with it), the embedding counts
  with the first block, the final norm and the head with the last. The cut makes the most expensive
  stage as cheap as it can be, then spreads the rest evenly (least sum of squared stage costs), and
  gives every stage a block. A pure Mamba model's stages differ from DeepSpeed's "type:Block" (equal
  block counts): the head's 2 x d_model x vocab FLOPs move blocks off the last stage.
- A hybrid_layer_pattern with "|": its segments are the stages, whatever the method; the embedding
  goes with the first, the final norm and the head with the last. There must be pp segments.
- "uniform", "parameters", "type:<regex>": DeepSpeed's PipelineModule partitions as it documents.
"""

import functools
import json
import math
from itertools import accumulate
from typing import Optional

from megamamba.config import MambaConfig
from megamamba.errors import LayoutError
from megamamba.model.flops import layer_flops
from megamamba.model.layers import layer_count

DEFAULT_PARTITION = "cost"
PARTITION_METHODS = ("cost", "uniform", "parameters", "type:<regex>")


def check_partition_method(method: str) -> None:
    if method not in ("cost", "uniform", "parameters") and not (method.startswith("type:") and len(method) > 5):
        raise ValueError(f"partition method {method!r}: choose one of {PARTITION_METHODS}")


def check_pattern_stages(config: MambaConfig, pp: int) -> None:
    """Refuse a hybrid_layer_pattern whose | marks cut another number of stages than `pp`."""
    stages = config.pattern_stages
    if stages and len(stages) != pp:
        raise LayoutError(
            f"hybrid_layer_pattern={config.hybrid_layer_pattern!r} marks {len(stages)} pipeline stages "
            f"with |, but the pipeline parallel size is {pp}: give --pipeline-parallel-size "
            f"{len(stages)}, or change the | marks"
        )


def balanced_cuts(weights: list, parts: int) -> list:
    """Where `parts` consecutive non-empty runs of `weights` start, and the end: the heaviest run as light as
    it can be, and under that bound the least sum of squared run weights; among equals, lighter runs first
    (a pipeline's first stages hold the most micro-batches in flight)."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} runs of {n} weights: every run needs at least one")
    prefix = list(accumulate(weights, initial=0))
    runs = range(1, parts + 1)
    heaviest = {(0, 0): 0}  # (runs, items) -> the lightest heaviest run
    for j in runs:
        for i in range(j, n - parts + j + 1):
            heaviest[j, i] = min(
                max(heaviest[j - 1, k], prefix[i] - prefix[k]) for k in range(j - 1, i) if (j - 1, k) in heaviest
            )
    bound = heaviest[parts, n]
    squares, start = {(0, 0): 0}, {}
    for j in runs:
        for i in range(j, n - parts + j + 1):
            options = [
                (squares[j - 1, k] + (prefix[i] - prefix[k]) ** 2, k)
                for k in range(j - 1, i)
                if (j - 1, k) in squares and prefix[i] - prefix[k] <= bound
            ]
            if options:
                squares[j, i], start[j, i] = min(options)
    cuts = [n]
    for j in range(parts, 0, -1):
        cuts.append(start[j, cuts[-1]])
    return cuts[::-1]


def _layer_bounds(config: MambaConfig, block_cuts: list) -> list:
    """Block cuts [0, .., n_layer] as layer-list bounds: the embedding before block 0, norm and head after the last."""
    return [0, *(c + 1 for c in block_cuts[1:-1]), layer_count(config)]


def cost_bounds(config: MambaConfig, pp: int, seq_length: int) -> list:
    """The layer-list bounds of the "cost" partition at `seq_length` tokens per sequence."""
    return list(_cost_bounds(json.dumps(config.to_dict(), sort_keys=True), pp, seq_length))


@functools.lru_cache(maxsize=256)
def _cost_bounds(config_json: str, pp: int, seq_length: int) -> tuple:
    """`cost_bounds` of a config given as its JSON: cut once per (config, pp, seq), as plans repeat them."""
    config = MambaConfig.from_dict(json.loads(config_json))
    costs = layer_flops(config, seq_length)
    blocks = costs[1:-2]
    blocks[0] += costs[0]
    blocks[-1] += costs[-2] + costs[-1]
    return tuple(_layer_bounds(config, balanced_cuts(blocks, pp)))


def own_bounds(config: MambaConfig, pp: int, method: str, seq_length: int) -> Optional[list]:
    """The first layer of each stage and the end, for the pattern's | marks or the "cost" method; None where
    DeepSpeed partitions (its own methods)."""
    if config.pattern_stages:
        check_pattern_stages(config, pp)
        return _layer_bounds(config, [0, *accumulate(config.pattern_stages)])
    if method == "cost":
        return cost_bounds(config, pp, seq_length)
    return None


def stage_costs(config: MambaConfig, bounds: list, seq_length: int) -> list:
    """Forward FLOPs per token of each stage's layers."""
    costs = layer_flops(config, seq_length)
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def imbalance(costs: list) -> float:
    """The most expensive stage over the mean stage: 1 is perfect balance."""
    return max(costs) * len(costs) / math.fsum(costs)
