"""Mamba-3's SISO scan on Triton: the exponential-trapezoidal recurrence run by the Mamba-2 SSD kernels (ssd.py).

Token s enters the state twice: with γ_s = λ_sΔ_s at its own step and, through the next token's
trapezoid term, with (1 - λ_{s+1})Δ_{s+1}α_{s+1} one step later. α_{s+1} is that step's own decay,
so both ride one key, B̂_s scaled by w_s = γ_s + ν_s with ν_s = (1 - λ_{s+1})Δ_{s+1} (0 where token s
ends its document or the sequence), and the state read at s itself holds ν_s x_s B̂_sᵀ too much: the
diagonal correction y_s -= ν_s (Ĉ_s·B̂_s) x_s. The SSD's decay exp(dt·A) with A = -1 and dt = -Δ_t A_t
is the per-token decay; its input scale dt is divided out of the key. The initial state's previous
token folds into the initial SSM state. Gradients: autograd through this glue and the SSD's
backward kernels.
"""

import torch
import torch.nn.functional as F

from ..reference.common import compute_dtype
from ..reference.mamba3 import ScanState, _check
from .ssd import ssd_chunk_scan

# The smallest step -Δ·A the SSD is given: a Δ that underflowed to 0 would otherwise divide 0 by 0 in
# the key. exp(-1e-20) is 1 in float32, so only the gradient of so small a log-decay is dropped.
STEP_FLOOR = 1e-20


def _next_weight(dt, lam, seq_idx):
    """ν_s = (1 - λ_{s+1})Δ_{s+1}: 0 at the sequence's last token and where token s+1 starts a document."""
    nu = F.pad(((1 - lam) * dt)[:, 1:], (0, 0, 0, 1))
    if seq_idx is None:
        return nu
    continues = F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (0, 1))
    return nu * continues[..., None]


def _folded_initial_state(initial_state, dt, lam):
    """The initial SSM state with its previous token's trapezoid term, (1 - λ_0)Δ_0 x_{-1} B̂_{-1}ᵀ, added:
    the first step's decay α_0 then applies to both, as in the recurrence."""
    weight = ((1 - lam[:, 0]) * dt[:, 0])[..., None, None]
    ssm, x, B = (t.to(weight.dtype) for t in initial_state)
    return ssm + weight * x[:, :, 0, :, None] * B[:, :, 0, None, :]


def mamba3_scan(x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, return_final_state=False):
    """The SISO scan (rank 1) with the arguments and results of the reference's `mamba3_scan_chunked`: y in
    x's compute dtype and, when asked, the final ScanState. Like the reference, it computes in float32 for
    bf16 inputs: the SSD run on bf16 rounds its output and that output's gradient to bf16, which doubled
    the errors of dΔ and dA and took dD from float32 round-off to bf16's."""
    _check(x, dt, A, lam, B, C, D, initial_state)
    rank = x.shape[3]
    if rank != 1:
        raise ValueError(
            f"the Triton Mamba-3 scan is SISO (rank 1), got rank {rank}; "
            "megamamba.kernels.mamba3_scan runs MIMO on the reference"
        )
    ct = compute_dtype(x)
    x1, B1, C1, dt, A, lam = (t.to(ct) for t in (x[:, :, :, 0], B[:, :, :, 0], C[:, :, :, 0], dt, A, lam))
    step = (-dt * A).clamp_min(STEP_FLOOR)
    nu = _next_weight(dt, lam, seq_idx)
    keys = B1 * ((lam * dt + nu) / step)[..., None]
    folded = None if initial_state is None else _folded_initial_state(initial_state, dt, lam)
    y, ssm = ssd_chunk_scan(
        x1,
        step,
        -torch.ones(x.shape[2], device=x.device),
        keys,
        C1,
        chunk_size,
        D=D,
        initial_states=folded,
        seq_idx=seq_idx,
        return_final_states=True,
    )
    y = (y - (nu * (C1 * B1).sum(-1))[..., None] * x1)[:, :, :, None]
    if return_final_state:
        return y, ScanState(ssm.to(ct), x[:, -1].to(ct), B[:, -1].to(ct))
    return y
