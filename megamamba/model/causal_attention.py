"""Causal (and document-causal) attention through torch's fused attention, for queries at any offset.

Queries sit at global positions q_start .. q_start + lq - 1, keys and values at 0 .. lk - 1 (a context-
parallel rank's queries against the keys gathered from every rank). Query i sees key j when j <= its
position and, with document ids, when both belong to the same document.

- No documents: `scaled_dot_product_attention` with `is_causal` (queries from position 0) or a
  lower-right causal bias over the keys up to the last query; both run the flash / memory-efficient
  kernels on CUDA.
- Documents on CUDA: FlexAttention with a block mask built from the ids (compiled once per shape),
  so fully masked blocks are skipped and no seqlen x seqlen mask exists.
- Documents elsewhere: a boolean mask for `scaled_dot_product_attention` (CPU runs are short).
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                     q_start: int = 0, q_ids: Optional[torch.Tensor] = None,
                     k_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (batch, lq, heads, head_dim), k and v (batch, lk, kv_heads, head_dim) -> (batch, lq, heads, head_dim).

    kv_heads divides heads (grouped-query attention: query head i reads key head i // (heads / kv_heads)).
    q_ids (batch, lq) and k_ids (batch, lk): document ids of the queries and keys, or None for one document.
    """
    lq = q.shape[1]
    k, v = k[:, :q_start + lq], v[:, :q_start + lq]  # no query sees a later key
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, len, head_dim)
    gqa = q.shape[1] != k.shape[1]
    if q_ids is None:
        if q_start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, k.shape[2]), scale=scale,
                                                 enable_gqa=gqa)
    else:
        k_ids = k_ids[:, :q_start + lq]
        if q.is_cuda:
            mask = document_block_mask(q_ids, k_ids, q_start)
            out = _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(q_ids, k_ids, q_start)[:, None],
                                                 scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_start: int) -> torch.Tensor:
    """(batch, lq, lk) bool: key j is at or before query i and in its document."""
    q_pos = torch.arange(q_ids.shape[1], device=q_ids.device) + q_start
    k_pos = torch.arange(k_ids.shape[1], device=k_ids.device)
    return (k_pos[None, None, :] <= q_pos[None, :, None]) & (k_ids[:, None, :] == q_ids[:, :, None])


def document_block_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_start: int):
    """FlexAttention's block mask of `document_mask` (nothing materialised at full size)."""

    def same_document_and_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + q_start) & (k_ids[b, kv_idx] == q_ids[b, q_idx])

    return create_block_mask(same_document_and_causal, q_ids.shape[0], None, q_ids.shape[1], k_ids.shape[1],
                             device=q_ids.device)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)
