"""Which formats a model exports to, and every reason each of the others cannot hold it.

Known from the model config alone: train.py's start-up summary says it before training, and
`convert export` refuses with it before writing anything. Each model has one transformers class of
its family (`transformers_format`: Mamba for Mamba-1 layers, Mamba2 for Mamba-2, NemotronH for
hybrids), the one `--to hf` writes; mamba_ssm's MambaLMHeadModel is the other target.
"""

from megamamba.checkpoint.hf import mamba_refusals
from megamamba.checkpoint.mamba_ssm_format import mamba_ssm_refusals
from megamamba.checkpoint.nemotron_h import nemotron_h_refusals
from megamamba.checkpoint.refusal import Refusal, joined
from megamamba.config import MambaConfig

MAMBA_SSM = "mamba_ssm"
MAMBA, MAMBA2, NEMOTRON_H = "transformers Mamba", "transformers Mamba2", "transformers NemotronH"
FORMATS = (MAMBA_SSM, MAMBA, MAMBA2, NEMOTRON_H)
TARGETS = {MAMBA_SSM: "mamba_ssm", MAMBA: "hf", MAMBA2: "hf", NEMOTRON_H: "hf"}  # convert export --to


def is_hybrid(config: MambaConfig) -> bool:
    """Whether the model has attention or MLP layers (or a layer pattern): NemotronH's, not Mamba's format."""
    return bool(config.hybrid_layer_pattern or config.attn_layer_idx or config.d_intermediate)


def transformers_format(config: MambaConfig) -> str:
    """The transformers class of the model's family, the one `convert export --to hf` writes."""
    if is_hybrid(config):
        return NEMOTRON_H
    return MAMBA if config.layer == "Mamba1" else MAMBA2  # a layer neither holds: Mamba2's refusal names it


def _family(config: MambaConfig, fmt: str) -> list:
    """Why the transformers class `fmt` is not of the model's family ([] when it is)."""
    if fmt == transformers_format(config):
        return []
    if is_hybrid(config):
        return [Refusal("attention or MLP layers", f"{fmt} has Mamba layers only (hybrids take NemotronH)")]
    if fmt == NEMOTRON_H:
        return [Refusal("no attention or MLP layers", "Mamba-only models take transformers Mamba or Mamba2")]
    return [Refusal(f"ssm_cfg.layer={config.layer!r}", f"{fmt} holds {'Mamba1' if fmt == MAMBA else 'Mamba2'} layers")]


def export_refusals(config: MambaConfig) -> dict:
    """Each export format (FORMATS) -> every reason it cannot compute `config` ([]: the model exports there)."""
    refusals = {MAMBA_SSM: mamba_ssm_refusals(config)}
    for fmt in (MAMBA, MAMBA2, NEMOTRON_H):
        family = _family(config, fmt)
        if family or fmt == NEMOTRON_H:
            refusals[fmt] = family or nemotron_h_refusals(config)
        else:
            refusals[fmt] = mamba_refusals(config)
    return refusals


def exports_line(config: MambaConfig) -> str:
    """The start-up summary's line: the formats the model exports to, and for its family's formats that it does
    not, every setting that prevents it, e.g. `exports to: mamba_ssm (not transformers NemotronH:
    attn_cfg.rotary_emb_dim=16; mlp_activation='gated_silu')`."""
    refusals = export_refusals(config)
    ok = [fmt for fmt in FORMATS if not refusals[fmt]]
    refused = [
        f"{fmt}: {'; '.join(r.setting for r in refusals[fmt])}"
        for fmt in (MAMBA_SSM, transformers_format(config))
        if refusals[fmt]
    ]
    if not refused:
        return f"exports to: {', '.join(ok)}"
    if not ok:
        return f"exports to: none ({' | '.join(refused)})"
    return f"exports to: {', '.join(ok)} (not {' | '.join(refused)})"


def refusal_message(config: MambaConfig, target: str) -> str:
    """Why `convert export --to target` cannot export the model, with every reason, and the other target that
    can, if one can (never one that would refuse too); "" when it can."""
    refusals = export_refusals(config)
    fmt = MAMBA_SSM if target == TARGETS[MAMBA_SSM] else transformers_format(config)
    if not refusals[fmt]:
        return ""
    other = transformers_format(config) if fmt == MAMBA_SSM else MAMBA_SSM
    flag = f"--to {TARGETS[other]}" + ("" if other == MAMBA_SSM else f" ({other})")
    message = f"--to {target}: {fmt} cannot compute this model: {joined(refusals[fmt])}"
    if refusals[other]:
        return f"{message}; nor can {flag}: {joined(refusals[other])}"
    return f"{message}; {flag} can"
