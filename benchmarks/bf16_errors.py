"""bf16 error against float64 of each op and of a small Mamba-2 LM, ours beside mamba_ssm's on the
same inputs.

    python benchmarks/bf16_errors.py [ops|model|all] [--ops OP ...] [--seqlens 128 512 2048]
        [--mamba-ssm-src DIR] [--json PATH]

ops    ssd_chunk_scan (batch 1, 4 heads, headdim 64, dstate 64, chunk 64, one group; bf16 x, dt, B, C,
       z; float32 A, D, dt_bias; dt_softplus), rmsnorm_gated and add_rmsnorm at that layer's widths
       (256, and d_model 128 with a float32 residual), causal_conv1d (dim 128, width 4, SiLU) and
       selective_scan (dim 16, dstate 16; channels are independent, and the interpreter's time grows
       with them). Per seqlen, the relative error of each output and input gradient (one seeded
       output gradient rounded to bf16, given to all) against our PyTorch reference in float64 on
       the same rounded inputs. Theirs: mamba_chunk_scan_combined, rmsnorm_fn and rms_norm_fn
       (Triton), selective_scan_ref (their CUDA scan is not built), torch conv1d + SiLU.
model  a 2-layer Mamba-2 LM (d_model 128, headdim 32, d_state 32, chunk 64, vocab 256, 2 x 128 tokens)
       in bf16 autocast with our Triton kernels, and mamba_ssm's MambaLMHeadModel with the same
       weights (use_mem_eff_path off), against our model in float64 on the reference kernels:
       the loss, the logits and each parameter group's gradient.

Without a GPU the Triton kernels, ours and theirs, run under TRITON_INTERPRET=1 with the
interpreter's bf16 fix (megamamba/testing/interpreter_bf16.py) and mamba_ssm's CPU stand-ins
(megamamba/testing/mamba_ssm_release.py); mamba_ssm's source release is --mamba-ssm-src, else
$MAMBA_SSM_SRC, else .venv/mamba_ssm-src (scripts/setup.sh fetches it). The GPU check's errors
section runs the same (benchmarks/gpu_check/check_ops.py).
"""

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OPS = ("ssd_chunk_scan", "selective_scan", "causal_conv1d", "rmsnorm_gated", "add_rmsnorm")
SEQLENS = (128, 512, 2048)
SSD = dict(batch=1, nheads=4, headdim=64, ngroups=1, dstate=64, chunk=64)
D_MODEL = 128  # the SSD shape's layer: d_inner 256 = 4 heads x 64
SCAN_DIM, CONV_DIM = 16, 128
OUTPUTS = {"ssd_chunk_scan": ("y",), "add_rmsnorm": ("out", "residual")}
MODEL = dict(
    d_model=D_MODEL, n_layer=2, vocab_size=256, ssm_cfg=dict(layer="Mamba2", d_state=32, headdim=32, chunk_size=64)
)
MODEL_BATCH, MODEL_SEQ = 2, 128
GROUPS = (
    "embedding",
    "A_log",
    "dt_bias",
    "D",
    "in_proj",
    "conv1d",
    "norm (gated)",
    "out_proj",
    "norm (pre-norm, final)",
)


# ----------------------------------------------------------------------------- ops


def load_kernel_benchmark():
    """benchmarks/kernel_bench.py as a module (its inputs, shapes and timer)."""
    spec = importlib.util.spec_from_file_location("benchmark_kernels", os.path.join(HERE, "kernel_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_causal_conv1d(x, weight, bias=None, activation=None):
    """Depthwise causal conv1d with torch's conv1d: mamba_ssm's path without causal-conv1d."""
    out = F.conv1d(
        x,
        weight.unsqueeze(1).to(x.dtype),
        None if bias is None else bias.to(x.dtype),
        padding=weight.shape[1] - 1,
        groups=x.shape[1],
    )[..., : x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def theirs_table(theirs):
    """op -> (mamba_ssm's function with our op's keyword arguments, its label), None where it has none."""

    def norm(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        return theirs.rmsnorm_fn(
            x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
        )

    return {
        "ssd_chunk_scan": (theirs.mamba_chunk_scan_combined, "mamba_chunk_scan_combined (Triton)"),
        "selective_scan": (theirs.selective_scan_ref, "selective_scan_ref (PyTorch; CUDA kernel not built)"),
        "causal_conv1d": (torch_causal_conv1d, "torch conv1d + silu (no causal-conv1d package)"),
        "rmsnorm_gated": (norm, "layernorm_gated.rmsnorm_fn (Triton)"),
    }


def forward_backward(fn, tensors, kwargs, dtype):
    """The outputs (a tuple) and the gradient of every float input, for fixed random output gradients
    rounded to `dtype` (the same values whatever the outputs' own dtypes)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items() if v.is_floating_point()}
    outs = fn(**{**tensors, **leaves}, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device=outs[0].device).manual_seed(1)
    torch.autograd.backward(
        outs, [torch.randn(o.shape, generator=gen, device=o.device).to(dtype).to(o.dtype) for o in outs]
    )
    return tuple(o.detach() for o in outs), {k: v.grad for k, v in leaves.items()}


def op_cases(bench, ops, seqlens):
    """(op, seqlen, inputs(dtype, device, gen) -> (tensors, kwargs)) for each op and seqlen."""
    makers = {
        "ssd_chunk_scan": lambda L: lambda dt, dev, g: bench.ssd_inputs(dict(SSD, seqlen=L), dt, dev, g),
        "selective_scan": lambda L: (
            lambda dt, dev, g: bench.scan_inputs(dict(batch=1, seqlen=L, dim=SCAN_DIM, dstate=16), dt, dev, g)
        ),
        "causal_conv1d": lambda L: lambda dt, dev, g: bench.conv_inputs(1, CONV_DIM, L, dt, dev, g),
        "rmsnorm_gated": lambda L: lambda dt, dev, g: bench.norm_inputs(L, 2 * D_MODEL, 2 * D_MODEL, dt, dev, g),
        "add_rmsnorm": lambda L: lambda dt, dev, g: bench.add_norm_inputs(L, D_MODEL, dt, dev, g),
    }
    return [(op, L, makers[op](L)) for op in ops for L in seqlens]


def theirs_ops(theirs):
    """op -> (mamba_ssm's function with our op's keyword arguments, its label)."""

    def add_norm(x, residual, weight, eps=1e-6, residual_dtype=None):
        return theirs.rms_norm_fn(
            x, weight, None, residual=residual, eps=eps, prenorm=True, residual_in_fp32=residual_dtype == torch.float32
        )

    return {**theirs_table(theirs), "add_rmsnorm": (add_norm, "layer_norm.rms_norm_fn (Triton), prenorm")}


def oracle_ops():
    """op -> our PyTorch reference, run in float64 as the oracle."""
    from megamamba.kernels.reference import add_norm, conv, norm, selective_scan, ssd

    return {
        "ssd_chunk_scan": ssd.ssd_chunk_scan,
        "selective_scan": selective_scan.selective_scan,
        "causal_conv1d": conv.causal_conv1d,
        "rmsnorm_gated": norm.rmsnorm_gated,
        "add_rmsnorm": add_norm.add_rmsnorm,
    }


def float64(tensors, kwargs):
    """float64 copies of the float tensors, and float64 for any dtype option (the oracle keeps all)."""
    exact = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
    return exact, {k: torch.float64 if isinstance(v, torch.dtype) else v for k, v in kwargs.items()}


def timed(fn, *args):
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def op_rows(device, theirs, ops=OPS, seqlens=SEQLENS):
    """One row per (op, seqlen, output or input gradient): ours' and theirs' bf16 error against float64,
    their ratio, and each side's seconds for the forward+backward."""
    import megamamba.kernels as ours

    bench = load_kernel_benchmark()
    oracle, table = oracle_ops(), theirs_ops(theirs) if theirs is not None else {}
    bf16, rows = torch.bfloat16, []
    for op, seqlen, make in op_cases(bench, ops, seqlens):
        tensors, kwargs = make(bf16, device, torch.Generator(device=device).manual_seed(0))
        ref, _ = timed(forward_backward, oracle[op], *float64(tensors, kwargs), bf16)
        mine, s_ours = timed(forward_backward, getattr(ours, op), tensors, kwargs, bf16)
        fn, impl = table.get(op, (None, "none"))
        other, s_theirs = timed(forward_backward, fn, tensors, kwargs, bf16) if fn else (None, None)
        for quantity, pick in quantities(op, ref):
            err_ours = error(pick(mine), pick(ref))
            err_theirs = error(pick(other), pick(ref)) if other else None
            rows.append(
                dict(
                    op=op,
                    seqlen=seqlen,
                    quantity=quantity,
                    ours=err_ours,
                    theirs=err_theirs,
                    ratio=err_ours / err_theirs if err_ours is not None and err_theirs else None,
                    theirs_impl=impl,
                    seconds_ours=round(s_ours, 2),
                    seconds_theirs=None if s_theirs is None else round(s_theirs, 2),
                )
            )
    return rows


def quantities(op, ref):
    """(name, pick(result) -> tensor) for each output, then each input's gradient."""
    outs, grads = ref
    names = OUTPUTS.get(op, ("out",))
    return [
        *((names[i], lambda res, i=i: res[0][i]) for i in range(len(outs))),
        *((f"d{k}", lambda res, k=k: res[1][k]) for k in grads),
    ]


def error(value, ref):
    """Relative error, None when the value is missing (no gradient returned)."""
    from megamamba.testing.numerics import relative_error

    return None if value is None else relative_error(value, ref)


# ----------------------------------------------------------------------------- model


@contextlib.contextmanager
def kernels(backend):
    """MEGAMAMBA_KERNELS set to `backend` for the block."""
    saved = os.environ.get("MEGAMAMBA_KERNELS")
    os.environ["MEGAMAMBA_KERNELS"] = backend
    try:
        yield
    finally:
        if saved is None:
            del os.environ["MEGAMAMBA_KERNELS"]
        else:
            os.environ["MEGAMAMBA_KERNELS"] = saved


def group(name: str) -> str:
    """The parameter group of a state-dict name (GROUPS)."""
    if "embedding" in name or "lm_head" in name:
        return "embedding"
    if ".mixer." in name:
        part = name.split(".mixer.")[1].split(".")[0]
        return "norm (gated)" if part == "norm" else part
    return "norm (pre-norm, final)"


def lm_step(model, ids, vocab, autocast):
    """(loss, logits, {name: gradient}) of one next-token loss of a model returning logits or .logits."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(ids[:, :-1])
    logits = getattr(out, "logits", out)[..., :vocab]
    logits = logits.float() if autocast else logits
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def group_errors(grads, ref) -> dict:
    """group -> sqrt(sum ||g - ref||^2) / sqrt(sum ||ref||^2) over the group's parameters."""
    num, den = {}, {}
    for name, r in ref.items():
        g = grads[name]
        key = group(name)
        num[key] = num.get(key, 0.0) + (float("inf") if g is None else (g.double() - r).norm().item() ** 2)
        den[key] = den.get(key, 0.0) + r.norm().item() ** 2
    return {key: (num[key] / max(den[key], 1e-60)) ** 0.5 for key in GROUPS if key in num}


def models(device, theirs_models=None):
    """(our MambaLM, mamba_ssm's MambaLMHeadModel with its weights or None, token ids (batch, seq + 1))."""
    from megamamba import MambaConfig, MambaLM

    config = MambaConfig.from_dict(copy.deepcopy(MODEL))
    torch.manual_seed(0)
    ours, theirs = MambaLM(config).to(device), None
    if theirs_models is not None:
        fields = {**config.to_dict(), "ssm_cfg": {**config.ssm_cfg, "use_mem_eff_path": False}}
        theirs = theirs_models.MambaLMHeadModel(theirs_models.MambaConfig(**fields), device=device, dtype=torch.float32)
        theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(
        0, config.vocab_size, (MODEL_BATCH, MODEL_SEQ + 1), generator=torch.Generator().manual_seed(3)
    ).to(device)
    return ours, theirs, ids


def model_rows(device, theirs_models, backend="triton"):
    """One row per quantity (loss, logits, each parameter group's gradient): ours (bf16 autocast, our
    kernels as `backend`) and mamba_ssm's (same weights, bf16 autocast) against our float64 model."""
    ours, theirs, ids = models(device, theirs_models)
    vocab = MODEL["vocab_size"]
    with kernels("reference"):
        ref_loss, ref_logits, ref_grads = lm_step(copy.deepcopy(ours).double(), ids, vocab, autocast=False)
    with kernels(backend):
        (loss, logits, grads), s_ours = timed(lm_step, ours, ids, vocab, True)
    runs = {"ours": (loss, logits, grads, s_ours)}
    if theirs is not None:
        (t_loss, t_logits, t_grads), s_theirs = timed(lm_step, theirs, ids, vocab, True)
        runs["theirs"] = (t_loss, t_logits, t_grads, s_theirs)
    found = {
        who: {"loss": error(r[0], ref_loss), "logits": error(r[1], ref_logits), **group_errors(r[2], ref_grads)}
        for who, r in runs.items()
    }
    rows = []
    for quantity, err_ours in found["ours"].items():
        err_theirs = found.get("theirs", {}).get(quantity)
        rows.append(
            dict(
                quantity=quantity,
                ours=err_ours,
                theirs=err_theirs,
                ratio=err_ours / err_theirs if err_theirs else None,
                seconds_ours=round(s_ours, 2),
                seconds_theirs=round(runs["theirs"][3], 2) if "theirs" in runs else None,
            )
        )
    return rows


# ----------------------------------------------------------------------------- tables


def fmt(value, ratio=False) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if ratio else f"{value:.2e}"


def op_tables(rows) -> list:
    """Markdown, one table per op: a row each for ours, theirs and ours/theirs at each seqlen."""
    lines = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        names = list(dict.fromkeys(r["quantity"] for r in mine))
        lines += [
            "",
            f"{op} (theirs: {mine[0]['theirs_impl']})",
            "",
            "| seqlen | | " + " | ".join(names) + " | s |",
            "| --- | --- |" + " --- |" * (len(names) + 1),
        ]
        for seqlen in dict.fromkeys(r["seqlen"] for r in mine):
            at = {r["quantity"]: r for r in mine if r["seqlen"] == seqlen}
            first = next(iter(at.values()))
            for who, key, is_ratio, secs in (
                ("ours", "ours", False, first["seconds_ours"]),
                ("mamba_ssm", "theirs", False, first["seconds_theirs"]),
                ("ours/theirs", "ratio", True, None),
            ):
                label = str(seqlen) if who == "ours" else ""
                cells = " | ".join(fmt(at[n][key], is_ratio) for n in names)
                lines.append(f"| {label} | {who} | {cells} | {'' if secs is None else secs} |")
    return lines


def model_table(rows) -> list:
    """Markdown: a row per quantity, ours, theirs and ours/theirs."""
    if not rows:
        return []
    lines = [
        "",
        f"Mamba-2 LM, bf16 autocast vs float64 ({MODEL['n_layer']} layers, d_model {MODEL['d_model']}, "
        f"{MODEL_BATCH} x {MODEL_SEQ} tokens; seconds for the step: ours {rows[0]['seconds_ours']}, "
        f"mamba_ssm {rows[0]['seconds_theirs']})",
        "",
        "| quantity | ours | mamba_ssm | ours/theirs |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['quantity']} | {fmt(r['ours'])} | {fmt(r['theirs'])} | {fmt(r['ratio'], True)} |" for r in rows]
    return lines


# ----------------------------------------------------------------------------- command line


def load_theirs(device, src):
    """(mamba_ssm's namespace or None, how it loaded, the context its kernels run in). Without a GPU:
    Triton's interpreter with its bf16 fix, and their CPU stand-ins."""
    from megamamba.testing.mamba_ssm_release import cpu_stand_ins, load

    theirs, how = load(src or os.environ.get("MAMBA_SSM_SRC") or os.path.join(REPO, ".venv", "mamba_ssm-src"))
    if device.type == "cuda":
        return theirs, how, contextlib.nullcontext()
    from megamamba.testing import interpreter_bf16

    interpreter_bf16.install()
    return theirs, how, cpu_stand_ins()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", nargs="?", default="all", choices=("ops", "model", "all"))
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, metavar="OP")
    p.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    p.add_argument("--mamba-ssm-src", default=None, help="unpacked mamba_ssm source release (default .venv's)")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs: before any kernel module is imported
    os.environ["MEGAMAMBA_KERNELS"] = "triton"
    torch.backends.cuda.matmul.allow_tf32 = False
    theirs, how, context = load_theirs(device, args.mamba_ssm_src)
    import triton

    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter, bf16 harness)",
        torch=torch.__version__,
        triton=triton.__version__,
        mamba_ssm=how,
    )
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    ops, model = [], []
    with context:
        for op in args.ops if args.what in ("ops", "all") else []:
            rows, info[f"{op}_seconds"] = timed(op_rows, device, theirs, [op], args.seqlens)
            print("\n".join(op_tables(rows)), flush=True)
            ops += rows
        if args.what in ("model", "all"):
            model, info["model_seconds"] = timed(model_rows, device, theirs)
            print("\n".join(model_table(model)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, ops=ops, model=model), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
