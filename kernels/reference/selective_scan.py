"""Mamba-1 selective scan in PyTorch, chunked.

Each channel d and state n decays by exp(delta_t A[d, n]), so unlike SSD the decay matrix
depends on n and cannot be shared. Within a chunk of CHUNK steps the states at every step
are one batched matrix-vector product: h_t = sum_{s<=t} exp(cs_t - cs_s) delta_s B_s u_s,
with cs the within-chunk cumulative sum of delta*A (cs_t - cs_s summed directly from its
terms, see segment_sums), masked (causal, same document) before exp. A loop over chunks carries the state: the state entering a chunk adds exp(cs_t) times
itself to positions of the document the previous chunk ended in. Nothing divides by a
decay, so tiny decays underflow to exact zeros instead of producing inf or NaN.

Memory is about CHUNK times that of storing every state (batch*dim*dstate*seqlen); the
chunk is kept small for that reason.
"""
import torch
import torch.nn.functional as F

from .common import (check_real, check_shape, compute_dtype, document_ids, pad_documents, pad_time,
                     segment_sums, silu)

CHUNK = 16


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
    raise ValueError(f"{name} must have shape (dim, dstate), (batch, dstate, seqlen) or "
                     f"(batch, groups, dstate, seqlen), got {tuple(M.shape)}")


def _per_channel(M, dim):
    """(batch, groups, dstate, L) -> (batch, dim, dstate, L): channel d reads group d // (dim/groups)."""
    batch, groups, dstate, length = M.shape
    return M.unsqueeze(2).expand(batch, groups, dim // groups, dstate, length).reshape(batch, dim, dstate, length)


def _check(u, delta, A, D, z, delta_bias):
    if u.dim() != 3:
        raise ValueError(f"u must have shape (batch, dim, seqlen), got {tuple(u.shape)}")
    batch, dim, seqlen = u.shape
    check_shape("delta", delta, u.shape, "(batch, dim, seqlen) like u")
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim, dstate) with dim = {dim}, got {tuple(A.shape)}")
    if D is not None:
        check_shape("D", D, (dim,), "(dim,)")
    if z is not None:
        check_shape("z", z, u.shape, "(batch, dim, seqlen) like u")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (dim,), "(dim,)")
    for name, t in (("u", u), ("delta", delta), ("A", A)):
        check_real(name, t)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, seq_idx=None):
    """Mamba-1 scan (as mamba_ssm's selective_scan_fn, plus seq_idx); see megamamba.kernels."""
    _check(u, delta, A, D, z, delta_bias)
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

    q = CHUNK
    pad = (-seqlen) % q
    nchunks = (seqlen + pad) // q
    # Padded steps have delta = 0 and u = 0: they leave the state unchanged.
    delta_c = pad_time(delta, 2, pad).reshape(batch, dim, 1, nchunks, q)
    du = delta_c * pad_time(u.to(ct), 2, pad).reshape(batch, dim, 1, nchunks, q)
    if B.dim() == 2:
        dBu = du * B.to(ct)[None, :, :, None, None]
    else:
        dBu = du * _per_channel(pad_time(B.to(ct), 3, pad), dim).reshape(batch, dim, dstate, nchunks, q)
    dA = delta_c * A.to(ct)[None, :, :, None, None]                          # (b, d, n, c, q)
    cs = torch.cumsum(dA, dim=-1)

    causal = torch.ones(q, q, dtype=torch.bool, device=u.device).tril()
    if doc is None:
        same_doc = causal
        entering = torch.ones(nchunks, q, dtype=torch.bool, device=u.device)
    else:
        docc = pad_documents(doc, pad).reshape(batch, 1, 1, nchunks, q)
        same_doc = causal & (docc[..., :, None] == docc[..., None, :])
        prev_doc = torch.cat([docc[..., :1, 0], docc[..., :-1, -1]], dim=-1)    # (b, 1, 1, c)
        entering = docc == prev_doc[..., None]

    # States at every step of each chunk, each chunk started from zero.
    decay = torch.exp(segment_sums(dA).masked_fill(~same_doc, float("-inf")))
    states = torch.matmul(decay, dBu.unsqueeze(-1)).squeeze(-1)              # (b, d, n, c, q)

    # Carry the state across chunks; entering[c] marks the positions it reaches (the chunk's
    # last position among them exactly when no document starts inside the chunk).
    from_start = torch.exp(cs.masked_fill(~entering, float("-inf")))
    chunk_decay = from_start[..., -1]
    state = states.new_zeros(batch, dim, dstate)
    entering_states = []
    for c in range(nchunks):
        entering_states.append(state)
        state = state * chunk_decay[..., c] + states[..., c, -1]
    states = states + from_start * torch.stack(entering_states, dim=-1).unsqueeze(-1)

    if C.dim() == 2:
        y = torch.einsum("bdncq,dn->bdcq", states, C.to(ct))
    else:
        Cc = _per_channel(pad_time(C.to(ct), 3, pad), dim).reshape(batch, dim, dstate, nchunks, q)
        y = (states * Cc).sum(2)
    y = y.reshape(batch, dim, nchunks * q)[..., :seqlen]
    if D is not None:
        y = y + u.to(ct) * D.to(ct)[:, None]
    if z is not None:
        y = y * silu(z.to(ct))
    y = y.to(out_dtype)
    return (y, state) if return_last_state else y
