"""Mamba-1 selective scan in PyTorch, chunked.

About sqrt(seqlen) chunks of sqrt(seqlen) steps: the recurrence runs inside all chunks at once
from zero, then a loop carries the state between them. Nothing divides by a decay, so tiny decays
underflow to zeros, never inf or NaN. The algorithm: docs/code.md ("How the kernels compute").
"""

import math

import torch
import torch.nn.functional as F

from .common import check_real, check_shape, compute_dtype, document_ids, pad_documents, pad_time, silu


def chunk_length(seqlen: int) -> int:
    """ceil(sqrt(seqlen)): as many steps inside a chunk as there are chunks."""
    return math.isqrt(seqlen - 1) + 1


def _as_groups(name, M, batch, dim, dstate, seqlen):
    """B or C as (batch, groups, dstate, seqlen) for input-dependent layouts, or (dim, dstate) as is."""
    if M.dim() == 2:
        check_shape(name, M, (dim, dstate), "(dim, dstate)")
        return M
    if M.dim() == 3:
        check_shape(name, M, (batch, dstate, seqlen), "(batch, dstate, seqlen)")
        return M.unsqueeze(1)
    if M.dim() == 4:
        groups = M.shape[1]
        check_shape(name, M, (batch, groups, dstate, seqlen), "(batch, groups, dstate, seqlen)")
        if groups < 1 or dim % groups != 0:
            raise ValueError(f"{name} has {groups} groups, which must divide dim ({dim})")
        return M
    raise ValueError(
        f"{name} must have shape (dim, dstate), (batch, dstate, seqlen) or "
        f"(batch, groups, dstate, seqlen), got {tuple(M.shape)}"
    )


def _states_operand(M, q, nchunks, pad, dim):
    """B or C broadcastable against states laid out (q, chunk, batch, dim, dstate).

    Channel d reads group d // (dim / groups); a constant (dim, dstate) matrix broadcasts as is.
    """
    if M.dim() == 2:
        return M
    batch, groups, dstate, _ = M.shape
    M = pad_time(M, 3, pad).reshape(batch, groups, dstate, nchunks, q).permute(4, 3, 0, 1, 2)
    if groups == 1:
        return M
    per_group = M.unsqueeze(4).expand(q, nchunks, batch, groups, dim // groups, dstate)
    return per_group.reshape(q, nchunks, batch, dim, dstate)


def _check(u, delta, A, D, z, delta_bias, initial_state=None):
    if u.dim() != 3:
        raise ValueError(f"u must have shape (batch, dim, seqlen), got {tuple(u.shape)}")
    batch, dim, seqlen = u.shape
    if seqlen < 1:
        raise ValueError(f"seqlen (u.shape[2]) must be at least 1, got {seqlen}")
    check_shape("delta", delta, u.shape, "(batch, dim, seqlen) like u")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, dstate) with dim = {dim}, got {tuple(A.shape)}")
    if D is not None:
        check_shape("D", D, (dim,), "(dim,)")
    if z is not None:
        check_shape("z", z, u.shape, "(batch, dim, seqlen) like u")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (dim,), "(dim,)")
    if initial_state is not None:
        check_shape("initial_state", initial_state, (batch, dim, A.shape[1]), "(batch, dim, dstate)")
        check_real("initial_state", initial_state)
    for name, t in (("u", u), ("delta", delta), ("A", A)):
        check_real(name, t)


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
    """Mamba-1 scan (as mamba_ssm's selective_scan_fn, plus seq_idx and initial_state); see
    megamamba.kernels."""
    _check(u, delta, A, D, z, delta_bias, initial_state)
    out_dtype, ct = u.dtype, compute_dtype(u)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    B = _as_groups("B", B, batch, dim, dstate, seqlen)
    C = _as_groups("C", C, batch, dim, dstate, seqlen)
    check_real("B", B)
    check_real("C", C)
    doc = document_ids(seq_idx, batch, seqlen)

    delta = delta.to(ct)
    if delta_bias is not None:
        delta = delta + delta_bias.to(ct)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)

    q = chunk_length(seqlen)
    pad = (-seqlen) % q
    nchunks = (seqlen + pad) // q

    def time_major(t):
        """(batch, dim, seqlen) -> (q, chunk, batch, dim), zero-padded, contiguous."""
        return pad_time(t, 2, pad).reshape(batch, dim, nchunks, q).permute(3, 2, 0, 1).contiguous()

    # Every tensor is laid out (q, chunk, batch, dim, dstate) so that the loops below walk
    # contiguous slices. Padded steps have delta = 0 and u = 0: they leave the state unchanged.
    delta_t = time_major(delta)
    dA = delta_t[..., None] * A.to(ct)
    dBu = (delta_t * time_major(u.to(ct)))[..., None] * _states_operand(B.to(ct), q, nchunks, pad, dim)

    if doc is None:
        step_decay = torch.exp(dA)
        entering = torch.ones(q, nchunks, 1, 1, 1, dtype=torch.bool, device=u.device)
    else:
        docc = pad_documents(doc, pad).reshape(batch, nchunks, q).permute(2, 1, 0)[..., None, None]
        starts = torch.cat([torch.zeros_like(docc[:1], dtype=torch.bool), docc[1:] != docc[:-1]])
        step_decay = torch.exp(dA.masked_fill(starts, float("-inf")))  # 0 where a document starts
        prev_doc = torch.cat([docc[0, :1], docc[-1, :-1]], dim=0)  # (chunk, batch, 1, 1)
        entering = docc == prev_doc

    # Every chunk's states, each chunk started from zero, all chunks advanced together. The
    # loops unbind their operands once: indexing inside them would cost a full-size gradient
    # buffer per step in the backward pass.
    decays, inputs = step_decay.unbind(0), dBu.unbind(0)
    h = inputs[0]
    steps = [h]
    for t in range(1, q):
        h = decays[t] * h + inputs[t]
        steps.append(h)
    states = torch.stack(steps)

    # Carry the state across chunks; `entering` marks the positions it reaches (the chunk's
    # last position among them exactly when no document starts inside the chunk).
    from_start = torch.exp(torch.cumsum(dA, dim=0).masked_fill(~entering, float("-inf")))
    chunk_decays, chunk_ends = from_start[-1].unbind(0), states[-1].unbind(0)
    state = states.new_zeros(batch, dim, dstate) if initial_state is None else initial_state.to(ct)
    entering_states = []
    for c in range(nchunks):
        entering_states.append(state)
        state = state * chunk_decays[c] + chunk_ends[c]
    states = states + from_start * torch.stack(entering_states)

    y = (states * _states_operand(C.to(ct), q, nchunks, pad, dim)).sum(-1)  # (q, chunk, batch, dim)
    y = y.permute(2, 3, 1, 0).reshape(batch, dim, nchunks * q)[..., :seqlen]
    if D is not None:
        y = y + u.to(ct) * D.to(ct)[:, None]
    if z is not None:
        y = y * silu(z.to(ct))
    y = y.to(out_dtype)
    return (y, state) if return_last_state else y
