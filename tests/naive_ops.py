"""Naive per-timestep versions of the kernel ops: the tests' float64 oracle.

Each function has the public API's signature (megamamba.kernels) and computes the
recurrence literally, one time step per Python iteration, in the dtype of its inputs
(pass float64). They favour being obviously correct over being fast: use small shapes.

Document boundaries (seq_idx): a position starts a new document when its id differs from
the previous position's id; the state is zero before the first token of every document
but the first, and nothing from one document reaches another.
"""
import torch
import torch.nn.functional as F


def _starts_document(seq_idx, b, t):
    """True when position t of batch row b begins a new document (never for t == 0)."""
    return seq_idx is not None and t > 0 and bool(seq_idx[b, t] != seq_idx[b, t - 1])


def _silu(v):
    return v * torch.sigmoid(v)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, seq_idx=None):
    """Mamba-1: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t . h_t (+ D u_t) (* silu z_t)."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)

    def per_channel(M, b, t):
        """B or C at (batch b, time t) as (dim, dstate), whatever its layout."""
        if M.dim() == 2:
            return M
        if M.dim() == 3:
            return M[b, :, t].expand(dim, dstate)
        groups = M.shape[1]
        return M[b, :, :, t].repeat_interleave(dim // groups, dim=0)

    rows, last = [], []
    for b in range(batch):
        h = u.new_zeros(dim, dstate)
        ys = []
        for t in range(seqlen):
            if _starts_document(seq_idx, b, t):
                h = torch.zeros_like(h)
            dt = delta[b, :, t][:, None]
            h = torch.exp(dt * A) * h + dt * per_channel(B, b, t) * u[b, :, t][:, None]
            y = (h * per_channel(C, b, t)).sum(-1)
            if D is not None:
                y = y + D * u[b, :, t]
            if z is not None:
                y = y * _silu(z[b, :, t])
            ys.append(y)
        rows.append(torch.stack(ys, dim=-1))
        last.append(h)
    out = torch.stack(rows)
    return (out, torch.stack(last)) if return_last_state else out


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                   return_final_states=False):
    """Mamba-2: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (+ D x_t) (* silu z_t).

    chunk_size is accepted for the signature and ignored: the recurrence has no chunks.
    """
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    heads_per_group = nheads // ngroups
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])

    rows, finals = [], []
    for b in range(batch):
        heads, head_finals = [], []
        for hd in range(nheads):
            g = hd // heads_per_group
            if initial_states is None:
                h = x.new_zeros(headdim, dstate)
            else:
                h = initial_states[b, hd]
            ys = []
            for t in range(seqlen):
                if _starts_document(seq_idx, b, t):
                    h = torch.zeros_like(h)
                step = dt[b, t, hd]
                h = torch.exp(step * A[hd]) * h + step * x[b, t, hd][:, None] * B[b, t, g][None, :]
                y = h @ C[b, t, g]
                if D is not None:
                    y = y + D[hd] * x[b, t, hd]
                if z is not None:
                    y = y * _silu(z[b, t, hd])
                ys.append(y)
            heads.append(torch.stack(ys))
            head_finals.append(h)
        rows.append(torch.stack(heads, dim=1))
        finals.append(torch.stack(head_finals))
    out = torch.stack(rows)
    return (out, torch.stack(finals)) if return_final_states else out


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """out_t = sum_k weight[:, k] x_{t-(width-1)+k} over taps in the same document (+ bias) (silu)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    rows = []
    for b in range(batch):
        cols = []
        for t in range(seqlen):
            acc = bias.clone() if bias is not None else x.new_zeros(dim)
            for k in range(width):
                s = t - (width - 1) + k
                if s < 0:
                    continue
                if any(_starts_document(seq_idx, b, r) for r in range(s + 1, t + 1)):
                    continue
                acc = acc + weight[:, k] * x[b, :, s]
            cols.append(acc)
        rows.append(torch.stack(cols, dim=-1))
    out = torch.stack(rows)
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
        part = v[..., start:start + group_size]
        pieces.append(part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + eps))
    out = torch.cat(pieces, dim=-1) * weight
    if bias is not None:
        out = out + bias
    if z is not None and norm_before_gate:
        out = out * _silu(z)
    return out


def relative_error(out, ref):
    """||out - ref|| / ||ref|| over the whole tensor, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def outputs_and_grads(fn, tensors, seed, **options):
    """Outputs of fn(**tensors, **options) and the gradients of every float input.

    The gradients are those of sum(out * g) for a random upstream g drawn from `seed` (the same
    for any dtype). Returns {"out0": ..., "out1": ..., "grad_<name>": ...}.
    """
    inputs = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    outs = fn(**inputs, **options)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    float_names = [k for k, v in inputs.items() if v.is_floating_point()]
    grads = torch.autograd.grad(outs, [inputs[k] for k in float_names], upstream)
    result = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    result.update({f"grad_{k}": g for k, g in zip(float_names, grads)})
    return result


def assert_matches_naive(op, naive, tensors, dtype, tol, seed, **options):
    """op on `tensors` in `dtype` vs the naive op in float64 on the same values: every output
    and every input gradient within `tol` relative error, all finite. Returns the errors."""
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    got = outputs_and_grads(op, cast, seed, **options)
    ref = outputs_and_grads(naive, {k: v.double() if v.is_floating_point() else v for k, v in cast.items()},
                            seed, **options)
    assert got.keys() == ref.keys(), f"seed {seed}: outputs {sorted(got)} vs naive {sorted(ref)}"
    errors = {}
    for name, expected in ref.items():
        assert torch.isfinite(got[name]).all(), f"seed {seed}: {name} has non-finite values"
        errors[name] = relative_error(got[name], expected)
        assert errors[name] <= tol, f"seed {seed}: {name} relative error {errors[name]:.2e} > {tol:.0e}"
    return errors
