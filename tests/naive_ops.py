"""Naive per-timestep versions of the kernel ops: the tests' float64 oracle.

Each function has the public API's signature (megamamba.kernels) and computes the
recurrence literally, one time step per Python iteration (vectorised only over batch,
channels and heads), in the dtype of its inputs (pass float64). They favour being obviously
correct over being fast: use small shapes. The last part compares an op with them.

Document boundaries (seq_idx): a position starts a new document when its id differs from
the previous position's id; the state is zero before the first token of every document
but the first, and nothing from one document reaches another.
"""

import torch
import torch.nn.functional as F

from megamamba.testing.numerics import errors_against_float64


def _document_starts(seq_idx, batch, seqlen, device):
    """(batch, seqlen) bool: True where a position begins a new document (never at t == 0)."""
    starts = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
    if seq_idx is not None:
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def _silu(v):
    return v * torch.sigmoid(v)


def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    seq_idx=None,
    initial_state=None,
):
    """Mamba-1: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t . h_t (+ D u_t) (* silu z_t);
    h_{-1} = initial_state (batch, dim, dstate), else zero."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    starts = _document_starts(seq_idx, batch, seqlen, u.device)

    def per_channel(M, t):
        """B or C at time t as (batch, dim, dstate), whatever its layout; channel d reads group
        d // (dim / groups)."""
        if M.dim() == 2:
            return M.expand(batch, dim, dstate)
        if M.dim() == 3:
            return M[:, None, :, t].expand(batch, dim, dstate)
        return M[:, :, :, t].repeat_interleave(dim // M.shape[1], dim=1)

    h = u.new_zeros(batch, dim, dstate) if initial_state is None else initial_state
    ys = []
    for t in range(seqlen):
        h = torch.where(starts[:, t, None, None], torch.zeros_like(h), h)
        dt = delta[:, :, t, None]
        h = torch.exp(dt * A) * h + dt * per_channel(B, t) * u[:, :, t, None]
        y = (h * per_channel(C, t)).sum(-1)
        if D is not None:
            y = y + D * u[:, :, t]
        if z is not None:
            y = y * _silu(z[:, :, t])
        ys.append(y)
    out = torch.stack(ys, dim=-1)
    return (out, h) if return_last_state else out


def ssd_chunk_scan(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
):
    """Mamba-2: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (+ D x_t) (* silu z_t).

    Head h reads group h // (nheads / ngroups). chunk_size is accepted for the signature and
    ignored: the recurrence has no chunks.
    """
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    heads_per_group = nheads // ngroups
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    starts = _document_starts(seq_idx, batch, seqlen, x.device)
    if D is not None and D.dim() == 1:
        D = D[:, None]

    h = x.new_zeros(batch, nheads, headdim, dstate) if initial_states is None else initial_states
    ys = []
    for t in range(seqlen):
        h = torch.where(starts[:, t, None, None, None], torch.zeros_like(h), h)
        step = dt[:, t, :, None, None]  # (batch, nheads, 1, 1)
        Bt = B[:, t].repeat_interleave(heads_per_group, dim=1)[:, :, None, :]  # (batch, nheads, 1, dstate)
        Ct = C[:, t].repeat_interleave(heads_per_group, dim=1)[:, :, None, :]
        h = torch.exp(step * A[:, None, None]) * h + step * x[:, t, :, :, None] * Bt
        y = (h * Ct).sum(-1)
        if D is not None:
            y = y + D * x[:, t]
        if z is not None:
            y = y * _silu(z[:, t])
        ys.append(y)
    out = torch.stack(ys, dim=1)
    return (out, h) if return_final_states else out


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """out_t = sum_k weight[:, k] x_{t-(width-1)+k} over taps in the same document (+ bias) (silu)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    starts = _document_starts(seq_idx, batch, seqlen, x.device)
    cols = []
    for t in range(seqlen):
        acc = x.new_zeros(batch, dim) if bias is None else bias.expand(batch, dim)
        for k in range(width):
            s = t - (width - 1) + k
            if s < 0:
                continue
            same_document = ~starts[:, s + 1 : t + 1].any(dim=1)  # (batch,)
            acc = acc + torch.where(same_document[:, None], weight[:, k] * x[:, :, s], 0.0)
        cols.append(acc)
    out = torch.stack(cols, dim=-1)
    if activation in ("silu", "swish"):
        out = _silu(out)
    return out


def rmsnorm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Each group of group_size channels: v / sqrt(mean(v^2) + eps) * weight (+ bias), gated by silu(z)."""
    n = x.shape[-1]
    group_size = n if group_size is None else group_size
    v = x if z is None or norm_before_gate else x * _silu(z)
    pieces = []
    for start in range(0, n, group_size):
        part = v[..., start : start + group_size]
        pieces.append(part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + eps))
    out = torch.cat(pieces, dim=-1) * weight
    if bias is not None:
        out = out + bias
    if z is not None and norm_before_gate:
        out = out * _silu(z)
    return out


def assert_matches_naive(op, naive, tensors, dtype, tol, seed, **options):
    """op on `tensors` in `dtype` vs the naive op in float64 on the same values: every output
    and every input gradient (the output gradients drawn from `seed`) within `tol` relative
    error, all finite. Returns the errors."""
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    errors = errors_against_float64({"op": op}, naive, cast, seed, **options)["op"]
    for name, error in errors.items():
        assert error != float("inf"), f"seed {seed}: {name} has non-finite values"
        assert error <= tol, f"seed {seed}: {name} relative error {error:.2e} > {tol:.0e}"
    return errors
