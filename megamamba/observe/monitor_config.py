"""Where metrics go besides the console and --metrics-jsonl: the DeepSpeed config's monitor blocks.

We honour the `tensorboard`, `csv_monitor`, `wandb` and `comet` blocks with DeepSpeed's keys,
defaults and meaning but write our metric names ourselves, so DeepSpeed never sees the blocks
(`MONITOR_BLOCKS`: the caller drops them). Each block's behaviour: docs/flags.md, docs/training.md.
"""

import importlib.util
import os
from typing import NamedTuple, Optional

MONITOR_BLOCKS = ("tensorboard", "csv_monitor", "wandb", "comet")
_PATH_KEYS = {"enabled": (bool,), "output_path": (str,), "job_name": (str,)}
_KEYS = {  # DeepSpeed 0.19's keys and the types they take
    "tensorboard": _PATH_KEYS,
    "csv_monitor": _PATH_KEYS,
    "wandb": {"enabled": (bool,), "group": (str, type(None)), "team": (str, type(None)), "project": (str,)},
}
_DEFAULT_JOB_NAME = "DeepSpeedJobName"
_DEFAULT_WANDB_PROJECT = "deepspeed"


class Monitors(NamedTuple):
    tensorboard_dir: Optional[str]
    csv_dir: Optional[str]
    wandb: Optional[dict]  # the keyword arguments of wandb.init; None: no wandb run


def _block(ds_config: dict, name: str) -> dict:
    """The block if it is enabled, else {}; a non-object, an unknown key or a mistyped value is refused."""
    block = ds_config.get(name, {})
    if not isinstance(block, dict):
        raise ValueError(
            f'the DeepSpeed config\'s "{name}" is {block!r}; it must be an object such as {{"enabled": true}}'
        )
    if name == "comet":
        if block.get("enabled", False):
            raise ValueError(
                'the DeepSpeed config\'s "comet" block is enabled; comet is not supported here, '
                'use "tensorboard", "csv_monitor" or "wandb"'
            )
        return {}
    keys = _KEYS[name]
    for key, value in block.items():
        if key not in keys:
            raise ValueError(
                f'the DeepSpeed config\'s "{name}" block has the unknown key {key!r}; known: {sorted(keys)}'
            )
        if not isinstance(value, keys[key]):
            raise ValueError(
                f'the DeepSpeed config\'s "{name}".{key} is {value!r}; it must be '
                f"{' or '.join('null' if t is type(None) else t.__name__ for t in keys[key])}"
            )
    return block if block.get("enabled", False) else {}


def _job_dir(block: dict) -> Optional[str]:
    if not block:
        return None
    return os.path.join(block.get("output_path", ""), block.get("job_name", _DEFAULT_JOB_NAME))


def monitors_from_config(ds_config: dict, log_dir: Optional[str]) -> Monitors:
    """The run's monitors; raises ValueError (one line) for a block that cannot work."""
    blocks = {name: _block(ds_config, name) for name in MONITOR_BLOCKS}
    wandb = blocks["wandb"]
    if wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            'the DeepSpeed config\'s "wandb" block is enabled but wandb is not installed: '
            'pip install wandb (or set "enabled": false)'
        )
    return Monitors(
        tensorboard_dir=log_dir or _job_dir(blocks["tensorboard"]),
        csv_dir=_job_dir(blocks["csv_monitor"]),
        wandb={
            "project": wandb.get("project", _DEFAULT_WANDB_PROJECT),
            "group": wandb.get("group"),
            "entity": wandb.get("team"),
        }
        if wandb
        else None,
    )
