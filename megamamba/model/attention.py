"""Causal self-attention as mamba_ssm's `MHA` (MHA, GQA, MQA, optional rotary), with its keys, so its hybrid
checkpoints load unchanged; query heads split over TP with their key/value heads (replicated when fewer
than the ranks), keys and values gathered over CP; a growing key/value cache for generation.
"""

from typing import Optional

import torch
from torch import nn

from megamamba.config import AttentionOptions
from megamamba.model.causal_attention import causal_attention
from megamamba.model.rotary import rotate
from megamamba.parallel import ColumnParallelLinear, Component, RowParallelLinear, TensorParallel, split
from megamamba.parallel.context.attention import gather_ids, gather_keys_values
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.tensor.from_full import sharded
from megamamba.parallel.tensor.model_layout import check_attention_layout


class KVCache:
    """One attention layer's keys and values so far, (batch, length, kv_heads, head_dim) each; the storage
    doubles when full, so a step appends in place."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, device=None, dtype=None, capacity: int = 64):
        self.keys = torch.zeros(batch_size, capacity, kv_heads, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k, v (batch, new, kv_heads, head_dim) after the cached positions; returns every key and value."""
        end = self.length + k.shape[1]
        if end > self.keys.shape[1]:
            grown = max(end, 2 * self.keys.shape[1])
            self.keys, self.values = (
                torch.cat([t, t.new_zeros(t.shape[0], grown - t.shape[1], *t.shape[2:])], 1)
                for t in (self.keys, self.values)
            )
        self.keys[:, self.length : end] = k
        self.values[:, self.length : end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def restart(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold only k, v (batch, seqlen, kv_heads, head_dim): a prefill starts a new sequence, as it
        overwrites the Mamba layers' states."""
        self.length = 0
        self.append(k, v)


class Attention(nn.Module):
    """Causal self-attention mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""

    def __init__(
        self,
        d_model: int,
        options: AttentionOptions,
        device=None,
        dtype=None,
        tp: Optional[TensorParallel] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.num_heads, self.kv_heads = options.num_heads, options.kv_heads
        self.head_dim = options.head_dim_for(d_model)
        self.softmax_scale = options.softmax_scale
        self.rotary = (options.rotary_emb_dim, options.rotary_emb_base, options.rotary_emb_interleaved)
        qkv_rows = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        self.in_proj = nn.Linear(d_model, qkv_rows, bias=options.qkv_proj_bias, **factory)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, d_model, bias=options.out_proj_bias, **factory)
        self.cp = split(cp)
        self.own_kv_head = None  # with key/value heads replicated over TP: the one this rank's queries read
        if tp is not None and tp.size > 1:
            self._shard(tp, options)

    def _shard(self, tp: TensorParallel, options: AttentionOptions) -> None:
        """Keep this rank's query heads and the key/value heads they read: split with them when num_heads_kv
        % TP == 0, else all on every rank, of which this rank reads `own_kv_head`."""
        check_attention_layout(options, tp.size)
        kv_split = self.kv_heads % tp.size == 0
        q_rows, kv_rows = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        components = [
            Component("q", q_rows),
            Component("k", kv_rows, sharded=kv_split),
            Component("v", kv_rows, sharded=kv_split),
        ]
        self.in_proj = sharded(
            self.in_proj,
            lambda: ColumnParallelLinear(
                self.d_model, self.in_proj.out_features, tp, bias=self.in_proj.bias is not None, components=components
            ),
            tp,
        )
        self.out_proj = sharded(
            self.out_proj, lambda: RowParallelLinear(q_rows, self.d_model, tp, bias=self.out_proj.bias is not None), tp
        )
        if not kv_split:
            self.own_kv_head = tp.rank // (tp.size // self.kv_heads)
        self.num_heads //= tp.size
        self.kv_heads = self.kv_heads // tp.size if kv_split else 1

    @property
    def output_projection(self) -> nn.Module:
        """The projection back onto the residual stream (initialised scaled by depth, as mamba_ssm)."""
        return self.out_proj

    def _qkv(self, hidden_states: torch.Tensor, start: Optional[int] = None) -> tuple:
        """q (batch, seqlen, heads, head_dim), k and v (batch, seqlen, kv_heads, head_dim), rotated for the
        positions from `start` (None: this rank's slice's, 0 without context parallelism)."""
        qkv = self.in_proj(hidden_states)  # under sequence parallelism: the whole (slice of the) sequence
        seqlen = qkv.shape[1]
        kv_rows = (qkv.shape[-1] - self.num_heads * self.head_dim) // 2
        q, k, v = (
            t.unflatten(-1, (-1, self.head_dim))
            for t in qkv.split([self.num_heads * self.head_dim, kv_rows, kv_rows], dim=-1)
        )
        if self.own_kv_head is not None:
            own = slice(self.own_kv_head, self.own_kv_head + 1)
            k, v = k[..., own, :], v[..., own, :]
        if start is None:
            start = 0 if self.cp is None else self.cp.rank * seqlen
        positions = torch.arange(start, start + seqlen, device=qkv.device)
        return rotate(q, positions, *self.rotary), rotate(k, positions, *self.rotary), v

    # ---- parallel form -------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        seq_idx: Optional[torch.Tensor] = None,
        inference_state: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """hidden_states (batch, seqlen, d_model); seq_idx (batch, seqlen) int32 document ids: no token
        attends to another document. With `inference_state` (a prefill) the keys and values are cached."""
        if self.cp is not None and inference_state is not None:
            raise ValueError(
                "inference_state with context parallelism: the recurrent form (prefill, step) needs "
                "the whole sequence on one rank; build the model without a context-parallel group"
            )
        q, k, v = self._qkv(hidden_states)
        if inference_state is not None:
            inference_state.restart(k, v)
        start, ids = 0, seq_idx
        if self.cp is not None:
            start = self.cp.rank * q.shape[1]
            k, v = gather_keys_values(k, v, self.cp)
            ids = None if seq_idx is None else gather_ids(seq_idx, self.cp)
        context = causal_attention(q, k, v, self.softmax_scale, q_start=start, ids=ids)
        return self.out_proj(context.flatten(-2))

    # ---- recurrent form (generation) -------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, dtype=None) -> KVCache:
        """An empty key/value cache for `step`."""
        weight = self.out_proj.weight
        return KVCache(
            batch_size,
            self.kv_heads,
            self.head_dim,
            device=weight.device,
            dtype=weight.dtype if dtype is None else dtype,
        )

    def step(self, hidden_states: torch.Tensor, inference_state: KVCache) -> torch.Tensor:
        """One token: hidden_states (batch, d_model) -> (batch, d_model); the cache grows by one position."""
        q, k, v = self._qkv(hidden_states[:, None], inference_state.length)
        k, v = (t.to(q.dtype) for t in inference_state.append(k, v))  # a cache in the weights' dtype, under autocast
        context = causal_attention(q, k, v, self.softmax_scale, q_start=inference_state.length - 1)
        return self.out_proj(context.flatten(-2))[:, 0]
