"""The router of a mixture-of-experts block: each token's experts and their weights, in float32, as transformers'
NemotronH routes (scores, a selection-only bias, group-limited choice, normalisation, scaling), with Megatron's
load-balancing and z losses, and the per-expert bias update of aux-loss-free balancing (`update_expert_biases`)
from what each router routed in the backward passes (`RouterLoad`, which the step's metrics read too).

Ties are broken the same way on every device: among equal scores the lower expert index wins (a stable sort).
Under context parallelism a router sees its slice of every sequence; its losses are then this rank's share of the
whole sequences' losses (the per-expert counts summed over the context-parallel group), which the training
loss's gradient adds up over the group.
"""

from typing import NamedTuple, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.config import MoEOptions
from megamamba.model.moe_dispatch import capacity_of
from megamamba.parallel import split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.collectives import start_all_reduce

NORM_EPS = 1e-20  # transformers' and Megatron's guard in the top-k normalisation


class Routing(NamedTuple):
    """Per token (flattened batch x sequence): `experts` (tokens, top_k) int64, `weights` (tokens, top_k) float32
    or wider; `tokens_per_expert` (num_experts,) int64; `aux_loss` the load-balancing and z losses times their
    coefficients (a scalar), None when not training or with both coefficients 0."""

    experts: torch.Tensor
    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: Optional[torch.Tensor]


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest of `values` along the last axis, largest first; equal values in index order."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def scores_of(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Every expert's score for every token: softmax over the experts, or each expert's sigmoid."""
    return logits.softmax(dim=-1) if score_function == "softmax" else logits.sigmoid()


def select_experts(scores: torch.Tensor, options: MoEOptions, expert_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """(tokens, top_k) chosen experts: the best scores + `expert_bias`, among the experts of each token's topk_group
    best groups (a group scored by the sum of its two best), as DeepSeek-V3 and transformers' NemotronH."""
    choice = scores if expert_bias is None else scores + expert_bias
    if options.n_group > 1:
        grouped = choice.view(-1, options.n_group, options.experts_per_group)
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, top_indices(group_scores, options.topk_group), True)
        choice = choice.masked_fill(~kept.repeat_interleave(options.experts_per_group, dim=1), float("-inf"))
    return top_indices(choice, options.top_k)


def expert_weights(scores: torch.Tensor, experts: torch.Tensor, options: MoEOptions) -> torch.Tensor:
    """The chosen experts' unbiased scores, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor."""
    weights = scores.gather(1, experts)
    if options.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * options.routed_scaling_factor


def load_balancing_loss(
    logits: torch.Tensor, options: MoEOptions, cp: Optional[ContextParallel] = None
) -> torch.Tensor:
    """Megatron's switch loss E / (k T^2) * sum_i P_i c_i on (batch, seqlen, experts) logits, without its
    coefficient: P_i the summed scores of expert i (sigmoid scores normalised per token), c_i the tokens whose k
    best scores include i (a count, no gradient), T the tokens: over the micro-batch (aux_loss), or per
    sequence and averaged over the sequences (seq_aux_loss). Under `cp` the logits are this rank's slice of the
    sequences: c_i and T are the whole sequences', P_i this slice's, so the shares add up to the loss."""
    scores = logits.softmax(dim=-1) if options.score_function == "softmax" else logits.sigmoid()
    if options.score_function == "sigmoid":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + NORM_EPS)
    if options.aux_loss_type == "aux_loss":
        scores = scores.reshape(1, -1, options.num_experts)
    chosen = F.one_hot(top_indices(scores.detach(), options.top_k), options.num_experts).sum(dim=-2)
    counts = chosen.sum(dim=1).to(scores.dtype)  # (sequences, experts)
    tokens = scores.shape[1]
    cp = split(cp)
    if cp is not None:
        counts, tokens = start_all_reduce(counts.contiguous(), cp).wait(), tokens * cp.size
    per_sequence = (scores.sum(dim=1) * counts).sum(dim=-1) * options.num_experts / (options.top_k * tokens**2)
    return per_sequence.mean()


def z_loss(logits: torch.Tensor, cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """ST-MoE's router z-loss without its coefficient: the mean over tokens of logsumexp(logits)^2 (under `cp`,
    this slice's share of the whole sequences' mean)."""
    cp = split(cp)
    return torch.logsumexp(logits, dim=-1).square().mean() / (1 if cp is None else cp.size)


class RouterLoad(NamedTuple):
    """What a router saw in the backward passes since its last update: `tokens_per_expert` (num_experts,) int64,
    `dropped` the token copies a capacity dropped (int64 scalar), `aux_loss` the sum of its losses (a float
    scalar, 0 without them), over `micro_batches` micro-batches."""

    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    aux_loss: torch.Tensor
    micro_batches: int

    def plus(self, other: "RouterLoad") -> "RouterLoad":
        return RouterLoad(
            self.tokens_per_expert + other.tokens_per_expert,
            self.dropped + other.dropped,
            self.aux_loss + other.aux_loss,
            self.micro_batches + other.micro_batches,
        )


class _CountInBackward(torch.autograd.Function):
    """The identity on the routing weights whose backward adds the micro-batch's `RouterLoad` to the router's
    `load`: once per micro-batch whether or not the forward was recomputed, never in evaluation."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, load: RouterLoad, router: "Router") -> torch.Tensor:
        ctx.load, ctx.router = load, router
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        router = ctx.router
        router.load = ctx.load if router.load is None else router.load.plus(ctx.load)
        return grad, None, None


class Router(nn.Module):
    """(batch, seqlen, d_model) -> `Routing`, in float32 or wider (autocast off). Keys `weight` (num_experts,
    d_model) and, with expert_bias, `e_score_correction_bias` (num_experts,), a parameter the optimizer leaves
    alone that `update_expert_biases` moves; `load` (`RouterLoad`) what it routed in the backward passes since the
    last update, `received` its tokens per expert."""

    def __init__(
        self, d_model: int, options: MoEOptions, device=None, dtype=None, cp: Optional[ContextParallel] = None
    ):
        super().__init__()
        self.options = options
        self.cp = split(cp)
        self.weight = nn.Parameter(torch.empty(options.num_experts, d_model, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # as nn.Linear
        self.e_score_correction_bias = None
        if options.expert_bias:
            bias = torch.zeros(options.num_experts, device=device, dtype=dtype)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.load: Optional[RouterLoad] = None

    @property
    def received(self) -> Optional[torch.Tensor]:
        """The tokens routed to each expert since the last update (None: none yet)."""
        return None if self.load is None else self.load.tokens_per_expert

    def forward(self, hidden: torch.Tensor) -> Routing:
        o = self.options
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.to(dtype), self.weight.to(dtype))  # (batch, seqlen, experts)
            flat = logits.reshape(-1, o.num_experts)
            scores = scores_of(flat, o.score_function)
            bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.to(dtype)
            experts = select_experts(scores.detach(), o, bias)
            weights = expert_weights(scores, experts, o)
            tokens_per_expert = torch.bincount(experts.flatten(), minlength=o.num_experts)
            aux_loss = self._losses(logits)
            if torch.is_grad_enabled():
                load = RouterLoad(
                    tokens_per_expert,
                    self._dropped(tokens_per_expert, flat.shape[0]),
                    flat.new_zeros(()) if aux_loss is None else aux_loss.detach(),
                    1,
                )
                weights = _CountInBackward.apply(weights, load, self)
            return Routing(experts, weights, tokens_per_expert, aux_loss)

    def _dropped(self, tokens_per_expert: torch.Tensor, tokens: int) -> torch.Tensor:
        """The token copies beyond each expert's capacity (`capacity_of`; 0 when dropless)."""
        o = self.options
        if o.capacity_factor is None:
            return torch.zeros((), dtype=torch.int64, device=tokens_per_expert.device)
        capacity = capacity_of(tokens, o.top_k, o.num_experts, o.capacity_factor)
        return (tokens_per_expert - capacity).clamp(min=0).sum()

    def _losses(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        o = self.options
        if not (self.training and torch.is_grad_enabled()) or not (o.aux_loss_coeff or o.z_loss_coeff):
            return None
        loss = logits.new_zeros(())
        if o.aux_loss_coeff:
            loss = loss + o.aux_loss_coeff * load_balancing_loss(logits, o, self.cp)
        if o.z_loss_coeff:
            loss = loss + o.z_loss_coeff * z_loss(logits, self.cp)
        return loss


@torch.no_grad()
def update_expert_biases(model: nn.Module, group=None) -> None:
    """Aux-loss-free balancing, after an optimizer step: each router with an expert bias moves it by
    bias_update_rate towards the experts that received fewer than the mean tokens since the last update
    (bias += rate * sign(mean - received)); then every router starts counting again. With `group` (the ranks
    that hold the same layers: data x context parallel) the counts are summed over it first, all routers in one
    all-reduce."""
    counted = [
        m
        for m in model.modules()
        if isinstance(m, Router) and m.e_score_correction_bias is not None and m.load is not None
    ]
    if counted:
        received = torch.cat([cast(torch.Tensor, router.received) for router in counted])
        if group is not None:
            torch.distributed.all_reduce(received, group=group)
        for router, counts in zip(counted, received.split([r.options.num_experts for r in counted])):
            bias = cast(torch.Tensor, router.e_score_correction_bias)
            counts = counts.float()
            bias.add_((torch.sign(counts.mean() - counts) * router.options.bias_update_rate).to(bias.dtype))
    forget_router_loads(model)


def forget_router_loads(model: nn.Module) -> None:
    """Every router of `model` starts counting again, its bias unchanged (alone: after a step the optimizer
    skipped)."""
    for router in model.modules():
        if isinstance(router, Router):
            router.load = None


def router_loads(model: nn.Module) -> list:
    """(module name, `RouterLoad` or None) of every router of `model`, as counted since the last update."""
    return [(name, m.load) for name, m in model.named_modules() if isinstance(m, Router)]
