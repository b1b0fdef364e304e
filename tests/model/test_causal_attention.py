"""Causal attention for a context-parallel rank's queries (a slice at global offset q_start against the keys of
every earlier position), with and without packed documents, equals the float64 reference of the whole
sequence's rows; FlexAttention's block mask (the CUDA path, run eagerly here) equals the boolean mask the
CPU uses. A document is a run of equal ids: a change of id starts a new one, as the Mamba layers reset
their state there, so an id reused by a later document names another document.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megamamba.model.causal_attention import causal_attention, document_block_mask, document_mask
from megamamba.testing.numerics import relative_error

SEED = 4127
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 6, 2, 5  # grouped-query: 3 query heads per key/value head


def reference(q, k, v, q_start, ids):
    """float64 attention, position by position: query i (global q_start + i) reads keys from its document's
    first position (the last id change at or before it) to itself."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            pos = q_start + i
            first = pos
            while ids is not None and first > 0 and ids[b, first - 1] == ids[b, pos]:
                first -= 1
            if ids is None:
                first = 0
            for h in range(q.shape[2]):
                keys, values = k[b, first : pos + 1, h // group], v[b, first : pos + 1, h // group]
                weights = torch.softmax(keys @ q[b, i, h] / q.shape[-1] ** 0.5, dim=0)
                out[b, i, h] = weights @ values
    return out


def inputs(seqlen, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seqlen, HEADS, HEAD_DIM, generator=gen, dtype=dtype)
    k, v = (torch.randn(BATCH, seqlen, KV_HEADS, HEAD_DIM, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v


DOCUMENTS = torch.tensor(
    [[0] * 5 + [1] * 10 + [2] * 2 + [3] * 7, [5] * 6 + [2] * 6 + [5] * 12], dtype=torch.int32
)  # id 5 names two documents
SEQLEN = DOCUMENTS.shape[1]


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("q_start, lq", [(0, 24), (0, 12), (12, 12), (6, 6), (18, 6), (5, 7)])
def test_queries_at_an_offset_give_those_rows_of_the_whole_sequence(q_start, lq, documents):
    """A rank's queries against the gathered keys: keys after its last query are never read."""
    q, k, v = inputs(SEQLEN, SEED)
    ids = DOCUMENTS if documents else None
    out = causal_attention(q[:, q_start : q_start + lq], k, v, q_start=q_start, ids=ids)
    err = relative_error(out, reference(q[:, q_start : q_start + lq], k, v, q_start, ids))
    assert err <= 1e-6, f"seed {SEED}, q_start {q_start}, {lq} queries, documents {documents}: {err:.2e}"


def test_an_id_reused_by_a_later_document_is_another_document():
    """Row 1's positions 12.. (id 5) do not read positions 0..5 (id 5 too, before a document of id 2)."""
    q, k, v = inputs(SEQLEN, SEED + 1)
    out = causal_attention(q, k, v, ids=DOCUMENTS)
    alone = causal_attention(q[1:, 12:], k[1:, 12:], v[1:, 12:])
    assert relative_error(out[1:, 12:], alone) <= 1e-6


def test_the_mask_of_a_slice_marks_keys_from_its_documents_first_position_to_the_query():
    mask = document_mask(torch.tensor([[3, 3, 7, 7, 3, 3]], dtype=torch.int32), q_start=4)
    assert mask.tolist() == [[[False, False, False, False, True, False], [False, False, False, False, True, True]]]


FLEX_CASES = {  # name: (seqlen, q_start, documents' lengths): lengths that are no multiple of the 128-token blocks
    "one_block": (24, 12, [5, 10, 2, 7]),
    "several_blocks": (300, 200, [90, 150, 3, 57]),
    "documents_at_block_edges": (384, 128, [128, 1, 127, 128]),
    "full_tiles_off_the_block_grid": (700, 70, [600, 100]),  # query tiles from 70, 198, ..., 582 (a 118)
}


def _ids(lengths, batch=BATCH):
    row = torch.cat([torch.full((n,), d % 2, dtype=torch.int32) for d, n in enumerate(lengths)])  # ids 0, 1, 0, 1
    return torch.stack([row, row.flip(0)])[:batch]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_flex_attentions_block_mask_equals_the_boolean_mask_for_a_slice(name):
    """float64, grouped-query heads; forward only (FlexAttention has no CPU backward). Eager FlexAttention reads
    the mask function everywhere, tiles or not; the tiles are the next test's."""
    seqlen, q_start, lengths = FLEX_CASES[name]
    ids = _ids(lengths)
    q, k, v = (t.transpose(1, 2) for t in inputs(seqlen, SEED + 2, torch.float64))  # (batch, heads, len, head_dim)
    q = q[:, :, q_start:]
    boolean = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(ids, q_start)[:, None], enable_gqa=True
    )
    flex = flex_attention(q, k, v, block_mask=document_block_mask(ids, q_start), enable_gqa=True)
    err = relative_error(flex, boolean)
    assert err <= 1e-12, f"seed {SEED + 2}, {name}: {err:.2e}"


def test_the_block_mask_skips_blocks_no_query_of_the_slice_reads():
    """Queries 256..383 in documents that start at 256 read no key block before them."""
    ids = _ids([128, 128, 128], batch=1)
    mask = document_block_mask(ids, q_start=256)
    assert mask.kv_num_blocks.flatten().tolist() == [1]


@pytest.mark.parametrize("name", list(FLEX_CASES))
def test_the_block_mask_equals_the_one_flex_attention_builds_from_the_whole_boolean_mask(name):
    """Skipped, partial and full tiles, worked out from tile bounds, as torch finds them in the materialised mask."""
    seqlen, q_start, lengths = FLEX_CASES[name]
    ids = _ids(lengths)
    dense = document_mask(ids, q_start)
    ref = create_block_mask(lambda b, h, q, kv: dense[b, q, kv], BATCH, None, seqlen - q_start, seqlen, device="cpu")
    ours = document_block_mask(ids, q_start)
    for part in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, part), getattr(ref, part)), part
    assert ours.seq_lengths == ref.seq_lengths
