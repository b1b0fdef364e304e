"""Measure this machine's profile: matmul rate, copy bandwidth, kernel launch time, each kernel kind's
efficiency and backward ratio at a model's shapes, the optimizer's pass, each layer kind's fit, and the
collectives' alpha and beta; each number's source written beside it (`sources`).

Kernels run through the model's own ops (`megamamba.kernels`: Triton on CUDA, the PyTorch reference on
the CPU) on one layer's inputs at the batch asked and 4 times it; a kind's forward is fitted as a fixed cost
per call plus its roofline time (the FLOPs and bytes the planner counts for it) over its efficiency, so
the planner scales only the part that grows with the work. Then the model's own layers (and the loss) run
forward and backward at both sizes, and each kind's time is fitted as a fixed cost (Python, autograd, the
small ops no kernel counts) plus a multiple of what its kernels predict; whole steps then give the
engine's costs, the layers' scales inside a step and the collectives' cost per call (`calibrate_engine`).
Collectives are timed on `ranks` spawned processes (gloo on the CPU, NCCL on GPUs) at several sizes and
fitted as alpha + bytes / bandwidth per ring step; one machine measures one tier, so both tiers get it
(the profile says so).
"""

import dataclasses
import datetime
import functools
import os
import platform
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from megamamba import kernels
from megamamba.config import MambaConfig
from megamamba.model.layer_types import costs, layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import build_layer, layer_kinds
from megamamba.model.loss import lm_loss
from megamamba.model.stream import Stream
from megamamba.pipelines.planner.calibrate_engine import one_rank_costs, two_rank_costs
from megamamba.pipelines.planner.layer_costs import loss_work
from megamamba.pipelines.planner.profile import (
    ADAMW_BYTES_PER_PARAMETER,
    Kernel,
    LayerFit,
    Link,
    OptimizerPass,
    Profile,
)
from megamamba.pipelines.planner.step_time import kernel_seconds_of
from megamamba.pipelines.planner.timing import on_ranks, seconds

SIZES = 4  # kernels are timed at the batch asked and SIZES times it


def _forward_backward(
    fn: Callable[..., torch.Tensor], inputs: list, device: torch.device, parameters=(), autocast: bool = False
) -> tuple:
    """(forward seconds, backward seconds) of fn(*inputs) (under bf16 autocast when asked) with every float
    input and `parameters` requiring a gradient; the backward is timed on its own, through one retained graph,
    not as a difference of two noisy medians."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        forward = seconds(lambda: fn(*leaves), device)
        out = fn(*leaves)
    grad, wanted = torch.randn_like(out), [t for t in leaves if t.requires_grad] + list(parameters)
    return forward, seconds(lambda: torch.autograd.grad(out, wanted, grad, retain_graph=True), device)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / seconds(lambda: a @ b, device)


def copy_bandwidth(device: torch.device, nbytes: int = 256 * 2**20) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), device)


def optimizer_pass(device: torch.device, copy: float, parameters: int = 2**22) -> OptimizerPass:
    """AdamW (fused on a GPU, for-each on the CPU) over `parameters` float32 parameters with gradients: its
    ADAMW_BYTES_PER_PARAMETER (the gradient norm's read among them), as a fraction of the copy bandwidth `copy`."""
    weight = torch.nn.Parameter(torch.zeros(parameters, device=device))
    weight.grad = torch.randn_like(weight)
    fused = device.type == "cuda"
    adamw = torch.optim.AdamW([weight], lr=1e-4, fused=fused, foreach=not fused)
    nbytes = ADAMW_BYTES_PER_PARAMETER * parameters

    def step():
        torch.linalg.vector_norm(weight.grad)
        adamw.step()

    return OptimizerPass(ADAMW_BYTES_PER_PARAMETER, min(1.0, nbytes / copy / seconds(step, device)))


def launch_time(device: torch.device) -> float:
    x = torch.zeros(1, device=device)
    return seconds(lambda: x.add_(1), device)


def _kernel_inputs(model: MambaConfig, batch: int, seqlen: int, device, dtype) -> dict:
    """kind -> (op, inputs, the kernel the planner counts for it) at one layer's shapes: the kinds every model
    has, and those of its block types (`LayerType.kernel_benchmarks`)."""

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype) * 0.5

    d, t, act = model.d_model, batch * seqlen, costs.activation_bytes(dtype)
    ops = {
        "norm": (
            lambda x, w: kernels.rmsnorm_gated(x, w, eps=1e-5),
            [rand(batch, seqlen, d), rand(d)],
            costs.Kernel("norm", 0, 2 * act * t * d),
        ),
        "matmul": (
            F.linear,
            [rand(batch, seqlen, d), rand(4 * d, d)],
            costs.Kernel("matmul", 2 * t * d * 4 * d, act * (4 * d * d + t * 5 * d)),
        ),
        "elementwise": (
            lambda y, g: y * F.silu(g),
            [rand(t, 4 * d), rand(t, 4 * d)],
            costs.Kernel("elementwise", 0, 3 * act * t * 4 * d),
        ),
    }
    for kind in dict.fromkeys(model.block_kinds):
        ops.update(layer_type(kind).kernel_benchmarks(model, batch, seqlen, device, dtype))
    return ops


def _roofline(kernel: costs.Kernel, matmul: float, copy: float) -> float:
    """The roofline seconds of a kernel the planner counts."""
    return max(kernel.flops / matmul, kernel.bytes / copy)


def _layer_inputs(model: MambaConfig, kind: str, batch: int, seqlen: int, device: torch.device) -> tuple:
    """(fn, inputs, parameters): the first layer of `kind` in the model's list on its input at these shapes
    (the stream; token ids for the embedding), or the loss on the head's logits."""
    ids = torch.randint(0, model.vocab_size, (batch, seqlen), device=device)
    if kind == "loss":
        return (
            lambda logits: lm_loss(logits, ids, model.vocab_size),
            [torch.randn(batch, seqlen, model.padded_vocab_size, device=device)],
            [],
        )
    layer = build_layer(model, layer_kinds(model).index(kind), seed=0, device=device)

    def run(hidden: torch.Tensor) -> torch.Tensor:
        out = layer(Stream(hidden))
        return out.hidden if isinstance(out, Stream) else out

    return run, [layer_type(kind).example_input(model, batch, seqlen, device)], list(layer.parameters())


def fit_line(small: tuple, large: tuple) -> tuple:
    """(fixed seconds, scale) from (predicted seconds, measured seconds) at two sizes, as
    measured = fixed + scale x predicted. Where the larger is not measurably slower, scale 1 and the rest of
    the smaller's time as the fixed cost."""
    (p1, t1), (p2, t2) = small, large
    scale = (t2 - t1) / (p2 - p1) if t2 > t1 and p2 > p1 else 1.0
    return max(0.0, t1 - scale * p1), scale


def layer_fits(model: MambaConfig, batch: int, seqlen: int, device: torch.device, kernel_profile: Profile) -> dict:
    """Layer kind -> LayerFit: each kind of the model's list and the loss, timed forward and backward at `batch`
    and SIZES x `batch` against what `kernel_profile`'s kernels predict for it."""
    cuda = device.type == "cuda"
    fits = {}
    for kind in dict.fromkeys([*layer_kinds(model), "loss"]):
        points = []
        for b in (batch, SIZES * batch):
            fn, inputs, parameters = _layer_inputs(model, kind, b, seqlen, device)
            shape = RankShape(model, b, seqlen, act=2 if cuda else 4)
            predicted = kernel_seconds_of(
                loss_work(shape) if kind == "loss" else layer_type(kind).work(shape), kernel_profile
            )
            points.append((predicted, _forward_backward(fn, inputs, device, parameters, autocast=cuda)))
        (pf1, pb1), (mf1, mb1) = points[0]
        (pf2, pb2), (mf2, mb2) = points[1]
        fits[kind] = LayerFit(*fit_line((pf1, mf1), (pf2, mf2)), *fit_line((pb1, mb1), (pb2, mb2)))
    return fits


def fit_kernel(small: tuple, large: tuple) -> tuple:
    """(efficiency, fixed seconds) from (roofline seconds, measured seconds) at two sizes, as
    measured = fixed + roofline / efficiency. Where the larger is not measurably slower, the work is below
    the noise: efficiency 1 and the smaller's time as the fixed cost."""
    (r1, t1), (r2, t2) = small, large
    efficiency = min(1.0, (r2 - r1) / (t2 - t1)) if t2 > t1 and r2 > r1 else 1.0
    return efficiency, max(0.0, t1 - r1 / efficiency)


def calibrate(
    model: MambaConfig, seqlen: int, batch: int, device: torch.device, links: dict, links_from: str, two_ranks: bool
) -> Profile:
    """This machine's profile at `model`'s shapes; `links` (from `measure_links`, or another profile's when
    this machine has one GPU) and where they come from, `links_from`, measured separately; the TP and CP
    collectives' cost per call when the machine can run `two_ranks`."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    matmul, copy, launch = matmul_rate(device, dtype), copy_bandwidth(device), launch_time(device)
    measured = {}
    larger = _kernel_inputs(model, SIZES * batch, seqlen, device, dtype)
    for kind, (op, inputs, counted) in _kernel_inputs(model, batch, seqlen, device, dtype).items():
        forward, backward = _forward_backward(op, inputs, device)
        large = seconds(functools.partial(op, *larger[kind][1]), device)
        efficiency, fixed = fit_kernel(
            (_roofline(counted, matmul, copy), forward), (_roofline(larger[kind][2], matmul, copy), large)
        )
        measured[kind] = Kernel(efficiency, backward / forward, fixed)
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'host'})"
    when = datetime.date.today().isoformat()
    threads = torch.get_num_threads()
    where = f"measured {when} on {platform.node()}, torch {torch.__version__} ({threads} CPU threads)"
    profile = Profile(
        name,
        f"{where}, at {model.d_model}-wide layers, batch {batch} x seq {seqlen}; links: {links_from}",
        int(memory),
        matmul,
        copy,
        launch,
        measured,
        links,
        overlap=device.type == "cuda",
        peak_flops_per_s=matmul,
        optimizer=optimizer_pass(device, copy),
    )
    profile = dataclasses.replace(profile, layers=layer_fits(model, batch, seqlen, device, profile))
    profile = one_rank_costs(model, batch, seqlen, profile)
    profile = two_rank_costs(model, batch, seqlen, profile) if two_ranks else profile
    return dataclasses.replace(profile, sources=calibrated_sources(profile, where, links_from, two_ranks))


def calibrated_sources(profile: Profile, where: str, links_from: str, two_ranks: bool) -> dict:
    """Where each number of a calibrated `profile` comes from, by field."""
    sources = {
        "device_memory_bytes": f"{where}: the device's (or the host's) total memory",
        "matmul_flops_per_s": f"{where}: a 2048-cube matmul",
        "copy_bytes_per_s": f"{where}: a 256 MiB copy",
        "peak_flops_per_s": f"{where}: the measured matmul rate (no datasheet figure here); MFU is against it",
        "launch_s": f"{where}: a one-element add and a synchronize",
        "optimizer": f"{where}: AdamW and the gradient norm over {2**22} float32 parameters",
        "links": links_from,
        "model_scale": f"{where}: whole steps of one rank against the layer fits",
        "engine": f"{where}: steps of 1 and {SIZES} micro-batches on one rank at ZeRO 0, 1 and 2",
        "shared_node_scale": f"{where}: data parallel 2" if two_ranks else "not measured (one rank): 1",
        "collective_call_s": f"{where}: steps at TP 2 and CP 2" if two_ranks else "not measured (one rank)",
    }
    sources.update(
        {
            f"kernels.{kind}": f"{where}: fitted at the model's shapes and {SIZES} x the batch"
            for kind in profile.kernels
        }
    )
    sources.update(
        {f"layers.{kind}": f"{where}: the layer forward and backward at two sizes" for kind in profile.layers}
    )
    return sources


def fit_link(samples: list) -> Link:
    """alpha + bytes / bandwidth per ring step, least squares over (bytes per step, seconds per step)."""
    xs, ys = [b for b, _ in samples], [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in samples) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return Link(max(my - slope * mx, 1e-7), 1 / slope)


COLLECTIVE_BYTES = (2**12, 2**16, 2**20, 2**22, 2**24)


def _time_all_reduces(rank: int, world: int, port: int, results) -> None:
    """One spawned rank: time an all-reduce at each of COLLECTIVE_BYTES; rank 0 reports the samples."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    samples = []
    for nbytes in COLLECTIVE_BYTES:
        took = seconds(functools.partial(dist.all_reduce, torch.zeros(nbytes // 4, device=device)), device)
        steps = 2 * (world - 1)
        samples.append((nbytes / world, took / steps))
    if rank == 0:
        results.put(samples)
    dist.destroy_process_group()


def measure_links(world: int) -> dict:
    """Both tiers' Link from all-reduces on `world` processes of this machine."""
    link = fit_link(on_ranks(_time_all_reduces, world))
    return {"intra_node": link, "inter_node": link}
