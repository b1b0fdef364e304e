"""Kernel benchmark and GPU correctness check (one CUDA GPU; finishes in a few minutes).

    python benchmarks/kernel_bench.py [--mamba-ssm-src PATH] [--json PATH] [--skip-timing] [--skip-check]

Correctness: every Triton op, forward and every gradient, against the PyTorch reference in
float32 with TF32 off (<= 1e-4 relative) and in bfloat16 (<= 1e-2 relative to the float32
reference of the same bf16-rounded inputs), including one sequence past 64K tokens.
Timing: forward and forward+backward of the ops at the shapes of Mamba-2 130M / 370M / 1.3B
layers (16K tokens, headdim 64, d_state 128, chunk 256, ngroups 1), Mamba-1 layers (d_state 16)
and Mamba-3 layers at launch/models/mamba3-1.5b.json's width, SISO (chunk 64) and as that model
is, MIMO of rank 4 (chunk 16), the scan and its preprocessing, in bf16: per op the bytes and FLOPs it must move at least
(`least_work`), the time, and the fraction of the roofline that makes against the copy bandwidth
and bf16 matmul rate measured on the same GPU in the same run (`ceilings`); and the time ratio
against mamba_ssm's Triton SSD (mamba_chunk_scan_combined) when its Python sources are given
(--mamba-ssm-src: the unpacked PyPI source release; its CUDA extension is replaced by a stub
module) and against our PyTorch reference.
megamamba is imported as installed, never from the checkout. A short table is printed last;
details go to --json (default $OUT/kernels_benchmark.json when OUT is set).
"""

import argparse
import functools
import json
import math
import os
import sys
import time
import types

import torch

TOKENS = 16 * 1024
MAMBA2_D_MODEL = {"130M": 768, "370M": 1024, "1.3B": 2048}
MAMBA1_D_MODEL = {"130M": 768, "1.4B": 2048}
MAMBA3_D_MODEL = {"1.5B": 2048}
MAMBA3_CHUNK = 64  # mamba_ssm's SISO default
MAMBA3_MIMO_RANK, MAMBA3_MIMO_CHUNK = 4, 16  # launch/models/mamba3-1.5b.json's
HEADDIM, D_STATE2, CHUNK, D_STATE1, EXPAND, D_CONV = 64, 128, 256, 16, 2, 4
LONG_SEQLEN = 65_600  # past 64K tokens and not a multiple of the chunk
CEILING_COPY_BYTES, CEILING_MATMUL_N = 2**30, 8192  # the roofline's measurements: a 1 GiB copy, an 8192^3 matmul


# ----------------------------------------------------------------------------- shapes and counts


def mamba2_shape(d_model, tokens=TOKENS, seqlen=2048):
    """Mamba-2 layer SSD shape: dict(batch, seqlen, nheads, headdim, ngroups, dstate, chunk)."""
    d_inner = EXPAND * d_model
    return dict(
        batch=tokens // seqlen,
        seqlen=seqlen,
        nheads=d_inner // HEADDIM,
        headdim=HEADDIM,
        ngroups=1,
        dstate=D_STATE2,
        chunk=CHUNK,
    )


def mamba1_shape(d_model, tokens=TOKENS, seqlen=2048):
    """Mamba-1 layer scan shape: dict(batch, seqlen, dim, dstate)."""
    return dict(batch=tokens // seqlen, seqlen=seqlen, dim=EXPAND * d_model, dstate=D_STATE1)


def mamba3_shape(d_model, tokens=TOKENS, seqlen=2048, mimo=False):
    """Mamba-3 layer scan shape, SISO or MIMO: dict(batch, seqlen, nheads, rank, headdim, dstate, chunk)."""
    nheads = EXPAND * d_model // HEADDIM
    return dict(
        batch=tokens // seqlen,
        seqlen=seqlen,
        nheads=nheads,
        rank=MAMBA3_MIMO_RANK if mimo else 1,
        headdim=HEADDIM,
        dstate=D_STATE2,
        chunk=MAMBA3_MIMO_CHUNK if mimo else MAMBA3_CHUNK,
    )


def least_work(op, tensors, kwargs, outputs):
    """What a call must do at least: dict(fwd_bytes, bwd_bytes, fwd_flops, bwd_flops).

    Bytes: the forward reads every input once and writes its outputs; the backward reads the
    inputs again and the first output's gradient and writes one gradient per float input. FLOPs:
    the scans' arithmetic by the formulas the model's MFU counts (megamamba.kernels.flops; the
    backward twice the forward); the other ops' arithmetic is negligible next to their bytes.
    """
    from megamamba.kernels.flops import mamba3_scan_flops, selective_scan_flops, ssd_flops

    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    inputs = sum(t.nbytes for t in tensors.values())
    grads = sum(t.nbytes for t in tensors.values() if t.is_floating_point())
    flops = 0
    if op == "ssd_chunk_scan":
        b, L, h, p = tensors["x"].shape
        g, n = tensors["B"].shape[2:]
        flops = ssd_flops(b * L, L, h, p, g, n, kwargs["chunk_size"])
    elif op == "mamba3_scan":
        b, L, h, rank, p = tensors["x"].shape
        flops = mamba3_scan_flops(b * L, L, h, rank, p, tensors["B"].shape[-1], kwargs["chunk_size"])
    elif op == "selective_scan":
        b, d, L = tensors["u"].shape
        flops = selective_scan_flops(b * L, d, tensors["A"].shape[1])
    return dict(
        fwd_bytes=inputs + sum(o.nbytes for o in outputs),
        bwd_bytes=inputs + outputs[0].nbytes + grads,
        fwd_flops=flops,
        bwd_flops=2 * flops,
    )


def ceilings(device, timer, copy_bytes, matmul_n):
    """The device's copy bandwidth (GB/s, bytes read + written) and bf16 matmul rate (TFLOP/s),
    measured with `timer` (milliseconds per call): the roofline the ops are held against."""
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    a = torch.randn(matmul_n, matmul_n, device=device).to(torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=device).to(torch.bfloat16)
    matmul_ms = timer(lambda: a @ b)
    return dict(copy_gbps=2 * src.nbytes / copy_ms / 1e6, matmul_tflops=2 * matmul_n**3 / matmul_ms / 1e9)


def roofline_fractions(work, fwd_ms, fwd_bwd_ms, ceiling):
    """Forward and backward time at the roofline (bytes at the copy bandwidth or FLOPs at the
    matmul rate, whichever is longer) over the measured time; backward = forward+backward - forward."""

    def least_ms(nbytes, flops):
        return max(nbytes / ceiling["copy_gbps"] / 1e6, flops / ceiling["matmul_tflops"] / 1e9)

    bwd_ms = max(fwd_bwd_ms - fwd_ms, 1e-9)
    return dict(
        bwd_ms=bwd_ms,
        fwd_roof=least_ms(work["fwd_bytes"], work["fwd_flops"]) / fwd_ms,
        bwd_roof=least_ms(work["bwd_bytes"], work["bwd_flops"]) / bwd_ms,
    )


# ----------------------------------------------------------------------------- inputs


def ssd_inputs(shape, dtype, device, gen, docs=False, initial=False):
    b, L, h, p, g, n = (shape[k] for k in ("batch", "seqlen", "nheads", "headdim", "ngroups", "dstate"))
    r = functools.partial(torch.randn, generator=gen, device=device)
    dt_init = torch.exp(torch.rand(h, generator=gen, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    t = dict(
        x=r(b, L, h, p),
        dt=0.5 * r(b, L, h),
        A=-torch.exp(torch.rand(h, generator=gen, device=device) * math.log(16)),
        B=r(b, L, g, n) / math.sqrt(n),
        C=r(b, L, g, n),
        D=r(h),
        z=r(b, L, h, p),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),
    )
    if initial:
        t["initial_states"] = 0.1 * r(b, h, p, n)
    t = {k: v.to(dtype) if k not in ("A", "D", "dt_bias") else v for k, v in t.items()}
    kwargs = dict(chunk_size=shape["chunk"], dt_softplus=True)
    if docs:
        kwargs["seq_idx"] = documents(b, L, device)
    return t, kwargs


def mamba3_inputs(shape, dtype, device, gen, docs=False):
    """The scan's inputs at the mixer's scale (Δ = softplus(·), A <= -0.5, λ = sigmoid(·)): x, B̂ and Ĉ in
    `dtype`, Δ, A, λ and D in float32 as the mixer computes them."""
    b, L, h, R, p, n = (shape[k] for k in ("batch", "seqlen", "nheads", "rank", "headdim", "dstate"))
    r = functools.partial(torch.randn, generator=gen, device=device)
    t = dict(
        x=r(b, L, h, R, p).to(dtype),
        dt=torch.nn.functional.softplus(r(b, L, h) - 1),
        A=-0.5 - torch.rand(b, L, h, generator=gen, device=device),
        lam=torch.sigmoid(r(b, L, h)),
        B=(r(b, L, h, R, n) / math.sqrt(n)).to(dtype),
        C=r(b, L, h, R, n).to(dtype),
        D=r(h),
    )
    kwargs = dict(chunk_size=shape["chunk"])
    if docs:
        kwargs["seq_idx"] = documents(b, L, device)
    return t, kwargs


def mamba3_raw_inputs(shape, dtype, device, gen, docs=False):
    """Mamba-3's preprocessing inputs: in_proj's raw columns in `dtype` (B and C of one group, dd_dt, dd_A,
    trap, and dstate / 4 angle columns, rope_fraction 0.5's), the parameters in float32 away from their
    initial values; SISO rotates adjacent pairs, MIMO halves."""
    b, L, h, R, n = (shape[k] for k in ("batch", "seqlen", "nheads", "rank", "dstate"))
    r = functools.partial(torch.randn, generator=gen, device=device)
    t = dict(
        B=r(b, L, R, 1, n).to(dtype),
        C=r(b, L, R, 1, n).to(dtype),
        dd_dt=r(b, L, h).to(dtype),
        dd_A=r(b, L, h).to(dtype),
        trap=r(b, L, h).to(dtype),
        angles=r(b, L, n // 4).to(dtype),
        dt_bias=r(h) - 3,
        B_norm_weight=1 + 0.1 * r(n),
        C_norm_weight=1 + 0.1 * r(n),
        B_bias=1 + 0.1 * r(h, R, n),
        C_bias=1 + 0.1 * r(h, R, n),
    )
    kwargs = dict(A_floor=1e-4, rotation="halves" if R > 1 else "adjacent")
    if docs:
        kwargs["seq_idx"] = documents(b, L, device)
    return t, kwargs


def angle_as_cos_sin(fn):
    """fn (a Mamba-3 preprocessing) with its angle output as cosine and sine: an angle is defined modulo 2π, so
    two that straddle 0 and 2π are the same."""

    def compared(**kwargs):
        out = fn(**kwargs)
        return (*out[:5], torch.cos(out.angle), torch.sin(out.angle))

    return compared


def scan_inputs(shape, dtype, device, gen, docs=False):
    b, L, d, n = (shape[k] for k in ("batch", "seqlen", "dim", "dstate"))
    r = functools.partial(torch.randn, generator=gen, device=device)
    t = dict(
        u=r(b, d, L),
        delta=0.5 * r(b, d, L) - 4.0,
        A=-torch.arange(1, n + 1, device=device).float().repeat(d, 1),
        B=r(b, n, L),
        C=r(b, n, L),
        D=r(d),
        z=r(b, d, L),
        delta_bias=0.1 * r(d),
    )
    t = {k: v.to(dtype) if k in ("u", "delta", "B", "C", "z") else v for k, v in t.items()}
    kwargs = dict(delta_softplus=True)
    if docs:
        kwargs["seq_idx"] = documents(b, L, device)
    return t, kwargs


def conv_inputs(batch, dim, seqlen, dtype, device, gen, docs=False):
    t = dict(
        x=torch.randn(batch, dim, seqlen, generator=gen, device=device).to(dtype),
        weight=torch.randn(dim, D_CONV, generator=gen, device=device) / 2,
        bias=torch.randn(dim, generator=gen, device=device),
    )
    kwargs = dict(activation="silu")
    if docs:
        kwargs["seq_idx"] = documents(batch, seqlen, device)
    return t, kwargs


def norm_inputs(rows, dim, group_size, dtype, device, gen):
    t = dict(
        x=torch.randn(rows, dim, generator=gen, device=device).to(dtype),
        weight=1 + 0.1 * torch.randn(dim, generator=gen, device=device),
        z=torch.randn(rows, dim, generator=gen, device=device).to(dtype),
    )
    return t, dict(group_size=group_size, norm_before_gate=False, eps=1e-5)


def add_norm_inputs(rows, dim, dtype, device, gen):
    """A block's residual add + RMSNorm: `dtype` branch output, float32 residual stream."""
    t = dict(
        x=torch.randn(rows, dim, generator=gen, device=device).to(dtype),
        residual=torch.randn(rows, dim, generator=gen, device=device),
        weight=1 + 0.1 * torch.randn(dim, generator=gen, device=device),
    )
    return t, dict(eps=1e-5, residual_dtype=torch.float32)


def documents(batch, seqlen, device):
    """Document ids with boundaries at fixed fractions of the sequence (one in every row)."""
    pos = torch.arange(seqlen, device=device)
    cuts = [seqlen // 7, seqlen // 3, (2 * seqlen) // 3 + 5]
    ids = sum((pos >= c).int() for c in cuts)
    return ids.to(torch.int32).expand(batch, seqlen).contiguous()


# ----------------------------------------------------------------------------- running ops


def ops():
    """name -> (Triton op, PyTorch reference op)."""
    from megamamba.kernels import mamba3_scan, mamba3_scan_inputs
    from megamamba.kernels import triton as tri
    from megamamba.kernels.reference.add_norm import add_rmsnorm
    from megamamba.kernels.reference.conv import causal_conv1d
    from megamamba.kernels.reference.mamba3 import mamba3_scan_chunked
    from megamamba.kernels.reference.mamba3_inputs import mamba3_scan_inputs as reference_mamba3_scan_inputs
    from megamamba.kernels.reference.norm import rmsnorm_gated
    from megamamba.kernels.reference.selective_scan import selective_scan
    from megamamba.kernels.reference.ssd import ssd_chunk_scan

    return {
        "ssd_chunk_scan": (tri.ssd_chunk_scan, ssd_chunk_scan),
        "selective_scan": (tri.selective_scan, selective_scan),
        "mamba3_scan": (mamba3_scan, mamba3_scan_chunked),  # the op: Triton on CUDA
        "mamba3_scan_inputs": (mamba3_scan_inputs, reference_mamba3_scan_inputs),
        "causal_conv1d": (tri.causal_conv1d, causal_conv1d),
        "rmsnorm_gated": (tri.rmsnorm_gated, rmsnorm_gated),
        "add_rmsnorm": (tri.add_rmsnorm, add_rmsnorm),
    }


def forward_backward(fn, tensors, kwargs, seed=0):
    """Outputs (a tuple) and gradients of every float input under fixed random output gradients."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items() if v.is_floating_point()}
    out = fn(**{**tensors, **leaves}, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return tuple(o.detach() for o in outs), {k: v.grad for k, v in leaves.items()}


def compare(name, dtype, triton_fn, reference_fn, tensors, kwargs, tol):
    """Triton on `tensors` vs the reference on their float32 copies: worst relative error."""
    from megamamba.testing.numerics import relative_error

    out, grads = forward_backward(triton_fn, tensors, kwargs)
    ref32 = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    ref_out, ref_grads = forward_backward(reference_fn, ref32, kwargs)
    names = ["out"] if len(out) == 1 else [f"out{i}" for i in range(len(out))]
    errs = {name: relative_error(o, r) for name, o, r in zip(names, out, ref_out)}
    errs.update({f"d{k}": relative_error(grads[k], ref_grads[k]) for k in grads})
    finite = all(bool(torch.isfinite(t).all()) for t in (*out, *grads.values()))
    worst = max(errs, key=errs.get)
    return dict(
        op=name,
        dtype=str(dtype).replace("torch.", ""),
        shape={k: list(v.shape) for k, v in tensors.items()},
        errors=errs,
        worst=worst,
        max_rel_err=errs[worst],
        tol=tol,
        finite=finite,
        ok=finite and errs[worst] <= tol,
    )


CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def check_cases(device, gen):
    """(op, dtype, label, (tensors, kwargs)) the correctness check runs: every op in float32 and bf16 at
    small shapes with documents, then sequences past 64K tokens in float32."""
    small2 = dict(batch=2, seqlen=1000, nheads=8, headdim=64, ngroups=2, dstate=128, chunk=256)
    small1 = dict(batch=2, seqlen=1000, dim=256, dstate=16)
    long2 = dict(batch=1, seqlen=LONG_SEQLEN, nheads=4, headdim=64, ngroups=1, dstate=128, chunk=256)
    long1 = dict(batch=1, seqlen=LONG_SEQLEN, dim=64, dstate=16)
    small3 = dict(batch=2, seqlen=1000, nheads=8, rank=1, headdim=64, dstate=128, chunk=MAMBA3_CHUNK)
    mimo3 = {**small3, "rank": MAMBA3_MIMO_RANK, "chunk": MAMBA3_MIMO_CHUNK}
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        cases += [
            ("ssd_chunk_scan", dtype, "docs+initial", ssd_inputs(small2, dtype, device, gen, docs=True, initial=True)),
            ("ssd_chunk_scan", dtype, "", ssd_inputs(small2, dtype, device, gen)),
            ("selective_scan", dtype, "docs", scan_inputs(small1, dtype, device, gen, docs=True)),
            ("mamba3_scan", dtype, "docs", mamba3_inputs(small3, dtype, device, gen, docs=True)),
            ("mamba3_scan", dtype, "MIMO docs", mamba3_inputs(mimo3, dtype, device, gen, docs=True)),
            ("mamba3_scan_inputs", dtype, "docs", mamba3_raw_inputs(small3, dtype, device, gen, docs=True)),
            ("mamba3_scan_inputs", dtype, "MIMO docs", mamba3_raw_inputs(mimo3, dtype, device, gen, docs=True)),
            ("causal_conv1d", dtype, "docs", conv_inputs(2, 384, 1000, dtype, device, gen, docs=True)),
            ("rmsnorm_gated", dtype, "", norm_inputs(2000, 512, 256, dtype, device, gen)),
        ]
    f32 = torch.float32
    return cases + [
        ("ssd_chunk_scan", f32, "long docs", ssd_inputs(long2, f32, device, gen, docs=True)),
        ("selective_scan", f32, "long docs", scan_inputs(long1, f32, device, gen, docs=True)),
        ("causal_conv1d", f32, "long", conv_inputs(1, 64, LONG_SEQLEN, f32, device, gen)),
    ]


def correctness(device):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    table = ops()
    gen = torch.Generator(device=device).manual_seed(0)
    cases = [(op, dtype, CHECK_TOLERANCE[dtype], inputs) for op, dtype, _, inputs in check_cases(device, gen)]
    results = []
    for name, dtype, tol, (tensors, kwargs) in cases:
        start = time.time()
        try:
            fns = table[name]
            if name == "mamba3_scan_inputs":
                fns = tuple(angle_as_cos_sin(fn) for fn in fns)
            res = compare(name, dtype, *fns, tensors, kwargs, tol)
        except Exception as exc:  # a kernel that fails to compile or run is reported, not fatal
            res = dict(
                op=name,
                dtype=str(dtype).replace("torch.", ""),
                ok=False,
                error=repr(exc)[:500],
                shape={k: list(v.shape) for k, v in tensors.items()},
            )
        res["seconds"] = round(time.time() - start, 2)
        results.append(res)
        print(
            f"[check] {name:15s} {res['dtype']:8s} {str(res['shape'].get('x', res['shape'].get('u'))):24s} "
            f"{'ok ' if res['ok'] else 'FAIL'} "
            + (
                f"max rel err {res['max_rel_err']:.2e} ({res['worst']})"
                if "max_rel_err" in res
                else res.get("error", "")
            ),
            flush=True,
        )
    torch.backends.cuda.matmul.allow_tf32 = True
    return results


# ----------------------------------------------------------------------------- timing


def cuda_time(fn, warmup=2, iters=5):
    """Mean milliseconds per call of fn, measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_op(fn, tensors, kwargs):
    """(forward ms, forward+backward ms) of fn on tensors."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items() if v.is_floating_point()}
    args = {**tensors, **leaves}

    def fwd():
        with torch.no_grad():
            fn(**tensors, **kwargs)

    def fwd_bwd():
        for v in leaves.values():
            v.grad = None
        out = fn(**args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    out = fn(**tensors, **kwargs)
    grad = torch.randn_like(out[0] if isinstance(out, tuple) else out)
    return cuda_time(fwd), cuda_time(fwd_bwd)


def load_mamba_ssm(src):
    """mamba_ssm's mamba_chunk_scan_combined from its source release, or (None, why not)."""
    if not src:
        return None, "not given (--mamba-ssm-src)"
    root = os.path.dirname(src.rstrip("/")) if os.path.basename(src.rstrip("/")) == "mamba_ssm" else src
    if not os.path.isdir(os.path.join(root, "mamba_ssm")):
        return None, f"no mamba_ssm package under {root}"
    sys.path.insert(0, root)
    # The package __init__ imports the compiled selective-scan extension: a stub stands in.
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        return mamba_chunk_scan_combined, "imported with its package __init__"
    except Exception as first:  # e.g. its __init__ needs transformers: skip the __init__
        for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
            del sys.modules[name]
        package = types.ModuleType("mamba_ssm")
        package.__path__ = [os.path.join(root, "mamba_ssm")]
        sys.modules["mamba_ssm"] = package
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            return mamba_chunk_scan_combined, f"imported without its package __init__ ({first!r:.120})"
        except Exception as second:
            return None, f"import failed: {second!r:.300}"


def timing(device, mamba_ssm_src):
    table = ops()
    theirs, how = load_mamba_ssm(mamba_ssm_src)
    print(f"[time] mamba_ssm: {how}", flush=True)
    ceiling = ceilings(device, cuda_time, CEILING_COPY_BYTES, CEILING_MATMUL_N)
    print(
        f"[time] ceilings: copy {ceiling['copy_gbps']:.0f} GB/s, bf16 matmul {ceiling['matmul_tflops']:.0f} TFLOP/s",
        flush=True,
    )
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16
    rows, ssd_cases = [], []

    def record(op, layer, tensors, kwargs, extra=None):
        fn, reference = table[op]
        fwd_ms, fb_ms = time_op(fn, tensors, kwargs)
        with torch.no_grad():
            work = least_work(op, tensors, kwargs, fn(**tensors, **kwargs))
        row = dict(
            op=op,
            layer=layer,
            fwd_ms=fwd_ms,
            fwd_bwd_ms=fb_ms,
            **work,
            **roofline_fractions(work, fwd_ms, fb_ms, ceiling),
        )
        if extra == "reference":
            ref = time_op(reference, tensors, kwargs)
            row.update(ref_fwd_ms=ref[0], ref_fwd_bwd_ms=ref[1], vs_reference_fwd_bwd=ref[1] / fb_ms)
        rows.append(row)
        print(
            f"[time] {op:15s} {layer:12s} fwd {fwd_ms:8.3f} ms ({100 * row['fwd_roof']:5.1f}% of roofline)  "
            f"bwd {row['bwd_ms']:8.3f} ms ({100 * row['bwd_roof']:5.1f}%)",
            flush=True,
        )

    for name, d_model in MAMBA2_D_MODEL.items():
        layer, shape = f"mamba2-{name}", mamba2_shape(d_model)
        tensors, kwargs = ssd_inputs(shape, dtype, device, gen)
        record("ssd_chunk_scan", layer, tensors, kwargs, extra="reference")
        ssd_cases.append((tensors, kwargs, rows[-1]))
        d_inner = EXPAND * d_model
        record(
            "causal_conv1d",
            layer,
            *conv_inputs(
                shape["batch"], d_inner + 2 * shape["ngroups"] * D_STATE2, shape["seqlen"], dtype, device, gen
            ),
        )
        record("rmsnorm_gated", layer, *norm_inputs(TOKENS, d_inner, d_inner, dtype, device, gen))
        record("add_rmsnorm", layer, *add_norm_inputs(TOKENS, d_model, dtype, device, gen))
    for name, d_model in MAMBA1_D_MODEL.items():
        record(
            "selective_scan",
            f"mamba1-{name}",
            *scan_inputs(mamba1_shape(d_model), dtype, device, gen),
            extra="reference",
        )
    for name, d_model in MAMBA3_D_MODEL.items():
        shape = mamba3_shape(d_model)
        record("mamba3_scan", f"mamba3-{name}", *mamba3_inputs(shape, dtype, device, gen), extra="reference")
        record("mamba3_scan_inputs", f"mamba3-{name}", *mamba3_raw_inputs(shape, dtype, device, gen), extra="reference")
        shape = mamba3_shape(d_model, mimo=True)
        record("mamba3_scan", f"mamba3-{name}-mimo", *mamba3_inputs(shape, dtype, device, gen), extra="reference")
        record(
            "mamba3_scan_inputs",
            f"mamba3-{name}-mimo",
            *mamba3_raw_inputs(shape, dtype, device, gen),
            extra="reference",
        )
    # mamba_ssm last: its autotuner compiles and times many configurations on first use, which must
    # not leave our own timings out when the run is cut short.
    for tensors, kwargs, row in ssd_cases if theirs is not None else []:
        try:
            ms = time_op(theirs, tensors, kwargs)
            row.update(
                mamba_ssm_fwd_ms=ms[0],
                mamba_ssm_fwd_bwd_ms=ms[1],
                vs_mamba_ssm_fwd=ms[0] / row["fwd_ms"],
                vs_mamba_ssm_fwd_bwd=ms[1] / row["fwd_bwd_ms"],
            )
            print(
                f"[time] mamba_ssm ssd   {row['layer']:12s} fwd {ms[0]:8.3f} ms  fwd+bwd {ms[1]:8.3f} ms  "
                f"theirs/ours {row['vs_mamba_ssm_fwd']:.2f} / {row['vs_mamba_ssm_fwd_bwd']:.2f}",
                flush=True,
            )
        except Exception as exc:
            row["mamba_ssm_error"] = repr(exc)[:300]
            print(f"[time] mamba_ssm ssd   {row['layer']:12s} failed: {row['mamba_ssm_error']}", flush=True)
    return rows, how, ceiling


def summary(checks, rows, ceiling=None):
    lines = ["", "== summary =="]
    if checks:
        bad = [c for c in checks if not c["ok"]]
        lines.append(
            f"correctness: {len(checks) - len(bad)}/{len(checks)} cases pass"
            + ("" if not bad else "; failing: " + ", ".join(f"{c['op']}/{c['dtype']}" for c in bad))
        )
    if rows:
        lines.append(
            f"roofline: copy {ceiling['copy_gbps']:.0f} GB/s, bf16 matmul {ceiling['matmul_tflops']:.0f} "
            "TFLOP/s (measured in this run)"
        )
        lines.append(
            f"{'op':15s} {'layer':12s} {'fwd MB':>8s} {'GFLOP':>7s} {'fwd ms':>8s} {'roof%':>6s} "
            f"{'bwd MB':>8s} {'bwd ms':>8s} {'roof%':>6s} {'x mamba_ssm':>11s} {'x ref':>6s}"
        )
        for r in rows:
            vs_theirs = r.get("vs_mamba_ssm_fwd_bwd")
            vs_ref = r.get("vs_reference_fwd_bwd")
            lines.append(
                f"{r['op']:15s} {r['layer']:12s} {r['fwd_bytes'] / 1e6:8.1f} {r['fwd_flops'] / 1e9:7.1f} "
                f"{r['fwd_ms']:8.3f} {100 * r['fwd_roof']:6.1f} {r['bwd_bytes'] / 1e6:8.1f} "
                f"{r['bwd_ms']:8.3f} {100 * r['bwd_roof']:6.1f} "
                f"{(f'{vs_theirs:11.2f}' if vs_theirs else '          -')} "
                f"{(f'{vs_ref:6.2f}' if vs_ref else '     -')}"
            )
        lines.append(
            "(roof% = time at the roofline / measured time; bwd = forward+backward - forward; "
            "x mamba_ssm / x ref = their forward+backward time / ours, >1 means we are faster)"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--mamba-ssm-src",
        default=None,
        help="unpacked mamba_ssm source release (folder holding mamba_ssm/), for the comparison",
    )
    parser.add_argument("--json", default=None, help="where to write the details (default $OUT/kernels_benchmark.json)")
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness section")
    parser.add_argument("--skip-timing", action="store_true", help="skip the timing section")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the CPU interpreter path is covered by tests/kernels/test_triton_*.py)")
    import triton

    device = torch.device("cuda")
    started = time.time()
    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=sys.version.split()[0],
    )
    print("[info] " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    checks = [] if args.skip_check else correctness(device)
    rows, how, ceiling = ([], "skipped", None) if args.skip_timing else timing(device, args.mamba_ssm_src)
    info.update(seconds=round(time.time() - started, 1), mamba_ssm=how, ceilings=ceiling)
    path = args.json or (os.path.join(os.environ["OUT"], "kernels_benchmark.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(info=info, checks=checks, timings=rows), f, indent=1, default=str)
    print(summary(checks, rows, ceiling))
    print(f"total {info['seconds']} s" + (f"; details in {path}" if path else ""))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
