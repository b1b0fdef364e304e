"""The GPU check's kernel sections: each op's error against float64, and op timings, ours next to
mamba_ssm's on the same inputs (inputs and layer shapes from benchmarks/kernel_bench.py).

errors   ssd_chunk_scan, selective_scan, causal_conv1d, rmsnorm_gated at a Mamba-2 / Mamba-1 130M
         layer's training shape (2 x 2048 tokens), and mamba3_scan and mamba3_scan_inputs (the preprocessing:
         its first output, B̂, and every input's gradient) (SISO and MIMO) at mamba3-1.5b's, in
         float32 (TF32 off) and bfloat16: the relative error of the output and of each input's
         gradient (one fixed output gradient) against our PyTorch reference in float64 on the same
         rounded inputs, for ours and for theirs. Then benchmarks/bf16_errors.py's comparison: each
         op's bf16 error at seqlens 128, 512, 2048 at a small layer's shape, and a small Mamba-2 LM's
         loss and gradients in bf16 autocast, ours, theirs and the ratio against float64.
timings  forward and forward+backward milliseconds at the Mamba-2 130M/370M/1.3B, Mamba-1 and Mamba-3
         (scan and preprocessing, SISO and MIMO, mamba3-1.5b's width) layer shapes (16K tokens, bf16),
         ours then theirs for each shape, with the bytes and FLOPs each call must move at least and the
         fraction of the roofline its forward and backward reach, against the copy bandwidth and bf16
         matmul rate measured first in the same section.

Theirs: mamba_ssm's mamba_chunk_scan_combined and rmsnorm_fn (Triton); its selective scan is a CUDA
extension that is not built, so its PyTorch selective_scan_ref stands in for the error and nothing
for the timing; causal_conv1d is torch's depthwise conv1d + SiLU, what mamba_ssm runs without the
causal-conv1d package. Mamba-3 is ours alone: mamba_ssm's kernels take the mixer's raw projections,
not the scan's inputs, and fuse the preprocessing into them. In the dry run everything is our reference at tiny shapes.
"""

import time

import torch

from check_io import load_benchmark

bf16_errors = load_benchmark("bf16_errors")


def error_cases(bench, dry):
    """(op, label, inputs(dtype, device, gen) -> (tensors, kwargs)) at training shapes (tiny when dry)."""
    if dry:
        ssd = dict(batch=2, seqlen=96, nheads=2, headdim=16, ngroups=1, dstate=16, chunk=32)
        scan, conv, norm = dict(batch=2, seqlen=96, dim=32, dstate=8), (2, 48, 96), (192, 32, 32)
        siso = dict(batch=2, seqlen=96, nheads=2, rank=1, headdim=16, dstate=16, chunk=32)
        mimo = {**siso, "rank": 2, "chunk": 16}
    else:
        ssd = bench.mamba2_shape(768, tokens=2 * 2048)
        scan = bench.mamba1_shape(768, tokens=2 * 2048)
        siso = bench.mamba3_shape(2048, tokens=2 * 2048)
        mimo = bench.mamba3_shape(2048, tokens=2 * 2048, mimo=True)
        d_inner = bench.EXPAND * 768
        conv, norm = (2, d_inner + 2 * bench.D_STATE2, 2048), (2 * 2048, d_inner, d_inner)
    return [
        (
            "ssd_chunk_scan",
            f"mamba2-130m {ssd['batch']}x{ssd['seqlen']} docs",
            lambda dt, dev, g: bench.ssd_inputs(ssd, dt, dev, g, docs=True),
        ),
        (
            "selective_scan",
            f"mamba1-130m {scan['batch']}x{scan['seqlen']}",
            lambda dt, dev, g: bench.scan_inputs(scan, dt, dev, g),
        ),
        (
            "causal_conv1d",
            f"dim {conv[1]} {conv[0]}x{conv[2]}",
            lambda dt, dev, g: bench.conv_inputs(*conv, dt, dev, g),
        ),
        ("rmsnorm_gated", f"{norm[0]} rows x {norm[1]}", lambda dt, dev, g: bench.norm_inputs(*norm, dt, dev, g)),
        (
            "mamba3_scan",
            f"mamba3-1.5b SISO {siso['batch']}x{siso['seqlen']} docs",
            lambda dt, dev, g: bench.mamba3_inputs(siso, dt, dev, g, docs=True),
        ),
        (
            "mamba3_scan",
            f"mamba3-1.5b MIMO {mimo['batch']}x{mimo['seqlen']} docs",
            lambda dt, dev, g: bench.mamba3_inputs(mimo, dt, dev, g, docs=True),
        ),
        (
            "mamba3_scan_inputs",
            f"mamba3-1.5b SISO {siso['batch']}x{siso['seqlen']} docs",
            lambda dt, dev, g: bench.mamba3_raw_inputs(siso, dt, dev, g, docs=True),
        ),
        (
            "mamba3_scan_inputs",
            f"mamba3-1.5b MIMO {mimo['batch']}x{mimo['seqlen']} docs",
            lambda dt, dev, g: bench.mamba3_raw_inputs(mimo, dt, dev, g, docs=True),
        ),
    ]


def errors(results, device, theirs, dry):
    """One record per (op, dtype, output or gradient): ours' and theirs' error against float64."""
    import megamamba.kernels as ours
    from megamamba.kernels.reference import conv, mamba3, mamba3_inputs, norm, selective_scan, ssd
    from megamamba.testing.numerics import relative_error

    oracle = {
        "ssd_chunk_scan": ssd.ssd_chunk_scan,
        "selective_scan": selective_scan.selective_scan,
        "causal_conv1d": conv.causal_conv1d,
        "rmsnorm_gated": norm.rmsnorm_gated,
        "mamba3_scan": mamba3.mamba3_scan_chunked,
        "mamba3_scan_inputs": mamba3_inputs.mamba3_scan_inputs,
    }
    bench = bf16_errors.load_kernel_benchmark()
    table = bf16_errors.theirs_table(theirs) if theirs else {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for op, label, make in error_cases(bench, dry):
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).replace("torch.", "")
            try:
                tensors, kwargs = make(dtype, device, torch.Generator(device=device).manual_seed(0))
                exact = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
                ref_out, ref_grads = bf16_errors.forward_backward(oracle[op], exact, kwargs, dtype)
                mine = bf16_errors.forward_backward(getattr(ours, op), tensors, kwargs, dtype)
                fn, impl = table.get(op, (None, "none"))
                other = bf16_errors.forward_backward(fn, tensors, kwargs, dtype) if fn else None
            except Exception as exc:  # noqa: BLE001 - one failing op must not hide the others
                results.write("error_failed", op=op, dtype=name, shape=label, error=repr(exc)[:500])
                continue
            for quantity, ref in [("out", ref_out[0]), *((f"d{k}", g) for k, g in ref_grads.items())]:
                pick = (lambda res: res[0][0]) if quantity == "out" else (lambda res, k=quantity[1:]: res[1][k])
                err_ours = relative_error(pick(mine), ref)
                err_theirs = relative_error(pick(other), ref) if other else None
                results.write(
                    "error",
                    op=op,
                    dtype=name,
                    shape=label,
                    quantity=quantity,
                    ours=err_ours,
                    theirs=err_theirs,
                    theirs_impl=impl,
                    ratio=err_ours / err_theirs if err_theirs else None,
                )
    bf16_comparison(results, device, theirs, dry)
    torch.backends.cuda.matmul.allow_tf32 = True


def bf16_comparison(results, device, theirs, dry):
    """benchmarks/bf16_errors.py's tables: one record per (op, seqlen, quantity), then one per
    quantity of the small LM (ours on Triton, on the reference in the dry run)."""
    seqlens = bf16_errors.SEQLENS[:1] if dry else bf16_errors.SEQLENS
    for op in bf16_errors.OPS:
        try:
            rows = bf16_errors.op_rows(device, theirs, [op], seqlens)
        except Exception as exc:  # noqa: BLE001 - one failing op must not hide the others
            results.write("bf16_failed", op=op, error=repr(exc)[:500])
            continue
        for row in rows:
            results.write("bf16_error", **row)
    try:
        rows = bf16_errors.model_rows(device, theirs, backend="reference" if dry else "triton")
    except Exception as exc:  # noqa: BLE001
        results.write("bf16_failed", op="model", error=repr(exc)[:500])
        return
    for row in rows:
        results.write("bf16_model", **row)


def cpu_time(fn):
    """The dry run's stand-in for CUDA-event timing: one call, milliseconds."""
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def timing_cases(bench, dry):
    """(op, layer, inputs(device, gen)) at the layer shapes: ssd/conv/norm/add+norm per Mamba-2 size, the Mamba-1
    scan, then the Mamba-3 scan and preprocessing."""
    tokens, seqlen = (128, 64) if dry else (bench.TOKENS, 2048)
    sizes2 = {"tiny": 64} if dry else bench.MAMBA2_D_MODEL
    sizes1 = {"tiny": 32} if dry else bench.MAMBA1_D_MODEL
    sizes3 = {"tiny": 64} if dry else bench.MAMBA3_D_MODEL
    bf16 = torch.bfloat16
    cases = []
    for name, d_model in sizes2.items():
        shape = bench.mamba2_shape(d_model, tokens=tokens, seqlen=seqlen)
        d_inner, batch = bench.EXPAND * d_model, tokens // seqlen
        cases += [
            ("ssd_chunk_scan", f"mamba2-{name}", lambda dev, g, s=shape: bench.ssd_inputs(s, bf16, dev, g)),
            (
                "causal_conv1d",
                f"mamba2-{name}",
                lambda dev, g, b=batch, d=d_inner + 2 * shape["dstate"]: bench.conv_inputs(b, d, seqlen, bf16, dev, g),
            ),
            (
                "rmsnorm_gated",
                f"mamba2-{name}",
                lambda dev, g, d=d_inner: bench.norm_inputs(tokens, d, d, bf16, dev, g),
            ),
            ("add_rmsnorm", f"mamba2-{name}", lambda dev, g, d=d_model: bench.add_norm_inputs(tokens, d, bf16, dev, g)),
        ]
    for name, d_model in sizes1.items():
        shape = bench.mamba1_shape(d_model, tokens=tokens, seqlen=seqlen)
        cases.append(("selective_scan", f"mamba1-{name}", lambda dev, g, s=shape: bench.scan_inputs(s, bf16, dev, g)))
    for name, d_model in sizes3.items():
        for mimo in (False, True):
            shape = bench.mamba3_shape(d_model, tokens=tokens, seqlen=seqlen, mimo=mimo)
            label = f"mamba3-{name}{'-mimo' if mimo else ''}"
            cases.append(("mamba3_scan", label, lambda dev, g, s=shape: bench.mamba3_inputs(s, bf16, dev, g)))
            cases.append(
                ("mamba3_scan_inputs", label, lambda dev, g, s=shape: bench.mamba3_raw_inputs(s, bf16, dev, g))
            )
    return cases


def timings(results, device, theirs, dry):
    """The measured roofline, then one record per (op, layer, implementation): forward and
    forward+backward ms, least bytes and FLOPs, and the roofline fractions, ours then theirs."""
    import megamamba.kernels as ours

    bench = bf16_errors.load_kernel_benchmark()
    if dry:
        bench.cuda_time = cpu_time
    ceiling = bench.ceilings(
        device, bench.cuda_time, *((2**20, 128) if dry else (bench.CEILING_COPY_BYTES, bench.CEILING_MATMUL_N))
    )
    results.write("ceilings", **ceiling)
    table = bf16_errors.theirs_table(theirs) if theirs else {}
    gen = torch.Generator(device=device).manual_seed(2)
    for op, layer, make in timing_cases(bench, dry):
        tensors, kwargs = make(device, gen)
        fn_theirs, impl = table.get(op, (None, "none"))
        runs = [("ours", getattr(ours, op))]
        if fn_theirs is not None and op != "selective_scan":  # their scan here is PyTorch: not timed
            runs.append((f"mamba_ssm: {impl}", fn_theirs))
        for who, fn in runs:
            try:
                fwd, fwd_bwd = bench.time_op(fn, tensors, kwargs)
                with torch.no_grad():
                    work = bench.least_work(op, tensors, kwargs, fn(**tensors, **kwargs))
            except Exception as exc:  # noqa: BLE001
                results.write("timing_failed", op=op, layer=layer, impl=who, error=repr(exc)[:500])
                continue
            results.write(
                "timing",
                op=op,
                layer=layer,
                impl=who,
                fwd_ms=fwd,
                fwd_bwd_ms=fwd_bwd,
                **work,
                **bench.roofline_fractions(work, fwd, fwd_bwd, ceiling),
            )
