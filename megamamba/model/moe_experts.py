"""The routed experts of a mixture-of-experts block, computed as grouped matrix multiplies over rows sorted by
expert (`megamamba.model.moe_dispatch`): one grouped GEMM per projection, `torch._grouped_mm` where torch has it
for the device and dtype, else one batched matmul over the experts' rows padded to the longest.

Keys as transformers' NemotronH: `up_proj` (num_experts, width, d_model) and `down_proj` (num_experts, d_model,
hidden), each expert's (out, in) matrix; with gated_silu `width` is 2 x hidden, the value's rows then the
gate's (as `megamamba.model.mlp.MLP`'s fc1). Under expert parallelism a rank holds a contiguous share of the experts
(`here`), each drawn as on one device.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.parallel.expert.expert_parallel import mark_experts

GROUPED_MM_ALIGNMENT = 16  # bytes: torch._grouped_mm's rows must start on this


def _grouped_mm_serves(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm multiplies these: bfloat16 or float32 on the CPU, bfloat16 on a CUDA device of
    compute capability 9.0 or newer, each matrix's rows aligned."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    if rows.device.type == "cuda":
        served = rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (9, 0)
    else:
        served = rows.device.type == "cpu" and rows.dtype in (torch.bfloat16, torch.float32)
    aligned = all(n * rows.element_size() % GROUPED_MM_ALIGNMENT == 0 for n in weight.shape[1:])
    return served and aligned


def _padded_bmm(rows: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The grouped product as one batched matmul: each expert's rows padded to the longest expert's."""
    experts = torch.arange(weight.shape[0], device=rows.device)
    expert_of_row = torch.repeat_interleave(experts, tokens_per_expert, output_size=rows.shape[0])
    starts = tokens_per_expert.cumsum(0) - tokens_per_expert
    position = torch.arange(rows.shape[0], device=rows.device) - starts[expert_of_row]
    longest = int(tokens_per_expert.max()) if rows.shape[0] else 0
    padded = rows.new_zeros(weight.shape[0], longest, rows.shape[1])
    padded = padded.index_put((expert_of_row, position), rows)
    return torch.bmm(padded, weight.transpose(1, 2))[expert_of_row, position]


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """(rows, in) sorted by expert, `tokens_per_expert` rows each -> (rows, out): each expert's rows times its
    (out, in) matrix of `weight` (experts, out, in), under autocast in its dtype."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        rows, weight = rows.to(dtype), weight.to(dtype)
    if _grouped_mm_serves(rows, weight):
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        return torch._grouped_mm(rows.contiguous(), weight.transpose(1, 2), offs=offsets)
    return _padded_bmm(rows, weight, tokens_per_expert)


class GroupedExperts(nn.Module):
    """`num_experts` MLPs without biases, (rows, d_model) sorted by expert -> (rows, d_model): relu(x)^2
    (Nemotron-H) or y * silu(gate) (gated_silu) between up_proj and down_proj. Holds the experts `here` (default:
    all), rows sorted by those. Initialised as nn.Linear, each expert on its own."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        activation: str,
        device=None,
        dtype=None,
        here: range | None = None,
    ):
        super().__init__()
        self.num_experts, self.here = num_experts, range(num_experts) if here is None else here
        self.gated = activation == "gated_silu"
        width = 2 * hidden if self.gated else hidden
        held = len(self.here)
        self.up_proj = nn.Parameter(torch.empty(held, width, d_model, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(held, d_model, hidden, device=device, dtype=dtype))
        for weight in (self.up_proj, self.down_proj):
            mark_experts(weight, num_experts, self.here)
        with torch.no_grad():
            for weight in (*self.each_expert(self.up_proj), *self.each_expert(self.down_proj)):
                nn.init.kaiming_uniform_(weight, a=5**0.5)

    def each_expert(self, weight: torch.Tensor) -> list:
        """A matrix per expert of the layer, in expert order, to draw into: `weight`'s own (up_proj or down_proj)
        for the experts held here, one scratch matrix for the others, drawn and dropped so that the random stream
        runs as on one device."""
        scratch = torch.empty_like(weight[0])
        return [weight[e - self.here.start] if e in self.here else scratch for e in range(self.num_experts)]

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        y = grouped_linear(rows, self.up_proj, tokens_per_expert)
        if self.gated:
            y, gate = y.chunk(2, dim=-1)
            y = y * F.silu(gate)
        else:
            y = F.relu(y).square()
        return grouped_linear(y, self.down_proj, tokens_per_expert)
