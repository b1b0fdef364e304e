"""A float64 mixture-of-experts block written from transformers' NemotronH routing, token by token and expert by
expert, for the MoE layer's tests: ties broken by (score, lower index), groups scored by their two best."""

import torch
import torch.nn.functional as F

from megamamba.config import MoEOptions


def _best(values: list, k: int) -> list:
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def reference_choices(scores: torch.Tensor, options: MoEOptions, bias) -> list:
    """Per token, its chosen experts, best first."""
    choices = []
    size = options.experts_per_group
    for row in scores.tolist():
        choice = [s + (0.0 if bias is None else float(b)) for s, b in zip(row, bias if bias is not None else row)]
        allowed = range(options.num_experts)
        if options.n_group > 1:
            groups = [sum(sorted(choice[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(options.n_group)]
            allowed = [e for g in _best(groups, options.topk_group) for e in range(g * size, (g + 1) * size)]
        masked = [choice[e] if e in allowed else float("-inf") for e in range(options.num_experts)]
        choices.append(_best(masked, options.top_k))
    return choices


def _expert(x, up, down, gated: bool):
    y = x @ up.T
    if gated:
        value, gate = y.chunk(2, dim=-1)
        y = value * F.silu(gate)
    else:
        y = F.relu(y) ** 2
    return y @ down.T


def reference_moe(moe, hidden: torch.Tensor) -> torch.Tensor:
    """The MoE mixer `moe`'s output on float64 `hidden` (batch, seqlen, d_model), from its parameters."""
    o = moe.options
    x = hidden.reshape(-1, hidden.shape[-1])
    logits = x @ moe.gate.weight.T
    scores = logits.softmax(-1) if o.score_function == "softmax" else logits.sigmoid()
    bias = moe.gate.e_score_correction_bias
    choices = reference_choices(scores.detach(), o, None if bias is None else bias.detach())
    gated = o.activation == "gated_silu"
    rows = []
    for t, chosen in enumerate(choices):
        weights = torch.stack([scores[t, e] for e in chosen])
        if o.norm_topk_prob:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * o.routed_scaling_factor
        out = torch.zeros_like(x[t])
        for e in range(o.num_experts):  # expert by expert
            if e in chosen:
                expert = _expert(x[t], moe.experts.up_proj[e], moe.experts.down_proj[e], gated)
                out = out + weights[chosen.index(e)] * expert
        rows.append(out)
    out = torch.stack(rows).view_as(hidden)
    if moe.shared_experts is not None:
        out = out + _expert(hidden, moe.shared_experts.fc1.weight, moe.shared_experts.fc2.weight, gated)
    return out
