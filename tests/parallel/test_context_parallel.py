"""Context parallelism (state passing) equals the single-process model, communicates as designed and
divides activation memory by the context-parallel size C.

Every rank builds the single-process model from a seed, perturbs its weights (so no bias, norm weight
or D is a no-op), loads them into the context-parallel model (and across TP, as full tensors), and
runs the whole sequence on it while the CP model runs this rank's slice. Logits (this rank's slice,
gathered over the vocab under TP), the loss (the mean over the whole sequences) and every parameter
gradient (summed over the CP group, as data-parallel reduction over dp x cp does) are compared in
float32. Packed documents cross rank edges (one of two tokens, shorter than the conv halo), change
exactly at rank edges, and reuse an id for a later document.

Communication per block (captured around one MambaBlock, CP alone, packed documents), with
ids = batch x (d_conv - 1) int32, halo = batch x conv channels x (d_conv - 1) float32 and
summaries = C x batch x (decay + final state) float32:

    forward:  send(ids), send(halo)  [every rank but the last]; all-gather(summaries)
    backward: reduce-scatter(summaries); send(halo gradient)  [every rank but the first]

None of it depends on the sequence length, asserted at two lengths.
"""

import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba import MambaLM
from megamamba.model.layer_types.mamba import MambaBlock
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, comm_counter
from megamamba.parallel.context.context_parallel import ContextParallel, sequence_slice
from model_cases import lm_config, lm_inputs
from model_checks import assert_equal_to_single_process, context_parallel_errors, recompute_blocks_in_backward
from saved_tensors import autograd_saved_bytes

pytestmark = pytest.mark.slow

SEED = 2031
BATCH, SEQLEN, D_MODEL = 2, 24, 16  # slices of 12 (C = 2) and 6 (C = 4): not multiples of the chunk 4
F32 = I32 = 4
D_CONV = 4

MAMBA1 = {"layer": "Mamba1", "d_state": 4, "dt_rank": 2}
MAMBA2 = {"layer": "Mamba2", "d_state": 4, "headdim": 4, "chunk_size": 4}  # d_inner 32: 8 heads
DOCUMENTS = [
    [0] * 5 + [1] * 10 + [2] * 2 + [3] * 7,  # changes at 5, 15, 17: documents cross every edge
    [5] * 6 + [2] * 6 + [5] * 12,
]  # changes exactly at the edges 6 and 12; id 5 reused

# name: (ssm_cfg, other config fields, packed documents)
CP_CASES = {
    "mamba1": (MAMBA1, {}, False),
    "mamba1_documents": ({**MAMBA1, "bias": True}, {"tie_embeddings": False}, True),
    "mamba2": ({**MAMBA2, "ngroups": 2}, {}, False),
    "mamba2_documents": ({**MAMBA2, "ngroups": 2}, {}, True),
    "mamba2_gate_in_scan_documents": ({**MAMBA2, "ngroups": 1, "rmsnorm": False, "D_has_hdim": True}, {}, True),
}
# name: (ssm_cfg, sequence parallel), all with packed documents, at CP 2 x TP 2
CP_TP_CASES = {
    "mamba2_ngroups_below_tp_sp": ({**MAMBA2, "ngroups": 1}, True),
    "mamba2_ngroups_above_tp": ({**MAMBA2, "ngroups": 4}, False),
    "mamba1_sp": (MAMBA1, True),
    "mamba1": ({**MAMBA1, "bias": True}, False),
}


def config(ssm, **fields):
    return lm_config(ssm, D_MODEL, **fields)


def compare(cfg, documents, cp, tp=None, recompute=False, masked_half=False):
    """Relative errors of the CP (x TP) model's logits, loss and gradients against the single-process model
    (masked_half: no token of the sequences' second half counted, as a masked prompt's)."""
    inputs = lm_inputs(cfg, BATCH, SEQLEN, SEED + 1, DOCUMENTS if documents else None)
    if masked_half:
        inputs[1][:, SEQLEN // 2 :] = -100
    return context_parallel_errors(cfg, inputs, cp, tp, SEED, recompute_blocks_in_backward if recompute else None)


def block_comm(cp, ssm, seqlen):
    """(forward, backward) collectives of one MambaBlock on this rank's slice, as (kind, nbytes) in issue order."""
    torch.manual_seed(SEED)
    block = MambaBlock(config(ssm), cp=cp)
    gen = torch.Generator().manual_seed(SEED + 3)
    local = seqlen // cp.size
    hidden, residual, up_h = (torch.randn(BATCH, local, D_MODEL, generator=gen) for _ in range(3))
    hidden.requires_grad_()
    documents_of_5 = torch.arange(seqlen, dtype=torch.int32).div(5, rounding_mode="floor").expand(BATCH, -1)
    seq_idx = sequence_slice(documents_of_5, cp)
    with comm_counter.capture() as fwd:
        out = block(Stream(hidden + residual, seq_idx)).hidden  # the stream of the pair (hidden, residual)
    with comm_counter.capture() as bwd:
        (out * up_h).sum().backward()
    return [(r.kind, r.nbytes) for r in fwd], [(r.kind, r.nbytes) for r in bwd]


MEMORY_SEQLEN = 8192
MEMORY_CASES = {
    "mamba1": {"layer": "Mamba1", "d_state": 4, "dt_rank": 2},
    "mamba2": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 64},
}


def saved_bytes(name, cp):
    """Bytes autograd saves for backward in one forward of the loss on this rank's slice, parameters excluded."""
    cfg = lm_config(MEMORY_CASES[name], 8, n_layer=1)
    torch.manual_seed(SEED)
    model = MambaLM(cfg, cp=cp)
    gen = torch.Generator().manual_seed(SEED + 4)
    ids = sequence_slice(torch.randint(0, cfg.vocab_size, (1, MEMORY_SEQLEN), generator=gen), cp)
    return autograd_saved_bytes(model, lambda: model(ids, ids))


def prefill_refusal(cp, ssm):
    """The error a context-parallel model raises when asked to fill an inference cache (prefill), or None."""
    model = MambaLM(config(ssm, n_layer=1), cp=cp)
    ids = torch.zeros(BATCH, SEQLEN // cp.size, dtype=torch.long)
    try:
        model(ids, inference_cache=model.allocate_inference_cache(BATCH))
    except ValueError as e:
        return str(e)
    return None


def _world(size):
    return ContextParallel(dist.group.WORLD, size, dist.get_rank())


def two_rank_checks():
    cp = _world(2)
    out = {"model": {name: compare(config(ssm, **fields), docs, cp) for name, (ssm, fields, docs) in CP_CASES.items()}}
    out["recompute"] = {
        name: compare(config(ssm, **fields), docs, cp, recompute=True)
        for name, (ssm, fields, docs) in CP_CASES.items()
        if docs
    }
    out["comm"] = {
        (mixer, seqlen): block_comm(cp, ssm, seqlen)
        for mixer, ssm in (("mamba1", MAMBA1), ("mamba2", {**MAMBA2, "ngroups": 2}))
        for seqlen in (SEQLEN, 2 * SEQLEN)
    }
    out["memory"] = {name: saved_bytes(name, cp) for name in MEMORY_CASES}
    out["prefill"] = {mixer: prefill_refusal(cp, ssm) for mixer, ssm in (("mamba1", MAMBA1), ("mamba2", MAMBA2))}
    if cp.rank == 0:
        out["memory_one_rank"] = {name: saved_bytes(name, ContextParallel()) for name in MEMORY_CASES}
    return out


def four_rank_checks():
    rank = dist.get_rank()
    out = {
        "model": {
            name: compare(config(ssm, **fields), docs, _world(4)) for name, (ssm, fields, docs) in CP_CASES.items()
        }
    }
    out["memory"] = {name: saved_bytes(name, _world(4)) for name in MEMORY_CASES}
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # TP rank fastest, as the process grid lays it out
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp = ContextParallel(cp_groups[rank % 2], 2, rank // 2)
    out["cp_tp"] = {}
    for name, (ssm, sp) in CP_TP_CASES.items():
        tp = TensorParallel(tp_groups[rank // 2], 2, rank % 2, sequence_parallel=sp)
        out["cp_tp"][name] = compare(config(ssm), True, cp, tp)
    return out


def masked_slice_checks():
    """CP 2 where rank 1's slice counts no token: its local mean is 0 / 0."""
    return compare(config({**MAMBA2, "ngroups": 2}), True, _world(2), masked_half=True)


TRITON_CASES = {"mamba1": MAMBA1, "mamba2": {**MAMBA2, "ngroups": 2}}


def triton_checks(mixer):
    os.environ["MEGAMAMBA_KERNELS"] = "triton"  # read per call; TRITON_INTERPRET comes from tests/conftest.py
    return compare(config(TRITON_CASES[mixer], n_layer=1), True, _world(2))


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(two_rank_checks, 2, timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(four_rank_checks, 4, timeout=600)


@pytest.mark.parametrize("name", list(CP_CASES))
def test_two_ranks_equal_the_single_process_model(two_ranks, name):
    assert_equal_to_single_process([r["model"][name] for r in two_ranks], f"seed {SEED}, CP 2, {name}")


@pytest.mark.parametrize("name", [name for name, case in CP_CASES.items() if case[2]])
def test_blocks_recomputed_in_backward_equal_the_single_process_model(two_ranks, name):
    """Activation checkpointing re-runs the halo exchange and the summary gather inside the backward."""
    assert_equal_to_single_process([r["recompute"][name] for r in two_ranks], f"seed {SEED}, CP 2, recomputed, {name}")


@pytest.mark.parametrize("name", list(CP_CASES))
def test_four_ranks_equal_the_single_process_model(four_ranks, name):
    assert_equal_to_single_process([r["model"][name] for r in four_ranks], f"seed {SEED}, CP 4, {name}")


def test_a_slice_without_counted_tokens_gives_the_single_process_loss_not_nan():
    assert_equal_to_single_process(run_ranks(masked_slice_checks, 2, timeout=600), f"seed {SEED}, CP 2, masked slice")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("mixer", list(TRITON_CASES))
def test_triton_kernels_states_give_the_single_process_model_too(mixer):
    """The Triton kernels' zero-start final states, initial states and their gradients (the GPU path)."""
    results = run_ranks(triton_checks, 2, args=(mixer,), timeout=600)
    assert_equal_to_single_process(results, f"seed {SEED}, CP 2, Triton, {mixer}")


@pytest.mark.parametrize("name", list(CP_TP_CASES))
def test_context_by_tensor_parallel_equals_the_single_process_model(four_ranks, name):
    assert_equal_to_single_process([r["cp_tp"][name] for r in four_ranks], f"seed {SEED}, CP 2 x TP 2, {name}")


def _expected_comm(mixer, rank, size):
    conv = 2 * D_MODEL if mixer == "mamba1" else 2 * D_MODEL + 2 * 2 * MAMBA2["d_state"]  # d_inner (+ B, C)
    if mixer == "mamba1":
        summary = 2 * 2 * D_MODEL * MAMBA1["d_state"]  # decay and state per (channel, state)
    else:
        heads = 2 * D_MODEL // MAMBA2["headdim"]
        summary = heads + heads * MAMBA2["headdim"] * MAMBA2["d_state"]  # decay per head, state
    summaries = size * BATCH * summary * F32
    halo = BATCH * conv * (D_CONV - 1) * F32
    sends = [("send", BATCH * (D_CONV - 1) * I32), ("send", halo)] if rank < size - 1 else []
    return sends + [("all_gather", summaries)], [("reduce_scatter", summaries)] + ([("send", halo)] if rank else [])


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_each_block_communicates_a_halo_and_one_summary_gather_each_way(two_ranks, mixer):
    for rank, r in enumerate(two_ranks):
        assert r["comm"][(mixer, SEQLEN)] == _expected_comm(mixer, rank, 2), f"rank {rank}"


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_communication_does_not_grow_with_the_sequence(two_ranks, mixer):
    for rank, r in enumerate(two_ranks):
        assert r["comm"][(mixer, 2 * SEQLEN)] == r["comm"][(mixer, SEQLEN)], f"rank {rank}"


@pytest.mark.parametrize("mixer", ["mamba1", "mamba2"])
def test_a_prefill_is_refused_naming_the_recurrent_form(two_ranks, mixer):
    for rank, r in enumerate(two_ranks):
        message = r["prefill"][mixer] or "no error"
        assert "the recurrent form (prefill, step) needs the whole sequence" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("name", list(MEMORY_CASES))
def test_activation_memory_per_rank_falls_as_one_over_c(two_ranks, four_ranks, name):
    whole = two_ranks[0]["memory_one_rank"][name]
    for size, results in ((2, two_ranks), (4, four_ranks)):
        for rank, r in enumerate(results):
            ratio = r["memory"][name] / (whole / size)
            assert 0.9 <= ratio <= 1.1, (
                f"{name}, C = {size}, rank {rank}: {r['memory'][name]} bytes vs {whole} at C = 1"
            )
