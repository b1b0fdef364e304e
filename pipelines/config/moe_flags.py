"""Megatron's mixture-of-experts flags as launch/train.py takes them: each sets one option of the model config's
moe_cfg (`megamamba.config.MoEOptions`), so a Megatron command line runs with its own names.

A flag and the --model-config file giving different values for one option are refused, as --hybrid-layer-pattern
and the file are; a flag the file agrees with, or leaves unset, is applied.
"""

import argparse

from megamamba.config import MOE_AUX_LOSS_TYPES, MOE_SCORE_FUNCTIONS
from megamamba.pipelines.config.layout import LayoutError

# flag -> (moe_cfg option, type); --moe-router-enable-expert-bias is a switch
MOE_FLAGS = {
    "--num-experts": ("num_experts", int),
    "--moe-router-topk": ("top_k", int),
    "--moe-ffn-hidden-size": ("ffn_hidden_size", int),
    "--moe-shared-expert-intermediate-size": ("shared_expert_ffn_hidden_size", int),
    "--moe-router-score-function": ("score_function", str),
    "--moe-router-enable-expert-bias": ("expert_bias", bool),
    "--moe-router-bias-update-rate": ("bias_update_rate", float),
    "--moe-router-topk-scaling-factor": ("routed_scaling_factor", float),
    "--moe-router-num-groups": ("n_group", int),
    "--moe-router-group-topk": ("topk_group", int),
    "--moe-router-load-balancing-type": ("aux_loss_type", str),
    "--moe-aux-loss-coeff": ("aux_loss_coeff", float),
    "--moe-z-loss-coeff": ("z_loss_coeff", float),
    "--moe-expert-capacity-factor": ("capacity_factor", float),
}
_CHOICES = {"score_function": MOE_SCORE_FUNCTIONS, "aux_loss_type": MOE_AUX_LOSS_TYPES}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    """launch/train.py's mixture-of-experts flags, Megatron's names (docs/flags.md)."""
    p = parser.add_argument_group("mixture of experts (Megatron's names; each sets the model config's moe_cfg)")
    for flag, (option, kind) in MOE_FLAGS.items():
        if kind is bool:
            p.add_argument(flag, action="store_const", const=True, default=None, help=f"moe_cfg {option}: true")
        else:
            p.add_argument(flag, type=kind, default=None, choices=_CHOICES.get(option), help=f"moe_cfg {option}")


def moe_cfg_flags(args: argparse.Namespace) -> dict:
    """flag -> (moe_cfg option, value) of the MoE flags given."""
    given = {flag: (option, getattr(args, _dest(flag))) for flag, (option, _) in MOE_FLAGS.items()}
    return {flag: entry for flag, entry in given.items() if entry[1] is not None}


def with_moe_flags(fields: dict, flags: dict, where: str) -> dict:
    """The model config's `fields` (read from `where`) with `flags` (`moe_cfg_flags`) set in its moe_cfg.
    LayoutError when the file gives an option another value."""
    if not flags:
        return fields
    moe_cfg = dict(fields.get("moe_cfg") or {})
    for flag, (option, value) in flags.items():
        if moe_cfg.get(option, value) != value:
            raise LayoutError(
                f"{flag} {value!r} disagrees with {where}'s moe_cfg.{option}={moe_cfg[option]!r}; keep one"
            )
        moe_cfg[option] = value
    return {**fields, "moe_cfg": moe_cfg}


def flags_text(flags: dict) -> str:
    """`flags` (`moe_cfg_flags`) as they were typed: "--num-experts 16 --moe-router-enable-expert-bias"."""
    return " ".join(flag if value is True else f"{flag} {value}" for flag, (_, value) in flags.items())
