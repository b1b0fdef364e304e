"""Mamba-3's exponential-trapezoidal scan in PyTorch, recurrent (token by token) and chunked (SSD-style).

    h_t = α_t h_{t-1} + (1 - λ_t) Δ_t α_t Σ_r x_{t-1,r} B̂_{t-1,r}ᵀ + λ_t Δ_t Σ_r x_{t,r} B̂_{t,r}ᵀ,  α_t = exp(Δ_t A_t)
    y_{t,r} = h_t Ĉ_{t,r} + D x_{t,r}

on the inputs `mamba3_inputs.mamba3_scan_inputs` prepares; rank R is 1 for SISO. The chunked form
reads the trapezoid as a rank-2R SSD: keys λΔ·B̂_t and (1 - λ)Δα·B̂_{t-1} with values x_t and
x_{t-1}. Documents (seq_idx) reset the state and the previous-token term, as in `ssd.py`; the
initial state continues the first document.
"""

from typing import NamedTuple

import torch

from .common import check_shape, compute_dtype, document_ids, pad_documents, pad_time
from .ssd import segment_sums


class ScanState(NamedTuple):
    """What the scan carries from one token to the next: ssm (batch, nheads, headdim, dstate), and the
    previous token's x (batch, nheads, rank, headdim) and B̂ (batch, nheads, rank, dstate)."""

    ssm: torch.Tensor
    x: torch.Tensor
    B: torch.Tensor


def _check(x, dt, A, lam, B, C, D, initial_state):
    if x.dim() != 5:
        raise ValueError(f"x must have shape (batch, seqlen, nheads, rank, headdim), got {tuple(x.shape)}")
    batch, seqlen, nheads, rank, headdim = x.shape
    if seqlen < 1:
        raise ValueError(f"seqlen (x.shape[1]) must be at least 1, got {seqlen}")
    if B.dim() != 5:
        raise ValueError(f"B must have shape (batch, seqlen, nheads, rank, dstate), got {tuple(B.shape)}")
    dstate = B.shape[-1]
    check_shape("B", B, (batch, seqlen, nheads, rank, dstate), "(batch, seqlen, nheads, rank, dstate)")
    check_shape("C", C, B.shape, "(batch, seqlen, nheads, rank, dstate) like B")
    for name, t in (("dt", dt), ("A", A), ("lam", lam)):
        check_shape(name, t, (batch, seqlen, nheads), "(batch, seqlen, nheads)")
    if D is not None:
        check_shape("D", D, (nheads,), "(nheads,)")
    if initial_state is not None:
        for name, t, shape, meaning in (
            ("ssm", initial_state.ssm, (batch, nheads, headdim, dstate), "(batch, nheads, headdim, dstate)"),
            ("x", initial_state.x, (batch, nheads, rank, headdim), "(batch, nheads, rank, headdim)"),
            ("B", initial_state.B, (batch, nheads, rank, dstate), "(batch, nheads, rank, dstate)"),
        ):
            check_shape(f"initial_state.{name}", t, shape, meaning)


def _skip(y, x, D):
    return y if D is None else y + D.to(y.dtype)[:, None, None] * x


def mamba3_scan_recurrent(x, dt, A, lam, B, C, D=None, initial_state=None, seq_idx=None, return_final_state=False):
    """The scan token by token: x (batch, seqlen, nheads, rank, headdim); dt, A, lam (batch, seqlen, nheads);
    B̂, Ĉ (batch, seqlen, nheads, rank, dstate); D (nheads,); initial_state a ScanState. Returns y like x
    (and the final ScanState)."""
    _check(x, dt, A, lam, B, C, D, initial_state)
    ct = compute_dtype(x)
    batch, seqlen, nheads, rank, headdim = x.shape
    doc = document_ids(seq_idx, batch, seqlen)
    x, dt, A, lam, B, C = (t.to(ct) for t in (x, dt, A, lam, B, C))
    if initial_state is None:
        h = x.new_zeros(batch, nheads, headdim, B.shape[-1])
        prev_x, prev_B = torch.zeros_like(x[:, 0]), torch.zeros_like(B[:, 0])
    else:
        h, prev_x, prev_B = (t.to(ct) for t in initial_state)
    ys = []
    for t in range(seqlen):
        if doc is not None and t > 0:  # a document starts: nothing of the previous one carries over
            keep = (doc[:, t] == doc[:, t - 1]).to(ct)[:, None, None, None]
            h, prev_x, prev_B = h * keep, prev_x * keep, prev_B * keep
        alpha = torch.exp(dt[:, t] * A[:, t])
        beta, gamma = (1 - lam[:, t]) * dt[:, t] * alpha, lam[:, t] * dt[:, t]
        previous = torch.einsum("bhrp,bhrn->bhpn", prev_x, prev_B)
        current = torch.einsum("bhrp,bhrn->bhpn", x[:, t], B[:, t])
        h = alpha[..., None, None] * h + beta[..., None, None] * previous + gamma[..., None, None] * current
        ys.append(torch.einsum("bhpn,bhrn->bhrp", h, C[:, t]))
        prev_x, prev_B = x[:, t], B[:, t]
    y = _skip(torch.stack(ys, dim=1), x, D)
    if return_final_state:
        return y, ScanState(h, prev_x, prev_B)
    return y


def _exp_where(logits, keep):
    """exp(logits) where keep, exactly 0 elsewhere (masked before exp: no inf, no NaN gradient)."""
    return torch.exp(logits.masked_fill(~keep, float("-inf")))


def decayed_chunk_scan(q, k, v, a, chunk_size, doc=None, initial_ssm=None):
    """y_{t,r} = Σ_{s≤t, same document} exp(a_{s+1} + ... + a_t) Σ_j (q_{t,r}·k_{s,j}) v_{s,j} + the initial
    state decayed to t and read by q_{t,r} (first document only), chunk by chunk.

    q (batch, seqlen, nheads, rq, n); k (batch, seqlen, nheads, rk, n); v (batch, seqlen, nheads, rk, p);
    a (batch, seqlen, nheads); doc (batch, seqlen) document counters; initial_ssm (batch, nheads, p, n).
    Returns y (batch, seqlen, nheads, rq, p) and the final state (batch, nheads, p, n).
    """
    batch, seqlen, nheads, _, n = q.shape
    p = v.shape[-1]
    pad = (-seqlen) % chunk_size
    nchunks, width = (seqlen + pad) // chunk_size, chunk_size
    # Padded steps have a = 0 and k = 0: no decay and no input, so they leave the state unchanged.
    qc, kc, vc = (pad_time(t, 1, pad).reshape(batch, nchunks, width, *t.shape[2:]) for t in (q, k, v))
    ac = pad_time(a, 1, pad).reshape(batch, nchunks, width, nheads).permute(0, 1, 3, 2)  # (b, c, h, q)
    cs = torch.cumsum(ac, dim=-1)
    seg = segment_sums(ac)  # seg[i, j] = cs_i - cs_j
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    if doc is None:
        same_doc = causal.expand(batch, nchunks, width, width)
        reaches_end = torch.ones(batch, nchunks, width, dtype=torch.bool, device=q.device)
        entering = reaches_end
    else:
        docc = pad_documents(doc, pad).reshape(batch, nchunks, width)
        same_doc = causal & (docc[:, :, :, None] == docc[:, :, None, :])
        reaches_end = docc == docc[:, :, -1:]
        prev_doc = torch.cat([docc[:, :1, 0], docc[:, :-1, -1]], dim=1)
        entering = docc == prev_doc[:, :, None]

    decay = _exp_where(seg, same_doc[:, :, None])  # (b, c, h, i, j)
    scores = torch.einsum("bcihrn,bcjhsn->bchirjs", qc, kc)
    y = torch.einsum("bchirjs,bchij,bcjhsp->bcihrp", scores, decay, vc)

    to_end = _exp_where(seg[..., -1, :], reaches_end[:, :, None])  # (b, c, h, q)
    chunk_states = torch.einsum("bchj,bcjhsp,bcjhsn->bchpn", to_end, vc, kc)
    from_start = _exp_where(cs, entering[:, :, None])  # (b, c, h, q)
    state = q.new_zeros(batch, nheads, p, n) if initial_ssm is None else initial_ssm
    chunk_decays = from_start[..., -1, None, None].unbind(1)
    states = []
    for c, chunk_state in enumerate(chunk_states.unbind(1)):
        states.append(state)
        state = state * chunk_decays[c] + chunk_state
    y = y + torch.einsum("bcihrn,bchpn,bchi->bcihrp", qc, torch.stack(states, dim=1), from_start)
    return y.reshape(batch, nchunks * width, *y.shape[3:])[:, :seqlen], state


def mamba3_scan_chunked(
    x, dt, A, lam, B, C, chunk_size, D=None, initial_state=None, seq_idx=None, return_final_state=False
):
    """The scan chunk by chunk (`chunk_size` steps each); arguments and result as `mamba3_scan_recurrent`."""
    _check(x, dt, A, lam, B, C, D, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    ct = compute_dtype(x)
    batch, seqlen = x.shape[:2]
    doc = document_ids(seq_idx, batch, seqlen)
    x, dt, A, lam, B, C = (t.to(ct) for t in (x, dt, A, lam, B, C))
    if initial_state is None:
        first_x, first_B, initial_ssm = torch.zeros_like(x[:, :1]), torch.zeros_like(B[:, :1]), None
    else:
        first_x, first_B = initial_state.x.to(ct)[:, None], initial_state.B.to(ct)[:, None]
        initial_ssm = initial_state.ssm.to(ct)
    prev_x = torch.cat([first_x, x[:, :-1]], dim=1)
    prev_B = torch.cat([first_B, B[:, :-1]], dim=1)
    a = dt * A
    previous = (1 - lam) * dt * torch.exp(a)
    if doc is not None:  # a document's first token has no previous-token term
        continues = torch.cat([torch.ones_like(doc[:, :1]), (doc[:, 1:] == doc[:, :-1]).long()], dim=1)
        previous = previous * continues[..., None]
    keys = torch.cat([(lam * dt)[..., None, None] * B, previous[..., None, None] * prev_B], dim=3)
    values = torch.cat([x, prev_x], dim=3)
    y, ssm = decayed_chunk_scan(C, keys, values, a, chunk_size, doc, initial_ssm)
    y = _skip(y, x, D)
    if return_final_state:
        return y, ScanState(ssm, x[:, -1], B[:, -1])
    return y
