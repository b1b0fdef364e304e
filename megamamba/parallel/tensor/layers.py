"""Megatron-style tensor-parallel layers with explicit, counted communication.

Each layer receives its `TensorParallel` explicitly, initialises the FULL tensor the way the
matching torch module does and keeps its own slice (so the same seed gives the same full
weights at any TP size), and marks every parameter with how it is sharded (`sharding.py`).

With `tp.sequence_parallel`, activations outside these layers are split along the sequence:
ColumnParallelLinear all-gathers its input, RowParallelLinear and VocabParallelEmbedding
reduce-scatter their output. Without it they are replicated and the layers all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.parallel.tensor.collectives import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from megamamba.parallel.tensor.components import component_parameters, in_component_order
from megamamba.parallel.tensor.linear import parallel_linear
from megamamba.parallel.tensor.sharding import (
    Component,
    Shard,
    assemble_full,
    load_full_tensors,
    mark,
    tp_padded_vocab_size,
)
from megamamba.parallel.tensor.tensor_parallel import TensorParallel, divide


def _linear_init(out_features: int, in_features: int, bias: bool) -> dict[str, torch.Tensor]:
    """Full weight (and bias) drawn exactly as `nn.Linear(in_features, out_features)` draws them."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    full = {"weight": weight}
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        full["bias"] = torch.empty(out_features).uniform_(-bound, bound)
    return full


def _param(shape: Sequence[int], shard: Shard) -> nn.Parameter:
    return mark(nn.Parameter(torch.empty(*shape)), shard)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split across TP.

    Input: replicated, or with `tp.sequence_parallel` this rank's sequence shard (all-gathered
    here). Output: this rank's features (..., out_local) in component order, or all of them in
    the full order with `gather_output`.

    `components` describe a fused output such as Mamba-2's in_proj [z, x, B, C, dt]: each
    sharded component is split across ranks on its own, so every rank holds its slice of each
    and the full weight does not depend on the TP size. A component with `sharded=False` is
    computed in full on every rank from `weight_replicated` / `bias_replicated`, whose
    gradients are all-reduced over TP (its rank-specific uses add up). Default: one component.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        *,
        bias: bool = True,
        gather_output: bool = False,
        components: Sequence[Component] | None = None,
    ):
        super().__init__()
        components = tuple(components) if components is not None else (Component("out_features", out_features),)
        total = sum(c.size for c in components)
        if total != out_features:
            raise ValueError(
                f"components {[(c.name, c.size) for c in components]} sum to {total}, not out_features = {out_features}"
            )
        replicated = [c.name for c in components if not c.sharded]
        if gather_output and replicated:
            raise ValueError(
                f"gather_output=True with replicated components {replicated}: "
                "their output is already full on every rank and feeds rank-specific compute"
            )
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.gather_output, self.components = tp, gather_output, components
        self.weight, self.weight_replicated = component_parameters(
            (out_features, in_features), 0, components, tp, "weight"
        )
        self.bias = self.bias_replicated = None
        if bias:
            self.bias, self.bias_replicated = component_parameters((out_features,), 0, components, tp, "bias")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        load_full_tensors(self, _linear_init(self.out_features, self.in_features, self.bias is not None), self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = in_component_order(self.weight, self.weight_replicated, self.components, self.tp)
        bias = (
            None if self.bias is None else in_component_order(self.bias, self.bias_replicated, self.components, self.tp)
        )
        out = parallel_linear(x, weight, bias, self.tp)
        if not self.gather_output or self.tp.size == 1:
            return out
        gathered = gather_from_tp_region(out, self.tp)
        if len(self.components) == 1:
            return gathered
        return assemble_full(Shard("out", out.dim() - 1, self.components), gathered.chunk(self.tp.size, -1))

    def extra_repr(self) -> str:
        parts = ", ".join(f"{c.name}={c.size}{'' if c.sharded else ' (replicated)'}" for c in self.components)
        return f"in_features={self.in_features}, out=[{parts}], tp={self.tp.size}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split across TP.

    Input: this rank's feature slice (..., in_local). The partial products are summed over TP
    (all-reduce; with `tp.sequence_parallel`, reduce-scatter along the sequence) and the bias,
    replicated, is added after the sum. With sequence parallelism every rank sees other tokens,
    so the bias gradient is all-reduced over TP.

    Without sequence parallelism the output is replicated and meant for replicated compute; if
    it feeds rank-specific compute instead, pass it through `copy_to_tp_region`.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        shard = Shard("weight", 1, (Component("in_features", in_features),))
        self.weight = _param((out_features, divide(in_features, tp.size, "in_features")), shard)
        self.bias = _param((out_features,), Shard("bias", None, grad_reduced=tp.sequence_parallel)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        load_full_tensors(self, _linear_init(self.out_features, self.in_features, self.bias is not None), self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.tp.sequence_parallel:
            out = reduce_scatter_to_sequence_region(partial, self.tp)
            return out if self.bias is None else out + copy_to_tp_region(self.bias, self.tp)
        out = reduce_from_tp_region(partial, self.tp)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp.size}"


def _vocab_shard(num_embeddings: int, tp: TensorParallel) -> Shard:
    padding = tp_padded_vocab_size(num_embeddings, tp.size) - num_embeddings
    return Shard("weight", 0, (Component("vocab", num_embeddings),), pad=padding)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary rows split across TP.

    Rows are padded at build time to a multiple of the TP size (`tp_padded_vocab_size`); the
    padding is never looked up and never saved. Each rank looks up the ids it owns (others give
    zeros), then the ranks sum (all-reduce; with `tp.sequence_parallel`, reduce-scatter along
    the sequence, giving this rank's sequence shard). Input ids: (batch, seqlen), replicated.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        shard = _vocab_shard(num_embeddings, tp)
        self.rows_per_rank = shard.local_sizes(tp.size)[0]
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = _param((self.rows_per_rank, embedding_dim), shard)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Full weight drawn as nn.Embedding draws it (standard normal)."""
        load_full_tensors(self, {"weight": torch.randn(self.num_embeddings, self.embedding_dim)}, self.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_start + self.rows_per_rank)
        local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return reduce_scatter_to_sequence_region(partial, self.tp)
        return reduce_from_tp_region(partial, self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}, rows_per_rank={self.rows_per_rank}"


class VocabParallelHead(nn.Module):
    """An untied LM head, nn.Linear(embedding_dim, num_embeddings, bias=False), vocab-split.

    Returns this rank's logits (..., rows_per_rank) for `vocab_parallel_cross_entropy`; the
    padding columns (last rank) are masked there. A head tied to a `VocabParallelEmbedding`
    is `parallel_linear(hidden, embedding.weight, None, tp)`.
    """

    def __init__(self, embedding_dim: int, num_embeddings: int, tp: TensorParallel):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        shard = _vocab_shard(num_embeddings, tp)
        self.rows_per_rank = shard.local_sizes(tp.size)[0]
        self.weight = _param((self.rows_per_rank, embedding_dim), shard)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        load_full_tensors(self, _linear_init(self.num_embeddings, self.embedding_dim, bias=False), self.tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return parallel_linear(hidden, self.weight, None, self.tp)
