"""Mamba-3 under tensor, sequence and context parallelism equals the single-device model.

As tests/parallel/test_tp_model.py and test_context_parallel.py: every rank builds the single-device model
from a seed, perturbs its weights (no bias, norm weight, D or MIMO projection is a no-op) and loads them as
full tensors into the parallel model; logits, loss and every parameter gradient (gathered to full shapes,
summed over the CP group) are compared in float32. One spawned run of 4 ranks computes every case: TP 2 on
rank pairs (SISO and MIMO; ngroups 1, whose B/C are replicated, and ngroups 2, split; with and without
sequence parallelism), CP 2 on rank pairs and CP 4 on all, with packed documents crossing every rank edge,
changing exactly at edges and reusing an id; and CP 2 x TP 2.

Tensor parallelism splits the heads (z, x, dd_dt, dd_A, trap columns; dt_bias, D, B_bias, C_bias, mimo_*,
the output norm; out_proj's columns), replicates the angle columns and the B/C norms (gradients summed over
TP). Context parallelism carries the SSM state, the angle and the previous token across rank edges.
"""

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba import MambaLM
from megamamba.checkpoint import Checkpoint, load_model_tensors, model_tensors, save_checkpoint
from megamamba.parallel import TensorParallel, full_tensors
from megamamba.parallel.context.context_parallel import ContextParallel
from model_cases import lm_config, lm_inputs
from model_checks import assert_equal_to_single_process, context_parallel_errors, perturb, tensor_parallel_errors

pytestmark = pytest.mark.slow

SEED = 2037
BATCH, SEQLEN, D_MODEL = 2, 24, 16  # slices of 12 (C = 2) and 6 (C = 4): not multiples of the chunk 4

# d_inner 32: 4 heads, 2 angles; Δ of 0.3 .. 1 (not 0.001 .. 0.1) turns the angles by about a radian per token
SISO = {"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4, "dt_min": 0.3, "dt_max": 1.0}
MIMO = {**SISO, "is_mimo": True, "mimo_rank": 2, "rope_fraction": 1.0}  # 4 angles
DOCUMENTS = [
    [0] * 5 + [1] * 10 + [2] * 2 + [3] * 7,  # changes at 5, 15, 17: documents cross every edge
    [5] * 6 + [2] * 6 + [5] * 12,
]  # changes exactly at the edges 6 and 12; id 5 reused

# name: (ssm_cfg, sequence parallel, packed documents), at TP 2
TP_CASES = {
    "siso_one_group": (SISO, False, True),
    "siso_one_group_sp": ({**SISO, "is_outproj_norm": True}, True, True),
    "siso_two_groups": ({**SISO, "ngroups": 2}, False, False),
    "mimo_one_group": ({**MIMO, "is_outproj_norm": True}, False, True),
    "mimo_two_groups_sp": ({**MIMO, "ngroups": 2}, True, True),
}
# name: (ssm_cfg, packed documents), at CP 2 and CP 4
CP_CASES = {
    "siso": (SISO, False),
    "siso_documents": ({**SISO, "is_outproj_norm": True}, True),
    "mimo_documents": ({**MIMO, "ngroups": 2, "a_activation": "softplus"}, True),
}
# name: (ssm_cfg, sequence parallel), with packed documents, at CP 2 x TP 2
CP_TP_CASES = {
    "siso_one_group_sp": (SISO, True),
    "mimo_two_groups": ({**MIMO, "ngroups": 2}, False),
}


def config(ssm):
    return lm_config(ssm, D_MODEL)


def inputs(cfg, documents):
    return lm_inputs(cfg, BATCH, SEQLEN, SEED + 1, DOCUMENTS if documents else None)


def angles_at_edges(cfg, documents, edges) -> float:
    """The mean |angle| (its distance from 0 mod 2π) the single-device model's first mixer carries across the
    rank `edges` (rows whose document crosses them): the context-parallel cases carry large angles."""
    torch.manual_seed(SEED)
    model = MambaLM(cfg)
    perturb(model, SEED + 2)
    seen = {}
    mixer = model.backbone.layers[0].mixer
    hook = mixer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    ids, _, seq_idx = inputs(cfg, documents)
    with torch.no_grad():
        model(ids, seq_idx=seq_idx)
        _, _, scan_inputs = mixer._project(seen["args"][0], seq_idx)
    hook.remove()
    crossing = [
        (row, e) for row in range(BATCH) for e in edges if seq_idx is None or seq_idx[row, e - 1] == seq_idx[row, e]
    ]
    angle = torch.stack([scan_inputs.angle[row, e - 1] for row, e in crossing])
    return torch.minimum(angle, 2 * math.pi - angle).mean().item()


def checkpoint_round_trip(cfg, tp, save_dir) -> bool:
    """A checkpoint saved from the TP model (its full tensors) loads into the single-device model strictly and
    holds the TP model's weights."""
    torch.manual_seed(SEED)
    model = MambaLM(cfg, tp=tp)
    perturb(model, SEED + 5)  # the same draw on every rank: replicated parameters stay equal
    full = model_tensors(model, tp)
    if tp.rank == 0:
        save_checkpoint(save_dir, 1, cfg, full)
    dist.barrier(group=tp.group)
    plain = MambaLM(cfg)
    load_model_tensors(plain, Checkpoint(f"{save_dir}/step_000001").model_tensors())
    back = MambaLM(cfg, tp=tp)
    load_model_tensors(back, {k: v for k, v in plain.state_dict().items()}, tp)
    back_full, plain_state = full_tensors(back, tp), plain.state_dict()
    return all(torch.equal(back_full[k], v) and torch.equal(plain_state[k], v) for k, v in full.items())


def four_rank_checks(save_root):
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # TP rank fastest, as the process grid lays it out
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group = TensorParallel(pairs[rank // 2], 2, rank % 2)
    out = {"tp": {}}
    for name, (ssm, sp, documents) in TP_CASES.items():
        tp = TensorParallel(tp_group.group, 2, tp_group.rank, sequence_parallel=sp)
        cfg = config(ssm)
        out["tp"][name] = tensor_parallel_errors(cfg, inputs(cfg, documents), tp, SEED, steps=4 if not sp else 0)
    out["checkpoint"] = checkpoint_round_trip(config(MIMO), tp_group, f"{save_root}/pair{rank // 2}")
    cp2, cp4 = ContextParallel(strided[rank % 2], 2, rank // 2), ContextParallel(dist.group.WORLD, 4, rank)
    for label, cp in (("cp2", cp2), ("cp4", cp4)):
        out[label] = {
            name: context_parallel_errors(config(ssm), inputs(config(ssm), documents), cp, seed=SEED)
            for name, (ssm, documents) in CP_CASES.items()
        }
    out["cp_tp"] = {}
    for name, (ssm, sp) in CP_TP_CASES.items():
        tp = TensorParallel(tp_group.group, 2, tp_group.rank, sequence_parallel=sp)
        out["cp_tp"][name] = context_parallel_errors(config(ssm), inputs(config(ssm), True), cp2, tp, SEED)
    if rank == 0:
        out["edge_angles"] = {
            name: angles_at_edges(config(ssm), documents, (6, 12, 18)) for name, (ssm, documents) in CP_CASES.items()
        }
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_ranks(four_rank_checks, 4, args=(str(tmp_path_factory.mktemp("mamba3_tp")),), timeout=600)


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_logits_loss_and_every_gradient_equal_the_single_device_model(four_ranks, name):
    assert_equal_to_single_process([r["tp"][name] for r in four_ranks], f"seed {SEED}, TP 2, {name}")
    assert all(r["tp"][name]["init_equal"] for r in four_ranks), "the same seed must build the same weights"


@pytest.mark.parametrize("name", [n for n, case in TP_CASES.items() if not case[1]])
def test_tp2_recurrent_steps_equal_the_single_device_steps(four_ranks, name):
    err = max(r["tp"][name]["step"] for r in four_ranks)
    assert err <= 1e-5, f"seed {SEED}, TP 2, {name}: {err:.2e}"


def test_a_checkpoint_saved_at_tp2_loads_at_tp1_and_back(four_ranks):
    assert all(r["checkpoint"] for r in four_ranks)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_equals_the_single_process_model(four_ranks, name, size):
    assert_equal_to_single_process([r[f"cp{size}"][name] for r in four_ranks], f"seed {SEED}, CP {size}, {name}")


@pytest.mark.parametrize("name", list(CP_CASES))
def test_the_angles_carried_across_rank_edges_are_not_zero(four_ranks, name):
    assert four_ranks[0]["edge_angles"][name] > 0.5


@pytest.mark.parametrize("name", list(CP_TP_CASES))
def test_context_by_tensor_parallel_equals_the_single_process_model(four_ranks, name):
    assert_equal_to_single_process([r["cp_tp"][name] for r in four_ranks], f"seed {SEED}, CP 2 x TP 2, {name}")
