"""What the planner knows of the hardware: rates per kernel kind, device memory, and the links' α–β.

A profile is a JSON file. Published-figure profiles (launch/profiles/) hold the vendors' peak
numbers with every kernel at the roofline, labelled "published"; `python launch/plan.py
--calibrate` writes a measured one for the machine it runs on.
"""
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from megamamba.errors import MegamambaError

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
class Profile:
    name: str
    source: str  # "published: <where>" or "measured <date> on <machine>"
    device_memory_bytes: int
    matmul_flops_per_s: float
    copy_bytes_per_s: float
    launch_s: float  # a kernel's fixed cost: launch and ramp-up
    kernels: dict = field(default_factory=dict)  # kind -> Kernel
    links: dict = field(default_factory=dict)  # tier -> Link
    overlap: bool = True  # communication runs beside compute (GPU streams); on the CPU they share the cores

    def kernel(self, kind: str) -> Kernel:
        return self.kernels.get(kind, Kernel())

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")


def _number(data: dict, key: str, where: str, zero_allowed: bool = False) -> float:
    value = data.get(key)
    in_range = isinstance(value, (int, float)) and (value >= 0 if zero_allowed else value > 0)
    if isinstance(value, bool) or not in_range:
        raise ProfileError(f"{where}: {key}={value!r} must be a {'non-negative' if zero_allowed else 'positive'} "
                           "number")
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
    links = {}
    for tier in TIERS:
        if tier not in data.get("links", {}):
            raise ProfileError(f"profile {path}: links.{tier} is missing (alpha_s, bytes_per_s)")
        values = data["links"][tier]
        links[tier] = Link(_number(values, "alpha_s", f"{path} links.{tier}"),
                           _number(values, "bytes_per_s", f"{path} links.{tier}"))
    overlap = data.get("overlap", True)
    if not isinstance(overlap, bool):
        raise ProfileError(f"profile {path}: overlap={overlap!r} must be true or false")
    return Profile(str(data.get("name", path)), str(data.get("source", "unknown")),
                   int(_number(data, "device_memory_bytes", path)), _number(data, "matmul_flops_per_s", path),
                   _number(data, "copy_bytes_per_s", path), _number(data, "launch_s", path), kernels, links, overlap)
