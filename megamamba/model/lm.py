"""The Mamba language model on one device: the layer list of `megamamba.model.layers`, run in order.

State-dict keys and initialisation are mamba_ssm's `MambaLMHeadModel`; each layer draws from its
own seeded stream, so a pipeline stage draws only its own. The same class runs tensor- and
context-parallel (`tp=`, `cp=`). Design: docs/code.md.
"""

from typing import Optional

import torch
from torch import nn

from megamamba.config import MambaConfig
from megamamba.model.chunked_cross_entropy import chunked_cross_entropy
from megamamba.model.layer_types.head import tie
from megamamba.model.layers import build_layer, check_layout, draw_seed, layer_count
from megamamba.model.stream import pack
from megamamba.parallel import TensorParallel, split, vocab_parallel_cross_entropy
from megamamba.parallel.context.context_parallel import ContextParallel, mean_over_context
from megamamba.parallel.tensor.model_layout import check_sequence_length


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not -100, on the real vocabulary (padded
    columns excluded). Under TP `logits` is this rank's vocab block and the full logits are never
    gathered (`vocab_parallel_cross_entropy`); every rank gets the loss. On one device the float32
    logits are never materialized whole (`chunked_cross_entropy`). Under CP `logits` and `labels`
    are this rank's slice and the mean is over the whole sequences (`mean_over_context`)."""
    if split(tp) is None:
        loss = chunked_cross_entropy(logits, labels, vocab_size)
    else:
        loss = vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=vocab_size)
    cp = split(cp)
    return loss if cp is None else mean_over_context(loss, labels, cp)


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
    """

    def __init__(
        self,
        config: MambaConfig,
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        config.validate()
        self.tp = split(tp)
        self.cp = split(cp)
        if self.tp is not None:
            check_layout(config, self.tp.size)
        self.config = config
        seed = draw_seed(device)
        embedding, *blocks, norm_f, head = [
            build_layer(config, i, seed, device, dtype, self.tp, self.cp) for i in range(layer_count(config))
        ]
        self.backbone = MambaBackbone(embedding, blocks, norm_f)
        self.lm_head = head
        if config.tie_embeddings:
            tie(self.lm_head, self.backbone.embedding)

    def forward(
        self, input_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None, inference_cache: Optional[list] = None
    ) -> torch.Tensor:
        """input_ids (batch, seqlen) -> logits (batch, seqlen, padded_vocab_size).

        seq_idx (batch, seqlen) int32 document ids: the state of every layer resets where the id
        changes, so packed documents do not see each other. inference_cache (from
        allocate_inference_cache): filled with the states after the last position, so `step`
        continues the sequence (prefill); not combined with seq_idx.

        Under CP: input_ids and seq_idx are this rank's slice (batch, seqlen / C), the ids of a document
        the same on every rank; the logits are the slice's. No inference_cache.

        Under TP: input_ids and seq_idx whole and the same on every rank; the logits are LOCAL,
        this rank's vocab block (batch, seqlen, rows) of the TP-padded vocab, rank r holding
        columns [r * rows, (r + 1) * rows). Use `loss`, or `lm_loss` / `vocab_parallel_cross_entropy`
        on them; `gather_from_tp_region(logits, tp)[..., :padded_vocab_size]` gives the full ones.
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
        embedding, *blocks, norm_f, head = layer_list(self)
        x = embedding(pack(input_ids, seq_idx))
        for i, block in enumerate(blocks):
            x = block(x, inference_state=None if inference_cache is None else inference_cache[i])
        return head(norm_f(x))

    def loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, seq_idx: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Mean cross-entropy of `labels` (batch, seqlen; -100 = ignored) under the logits of `input_ids`,
        over the real vocabulary; under TP computed on the vocab-parallel logits, never gathered."""
        return lm_loss(self(input_ids, seq_idx=seq_idx), labels, self.config.vocab_size, self.tp, self.cp)

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
        x = embedding(input_ids)
        for block, state in zip(blocks, inference_cache):
            x = block.step(x, state)
        return head(norm_f(x))
