"""Mamba-2 SSD scan in PyTorch: the chunked semi-separable algorithm.

A masked matrix product inside each chunk, a short loop passing states between chunks; only sums
of dt*A inside one chunk are exponentiated, masked before exp. The algorithm and its document
masking: docs/code.md ("How the kernels compute").
"""

import torch
import torch.nn.functional as F

from .common import check_real, check_shape, compute_dtype, document_ids, pad_documents, pad_time, silu


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt -> dt + dt_bias -> softplus (if asked) -> clamp to dt_limit, as mamba_ssm.

    The clamp is always applied, as in mamba_ssm: the default (0, inf) zeroes negative dt.
    """
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states):
    if x.dim() != 4:
        raise ValueError(f"x must have shape (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
    batch, seqlen, nheads, headdim = x.shape
    if B.dim() != 4:
        raise ValueError(f"B must have shape (batch, seqlen, ngroups, dstate), got {tuple(B.shape)}")
    ngroups, dstate = B.shape[2], B.shape[3]
    if seqlen < 1:
        raise ValueError(f"seqlen (x.shape[1]) must be at least 1, got {seqlen}")
    check_shape("dt", dt, (batch, seqlen, nheads), "(batch, seqlen, nheads)")
    check_shape("A", A, (nheads,), "(nheads,)")
    check_shape("B", B, (batch, seqlen, ngroups, dstate), "(batch, seqlen, ngroups, dstate)")
    check_shape("C", C, (batch, seqlen, ngroups, dstate), "(batch, seqlen, ngroups, dstate) like B")
    if nheads % ngroups != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if D is not None and tuple(D.shape) not in ((nheads,), (nheads, headdim)):
        raise ValueError(
            f"D must have shape (nheads,) = {(nheads,)} or (nheads, headdim) = "
            f"{(nheads, headdim)}, got {tuple(D.shape)}"
        )
    if z is not None:
        check_shape("z", z, x.shape, "(batch, seqlen, nheads, headdim) like x")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (nheads,), "(nheads,)")
    if initial_states is not None:
        check_shape(
            "initial_states", initial_states, (batch, nheads, headdim, dstate), "(batch, nheads, headdim, dstate)"
        )
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        check_real(name, t)


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """S[..., i, j] = a[..., j+1] + ... + a[..., i] for i >= j (0 on the diagonal), over the last dim.

    Each entry sums its own terms rather than subtracting two long cumulative sums, so it
    keeps full precision when the cumulative sums are large, and its gradient reaches only
    the terms in between (no cancelling contributions). Entries above the diagonal are
    meaningless: mask them.
    """
    q = a.shape[-1]
    strictly_below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, q).masked_fill(~strictly_below, 0.0)  # [i, j] = a_i if i > j
    return terms.cumsum(dim=-2)


def _exp_masked(logits, keep):
    """exp(logits) where keep, exactly 0 elsewhere (masked before exp: no inf, no NaN gradient)."""
    return torch.exp(logits.masked_fill(~keep, float("-inf")))


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
    """Mamba-2 scan (as mamba_ssm's mamba_chunk_scan_combined); see megamamba.kernels."""
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    out_dtype, ct = x.dtype, compute_dtype(x)
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    per_group = nheads // ngroups
    doc = document_ids(seq_idx, batch, seqlen)

    dt = process_dt(dt.to(ct), None if dt_bias is None else dt_bias.to(ct), dt_softplus, dt_limit)
    pad = (-seqlen) % chunk_size
    nchunks = (seqlen + pad) // chunk_size
    q = chunk_size
    # Padded steps have dt = 0: no decay and no input, so they leave the state unchanged.
    xc = pad_time(x.to(ct), 1, pad).reshape(batch, nchunks, q, ngroups, per_group, headdim)
    dtc = pad_time(dt, 1, pad).reshape(batch, nchunks, q, ngroups, per_group)
    Bc = pad_time(B.to(ct), 1, pad).reshape(batch, nchunks, q, ngroups, dstate)
    Cc = pad_time(C.to(ct), 1, pad).reshape(batch, nchunks, q, ngroups, dstate)
    Ag = A.to(ct).reshape(ngroups, per_group)

    dA = (dtc * Ag).permute(0, 1, 3, 4, 2)  # (b, c, g, r, q)
    cs = torch.cumsum(dA, dim=-1)
    seg = segment_sums(dA)  # seg[i, j] = cs_i - cs_j
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    if doc is None:
        same_doc = causal.expand(batch, nchunks, q, q)
        reaches_end = torch.ones(batch, nchunks, q, dtype=torch.bool, device=x.device)
        entering = reaches_end
    else:
        docc = pad_documents(doc, pad).reshape(batch, nchunks, q)
        same_doc = causal & (docc[:, :, :, None] == docc[:, :, None, :])
        reaches_end = docc == docc[:, :, -1:]
        prev_doc = torch.cat([docc[:, :1, 0], docc[:, :-1, -1]], dim=1)  # (b, c)
        entering = docc == prev_doc[:, :, None]

    # Intra-chunk (diagonal blocks): y_i = sum_j (C_i . B_j) exp(cs_i - cs_j) dt_j x_j.
    decay = _exp_masked(seg, same_doc[:, :, None, None])
    CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)
    xdt = xc * dtc[..., None]
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", CB[:, :, :, None] * decay, xdt)

    # Each chunk's end state started from zero.
    to_end = _exp_masked(seg[..., -1, :], reaches_end[:, :, None, None])  # (b, c, g, r, q)
    chunk_states = torch.einsum("bcgrj,bcjgrp,bcjgn->bcgrpn", to_end, xdt, Bc)

    # Pass states between chunks; states[c] enters chunk c and reaches the positions marked
    # by `entering` (the chunk's last position among them exactly when no document starts
    # inside the chunk, so that is also when it survives the chunk).
    from_start = _exp_masked(cs, entering[:, :, None, None])  # (b, c, g, r, q)
    if initial_states is None:
        state = xc.new_zeros(batch, ngroups, per_group, headdim, dstate)
    else:
        state = initial_states.to(ct).reshape(batch, ngroups, per_group, headdim, dstate)
    # The loop unbinds its operands once: indexing inside it would cost a full-size gradient
    # buffer per chunk in the backward pass.
    chunk_decays = from_start[..., -1, None, None].unbind(1)  # (b, g, r, 1, 1) each
    states = []
    for c, chunk_state in enumerate(chunk_states.unbind(1)):
        states.append(state)
        state = state * chunk_decays[c] + chunk_state
    states = torch.stack(states, dim=1)  # (b, c, g, r, p, n)

    # Off-diagonal blocks: the entering state read out at each position.
    y = y + torch.einsum("bcign,bcgrpn,bcgri->bcigrp", Cc, states, from_start)

    y = y.reshape(batch, nchunks * q, nheads, headdim)[:, :seqlen]
    if D is not None:
        Dc = D.to(ct)
        y = y + x.to(ct) * (Dc[:, None] if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * silu(z.to(ct))
    y = y.to(out_dtype)
    if return_final_states:
        return y, state.reshape(batch, nheads, headdim, dstate)
    return y
