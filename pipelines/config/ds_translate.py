"""The optimizer and LR schedule of a run, from the DeepSpeed JSON's "optimizer"/"scheduler" blocks and our flags.

DeepSpeed never sees these blocks (`layout.engine_config` drops them): we hand it a client optimizer,
torch's fused AdamW, and step our own schedule. Each setting has one value:
  - the JSON's, else its flag's, else our default (lr 3e-4, min lr 3e-5, no warm-up, cosine decay,
    weight decay 0.1, betas 0.9/0.95, eps 1e-8); a JSON value and an explicitly given flag that
    disagree are refused, naming both.
  - "optimizer": Adam or AdamW (any case). DeepSpeed runs "Adam" as AdamW unless "adam_w_mode": false;
    that L2 Adam is translated only with weight_decay 0, where it is AdamW.
  - "scheduler": WarmupLR, WarmupDecayLR, WarmupCosineLR, reproduced step for step
    (`megamamba.schedule.lr_schedule.DeepSpeedSchedule`), missing params at DeepSpeed's defaults.
    total_num_steps ends the decay (our --lr-decay-iters); it may differ from --train-iters, the
    lr stays at the decay's end after it.
Weight decay applies to our decayed parameter group (matrices), as with the flags.
"""

import argparse
import math
from typing import NamedTuple, Optional

from megamamba.pipelines.config.layout import LayoutError
from megamamba.pipelines.loop.engine import OptimizerSettings
from megamamba.schedule.lr_schedule import DECAY_STYLES, DeepSpeedSchedule, LRSchedule

DEFAULTS = {
    "lr": 3e-4,
    "min_lr": 3e-5,
    "lr_warmup_iters": 0,
    "lr_decay_style": "cosine",
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
}
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction"}
SCHEDULER_PARAMS = {  # DeepSpeed 0.19's keyword arguments and defaults
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
}
DECAY = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


class OptimizerFlags(NamedTuple):
    """The optimizer and LR-schedule flags of a run, each None when not given."""

    lr: Optional[float] = None
    adam_beta1: Optional[float] = None
    adam_beta2: Optional[float] = None
    adam_eps: Optional[float] = None
    weight_decay: Optional[float] = None
    min_lr: Optional[float] = None
    lr_warmup_iters: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_decay_iters: Optional[int] = None
    lr_decay_style: Optional[str] = None


class Settings(NamedTuple):
    optimizer: OptimizerSettings
    line: Optional[str]  # what the JSON's blocks were translated to; None without blocks


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def _pick(flags: OptimizerFlags, name: str, json_value, json_name: str):
    """The JSON's value, else the flag's, else the default; a disagreeing explicit flag is refused."""
    flag = getattr(flags, name)
    if json_value is None:
        return DEFAULTS[name] if flag is None else flag
    if flag is not None and not _same(flag, json_value):
        raise LayoutError(
            f"{_flag(name)} {flag} disagrees with the DeepSpeed config's {json_name}={json_value}; keep one"
        )
    return json_value


def _number(name: str, value, low=0.0, high=math.inf):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise LayoutError(f"DeepSpeed config {name}={value!r}: must be a number in [{low}, {high}]")
    return value


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"DeepSpeed config {name}={value!r}: must be a positive integer")
    return value


def _optimizer_params(block: dict) -> tuple:
    """(params with lr/betas/eps/weight_decay, AdamW or L2 Adam, type) of the JSON's optimizer block."""
    kind = block.get("type")
    if str(kind).lower() not in ("adam", "adamw"):
        raise LayoutError(
            f"optimizer.type={kind!r}: only Adam and AdamW are translated (to torch's fused AdamW); "
            "use one of them or remove the block"
        )
    params = block.get("params") or {}
    unknown = sorted(set(params) - OPTIMIZER_PARAMS)
    if unknown:
        raise LayoutError(
            f"optimizer.params {unknown}: not translated (we know {sorted(OPTIMIZER_PARAMS)}); remove them"
        )
    if params.get("bias_correction", True) is not True:
        raise LayoutError(
            f"optimizer.params.bias_correction={params['bias_correction']!r}: torch's AdamW always "
            "corrects the bias; remove the key"
        )
    betas = params.get("betas")
    if betas is not None and (not isinstance(betas, (list, tuple)) or len(betas) != 2):
        raise LayoutError(f"optimizer.params.betas={betas!r}: must be two numbers")
    values = {
        "lr": _number("optimizer.params.lr", params.get("lr"), 0.0),
        "beta1": _number("optimizer.params.betas[0]", betas and betas[0], 0.0, 1.0),
        "beta2": _number("optimizer.params.betas[1]", betas and betas[1], 0.0, 1.0),
        "eps": _number("optimizer.params.eps", params.get("eps")),
        "weight_decay": _number("optimizer.params.weight_decay", params.get("weight_decay")),
    }
    adamw = str(kind).lower() == "adamw" or params.get("adam_w_mode", True)
    return values, adamw, kind


def _optimizer(ds_config: dict, flags: OptimizerFlags) -> tuple:
    """(lr, betas, eps, weight decay, description or None)."""
    block = ds_config.get("optimizer")
    values, adamw, kind = _optimizer_params(block) if block is not None else ({}, True, None)
    lr = _pick(flags, "lr", values.get("lr"), "optimizer.params.lr")
    betas = (
        _pick(flags, "adam_beta1", values.get("beta1"), "optimizer.params.betas[0]"),
        _pick(flags, "adam_beta2", values.get("beta2"), "optimizer.params.betas[1]"),
    )
    eps = _pick(flags, "adam_eps", values.get("eps"), "optimizer.params.eps")
    weight_decay = _pick(flags, "weight_decay", values.get("weight_decay"), "optimizer.params.weight_decay")
    if not adamw and weight_decay != 0:
        raise LayoutError(
            f'optimizer {kind} with "adam_w_mode": false adds weight_decay={weight_decay} x weights to '
            "the gradient (L2), which AdamW's decoupled decay does not reproduce; use AdamW or set "
            "weight_decay 0"
        )
    text = (
        None
        if block is None
        else (
            f"optimizer {kind}(lr={lr:g}, betas=({betas[0]:g}, {betas[1]:g}), eps={eps:g}, "
            f"weight_decay={weight_decay:g}) -> fused torch AdamW"
        )
    )
    return lr, betas, eps, weight_decay, text


def _scheduler(block: dict, lr: float, flags: OptimizerFlags) -> tuple:
    """(DeepSpeedSchedule, description) of the JSON's scheduler block, with the flags it must agree with."""
    kind = block.get("type")
    if kind not in SCHEDULER_PARAMS:
        raise LayoutError(
            f"scheduler.type={kind!r}: only {', '.join(SCHEDULER_PARAMS)} are translated; use one, "
            "or our flags (--lr-warmup-iters, --lr-decay-style, ...) without the block"
        )
    given = dict(block.get("params") or {})
    if given.pop("last_batch_iteration", -1) != -1:
        raise LayoutError("scheduler.params.last_batch_iteration: resuming is --load's job; remove the key")
    unknown = sorted(set(given) - set(SCHEDULER_PARAMS[kind]))
    if unknown:
        raise LayoutError(f"scheduler.params {unknown}: {kind} takes {sorted(SCHEDULER_PARAMS[kind])}")
    p = {**SCHEDULER_PARAMS[kind], **given}
    name = "scheduler.params."
    warmup = max(2, _count(name + "warmup_num_steps", p["warmup_num_steps"]))
    if p["warmup_type"] not in ("log", "linear"):
        raise LayoutError(f"{name}warmup_type={p['warmup_type']!r}: must be 'log' or 'linear'")
    total = None if kind == "WarmupLR" else _count(name + "total_num_steps", p["total_num_steps"])
    if kind == "WarmupCosineLR":
        peak = lr
        start = peak * _number(name + "warmup_min_ratio", p["warmup_min_ratio"], 0.0, 1.0)
        minimum, first = peak * _number(name + "cos_min_ratio", p["cos_min_ratio"], 0.0, 1.0), 0.0
    else:
        peak = lr if p["warmup_max_lr"] is None else _number(name + "warmup_max_lr", p["warmup_max_lr"], 0.0)
        start = first = _number(name + "warmup_min_lr", p["warmup_min_lr"], 0.0, peak)
        minimum = start if kind == "WarmupDecayLR" else None
    if "warmup_max_lr" in p and p["warmup_max_lr"] is not None:
        _pick(flags, "lr", p["warmup_max_lr"], name + "warmup_max_lr")
    for flag, value in (
        ("min_lr", minimum),
        ("lr_warmup_iters", p["warmup_num_steps"]),
        ("lr_decay_iters", total),
        ("lr_decay_style", DECAY[kind]),
    ):
        if getattr(flags, flag) is not None and (value is None or not _same(getattr(flags, flag), value)):
            raise LayoutError(
                f"{_flag(flag)} {getattr(flags, flag)} disagrees with the DeepSpeed config's {kind} "
                f"({'no such setting' if value is None else value}); keep one"
            )
    if flags.lr_warmup_fraction is not None:
        raise LayoutError(
            f"--lr-warmup-fraction {flags.lr_warmup_fraction} and the DeepSpeed config's "
            f"{name}warmup_num_steps both set the warm-up; keep one"
        )
    try:
        schedule = DeepSpeedSchedule(
            peak,
            start,
            warmup,
            p["warmup_type"],
            DECAY[kind],
            total or warmup,
            start if minimum is None else minimum,
            first,
        )
    except ValueError as e:
        raise LayoutError(f"scheduler {kind}: {e}") from None
    shown = ", ".join(f"{k}={v}" for k, v in p.items())
    return schedule, (
        f"scheduler {kind}({shown}) -> LR schedule peak {peak:g}, {p['warmup_type']} warm-up from "
        f"{start:g} over {warmup} steps, {DECAY[kind]} decay"
        + ("" if total is None else f" to {minimum:g} at step {total}")
    )


def _warmup_iters(flags: OptimizerFlags, decay_iters: int) -> int:
    """--lr-warmup-iters, or --lr-warmup-fraction of the decay iters (Megatron's); not both."""
    if flags.lr_warmup_fraction is None:
        return DEFAULTS["lr_warmup_iters"] if flags.lr_warmup_iters is None else flags.lr_warmup_iters
    if flags.lr_warmup_iters:
        raise LayoutError(
            f"--lr-warmup-iters {flags.lr_warmup_iters} and --lr-warmup-fraction "
            f"{flags.lr_warmup_fraction} both set the warm-up; keep one"
        )
    if not 0 <= flags.lr_warmup_fraction <= 1:
        raise LayoutError(f"--lr-warmup-fraction {flags.lr_warmup_fraction}: must lie in [0, 1]")
    return int(flags.lr_warmup_fraction * decay_iters)


def optimizer_settings(ds_config: dict, flags: OptimizerFlags, train_iters: int) -> Settings:
    """The run's optimizer settings and LR schedule; LayoutError on a refused block or a conflict."""
    lr, betas, eps, weight_decay, text = _optimizer(ds_config, flags)
    parts = [] if text is None else [text]
    if ds_config.get("scheduler") is not None:
        schedule, text = _scheduler(ds_config["scheduler"], lr, flags)
        parts.append(text)
    else:
        decay_iters = train_iters if flags.lr_decay_iters is None else flags.lr_decay_iters
        min_lr = DEFAULTS["min_lr"] if flags.min_lr is None else flags.min_lr
        style = flags.lr_decay_style or DEFAULTS["lr_decay_style"]
        try:
            schedule = LRSchedule(lr, min_lr, _warmup_iters(flags, decay_iters), decay_iters, style)
        except ValueError as e:
            raise LayoutError(str(e)) from None
        if parts:
            parts.append("no scheduler block: LR schedule from the flags")
    if ds_config.get("bf16", {}).get("enabled", False):
        parts.append("bf16 -> torch_autocast bf16 (float32 parameters, the SSM's A_log, D, dt_bias included)")
    line = "DeepSpeed config: " + "; ".join(parts) if parts else None
    return Settings(OptimizerSettings(schedule, weight_decay, betas, eps), line)


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's learning-rate and optimizer flags, read as `OptimizerFlags` (docs/flags.md)."""
    p = parser.add_argument_group("learning rate and optimizer")
    # None: not given; pipelines.config.ds_translate resolves the JSON's value, the flag's, or the default (in brackets)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate [3e-4]")
    p.add_argument("--min-lr", type=float, default=None, help="[3e-5]")
    p.add_argument("--lr-warmup-iters", type=int, default=None, help="[0]")
    p.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warm-up as a fraction of the decay iters (instead of --lr-warmup-iters)",
    )
    p.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="steps until the LR reaches --min-lr (default: the train iters)",
    )
    p.add_argument("--lr-decay-style", default=None, choices=DECAY_STYLES, help="[cosine]")
    p.add_argument("--weight-decay", type=float, default=None, help="[0.1]")
    p.add_argument("--adam-beta1", type=float, default=None, help="[0.9]")
    p.add_argument("--adam-beta2", type=float, default=None, help="[0.95]")
    p.add_argument("--adam-eps", type=float, default=None, help="[1e-8]")
    p.add_argument("--clip-grad", type=float, default=None, help="max global gradient norm (default 1.0)")
