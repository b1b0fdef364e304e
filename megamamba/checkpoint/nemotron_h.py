"""transformers' NemotronH format <-> our hybrid models: config fields and tensor names.

NemotronH has one mixer per layer (`layers_block_type`: "linear_attention" Mamba-2, "full_attention",
"mlp", "moe": nemotron_h_moe.py), attention without biases or rotary at head_dim ** -0.5, a squared-ReLU
MLP, one norm epsilon, and clamps dt below at `time_step_min`; what it cannot compute is refused by name
(`HFFormatError`). Attention's fused in_proj rows [q, k, v] are its q_proj, k_proj and v_proj; the head is
always written (transformers does not tie NemotronH's).
"""

import math
import re
from typing import Optional

import torch

from megamamba.checkpoint.hf import (
    HF_EMBEDDING,
    VOCABULARY,
    HFFormatError,
    Part,
    expand_refusals,
    vocab_fields,
    vocab_from,
)
from megamamba.checkpoint.nemotron_h_moe import (
    HF_MOE,
    MOE_DEFAULTS,
    moe_cfg_from,
    moe_fields,
    moe_parts,
    moe_refusals,
)
from megamamba.checkpoint.refusal import Refusal, joined
from megamamba.config import ATTENTION_LETTER, MAMBA_LETTER, MLP_LETTER, MOE_LETTER, Mamba2Options, MambaConfig
from megamamba.model.block import NORM_EPS
from megamamba.model.layers import EMBEDDING, HEAD

MODEL_TYPE, ARCHITECTURE = "nemotron_h", "NemotronHForCausalLM"
HF_MAMBA, HF_ATTENTION, HF_MLP = "linear_attention", "full_attention", "mlp"  # its layers_block_type
# ours by pattern letter
BLOCK_TYPES = {MAMBA_LETTER: HF_MAMBA, ATTENTION_LETTER: HF_ATTENTION, MLP_LETTER: HF_MLP, MOE_LETTER: HF_MOE}
SYMBOLS = {hf_type: letter for letter, hf_type in BLOCK_TYPES.items()}
# transformers' defaults (configuration_nemotron_h.py) for the fields read here.
DEFAULTS = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "use_conv_bias": True,
    "chunk_size": 128,
    "num_nextn_predict_layers": 0,
    "use_bias": False,
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": False,
    **MOE_DEFAULTS,
}
# older NemotronH configs' names, which transformers still reads (configuration_nemotron_h.py)
LEGACY_NAMES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
LEGACY_SYMBOLS = BLOCK_TYPES  # hybrid_override_pattern, the same letters as ours
LEGACY_TYPES = {"mamba": HF_MAMBA, "attention": HF_ATTENTION}  # its older type names; transformers remaps them too
_LAYER_KEY = re.compile(r"backbone\.layers\.(\d+)\.mixer\.(in_proj|out_proj|fc1|fc2)\.weight")
_RENAMED = {(ATTENTION_LETTER, "out_proj"): "o_proj", (MLP_LETTER, "fc1"): "up_proj", (MLP_LETTER, "fc2"): "down_proj"}


def _mamba_refusals(config: MambaConfig) -> list:
    o = config.mixer_options
    if not isinstance(o, Mamba2Options):
        return [Refusal(f"ssm_cfg.layer={config.layer!r}", "NemotronH's Mamba layers are Mamba2")]
    reasons = expand_refusals(config)
    if not o.rmsnorm or o.norm_before_gate:
        reasons.append(
            Refusal(
                f"ssm_cfg rmsnorm={o.rmsnorm}, norm_before_gate={o.norm_before_gate}",
                "NemotronH applies the gated RMSNorm after gating only (rmsnorm=true, norm_before_gate=false)",
            )
        )
    if o.D_has_hdim:
        reasons.append(Refusal("ssm_cfg.D_has_hdim=true", "NemotronH has one D per head"))
    if o.dt_limit[1] != math.inf:
        reasons.append(
            Refusal(
                f"ssm_cfg.dt_limit={list(o.dt_limit)}",
                "NemotronH clamps dt below only (at time_step_min); the upper limit must be inf",
            )
        )
    return reasons


def _attention_refusals(config: MambaConfig) -> list:
    o = config.attention_options
    head_dim = config.head_dim_of(o)
    reasons = []
    if o.qkv_proj_bias or o.out_proj_bias:
        reasons.append(
            Refusal(
                f"attn_cfg qkv_proj_bias={o.qkv_proj_bias}, out_proj_bias={o.out_proj_bias}",
                "NemotronH's attention has no biases (set both false)",
            )
        )
    if o.rotary_emb_dim:
        reasons.append(
            Refusal(
                f"attn_cfg.rotary_emb_dim={o.rotary_emb_dim}", "NemotronH's attention has no rotary embedding (use 0)"
            )
        )
    if o.softmax_scale is not None and o.softmax_scale != head_dim**-0.5:
        reasons.append(
            Refusal(
                f"attn_cfg.softmax_scale={o.softmax_scale}",
                f"NemotronH scales by head_dim ** -0.5 = {head_dim**-0.5} (use null)",
            )
        )
    return reasons


def nemotron_h_refusals(config: MambaConfig) -> list:
    """Every reason NemotronH cannot compute the hybrid `config` ([] when it can)."""
    reasons = [] if config.rms_norm else [Refusal("rms_norm=false (LayerNorm)", "NemotronH has RMSNorm only")]
    if config.mlp_inside_blocks:
        reasons.append(
            Refusal(
                f"d_intermediate={config.d_intermediate} without hybrid_layer_pattern (an MLP inside every block, "
                "as mamba_ssm)",
                "NemotronH has one mixer per layer; express the MLPs as their own layers (- in hybrid_layer_pattern)",
            )
        )
    letters = config.layer_pattern
    reasons += [
        Refusal(
            f"{letter} layers in hybrid_layer_pattern", f"the NemotronH export has {''.join(BLOCK_TYPES)} layers only"
        )
        for letter in sorted(set(letters) - set(BLOCK_TYPES))
    ]
    if MAMBA_LETTER in letters:
        reasons += _mamba_refusals(config)
    if ATTENTION_LETTER in letters:
        reasons += _attention_refusals(config)
    if MLP_LETTER in letters and config.mlp_activation != "squared_relu":
        reasons.append(
            Refusal(
                f"mlp_activation={config.mlp_activation!r}",
                'NemotronH\'s MLP is squared ReLU, not gated (mlp_activation="squared_relu")',
            )
        )
    if MOE_LETTER in letters:
        reasons += moe_refusals(config)
    return reasons


def _mamba_fields(config: MambaConfig, o: Mamba2Options) -> dict:
    low, high = o.dt_limit
    return {
        "ssm_state_size": o.d_state,
        "mamba_num_heads": config.nheads,
        "mamba_head_dim": o.headdim,
        "n_groups": o.ngroups,
        "conv_kernel": o.d_conv,
        "expand": int(o.expand),
        "use_conv_bias": o.conv_bias,
        "use_bias": o.bias,
        "mamba_hidden_act": "silu",
        "chunk_size": o.chunk_size,
        "time_step_min": low,
        "time_step_max": o.dt_max,
        "time_step_floor": o.dt_init_floor,
        "time_step_limit": [low, high],
    }


def nemotron_h_config(config: MambaConfig, dtype: torch.dtype, eos_token_id: Optional[int] = None) -> dict:
    """transformers' NemotronH config.json for `config`; HFFormatError naming everything it cannot represent.

    `vocab_size` is our real vocabulary, as in hf.hf_config."""
    reasons = nemotron_h_refusals(config)
    if reasons:
        raise HFFormatError(joined(reasons))
    letters = config.layer_pattern
    fields = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **vocab_fields(config),
        "hidden_size": config.d_model,
        "layers_block_type": [BLOCK_TYPES[letter] for letter in letters],
        "layer_norm_epsilon": NORM_EPS,
        "residual_in_fp32": config.residual_in_fp32,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }
    mixer = config.mixer_options
    if MAMBA_LETTER in letters and isinstance(mixer, Mamba2Options):  # the refusals leave no other mixer
        fields.update(_mamba_fields(config, mixer))
    if ATTENTION_LETTER in letters:
        o = config.attention_options
        fields.update(
            num_attention_heads=o.num_heads,
            num_key_value_heads=o.kv_heads,
            head_dim=config.head_dim_of(o),
            attention_bias=False,
        )
    if MLP_LETTER in letters:
        fields.update(intermediate_size=config.d_intermediate)
    if MLP_LETTER in letters or MOE_LETTER in letters:
        fields.update(mlp_hidden_act="relu2", mlp_bias=False)  # the MLPs' and the experts'
    if MOE_LETTER in letters:
        fields.update(moe_fields(config))
    if eos_token_id is not None:
        fields.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    return fields


def _check_supported(f: dict, types: list) -> None:
    unknown = sorted(set(types) - set(SYMBOLS))
    if unknown:
        raise HFFormatError(f"layers_block_type has {unknown}: only {sorted(SYMBOLS)} layers are implemented")
    if f["num_nextn_predict_layers"]:
        raise HFFormatError(
            f"num_nextn_predict_layers={f['num_nextn_predict_layers']}: multi-token prediction "
            "layers are not implemented"
        )
    if f["layer_norm_epsilon"] != NORM_EPS:
        raise HFFormatError(f"layer_norm_epsilon={f['layer_norm_epsilon']!r}: our norms use mamba_ssm's {NORM_EPS}")
    if f["mamba_hidden_act"] != "silu":
        raise HFFormatError(f"mamba_hidden_act={f['mamba_hidden_act']!r}: the Mamba mixers use silu only")
    if (HF_MLP in types or HF_MOE in types) and (f["mlp_hidden_act"] != "relu2" or f["mlp_bias"]):
        raise HFFormatError(
            f"mlp_hidden_act={f['mlp_hidden_act']!r}, mlp_bias={f['mlp_bias']}: our MLP layers and experts "
            "are relu2 (squared ReLU) without biases"
        )


def _ssm_cfg(f: dict, d_model: int) -> dict:
    d_inner = f["expand"] * d_model
    if f["mamba_num_heads"] * f["mamba_head_dim"] != d_inner:
        raise HFFormatError(
            f"mamba_num_heads={f['mamba_num_heads']} x mamba_head_dim={f['mamba_head_dim']} != "
            f"expand x hidden_size = {d_inner}"
        )
    ssm = {
        "layer": "Mamba2",
        "d_state": f["ssm_state_size"],
        "d_conv": f["conv_kernel"],
        "expand": f["expand"],
        "headdim": f["mamba_head_dim"],
        "ngroups": f["n_groups"],
        "bias": f["use_bias"],
        "conv_bias": f["use_conv_bias"],
        "chunk_size": f["chunk_size"],
        "dt_max": f["time_step_max"],
        "dt_init_floor": f["time_step_floor"],
        "dt_limit": [float(f["time_step_min"]), math.inf],
    }
    if f["time_step_min"] > 0:  # also the initialisation's lower end; 0 keeps mamba_ssm's default there
        ssm["dt_min"] = f["time_step_min"]
    return ssm


def config_from_nemotron_h(hf: dict) -> MambaConfig:
    """Our pattern config for transformers' NemotronH config.json `hf`; HFFormatError naming what we cannot
    represent."""
    f = {**DEFAULTS, **{LEGACY_NAMES.get(k, k): v for k, v in hf.items()}}
    types = f.get("layers_block_type")
    if types is None and isinstance(f.get("hybrid_override_pattern"), str):
        types = [LEGACY_SYMBOLS.get(symbol, symbol) for symbol in f["hybrid_override_pattern"]]
    if not isinstance(types, list) or not types:
        raise HFFormatError(
            f"layers_block_type={types!r}: a NemotronH config lists its layers' types (or "
            "hybrid_override_pattern has their symbols)"
        )
    types = [LEGACY_TYPES.get(t, t) for t in types]
    _check_supported(f, types)
    fields = {
        "d_model": f["hidden_size"],
        "n_layer": len(types),
        **vocab_from(f),
        "hybrid_layer_pattern": "".join(SYMBOLS[t] for t in types),
        "rms_norm": True,
        "residual_in_fp32": f["residual_in_fp32"],
        "tie_embeddings": f["tie_word_embeddings"],
    }
    if HF_MAMBA in types:
        fields["ssm_cfg"] = _ssm_cfg(f, f["hidden_size"])
    if HF_ATTENTION in types:
        fields["attn_cfg"] = {
            "num_heads": f["num_attention_heads"],
            "num_heads_kv": f["num_key_value_heads"],
            "head_dim": f["head_dim"],
            "qkv_proj_bias": False,
            "out_proj_bias": False,
            "causal": True,
        }
    if HF_MLP in types:
        fields.update(d_intermediate=f["intermediate_size"], mlp_activation="squared_relu")
    if HF_MOE in types:
        fields["moe_cfg"] = moe_cfg_from(f)
    return MambaConfig(**fields)


def nemotron_h_parts(config: MambaConfig, name: str) -> list:
    """Where our tensor `name` lies in NemotronH's file: [Part(name there, rows of ours)], rows in order (of
    the embedding and head the real vocabulary's)."""
    if name in VOCABULARY:  # the rows of the real vocabulary only
        return [Part(HF_EMBEDDING if name == EMBEDDING else name, config.vocab_size)]
    moe = moe_parts(config, name)
    if moe is not None:
        return moe
    match = _LAYER_KEY.fullmatch(name)
    if match is None:
        return [Part(name, None)]
    layer, proj = int(match.group(1)), match.group(2)
    letter = config.layer_pattern[layer]
    prefix = f"backbone.layers.{layer}.mixer."
    if letter == ATTENTION_LETTER and proj == "in_proj":
        o = config.attention_options
        head_dim = config.head_dim_of(o)
        return [
            Part(prefix + "q_proj.weight", o.num_heads * head_dim),
            Part(prefix + "k_proj.weight", o.kv_heads * head_dim),
            Part(prefix + "v_proj.weight", o.kv_heads * head_dim),
        ]
    return [Part(prefix + _RENAMED.get((letter, proj), proj) + ".weight", None)]


def written_names(names: list) -> list:
    """Our tensor names NemotronH's file holds: all of `names`, and the head even when tied."""
    return names if HEAD in names else names + [HEAD]
