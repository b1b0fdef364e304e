"""Which tensor/sequence-parallel layouts a model config allows, checked before any work.

Each refusal names the rule and the numbers. The rules:

- Mamba-1 splits the d_inner channels (conv, x_proj input, dt_proj, A_log, D): d_inner % TP == 0.
- Mamba-2 splits the heads (with their channels, dt_bias, A_log, D): nheads % TP == 0. Its B/C
  groups are split when ngroups % TP == 0, or replicated on every rank when TP % ngroups == 0
  (each rank then uses the one group its heads belong to); any other ngroups is refused.
- Sequence parallelism splits the sequence between blocks: seqlen % TP == 0.
"""
from __future__ import annotations

from megamamba.config import Mamba1Options, MambaConfig, MixerOptions
from megamamba.errors import LayoutError


def check_model_layout(config: MambaConfig, tp_size: int) -> None:
    """Refuse a config whose mixer cannot be split across `tp_size` ranks."""
    check_mixer_layout(config.d_model, config.mixer_options, tp_size)


def check_mixer_layout(d_model: int, options: MixerOptions, tp_size: int) -> None:
    """Refuse mixer options that cannot be split across `tp_size` ranks."""
    if tp_size == 1:
        return
    d_inner = int(options.expand * d_model)
    if isinstance(options, Mamba1Options):
        if d_inner % tp_size:
            raise LayoutError(
                f"Mamba-1 tensor parallelism splits the d_inner channels across ranks: d_inner = {d_inner} "
                f"(expand x d_model) is not divisible by TP = {tp_size}")
        return
    nheads, ngroups = d_inner // options.headdim, options.ngroups
    if nheads % tp_size:
        raise LayoutError(
            f"Mamba-2 tensor parallelism splits the heads across ranks: nheads = {nheads} "
            f"(d_inner {d_inner} / headdim {options.headdim}) is not divisible by TP = {tp_size}")
    if ngroups % tp_size and tp_size % ngroups:
        raise LayoutError(
            f"Mamba-2 tensor parallelism splits the B/C groups (ngroups divisible by TP) or replicates them "
            f"(ngroups dividing TP): ngroups = {ngroups} does neither at TP = {tp_size}")


def check_sequence_length(seqlen: int, tp_size: int, sequence_parallel: bool) -> None:
    """Refuse a sequence that sequence parallelism cannot split evenly across the TP group."""
    if sequence_parallel and seqlen % tp_size:
        raise LayoutError(
            f"sequence parallelism splits the sequence across the tensor-parallel group: "
            f"seqlen = {seqlen} is not divisible by TP = {tp_size}")
