"""The Mamba language model: the layer list of `megamamba.model.layers`, run in order. It is what trains: its
forward with labels is the training loss DeepSpeed's engine takes (a pipeline stage runs a slice of the same
layers).

State-dict keys and initialisation are mamba_ssm's `MambaLMHeadModel`; each layer draws from its
own seeded stream, so a pipeline stage draws only its own. The same class runs tensor- and
context-parallel (`tp=`, `cp=`). Design: docs/code.md.
"""

from typing import Callable, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.layer_types.head import tie
from megamamba.model.layers import build_layer, check_layout, draw_seed, layer_count
from megamamba.model.loss import training_loss
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel
from megamamba.parallel.tensor.model_layout import check_sequence_length


class MambaBackbone(nn.Module):
    """Where mamba_ssm keeps the layers before the head: `embedding`, `layers`, `norm_f`."""

    def __init__(self, embedding: nn.Module, blocks: list, norm_f: nn.Module):
        super().__init__()
        self.embedding, self.layers, self.norm_f = embedding, nn.ModuleList(blocks), norm_f


def layer_list(model: nn.Module) -> list:
    """The layers of `model` (a `MambaLM`, or a module holding its `backbone` and `lm_head`) in order."""
    backbone = model.backbone
    return [backbone.embedding, *backbone.layers, backbone.norm_f, model.lm_head]


class MambaLM(nn.Module):
    """Mamba-1 / Mamba-2 language model, pure or hybrid with attention and MLP blocks:
    `MambaLM(config)(input_ids)` -> logits (batch, seqlen, padded vocab).

    With `tp` (size > 1) the model is split across its tensor-parallel group (docs/code.md).
    With `cp` (size > 1) each rank of the context-parallel group runs a slice of every sequence.
    With `ep` (size > 1) each rank of the expert-parallel group holds a share of every MoE layer's experts.
    With `checkpoint_interval` k > 0, training recomputes each run of k consecutive layers of the list in the
    backward (non-reentrant activation checkpointing, as DeepSpeed's pipeline does within a stage).
    """

    def __init__(
        self,
        config: MambaConfig,
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
        checkpoint_interval: int = 0,
        ep: Optional[ExpertParallel] = None,
    ):
        super().__init__()
        config.validate()
        if checkpoint_interval < 0:
            raise ValueError(f"checkpoint interval {checkpoint_interval}: must be >= 0")
        self.checkpoint_interval = checkpoint_interval
        self.tp = split(tp)
        self.cp = split(cp)
        if self.tp is not None:
            check_layout(config, self.tp.size)
        self.config = config
        seed = draw_seed(device)
        embedding, *blocks, norm_f, head = [
            build_layer(config, i, seed, device, dtype, self.tp, self.cp, ep) for i in range(layer_count(config))
        ]
        self.backbone = MambaBackbone(embedding, blocks, norm_f)
        self.lm_head = head
        if config.tie_embeddings:
            tie(self.lm_head, self.backbone.embedding)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        seq_idx: Optional[torch.Tensor] = None,
        inference_cache: Optional[list] = None,
    ) -> torch.Tensor:
        """input_ids (batch, seqlen) -> logits (batch, seqlen, padded_vocab_size); with `labels` (batch, seqlen;
        -100 = ignored) the training loss instead (`megamamba.model.loss.training_loss`: the mean cross-entropy
        over the real vocabulary, under TP on the vocab-parallel logits, never gathered; the mixture-of-experts
        blocks' router losses, carried by the stream, in its gradient).

        seq_idx (batch, seqlen) int32 document ids: the state of every layer resets where the id
        changes, so packed documents do not see each other. inference_cache (from
        allocate_inference_cache): filled with the states after the last position, so `step`
        continues the sequence (prefill); not combined with seq_idx.

        Under CP: input_ids, labels and seq_idx are this rank's slice (batch, seqlen / C), the ids of a
        document the same on every rank; the logits are the slice's. No inference_cache.

        Under TP: input_ids and seq_idx whole and the same on every rank; the logits are LOCAL,
        this rank's vocab block (batch, seqlen, rows) of the TP-padded vocab, rank r holding
        columns [r * rows, (r + 1) * rows); `gather_from_tp_region(logits, tp)[..., :padded_vocab_size]`
        gives the full ones.
        """
        if seq_idx is not None and seq_idx.shape != input_ids.shape:
            raise ValueError(
                f"seq_idx shape {tuple(seq_idx.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
        if seq_idx is not None and inference_cache is not None:
            raise ValueError(
                "inference_cache with seq_idx: a prefill continues one sequence; pass packed documents without a cache"
            )
        if self.tp is not None:
            check_sequence_length(input_ids.shape[1], self.tp.size, self.tp.sequence_parallel)
            if inference_cache is not None:
                self._check_recurrent_form()
        states = None if inference_cache is None else [None, *inference_cache, None]
        k = self.checkpoint_interval if self.training and inference_cache is None else 0
        *layers, head = layer_list(self)
        x = run_layers(layers, Stream.of(input_ids, seq_idx), k, states)
        logits = head(x)
        if labels is None:
            return logits
        return training_loss(logits, labels, self.config.vocab_size, self.tp, self.cp, x.aux_loss)

    def _check_recurrent_form(self) -> None:
        if self.tp is not None and self.tp.sequence_parallel:
            raise ValueError(
                "the recurrent form (inference_cache, step) is not sequence-parallel: "
                "build the model with tp.without_sequence_parallel() for generation"
            )

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> list:
        """Empty recurrent state for `step`, one per block: (conv_state, ssm_state) zeroed for a Mamba block,
        an empty key/value cache for an attention block, None for an MLP block."""
        return [layer.allocate_inference_cache(batch_size, dtype=dtype) for layer in self.backbone.layers]

    def step(self, input_ids: torch.Tensor, inference_cache: list) -> torch.Tensor:
        """One token per sequence: input_ids (batch,) -> logits (batch, padded_vocab_size); the cache
        advances in place."""
        self._check_recurrent_form()
        embedding, *blocks, norm_f, head = layer_list(self)
        x = embedding(Stream(input_ids)).hidden
        for block, state in zip(blocks, inference_cache):
            x = block.step(x, state)
        return head(norm_f(Stream(x)))


def run_layers(layers: Sequence[Callable], x: Stream, checkpoint_interval: int = 0, states: Optional[list] = None):
    """The model's loop: `layers` (the whole list, or a pipeline stage's slice of it) in order on `x`; the head's
    logits when the slice ends with it, else the last layer's Stream. With `checkpoint_interval` k > 0, each run of
    k consecutive layers is recomputed in the backward (torch's non-reentrant checkpoint, which also takes a run
    that starts at the token ids, where no input needs a gradient). `states` (a prefill): one inference state per
    layer, or None; a block with one fills it."""
    states = states or [None] * len(layers)
    k = checkpoint_interval or len(layers)
    for start in range(0, len(layers), k):
        run = range(start, min(start + k, len(layers)))
        if checkpoint_interval:
            x = torch.utils.checkpoint.checkpoint(_run_layers, layers, run, x, states, use_reentrant=False)
        else:
            x = _run_layers(layers, run, x, states)
    return x


def _run_layers(layers: Sequence[Callable], run: range, x: Stream, states: list):
    """Layers `run` of the list on `x`; a block with an inference state (a prefill) fills it."""
    for i in run:
        x = layers[i](x) if states[i] is None else layers[i](x, inference_state=states[i])
    return x
