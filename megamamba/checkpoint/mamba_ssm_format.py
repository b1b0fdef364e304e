"""mamba_ssm's config.json for our model: what its MambaLMHeadModel builds, and every reason it cannot.

mamba_ssm places attention among Mamba blocks by index (`attn_layer_idx`) and has a gated-SiLU MLP
inside every block (`d_intermediate`), but no MLP layers of their own.
"""

from megamamba.checkpoint.refusal import Refusal, joined
from megamamba.config import ATTENTION_LETTER, MAMBA_LETTER, MLP_LETTER, MambaConfig
from megamamba.errors import MegamambaError


class MambaSsmFormatError(MegamambaError, ValueError):
    """A model mamba_ssm cannot build; the message names every field that prevents it."""


def mamba_ssm_refusals(config: MambaConfig) -> list:
    """Every reason mamba_ssm's MambaLMHeadModel cannot compute `config` ([] when it can)."""
    reasons = [
        Refusal(f"{letter} layers in hybrid_layer_pattern", "mamba_ssm has Mamba and attention layers only")
        for letter in sorted(set(config.layer_pattern) - {MAMBA_LETTER, ATTENTION_LETTER, MLP_LETTER})
    ]
    if MLP_LETTER in config.layer_pattern:
        reasons.append(
            Refusal(
                "MLP layers (-)",
                "mamba_ssm has no MLP layers of their own (its MLP, d_intermediate, sits inside every block; "
                f"hybrid_layer_pattern={config.hybrid_layer_pattern!r})",
            )
        )
    if config.mlp_inside_blocks and config.mlp_activation != "gated_silu":
        reasons.append(
            Refusal(f"mlp_activation={config.mlp_activation!r}", "mamba_ssm's MLP (d_intermediate) is gated SiLU only")
        )
    return reasons


def mamba_ssm_config(config: MambaConfig) -> dict:
    """mamba_ssm's config.json for `config` (a pattern of Mamba and attention layers as attn_layer_idx);
    MambaSsmFormatError naming everything mamba_ssm cannot build."""
    reasons = mamba_ssm_refusals(config)
    if reasons:
        raise MambaSsmFormatError(joined(reasons))
    fields = config.to_dict()
    if config.hybrid_layer_pattern:
        del fields["hybrid_layer_pattern"]
        fields.update(
            attn_layer_idx=[i for i, s in enumerate(config.layer_pattern) if s == ATTENTION_LETTER], d_intermediate=0
        )
    fields.pop("mlp_activation", None)
    return fields
