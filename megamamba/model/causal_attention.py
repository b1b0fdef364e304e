"""Causal, document-causal attention for queries at global positions q_start .. (a context-parallel slice)
against the keys from position 0, through torch's fused kernels: SDPA's causal paths without documents;
with documents FlexAttention's block mask on CUDA (no seqlen x seqlen mask), a boolean mask on the CPU.
A document is a run of equal ids, as the Mamba layers reset their state where the id changes.
torch.nn.attention's modules import TorchDynamo (about a second per process), so they are imported where
used: a Mamba-only run, and every rank and command-line tool that imports the package, never pays for them.
"""

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # FlexAttention's default block size, queries and keys


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    q_start: int = 0,
    ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q (batch, lq, heads, head_dim), k and v (batch, lk, kv_heads, head_dim) -> (batch, lq, heads, head_dim).

    kv_heads divides heads (grouped-query attention: query head i reads key head i // (heads / kv_heads)).
    ids (batch, >= q_start + lq): document ids of positions 0 .. (the queries' are ids[:, q_start:q_start + lq]),
    or None for one document.
    """
    lq = q.shape[1]
    k, v = k[:, : q_start + lq], v[:, : q_start + lq]  # no query sees a later key
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, len, head_dim)
    gqa = q.shape[1] != k.shape[1]
    if ids is None:
        if q_start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            from torch.nn.attention.bias import causal_lower_right

            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(lq, k.shape[2]), scale=scale, enable_gqa=gqa
            )
    else:
        ids = ids[:, : q_start + lq]
        if q.is_cuda:
            mask = document_block_mask(ids, q_start)
            out = _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=document_mask(ids, q_start)[:, None], scale=scale, enable_gqa=gqa
            )
    return out.transpose(1, 2)


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """(batch, len) ids -> (batch, len) int64: the first position of each position's document (the last
    id change at or before it)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
    changes = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    changes[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(changes, positions, 0).cummax(dim=1).values


def document_mask(ids: torch.Tensor, q_start: int) -> torch.Tensor:
    """ids (batch, lk) -> (batch, lk - q_start, lk) bool: the queries at q_start .. lk - 1 read the keys from
    their document's first position to their own."""
    first = document_starts(ids)[:, q_start:, None]
    k_pos = torch.arange(ids.shape[1], device=ids.device)
    q_pos = k_pos[q_start:, None]
    return (k_pos <= q_pos) & (k_pos >= first)


def document_block_mask(ids: torch.Tensor, q_start: int) -> "BlockMask":
    """FlexAttention's block mask of `document_mask`, from each TILE x TILE tile's bounds alone.

    Query q reads the keys [first(q), q], and first(q) never decreases with q, so the queries of a tile row
    together read one interval, [first of its first query, its last query]: a key tile outside it is skipped;
    one inside every query's interval (and not cut by the sequence's end) is full and needs no mask.
    Work and memory are (lq / TILE) x (lk / TILE) per row.
    """
    from torch.nn.attention.flex_attention import BlockMask

    lk = ids.shape[1]
    lq = lk - q_start
    first = document_starts(ids)[:, q_start:]  # (batch, lq)
    device = ids.device
    q_lo = torch.arange(0, lq, TILE, device=device)
    q_hi = (q_lo + TILE).clamp(max=lq) - 1
    k_lo = torch.arange(0, lk, TILE, device=device)
    k_hi = (k_lo + TILE).clamp(max=lk) - 1
    last_query, first_query = (q_hi + q_start)[:, None], (q_lo + q_start)[:, None]  # (query tiles, 1)
    reads_some = (k_lo <= last_query) & (k_hi >= first[:, q_lo, None])  # (batch, query tiles, key tiles)
    whole = (q_hi - q_lo + 1 == TILE)[:, None] & (k_hi - k_lo + 1 == TILE)
    reads_all = (k_lo >= first[:, q_hi, None]) & (k_hi <= first_query) & whole
    partial = reads_some & ~reads_all

    def same_document_and_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + q_start) & (kv_idx >= first[b, q_idx])

    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(reads_all),
        BLOCK_SIZE=TILE,
        mask_mod=same_document_and_causal,
        seq_lengths=(lq, lk),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, query tiles, key tiles) bool -> BlockMask's (count, key tile indices, those read first) per
    query tile, with a heads dimension of 1."""
    tiles = tiles[:, None].to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled once per process (recompiled per shape); uncompiled it materialises the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
