"""Which tensor/sequence-parallel layouts each mixer allows, checked before any work (a whole model's:
`megamamba.model.layers.check_layout`).

Each refusal names the rule and the numbers. The rules:

- Mamba-1 splits the d_inner channels (conv, x_proj input, dt_proj, A_log, D): d_inner % TP == 0.
- Mamba-2 splits the heads (with their channels, dt_bias, A_log, D): nheads % TP == 0. Its B/C
  groups are split when ngroups % TP == 0, or replicated on every rank when TP % ngroups == 0
  (each rank then uses the one group its heads belong to); any other ngroups is refused.
- Attention splits the query heads: num_heads % TP == 0. Its key/value heads are split with them when
  num_heads_kv % TP == 0, or replicated on every rank when TP % num_heads_kv == 0 (each rank then uses
  the one its query heads read); any other num_heads_kv is refused.
- An MLP splits its hidden channels: width % TP == 0.
- Sequence parallelism splits the sequence between blocks: seqlen % TP == 0.
"""

from __future__ import annotations

from megamamba.config import AttentionOptions, Mamba1Options, MixerOptions
from megamamba.errors import LayoutError


def check_attention_layout(options: AttentionOptions, tp_size: int) -> None:
    """Refuse attention options whose heads cannot be split across `tp_size` ranks."""
    heads, kv_heads = options.num_heads, options.kv_heads
    if heads % tp_size:
        raise LayoutError(
            f"attention tensor parallelism splits the query heads across ranks: num_heads = {heads} "
            f"is not divisible by TP = {tp_size}"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise LayoutError(
            f"attention tensor parallelism splits the key/value heads (num_heads_kv divisible by TP) "
            f"or replicates them (num_heads_kv dividing TP): num_heads_kv = {kv_heads} does neither at "
            f"TP = {tp_size}"
        )


def check_mlp_layout(width: int, tp_size: int) -> None:
    """Refuse an MLP whose hidden channels cannot be split across `tp_size` ranks."""
    if width % tp_size:
        raise LayoutError(
            f"MLP tensor parallelism splits the hidden channels across ranks: d_intermediate = {width} "
            f"is not divisible by TP = {tp_size}"
        )


def check_mixer_layout(d_model: int, options: MixerOptions, tp_size: int) -> None:
    """Refuse mixer options that cannot be split across `tp_size` ranks."""
    if tp_size == 1:
        return
    d_inner = int(options.expand * d_model)
    if isinstance(options, Mamba1Options):
        if d_inner % tp_size:
            raise LayoutError(
                f"Mamba-1 tensor parallelism splits the d_inner channels across ranks: d_inner = {d_inner} "
                f"(expand x d_model) is not divisible by TP = {tp_size}"
            )
        return
    nheads, ngroups = d_inner // options.headdim, options.ngroups
    if nheads % tp_size:
        raise LayoutError(
            f"Mamba-2 tensor parallelism splits the heads across ranks: nheads = {nheads} "
            f"(d_inner {d_inner} / headdim {options.headdim}) is not divisible by TP = {tp_size}"
        )
    if ngroups % tp_size and tp_size % ngroups:
        raise LayoutError(
            f"Mamba-2 tensor parallelism splits the B/C groups (ngroups divisible by TP) or replicates them "
            f"(ngroups dividing TP): ngroups = {ngroups} does neither at TP = {tp_size}"
        )


def check_sequence_length(seqlen: int, tp_size: int, sequence_parallel: bool) -> None:
    """Refuse a sequence that sequence parallelism cannot split evenly across the TP group."""
    if sequence_parallel and seqlen % tp_size:
        raise LayoutError(
            f"sequence parallelism splits the sequence across the tensor-parallel group: "
            f"seqlen = {seqlen} is not divisible by TP = {tp_size}"
        )
