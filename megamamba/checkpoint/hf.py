"""Hugging Face transformers' Mamba / Mamba2 format <-> ours: config fields and tensor names.

Options transformers cannot compute are refused by name (`HFFormatError`). The name and field
mapping: docs/checkpoints.md ("Converting to and from Hugging Face and mamba_ssm").
"""

import math
from typing import NamedTuple, Optional

import torch

from megamamba.checkpoint.refusal import Refusal, joined
from megamamba.config import Mamba1Options, Mamba2Options, MambaConfig
from megamamba.errors import MegamambaError
from megamamba.model.block import NORM_EPS
from megamamba.model.layers import EMBEDDING, HEAD

HF_EMBEDDING = "backbone.embeddings.weight"

# transformers' defaults for the fields read here (configuration_mamba.py / configuration_mamba2.py).
HF_DEFAULTS = {
    "mamba": {
        "vocab_size": 50280,
        "hidden_size": 768,
        "state_size": 16,
        "num_hidden_layers": 32,
        "layer_norm_epsilon": 1e-5,
        "expand": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "time_step_rank": "auto",
        "time_step_scale": 1.0,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_init_scheme": "random",
        "time_step_floor": 1e-4,
        "tie_word_embeddings": True,
    },
    "mamba2": {
        "num_heads": 128,
        "head_dim": 64,
        "vocab_size": 32768,
        "hidden_size": 4096,
        "state_size": 128,
        "num_hidden_layers": 64,
        "layer_norm_epsilon": 1e-5,
        "expand": 2,
        "conv_kernel": 4,
        "n_groups": 8,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "time_step_limit": [0.0, math.inf],
        "chunk_size": 256,
        "tie_word_embeddings": False,
    },
}
ARCHITECTURES = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}


PAD_MULTIPLE = "pad_vocab_size_multiple"  # ours, in our exports' config.json: how the import pads the vocabulary
VOCABULARY = (EMBEDDING, HEAD)  # our tensors with a row per token id


class HFFormatError(MegamambaError, ValueError):
    """A config that the other format cannot represent; the message names the field."""


class Part(NamedTuple):
    """A tensor of transformers' file holding `rows` rows (dim 0; None: all) of one of ours; `stacked`: one row
    without that dimension (an expert's matrix of our experts' stack)."""

    name: str
    rows: Optional[int]
    stacked: bool = False


def decode_special_floats(obj):
    """transformers' JSON encoding of non-finite floats ({"__float__": "Infinity"}) decoded, recursively."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].replace("Infinity", "inf"))
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def vocab_fields(config: MambaConfig) -> dict:
    """The export's vocabulary: our real vocab_size (the file holds no padding rows) and our padding multiple."""
    return {"vocab_size": config.vocab_size, PAD_MULTIPLE: config.pad_vocab_size_multiple}


def vocab_from(f: dict) -> dict:
    """Our vocab_size and pad_vocab_size_multiple for transformers' fields `f`: those our export wrote, or for
    another's folder its rows, padded by 8 when 8 divides them (as mamba_ssm pads) and not padded otherwise."""
    rows = f["vocab_size"]
    return {"vocab_size": rows, PAD_MULTIPLE: f.get(PAD_MULTIPLE, 8 if rows % 8 == 0 else 1)}


def expand_refusals(config: MambaConfig) -> list:
    """Why transformers cannot store the config's expand ([] when it can)."""
    expand = config.mixer_options.expand
    return (
        []
        if expand == int(expand)
        else [Refusal(f"ssm_cfg.expand={expand!r}", "transformers stores expand as an integer")]
    )


def mamba_refusals(config: MambaConfig) -> list:
    """Every reason transformers' Mamba (Mamba-1 layers) or Mamba2 (Mamba-2 layers) cannot compute the Mamba-only
    `config` ([] when it can)."""
    o = config.mixer_options
    if not isinstance(o, (Mamba1Options, Mamba2Options)):
        return [
            Refusal(f"ssm_cfg.layer={config.layer!r}", "transformers' Mamba and Mamba2 hold Mamba1 and Mamba2 layers")
        ]
    reasons = (
        []
        if config.rms_norm
        else [Refusal("rms_norm=false (LayerNorm)", "transformers' Mamba and Mamba2 have RMSNorm only")]
    )
    reasons += expand_refusals(config)
    if isinstance(o, Mamba1Options):
        return reasons
    if not o.rmsnorm:
        reasons.append(Refusal("ssm_cfg.rmsnorm=false", "transformers' Mamba2 always applies the gated RMSNorm"))
    if o.norm_before_gate:
        reasons.append(
            Refusal(
                "ssm_cfg.norm_before_gate=true",
                "transformers' Mamba2 gates before normalising (norm_before_gate=false) only",
            )
        )
    if o.D_has_hdim:
        reasons.append(Refusal("ssm_cfg.D_has_hdim=true", "transformers' Mamba2 has one D per head"))
    return reasons


def hf_config(config: MambaConfig, dtype: torch.dtype, eos_token_id: Optional[int] = None) -> dict:
    """transformers' config.json for `config`; HFFormatError naming everything it cannot represent.

    `vocab_size` is our real vocabulary: the rows past it, padding, are not written, and
    `pad_vocab_size_multiple` (ours, ignored by transformers) lets the import pad them back.
    """
    reasons, o = mamba_refusals(config), config.mixer_options
    if reasons or not isinstance(o, (Mamba1Options, Mamba2Options)):  # the refusals name any other mixer
        raise HFFormatError(joined(reasons))
    common = {
        **vocab_fields(config),
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layer,
        "state_size": o.d_state,
        "conv_kernel": o.d_conv,
        "expand": int(o.expand),
        "use_bias": o.bias,
        "use_conv_bias": o.conv_bias,
        "hidden_act": "silu",
        "layer_norm_epsilon": NORM_EPS,
        "residual_in_fp32": config.residual_in_fp32,
        "tie_word_embeddings": config.tie_embeddings,
        "time_step_min": o.dt_min,
        "time_step_max": o.dt_max,
        "time_step_floor": o.dt_init_floor,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if eos_token_id is not None:
        common.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    if isinstance(o, Mamba1Options):
        model_type = "mamba"
        fields = {
            "time_step_rank": config.dt_rank,
            "time_step_scale": o.dt_scale,
            "time_step_init_scheme": o.dt_init,
            "intermediate_size": config.d_inner,
        }
    else:
        model_type = "mamba2"
        fields = {
            "num_heads": config.nheads,
            "head_dim": o.headdim,
            "n_groups": o.ngroups,
            "time_step_limit": list(o.dt_limit),
            "chunk_size": o.chunk_size,
        }
    return {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **common, **fields}


def config_from_hf(hf: dict) -> MambaConfig:
    """Our config for transformers' config.json `hf`; HFFormatError naming what we cannot represent."""
    model_type = hf.get("model_type")
    if model_type not in HF_DEFAULTS:
        raise HFFormatError(
            f"model_type={model_type!r}: only {sorted(HF_DEFAULTS)} (transformers' Mamba, Mamba2) convert"
        )
    f = {**HF_DEFAULTS[model_type], **hf}
    if f["hidden_act"] != "silu":
        raise HFFormatError(f"hidden_act={f['hidden_act']!r}: the Mamba mixers use silu only")
    if f["layer_norm_epsilon"] != NORM_EPS:
        raise HFFormatError(f"layer_norm_epsilon={f['layer_norm_epsilon']!r}: our norms use mamba_ssm's {NORM_EPS}")
    ssm = {
        "d_state": f["state_size"],
        "d_conv": f["conv_kernel"],
        "expand": f["expand"],
        "bias": f["use_bias"],
        "conv_bias": f["use_conv_bias"],
        "dt_min": f["time_step_min"],
        "dt_max": f["time_step_max"],
        "dt_init_floor": f["time_step_floor"],
    }
    if model_type == "mamba":
        ssm.update(
            layer="Mamba1",
            dt_rank=f["time_step_rank"],
            dt_scale=f["time_step_scale"],
            dt_init=f["time_step_init_scheme"],
        )
    else:
        d_inner = f["expand"] * f["hidden_size"]
        if f["num_heads"] * f["head_dim"] != d_inner:
            raise HFFormatError(
                f"num_heads={f['num_heads']} x head_dim={f['head_dim']} != expand x hidden_size = {d_inner}"
            )
        ssm.update(
            layer="Mamba2",
            headdim=f["head_dim"],
            ngroups=f["n_groups"],
            dt_limit=[float(v) for v in f["time_step_limit"]],
            chunk_size=f["chunk_size"],
        )
    return MambaConfig(
        d_model=f["hidden_size"],
        n_layer=f["num_hidden_layers"],
        **vocab_from(f),
        ssm_cfg=ssm,
        rms_norm=True,
        residual_in_fp32=f["residual_in_fp32"],
        tie_embeddings=f["tie_word_embeddings"],
    )


def mamba_parts(config: MambaConfig, name: str) -> list:
    """Where our tensor `name` lies in transformers' Mamba / Mamba2 file (the tied head is not written; of the
    embedding and head the rows of the real vocabulary only)."""
    return [Part(HF_EMBEDDING if name == EMBEDDING else name, config.vocab_size if name in VOCABULARY else None)]
