"""Attention layers under context parallelism, in a hybrid with Mamba and MLP layers: equal to the
single-process model, blind to other documents on any rank, and communicating one K/V all-gather forward
and one reduce-scatter backward.

One spawned run of 4 ranks holds every check: CP 4 over the world, CP 2 over the rank pairs, and CP 2 x
TP 2 (TP rank fastest, as the process grid lays it out). Each rank builds the single-process model from a
seed, perturbs its weights (no bias or norm weight is a no-op), loads them into the CP model, and compares
logits of its slice, the whole-sequence loss and every parameter gradient (summed over the CP group) in
float32 (`model_checks.context_parallel_errors`). Rotary embedding on 4 of 6 head channels at global
positions; grouped-query and multi-query heads. Documents cross rank edges, start exactly at them, and
reuse an id for a later document.

Communication of one attention block at CP C, batch b, sequence L, kv key/value heads of head_dim d,
float32 (an all-gather counts its output, a reduce-scatter its input):

    forward:  all-gather(K and V) = b x L x 2 kv d x 4 bytes; all-gather(ids) = b x L x 4 (documents only)
    backward: reduce-scatter(dK and dV) = b x L x 2 kv d x 4 bytes

The same at every rank; it grows with L (every rank holds the whole sequence's K and V).
"""

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba import MambaLM
from megamamba.model.layer_types.attention import AttentionBlock
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, comm_counter
from megamamba.parallel.context.context_parallel import ContextParallel, sequence_slice
from megamamba.testing.numerics import relative_error
from model_cases import hybrid_config, lm_inputs
from model_checks import (
    assert_equal_to_single_process,
    context_parallel_errors,
    perturb,
    recompute_blocks_in_backward,
)

pytestmark = pytest.mark.slow

SEED = 2203
BATCH, SEQLEN, D_MODEL, D_INTERMEDIATE = 2, 24, 16, 20  # slices of 12 (C = 2) and 6 (C = 4)
F32 = I32 = 4
PATTERN = "M*-M*-"  # every layer kind, two attention layers

MAMBA2 = {"layer": "Mamba2", "d_state": 4, "headdim": 4, "chunk_size": 4, "ngroups": 2}
GQA = {"num_heads": 4, "num_heads_kv": 2, "head_dim": 6, "rotary_emb_dim": 4, "causal": True}
MQA = {**GQA, "num_heads_kv": 1}  # under TP 2 its one key/value head is replicated
DOCUMENTS = [
    [0] * 5 + [1] * 10 + [2] * 2 + [3] * 7,  # changes at 5, 15, 17: documents cross the edges 6, 12, 18
    [5] * 6 + [2] * 6 + [5] * 12,
]  # changes exactly at the edges 6 and 12; id 5 names two documents

# name: (ssm_cfg, attn_cfg, packed documents); Mamba-1 under CP is test_context_parallel.py's, MQA's one
# key/value head is CP_TP_CASES'
CP_CASES = {
    "mamba2_gqa_documents": (MAMBA2, GQA, True),
    "mamba2_gqa": (MAMBA2, GQA, False),
}
# name: (attn_cfg, sequence parallel), Mamba-2 with packed documents at CP 2 x TP 2
CP_TP_CASES = {
    "gqa_kv_heads_split_sp": (GQA, True),
    "mqa_kv_head_replicated": (MQA, False),
}


def config(ssm, attn):
    return hybrid_config(PATTERN, ssm, attn, D_MODEL, D_INTERMEDIATE)


def errors(ssm, attn, documents, cp, tp=None, prepare=None):
    cfg = config(ssm, attn)
    inputs = lm_inputs(cfg, BATCH, SEQLEN, SEED + 1, DOCUMENTS if documents else None)
    return context_parallel_errors(cfg, inputs, cp, tp, SEED, prepare)


def isolation(cp):
    """For every document: this rank's logits of its positions, before and after every other token of its
    row changes, and after the first token of every document changes — {(row, document start): (error after
    the others changed, error after its own first token changed)}."""
    cfg = config(MAMBA2, GQA)
    torch.manual_seed(SEED)
    model = MambaLM(cfg, cp=cp)
    perturb(model, SEED + 2)
    ids, _, seq_idx = lm_inputs(cfg, BATCH, SEQLEN, SEED + 1, DOCUMENTS)
    gen = torch.Generator().manual_seed(SEED + 5)
    lo, hi = cp.rank * SEQLEN // cp.size, (cp.rank + 1) * SEQLEN // cp.size

    def logits(tokens):
        with torch.no_grad():
            return model(sequence_slice(tokens, cp), seq_idx=sequence_slice(seq_idx, cp))

    def changed(tokens, row, positions):
        tokens = tokens.clone()
        shift = 1 + torch.randint(0, cfg.vocab_size - 1, (len(positions),), generator=gen)
        tokens[row, positions] = (tokens[row, positions] + shift) % cfg.vocab_size
        return tokens

    documents = [
        (row, start, end) for row, ids_of_row in enumerate(DOCUMENTS) for start, end in _document_bounds(ids_of_row)
    ]
    first_tokens = ids
    for row, start, _ in documents:
        first_tokens = changed(first_tokens, row, [start])
    before, after_own = logits(ids), logits(first_tokens)
    out = {}
    for row, start, end in documents:
        after_others = logits(changed(ids, row, [i for i in range(SEQLEN) if not start <= i < end]))  # every rank
        local = [i - lo for i in range(max(start, lo), min(end, hi))]  # this rank's positions of the document
        if local:
            out[(row, start)] = (
                relative_error(after_others[row, local], before[row, local]),
                relative_error(after_own[row, local], before[row, local]),
            )
    return out


def _document_bounds(ids_of_row):
    """[(start, end)] of the documents (runs of equal ids) of one row."""
    starts = [0] + [i for i in range(1, len(ids_of_row)) if ids_of_row[i] != ids_of_row[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids_of_row)]))


def attention_block_comm(cp, seqlen, documents):
    """(forward, backward) collectives of one attention block on this rank's slice, as (kind, nbytes)."""
    torch.manual_seed(SEED)
    block = AttentionBlock(config(MAMBA2, GQA), cp=cp)
    gen = torch.Generator().manual_seed(SEED + 3)
    local = seqlen // cp.size
    stream, up = (torch.randn(BATCH, local, D_MODEL, generator=gen) for _ in range(2))
    stream.requires_grad_()
    seq_idx = None
    if documents:
        seq_idx = sequence_slice(
            torch.arange(seqlen, dtype=torch.int32).div(5, rounding_mode="floor").expand(BATCH, -1), cp
        )
    with comm_counter.capture() as fwd:
        out = block(Stream(stream, seq_idx)).hidden
    with comm_counter.capture() as bwd:
        (out * up).sum().backward()
    return [(r.kind, r.nbytes) for r in fwd], [(r.kind, r.nbytes) for r in bwd]


def four_rank_checks():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    world = ContextParallel(dist.group.WORLD, 4, rank)
    pair = ContextParallel(pairs[rank // 2], 2, rank % 2)
    out = {
        "cp4": {name: errors(*case, world) for name, case in CP_CASES.items()},
        "cp2": {name: errors(*case, pair) for name, case in CP_CASES.items()},
    }
    out["cp2_recomputed"] = errors(*CP_CASES["mamba2_gqa_documents"], pair, prepare=recompute_blocks_in_backward)
    cp = ContextParallel(strided[rank % 2], 2, rank // 2)
    out["cp2_tp2"] = {}
    for name, (attn, sp) in CP_TP_CASES.items():
        tp = TensorParallel(pairs[rank // 2], 2, rank % 2, sequence_parallel=sp)
        out["cp2_tp2"][name] = errors(MAMBA2, attn, True, cp, tp)
    out["isolation"] = isolation(world)
    out["comm"] = {
        (seqlen, documents): attention_block_comm(world, seqlen, documents)
        for seqlen in (SEQLEN, 2 * SEQLEN)
        for documents in (True, False)
    }
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(four_rank_checks, 4, timeout=600)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(CP_CASES))
def test_a_hybrid_under_context_parallelism_equals_the_single_process_model(four_ranks, name, size):
    assert_equal_to_single_process([r[f"cp{size}"][name] for r in four_ranks], f"seed {SEED}, CP {size}, {name}")


def test_blocks_recomputed_in_backward_gather_keys_again_and_equal_the_single_process_model(four_ranks):
    assert_equal_to_single_process([r["cp2_recomputed"] for r in four_ranks], f"seed {SEED}, CP 2, recomputed blocks")


@pytest.mark.parametrize("name", list(CP_TP_CASES))
def test_context_by_tensor_parallel_hybrid_equals_the_single_process_model(four_ranks, name):
    assert_equal_to_single_process([r["cp2_tp2"][name] for r in four_ranks], f"seed {SEED}, CP 2 x TP 2, {name}")


def test_no_token_reads_another_document_on_any_rank(four_ranks):
    """CP 4: every other token of the row changes (documents before, after, on other ranks, and the earlier
    document of a reused id): the document's logits on this rank stay; its own first token moves them."""
    for rank, r in enumerate(four_ranks):
        assert len(r["isolation"]) >= 2, f"rank {rank}"
        for (row, start), (unchanged, moved) in r["isolation"].items():
            where = f"seed {SEED}, rank {rank}, row {row}, document from {start}"
            assert unchanged <= 1e-6, f"{where}: moved by {unchanged:.2e} when other documents changed"
            assert moved > 1e-3, f"{where}: did not move when its own first token changed"


def _expected_comm(seqlen, documents):
    kv = BATCH * seqlen * 2 * GQA["num_heads_kv"] * GQA["head_dim"] * F32
    ids = [("all_gather", BATCH * seqlen * I32)] if documents else []
    return [("all_gather", kv)] + ids, [("reduce_scatter", kv)]


@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("seqlen", [SEQLEN, 2 * SEQLEN])
def test_an_attention_block_gathers_keys_and_values_once_and_reduce_scatters_their_gradient_once(
    four_ranks, seqlen, documents
):
    for rank, r in enumerate(four_ranks):
        assert r["comm"][(seqlen, documents)] == _expected_comm(seqlen, documents), f"rank {rank}"
