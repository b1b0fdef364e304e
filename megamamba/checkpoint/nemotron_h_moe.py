"""transformers' NemotronH mixture-of-experts layers ("moe") <-> our E blocks: config fields and tensor names.

NemotronH routes as ours does with sigmoid scores (selection-only bias, groups, normalisation, scaling), has
squared-ReLU experts without biases, always one shared expert, and no token dropping; anything else is refused.
Its files hold each expert's matrices (`mixer.experts.{e}.up_proj.weight`), ours the stack of them, and always
the router's `e_score_correction_bias`: written as zeros where our routers have none. The settings NemotronH has
no field for (whether training updates the bias, the load-balancing losses) travel as `moe_cfg` in the export's
config.json, ours, which transformers ignores; a folder without it imports with the bias updated.
"""

import re
from typing import Optional

from megamamba.checkpoint.hf import HFFormatError, Part
from megamamba.checkpoint.refusal import Refusal
from megamamba.config import MOE_LETTER, MambaConfig

HF_MOE = "moe"  # its layers_block_type
CARRIED = ("expert_bias", "bias_update_rate", "aux_loss_coeff", "aux_loss_type", "z_loss_coeff")  # in our moe_cfg
# transformers' defaults (configuration_nemotron_h.py) for the fields read here.
MOE_DEFAULTS = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
}
BIAS = "gate.e_score_correction_bias"
_EXPERTS_KEY = re.compile(r"backbone\.layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)")
_SHARED_KEY = re.compile(r"backbone\.layers\.(\d+)\.mixer\.shared_experts\.(fc1|fc2)\.weight")
_SHARED_RENAMED = {"fc1": "up_proj", "fc2": "down_proj"}


def moe_refusals(config: MambaConfig) -> list:
    """Every reason NemotronH cannot compute the config's E blocks ([] when it can)."""
    o = config.moe_options
    reasons = []
    if o.activation != "relu2":
        reasons.append(
            Refusal(
                f"moe_cfg.activation={o.activation!r}", 'NemotronH\'s experts are squared ReLU, not gated ("relu2")'
            )
        )
    if o.score_function != "sigmoid":
        reasons.append(
            Refusal(
                f"moe_cfg.score_function={o.score_function!r}",
                'NemotronH scores each expert by its sigmoid ("sigmoid")',
            )
        )
    if not o.shared_expert_ffn_hidden_size:
        reasons.append(
            Refusal(
                "moe_cfg.shared_expert_ffn_hidden_size=0 (no shared expert)",
                "NemotronH's MoE layers always add a shared expert (give its width)",
            )
        )
    if o.capacity_factor is not None:
        reasons.append(
            Refusal(
                f"moe_cfg.capacity_factor={o.capacity_factor}",
                "NemotronH drops no tokens (use null: dropless)",
            )
        )
    return reasons


def moe_fields(config: MambaConfig) -> dict:
    """NemotronH's config fields for the config's E blocks (which moe_refusals accepts), and our moe_cfg's
    settings it has no field for."""
    o = config.moe_options
    return {
        "n_routed_experts": o.num_experts,
        "num_experts_per_tok": o.top_k,
        "moe_intermediate_size": o.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": o.shared_expert_ffn_hidden_size,
        "n_shared_experts": 1,
        "moe_latent_size": None,
        "n_group": o.n_group,
        "topk_group": o.topk_group,
        "norm_topk_prob": o.norm_topk_prob,
        "routed_scaling_factor": o.routed_scaling_factor,
        "moe_cfg": {name: getattr(o, name) for name in CARRIED},
    }


def moe_cfg_from(f: dict) -> dict:
    """Our moe_cfg for NemotronH's fields `f` (its defaults filled in); HFFormatError for a latent projection."""
    if f["moe_latent_size"] is not None:
        raise HFFormatError(
            f"moe_latent_size={f['moe_latent_size']}: experts working in a latent projection are not implemented"
        )
    carried = f.get("moe_cfg", {})
    if not isinstance(carried, dict):
        raise HFFormatError(f"moe_cfg={carried!r}: our export writes it as a dict of moe_cfg settings, or none")
    return {
        "expert_bias": True,
        **carried,
        "num_experts": f["n_routed_experts"],
        "top_k": f["num_experts_per_tok"],
        "ffn_hidden_size": f["moe_intermediate_size"],
        "shared_expert_ffn_hidden_size": f["moe_shared_expert_intermediate_size"],
        "activation": "relu2",
        "score_function": "sigmoid",
        "norm_topk_prob": f["norm_topk_prob"],
        "routed_scaling_factor": f["routed_scaling_factor"],
        "n_group": f["n_group"],
        "topk_group": f["topk_group"],
    }


def moe_parts(config: MambaConfig, name: str) -> Optional[list]:
    """Where our E block tensor `name` lies in NemotronH's file ([Part], rows in order); None for a tensor that
    keeps its name (the router's, the norm) or is not an E block's."""
    experts = _EXPERTS_KEY.fullmatch(name)
    if experts is not None:
        layer, proj = experts.groups()
        prefix = f"backbone.layers.{layer}.mixer.experts."
        return [Part(f"{prefix}{e}.{proj}.weight", 1, stacked=True) for e in range(config.moe_options.num_experts)]
    shared = _SHARED_KEY.fullmatch(name)
    if shared is not None:
        layer, proj = shared.groups()
        return [Part(f"backbone.layers.{layer}.mixer.shared_experts.{_SHARED_RENAMED[proj]}.weight", None)]
    return None


def zero_biases(config: MambaConfig) -> dict:
    """NemotronH's tensors that are none of ours and hold zeros: each E block's e_score_correction_bias when our
    routers have none (expert_bias false), name -> shape."""
    if not config.has_moe_layers or config.moe_options.expert_bias:
        return {}
    shape = (config.moe_options.num_experts,)
    return {
        f"backbone.layers.{i}.mixer.{BIAS}": shape
        for i, letter in enumerate(config.layer_pattern)
        if letter == MOE_LETTER
    }
