"""Fill Triton's on-disk cache with every kernel the GPU check launches, on a machine without a GPU,
and pack it for the check (.whl/ is carried to the GPU machine; gpu_check.sh unpacks it and points
TRITON_CACHE_DIR at it).

    PYTHONPATH=.venv/triton-3.6 python benchmarks/gpu_check/triton_cache.py [--out .whl/triton-cache-3.6.0.tar.gz]
        [--triton-wheel WHEEL] [--verify]

The check's work runs on CPU tensors with Triton's launcher replaced by compile_kernels.py's recorder
(each launch specialized as the GPU's launcher would): the ops at the error and timing shapes
(benchmarks/gpu_check/check_ops.py), and a training step, bf16 autocast, of a two-layer model of each size at
its micro-batch and 2048 tokens, with documents (launch/train.py) and without (the parity section).
The same for mamba_ssm's Triton kernels (SSD, gated norm, its model's fused add+norm), autotuning
capped to one configuration as the check caps it. Each specialization is compiled for sm_90 into a
fresh cache folder, then packed.

Whether the GPU finds them: Triton 3.6 files a kernel under sha256 of triton_key() (its version and
the hashes of its compiler sources and libtriton), the kernel's source hash (its text, starting line,
callees and constexpr globals; no file path), the backend's hash (the `ptxas --version` output of
the ptxas that Triton ships, and the arch), the compile options (libdevice by content) and any
cache-invalidating TRITON_* variables set. No driver, GPU or torch version enters it, but the wheel
does: each Python's build of a release has its own libtriton, so --triton-wheel (the GPU machine's
Python's wheel) keys the entries as that build does (keys_of_wheel). Those inputs are written beside
the archive (.json); the check compares them with the GPU machine's and reports the hits (gpu_check.py's
summary).
The cache's group files name their kernel files by absolute path: check_io.unpack_triton_cache
rewrites them wherever the archive is unpacked (--verify does, then looks every kernel up).
"""

import argparse
import contextlib
import json
import os
import sys
import tarfile
import tempfile
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = ("130m", "370m", "1.3b")
H200_SMS = 132
OUR_OPS = (  # the ops the check times
    "ssd_chunk_scan",
    "selective_scan",
    "causal_conv1d",
    "rmsnorm_gated",
    "add_rmsnorm",
    "mamba3_scan",
)


def _bf16_errors():
    """benchmarks/bf16_errors.py, whose ops and model the check also runs."""
    from check_io import load_benchmark

    return load_benchmark("bf16_errors")


def op_work(table):
    """(case, thunk) for every call of the check's errors and timings sections to the ops in
    `table` (op name -> function), bf16_errors.py's included."""
    import check_ops

    bf16_errors = _bf16_errors()
    bench = bf16_errors.load_kernel_benchmark()
    gen = torch.Generator().manual_seed(0)
    work = []
    for op, _label, make in check_ops.error_cases(bench, dry=False):
        for dtype in (torch.float32, torch.bfloat16):
            if op in table:
                tensors, kwargs = make(dtype, "cpu", gen)
                work.append(
                    (
                        f"errors {op} {dtype}",
                        lambda f=table[op], t=tensors, k=kwargs, d=dtype: bf16_errors.forward_backward(f, t, k, d),
                    )
                )
    for op, seqlen, make in bf16_errors.op_cases(bench, bf16_errors.OPS, bf16_errors.SEQLENS):
        if op in table:
            tensors, kwargs = make(torch.bfloat16, "cpu", gen)
            work.append(
                (
                    f"bf16 errors {op} {seqlen}",
                    lambda f=table[op], t=tensors, k=kwargs: bf16_errors.forward_backward(f, t, k, torch.bfloat16),
                )
            )
    for op, layer, make in check_ops.timing_cases(bench, dry=False):
        if op in table:
            tensors, kwargs = make("cpu", gen)
            work.append((f"timings {op} {layer}", lambda f=table[op], t=tensors, k=kwargs: timed_calls(f, t, k)))
    return work


def timed_calls(fn, tensors, kwargs):
    """The two calls benchmarks/kernel_bench.py's time_op makes: forward without grad, forward+backward."""
    bf16_errors = _bf16_errors()
    with torch.no_grad():
        fn(**tensors, **kwargs)
    bf16_errors.forward_backward(fn, tensors, kwargs, torch.bfloat16)


def model_work(theirs=None):
    """(case, thunk) for a bf16-autocast training step of two layers of each size at its micro-batch
    (and the NCCL smoke's and the parity's), and of bf16_errors.py's small LM: ours with and without
    documents, or mamba_ssm's."""
    bf16_errors = _bf16_errors()
    from megamamba import MambaConfig, MambaLM

    work = []
    for size in SIZES:
        with open(os.path.join(REPO, f"launch/configs/mamba2-{size}.json")) as f:
            micro = json.load(f)["train_micro_batch_size_per_gpu"]
        config = MambaConfig.from_json(os.path.join(REPO, f"launch/models/mamba2-{size}.json"))
        fields = {**config.to_dict(), "n_layer": 2, "vocab_size": 512}  # block 2: residual in the pre-norm
        if theirs is None:
            model, batches, documents = MambaLM(MambaConfig.from_dict(fields)), {micro, 2, 4}, (True, False)
        else:
            fields["ssm_cfg"] = {**config.ssm_cfg, "use_mem_eff_path": False}
            model = theirs.MambaLMHeadModel(theirs.MambaConfig(**fields), device="cpu", dtype=torch.float32)
            batches, documents = {micro, 4}, (False,)
        for batch in sorted(batches if size == "130m" else {micro}):  # 2: the smoke's, 4: the parity's
            for docs in documents:
                work.append(
                    (
                        f"step {size} batch {batch}{' docs' if docs else ''}{' mamba_ssm' if theirs else ''}",
                        lambda m=model, b=batch, d=docs: train_step(m, b, 2048, d),
                    )
                )
    ours, theirs_model, ids = bf16_errors.models("cpu", theirs)
    model = ours if theirs is None else theirs_model
    work.append(
        (
            f"bf16 errors model{' mamba_ssm' if theirs else ''}",
            lambda: bf16_errors.lm_step(model, ids, bf16_errors.MODEL["vocab_size"], True),
        )
    )
    return work


def train_step(model, batch, seqlen, docs):
    ids = torch.randint(0, 512, (batch, seqlen), generator=torch.Generator().manual_seed(0))
    seq_idx = (torch.arange(seqlen) >= seqlen // 3).int().expand(batch, seqlen).contiguous() if docs else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, seq_idx=seq_idx) if docs else model(ids)
    logits = getattr(out, "logits", out)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()


def mamba_ssm_work(theirs):
    """(case, thunk) for mamba_ssm's Triton kernels in the check: its SSD and gated norm at the
    errors and timings shapes, and training steps of its model (throughput and parity)."""
    bf16_errors = _bf16_errors()
    table = {
        op: fn
        for op, (fn, _) in bf16_errors.theirs_ops(theirs).items()
        if op in ("ssd_chunk_scan", "rmsnorm_gated", "add_rmsnorm")
    }
    return [
        (case, lambda thunk=thunk: without_device_switch(thunk)) for case, thunk in op_work(table) + model_work(theirs)
    ]


def choose_mamba_ssm_configs(src, target, limits):
    """Record and compile mamba_ssm's kernels with each autotuner capped to its configuration 0, 1, ...
    until every kernel has one that compiles and fits an sm_90 block at all its shapes (its first
    configurations often need more shared memory than sm_90 has: its autotuner skips them there).
    Returns (kernel name -> chosen configuration number, compile rows of the chosen ones)."""
    import compile_kernels
    from megamamba.testing.mamba_ssm_release import autotuners, cap_autotuning, load

    theirs, how = load(src)
    print(f"mamba_ssm: {how}", flush=True)
    if theirs is None:
        return {}, []
    tuners = autotuners("mamba_ssm.ops.triton")
    choices, rows, pending, index = {}, [], set(tuners), 0
    while True:
        cap_autotuning(tuners, {name: choices.get(name, index) for name in tuners})
        with compile_kernels.LaunchRecorder(target) as recorder:
            for case, thunk in mamba_ssm_work(theirs):
                recorder.case = case
                thunk()
        todo = [
            launch
            for launch in recorder.launches.values()
            if launch["jit"].fn.__name__ in pending or (index == 0 and launch["jit"].fn.__name__ not in tuners)
        ]
        compiled = compile_kernels.compile_all(todo, target, limits)
        for name in list(pending):
            mine = [r for r in compiled if r["kernel"] == name]
            if all(r["ok"] for r in mine):  # none: not launched by the check
                choices[name] = index
                pending.discard(name)
                rows += mine
        rows += [r for r in compiled if r["kernel"] not in tuners]
        index += 1
        if not pending or index >= max(len(tuners[name].configs_before_cap) for name in pending):
            break
    for name in pending:
        print(f"mamba_ssm {name}: no configuration fits sm_90 at every shape; the check keeps its first")
    return choices, rows


def without_device_switch(thunk):
    """Run thunk with torch.cuda.device(index) a no-op and the H200's 132 SMs as the device's
    properties: mamba_ssm's wrappers switch to their tensors' CUDA device and size some buffers
    (so some strides) by its SM count; CPU tensors have neither."""
    switch, properties = torch.cuda.device, torch.cuda.get_device_properties
    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=H200_SMS)
    try:
        thunk()
    finally:
        torch.cuda.device, torch.cuda.get_device_properties = switch, properties


def verify(tarball, mamba_ssm_src, target) -> int:
    """Record the same work again in this process (from whatever megamamba and mamba_ssm it imports:
    run it with the package installed elsewhere to show that no path enters the keys) and look each
    specialization up in a fresh copy of the archive's cache; print the hits and the misses."""
    import triton
    from triton.compiler import ASTSource

    import compile_kernels
    import megamamba.kernels as ours
    from check_io import unpack_triton_cache
    from megamamba.testing.mamba_ssm_release import load as load_mamba_ssm

    table = {op: getattr(ours, op) for op in OUR_OPS}
    with tempfile.TemporaryDirectory() as cache:
        unpack_triton_cache(tarball, cache)
        os.environ["TRITON_CACHE_DIR"] = cache
        with compile_kernels.LaunchRecorder(target) as recorder:
            theirs, how = load_mamba_ssm(mamba_ssm_src)
            for case, thunk in op_work(table) + model_work() + (mamba_ssm_work(theirs) if theirs else []):
                recorder.case = case
                thunk()
        seen = []
        triton.knobs.compilation.listener = lambda *, src, cache_hit, **_: seen.append((src.fn.__name__, cache_hit))
        for launch in recorder.launches.values():
            source = ASTSource(launch["jit"], launch["signature"], launch["constexprs"], launch["attrs"])
            triton.compile(source, target=target, options=launch["options"].__dict__)
    missed = sorted({name for name, hit in seen if not hit})
    print(f"megamamba from {os.path.dirname(ours.__file__)}; mamba_ssm: {how}")
    print(
        f"{sum(hit for _, hit in seen)} of {len(seen)} specializations found in {tarball}"
        + (f"; compiled anew: {', '.join(missed)}" if missed else "")
    )
    return 1 if missed else 0


@contextlib.contextmanager
def keys_of_wheel(wheel: str):
    """Inside: Triton files cache entries under the keys that the Triton of `wheel` (the same release,
    built for the GPU machine's Python) computes. Its key hashes its Python sources, equal here, and
    its libtriton, which each Python's build has its own of: that hash is put in place of ours.
    SystemExit when the wheel is another release or its Python sources differ from ours."""
    import hashlib
    import zipfile

    import triton
    import triton.runtime.cache as cache

    root = os.path.dirname(triton.__file__)
    hashed = ("compiler/", "backends/", "language/", "runtime/cache.py")
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.startswith("triton/")]
        version = next(
            n.split("/")[0][len("triton-") : -len(".dist-info")]
            for n in whl.namelist()
            if n.endswith(".dist-info/METADATA")
        )
        if version != triton.__version__:
            raise SystemExit(
                f"--triton-wheel {wheel}: Triton {version}, but this process runs {triton.__version__}; "
                "its key hashes its own sources: give the wheel of the same release"
            )
        for name in names:
            rel = name[len("triton/") :]
            if rel.endswith(".py") and rel.startswith(hashed):
                mine = os.path.join(root, rel)
                if not os.path.exists(mine) or open(mine, "rb").read() != whl.read(name):
                    raise SystemExit(
                        f"--triton-wheel {wheel}: its {name} differs from {mine}; only libtriton "
                        "may differ between the two builds"
                    )
        theirs = hashlib.sha256()
        with whl.open("triton/_C/libtriton.so") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                theirs.update(chunk)
    with open(os.path.join(root, "_C", "libtriton.so"), "rb") as f:
        ours = hashlib.file_digest(f, "sha256").hexdigest()
    original = cache.triton_key
    key = original()
    if ours not in key:
        raise SystemExit(f"Triton {triton.__version__}'s triton_key() does not hash its libtriton as expected")
    cache.triton_key = lambda: key.replace(ours, theirs.hexdigest())
    try:
        yield
    finally:
        cache.triton_key = original


def identity_path(tarball: str) -> str:
    """Where the cache's key inputs are written beside it (gpu_check.sh hands them to the check)."""
    return tarball[: -len(".tar.gz")] + ".json" if tarball.endswith(".tar.gz") else tarball + ".json"


def main(argv=None):
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, ".whl", f"triton-cache-{triton.__version__}.tar.gz"))
    parser.add_argument(
        "--mamba-ssm-src",
        default=os.path.join(REPO, ".whl", "mamba_ssm-src"),
        help="unpacked mamba_ssm source release, whose kernels are added (skipped when absent)",
    )
    parser.add_argument(
        "--triton-wheel",
        default=None,
        help="the GPU machine's Triton wheel (this release, built for its Python): key the cache as that Triton does",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="instead: look every specialization up in the --out archive, report the hits",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: interpreted kernels are not compiled; unset it")
    from triton.backends.compiler import GPUTarget

    os.environ["MEGAMAMBA_KERNELS"] = "triton"
    target = GPUTarget("cuda", 90, 32)
    with keys_of_wheel(args.triton_wheel) if args.triton_wheel else contextlib.nullcontext():
        return verify(args.out, args.mamba_ssm_src, target) if args.verify else build(args, target)


def build(args, target) -> int:
    """Record, compile and pack; print what was compiled. 1 if a specialization fails or does not fit."""
    import triton

    import compile_kernels
    from check_io import triton_cache_identity
    from megamamba.testing.mamba_ssm_release import CHOICES

    start = time.time()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        import megamamba.kernels as ours

        table = {op: getattr(ours, op) for op in OUR_OPS}
        with compile_kernels.LaunchRecorder(target) as recorder:
            for case, thunk in op_work(table) + model_work():
                recorder.case = case
                thunk()
        rows = compile_kernels.compile_all(list(recorder.launches.values()), target, compile_kernels.LIMITS[90])
        choices, their_rows = choose_mamba_ssm_configs(args.mamba_ssm_src, target, compile_kernels.LIMITS[90])
        if choices:
            with open(os.path.join(args.mamba_ssm_src, CHOICES), "w") as f:
                json.dump(choices, f, indent=1, sort_keys=True)
        entries = len(os.listdir(cache))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(identity_path(args.out), "w") as f:
            json.dump(triton_cache_identity(), f, indent=1)
        with tarfile.open(args.out, "w:gz") as tar:
            for name in sorted(os.listdir(cache)):
                tar.add(os.path.join(cache, name), arcname=name)
    failed = [r for r in rows + their_rows if not r["ok"]]
    print(
        f"ours: {len(rows)} specializations; mamba_ssm: {len(their_rows)} with the configurations chosen "
        f"({', '.join(f'{k}#{v}' for k, v in sorted(choices.items()))}); {entries} cache entries for sm_90, "
        f"triton {triton.__version__}; {args.out}: {os.path.getsize(args.out) / 2**20:.1f} MiB; "
        f"{time.time() - start:.0f} s"
    )
    for r in failed:
        print(f"FAILED {r['kernel']} ({r['case']}): {r['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
