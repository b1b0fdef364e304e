"""What the planner knows of the hardware: rates per kernel kind, device memory, and the links' α–β;
a measured profile adds each layer kind's fit, the engine's fixed costs, how much slower layers run inside
a whole step and beside other ranks, and what a TP or CP collective costs inside a step beyond its ring.

A profile is a JSON file whose `sources` say where each number comes from (a measurement and its date,
a datasheet, or "assumed: ..." and why). launch/profiles/h200.json is built from one H200's measurements
(benchmarks/h200_profile.py); `python launch/plan.py --calibrate` writes a measured one for the machine
it runs on.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from megamamba.errors import MegamambaError
from megamamba.model.layer_types import LAYER_TYPES

# AdamW reads parameter, gradient and two moments and writes three, in float32; the gradient norm reads the gradient
ADAMW_BYTES_PER_PARAMETER = 4 * (4 + 3) + 4
KERNELS = ("matmul", "matmul_fp32", "ssd", "scan", "conv", "norm", "attention", "elementwise")
TIERS = ("intra_node", "inter_node")


class ProfileError(MegamambaError, ValueError):
    """A profile file that cannot be read; the message names the file and the field."""


@dataclass(frozen=True)
class Link:
    """A collective's ring step on one tier costs alpha seconds plus bytes / bandwidth."""

    alpha_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Kernel:
    """A kernel kind's forward: a fixed cost per call (None: the profile's launch_s) plus its roofline time
    (flops at the matmul rate or bytes at the copy bandwidth) over `efficiency`; its backward's time as a
    multiple of its forward's."""

    efficiency: float = 1.0
    backward_ratio: float = 2.0
    fixed_s: Optional[float] = None


@dataclass(frozen=True)
class LayerFit:
    """A layer kind's measured forward and backward as a fixed cost (Python, autograd, the layer's small ops)
    plus a multiple of what its kernels predict; a published profile has none (the kernels alone)."""

    forward_fixed_s: float = 0.0
    forward_scale: float = 1.0
    backward_fixed_s: float = 0.0
    backward_scale: float = 1.0


@dataclass(frozen=True)
class EngineCost:
    """What the trainer and DeepSpeed's engine add beyond the layers and the optimizer's pass: per micro-batch
    (the engine's forward, backward and step calls) and per optimizer step."""

    micro_batch_s: float = 0.0
    step_s: float = 0.0


@dataclass(frozen=True)
class OptimizerPass:
    """AdamW's pass over the optimizer state a rank holds: the bytes it moves per parameter, at `efficiency` of
    the copy bandwidth."""

    bytes_per_parameter: float
    efficiency: float


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # "published: <where>" or "measured <date> on <machine>"
    device_memory_bytes: int
    matmul_flops_per_s: float
    copy_bytes_per_s: float
    launch_s: float  # a kernel's fixed cost: launch and ramp-up
    kernels: dict = field(default_factory=dict)  # kind -> Kernel
    links: dict = field(default_factory=dict)  # tier -> Link
    layers: dict = field(default_factory=dict)  # layer kind -> LayerFit
    engine: dict = field(default_factory=dict)  # ZeRO stage as a string ("0", "1", "2") -> EngineCost
    collective_call_s: dict = field(default_factory=dict)  # "tp", "cp" -> a collective's cost beyond its ring
    model_scale: float = 1.0  # the layers inside a whole step take this multiple of their fits (caches run cold)
    shared_node_scale: float = 1.0  # and this multiple again while a node's other ranks compute (a shared host)
    overlap: bool = True  # communication runs beside compute (GPU streams); on the CPU they share the cores
    peak_flops_per_s: Optional[float] = None  # MFU's denominator (the datasheet's); None: matmul_flops_per_s
    measured_mfu: Optional[float] = None  # the best MFU a training run measured on this GPU (against the peak)
    optimizer: Optional[OptimizerPass] = None  # None: ADAMW_BYTES_PER_PARAMETER at the elementwise efficiency
    sources: dict = field(default_factory=dict)  # a field's dotted name -> where its number comes from

    @property
    def mfu_flops_per_s(self) -> float:
        return self.peak_flops_per_s or self.matmul_flops_per_s

    @property
    def adamw(self) -> OptimizerPass:
        """The optimizer's pass: measured, or its bytes at the elementwise kernels' efficiency."""
        return self.optimizer or OptimizerPass(ADAMW_BYTES_PER_PARAMETER, self.kernel("elementwise").efficiency)

    def kernel(self, kind: str) -> Kernel:
        return self.kernels.get(kind, Kernel())

    def layer(self, kind: str) -> LayerFit:
        return self.layers.get(kind, LayerFit())

    def engine_cost(self, zero_stage: int) -> EngineCost:
        """ZeRO 3 is charged ZeRO 2's (calibration measures stages 0 to 2)."""
        return self.engine.get(str(min(zero_stage, 2)), EngineCost())

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")


def _number(data: dict, key: str, where: str, zero_allowed: bool = False) -> float:
    value = data.get(key)
    in_range = isinstance(value, (int, float)) and (value >= 0 if zero_allowed else value > 0)
    if isinstance(value, bool) or not in_range:
        raise ProfileError(
            f"{where}: {key}={value!r} must be a {'non-negative' if zero_allowed else 'positive'} number"
        )
    return float(value)


def load_profile(path: str) -> Profile:
    """The profile in `path`; ProfileError naming the field that is missing or wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile {path}: {e}") from None
    kernels = {}
    for kind, values in data.get("kernels", {}).items():
        if kind not in KERNELS:
            raise ProfileError(f"profile {path}: kernels.{kind} is not a kernel kind; known: {KERNELS}")
        where = f"{path} kernels.{kind}"
        fixed = None if values.get("fixed_s") is None else _number(values, "fixed_s", where, zero_allowed=True)
        kernels[kind] = Kernel(_number(values, "efficiency", where), _number(values, "backward_ratio", where), fixed)
    layers = {}
    for kind, values in data.get("layers", {}).items():
        known = [*LAYER_TYPES, "loss"]  # the loss: after the head
        if kind not in known:
            raise ProfileError(f"profile {path}: layers.{kind} is not a layer kind; known: {known}")
        where = f"{path} layers.{kind}"
        layers[kind] = LayerFit(
            *(
                _number(values, key, where, zero_allowed=key.endswith("fixed_s"))
                for key in ("forward_fixed_s", "forward_scale", "backward_fixed_s", "backward_scale")
            )
        )
    engine = {}
    for stage, values in data.get("engine", {}).items():
        if stage not in ("0", "1", "2"):
            raise ProfileError(f"profile {path}: engine.{stage} is not a ZeRO stage 0, 1 or 2")
        engine[stage] = EngineCost(
            *(_number(values, key, f"{path} engine.{stage}", zero_allowed=True) for key in ("micro_batch_s", "step_s"))
        )
    calls = {}
    for group, value in data.get("collective_call_s", {}).items():
        if group not in ("tp", "cp"):
            raise ProfileError(f"profile {path}: collective_call_s.{group} is not a group (tp or cp)")
        calls[group] = _number({group: value}, group, f"{path} collective_call_s", zero_allowed=True)
    scales = [_number(data, key, path) if key in data else 1.0 for key in ("model_scale", "shared_node_scale")]
    links = {}
    for tier in TIERS:
        if tier not in data.get("links", {}):
            raise ProfileError(f"profile {path}: links.{tier} is missing (alpha_s, bytes_per_s)")
        values = data["links"][tier]
        links[tier] = Link(
            _number(values, "alpha_s", f"{path} links.{tier}"), _number(values, "bytes_per_s", f"{path} links.{tier}")
        )
    overlap = data.get("overlap", True)
    if not isinstance(overlap, bool):
        raise ProfileError(f"profile {path}: overlap={overlap!r} must be true or false")
    optimizer = None
    if data.get("optimizer") is not None:
        values, where = data["optimizer"], f"{path} optimizer"
        optimizer = OptimizerPass(_number(values, "bytes_per_parameter", where), _number(values, "efficiency", where))
    sources = data.get("sources", {})
    if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
        raise ProfileError(f"profile {path}: sources must map each field's name to a text saying where it comes from")
    return Profile(
        str(data.get("name", path)),
        str(data.get("source", "unknown")),
        int(_number(data, "device_memory_bytes", path)),
        _number(data, "matmul_flops_per_s", path),
        _number(data, "copy_bytes_per_s", path),
        _number(data, "launch_s", path),
        kernels,
        links,
        layers,
        engine,
        calls,
        model_scale=scales[0],
        shared_node_scale=scales[1],
        overlap=overlap,
        peak_flops_per_s=_number(data, "peak_flops_per_s", path) if data.get("peak_flops_per_s") is not None else None,
        measured_mfu=_number(data, "measured_mfu", path) if data.get("measured_mfu") is not None else None,
        optimizer=optimizer,
        sources=dict(sources),
    )
