"""Tensor/sequence-parallel hybrids equal the single-device model, and attention and MLP blocks communicate
as Megatron's do.

As tests/parallel/test_tp_model.py: every rank builds the single-device model and the TP model from the same
seed (they must start equal), perturbs the single-device weights and loads them into the TP model; logits
(gathered over the vocab), loss and every parameter gradient (gathered to full shapes) are compared in
float32. One spawned run of 4 ranks computes every case at TP 4 and at TP 2; the tests read it.

Key/value heads: ATTN_GQA's 2 are split at TP 2 and replicated at TP 4, ATTN_MHA's 4 split at both, ATTN_MQA's
1 replicated at both. Communication per block (one forward, one backward, around a single block), with
act = batch x seqlen x d_model float32 bytes:

    attention or MLP, no SP:  forward all-reduce(act)                      backward all-reduce(act)
    attention or MLP, SP:     forward all-gather(act), reduce-scatter(act)
                              backward all-gather(act), reduce-scatter(act), all-reduce(norm weight)

plus, backward, one all-reduce per replicated key/value parameter (in_proj weight and bias rows of k and v;
`Component(sharded=False)`) and, with SP, one of out_proj's bias (added to every rank's tokens after the
reduce-scatter). A Mamba block with an MLP inside (d_intermediate) communicates as the two in sequence.
"""

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megamamba.model.layer_types import layer_type
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, comm_counter
from model_cases import lm_config, lm_inputs
from model_checks import assert_equal_to_single_process, tensor_parallel_errors

pytestmark = pytest.mark.slow

SEED = 2025
BATCH, SEQLEN = 2, 12
D_MODEL = 32
F32 = 4
DOCUMENTS = [[0] * 5 + [1] * 7, [0] * 9 + [1] * 3]

MAMBA1 = {"layer": "Mamba1", "d_state": 5, "dt_rank": 3}
MAMBA2 = {"layer": "Mamba2", "d_state": 6, "headdim": 8, "ngroups": 4, "chunk_size": 8}  # d_inner 64: 8 heads
ATTN_GQA = {"num_heads": 8, "num_heads_kv": 2, "head_dim": 6, "rotary_emb_dim": 4, "causal": True}
ATTN_MHA = {"num_heads": 4, "head_dim": 10, "qkv_proj_bias": False, "softmax_scale": 0.3, "causal": True}
ATTN_MQA = {
    "num_heads": 4,
    "num_heads_kv": 1,
    "rotary_emb_dim": 8,
    "rotary_emb_interleaved": True,
    "out_proj_bias": False,
    "causal": True,
}  # head_dim 32 / 4 = 8

GQA_PATTERN = {
    "ssm_cfg": MAMBA2,
    "n_layer": 3,
    "hybrid_layer_pattern": "M*-",
    "attn_cfg": ATTN_GQA,
    "d_intermediate": 24,
}
MQA_PATTERN = {
    "ssm_cfg": MAMBA2,
    "n_layer": 3,
    "hybrid_layer_pattern": "*M-",
    "attn_cfg": ATTN_MQA,
    "d_intermediate": 20,
    "mlp_activation": "squared_relu",
    "tie_embeddings": False,
}
MOE_PATTERN = {
    "ssm_cfg": MAMBA2,
    "n_layer": 3,
    "hybrid_layer_pattern": "ME*",
    "attn_cfg": ATTN_GQA,
    "moe_cfg": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 12, "shared_expert_ffn_hidden_size": 8},
}  # the experts and the router whole on every rank
BLOCK_MLPS = {
    "ssm_cfg": MAMBA1,
    "n_layer": 2,
    "attn_layer_idx": [1],
    "attn_cfg": ATTN_MHA,
    "d_intermediate": 40,
    "rms_norm": False,
}  # gated MLP of 128 channels inside both blocks

# name: (config fields, sequence parallel, packed documents, also check `step`)
CASES = {
    "gqa_gated_mlp": (GQA_PATTERN, False, True, True),
    "gqa_gated_mlp_sp": (GQA_PATTERN, True, True, False),
    "mqa_squared_relu": (MQA_PATTERN, False, False, True),
    "mqa_squared_relu_sp": (MQA_PATTERN, True, True, False),
    "mlp_inside_blocks": (BLOCK_MLPS, False, True, True),
    "mlp_inside_blocks_sp": (BLOCK_MLPS, True, False, False),
    "moe": (MOE_PATTERN, False, True, True),
    "moe_sp": (MOE_PATTERN, True, True, False),
}
# name: (config fields, block kind)
BLOCK_CASES = {
    "attention_gqa": (GQA_PATTERN, "attention"),
    "attention_mqa": (MQA_PATTERN, "attention"),
    "mlp_gated": (GQA_PATTERN, "mlp"),
    "mlp_squared_relu": (MQA_PATTERN, "mlp"),
    "mamba_with_mlp_inside": ({**BLOCK_MLPS, "ssm_cfg": MAMBA2, "rms_norm": True}, "mamba"),
}


def config(fields):
    fields = dict(fields)
    return lm_config(fields.pop("ssm_cfg"), D_MODEL, **fields)


def check_model(tp_base, name):
    fields, sp, packed, step = CASES[name]
    cfg = config(fields)
    tp = TensorParallel(tp_base.group, tp_base.size, tp_base.rank, sequence_parallel=sp)
    inputs = lm_inputs(cfg, BATCH, SEQLEN, SEED + 1, DOCUMENTS if packed else None)
    return tensor_parallel_errors(cfg, inputs, tp, SEED, steps=5 if step else 0)


def block_comm(tp_base, name, sp):
    """(forward, backward) collectives of one block at TP, as (kind, nbytes) in issue order."""
    fields, kind = BLOCK_CASES[name]
    tp = TensorParallel(tp_base.group, tp_base.size, tp_base.rank, sequence_parallel=sp)
    torch.manual_seed(SEED)
    block = layer_type(kind).layer_class(config(fields), tp)(config(fields), tp=tp)
    gen = torch.Generator().manual_seed(SEED + 3)
    local_len = SEQLEN // tp.size if sp else SEQLEN
    stream, up = (torch.randn(BATCH, local_len, D_MODEL, generator=gen) for _ in range(2))
    stream.requires_grad_()
    with comm_counter.capture() as fwd:
        out = block(Stream(stream)).hidden
    with comm_counter.capture() as bwd:
        (out * up).sum().backward()
    return [(r.kind, r.nbytes) for r in fwd], [(r.kind, r.nbytes) for r in bwd]


def hybrid_checks():
    """Every case at TP 4 (the world) and at TP 2 (ranks 0, 1 and ranks 2, 3), in one spawned run."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for tp in (TensorParallel(dist.group.WORLD, world, rank), TensorParallel(pairs[rank // 2], 2, rank % 2)):
        torch.manual_seed(0)
        out[tp.size] = {
            "model": {name: check_model(tp, name) for name in CASES},
            "comm": {(name, sp): block_comm(tp, name, sp) for name in BLOCK_CASES for sp in (False, True)},
        }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(hybrid_checks, 4, timeout=300)


@pytest.fixture(params=[2, 4], ids=["tp2", "tp4"])
def run(request, runs):
    """(TP size, the results of its ranks)."""
    return request.param, [r[request.param] for r in runs]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_and_every_gradient_equal_the_single_device_model(run, name):
    tp_size, results = run
    assert_equal_to_single_process([r["model"][name] for r in results], f"seed {SEED}, TP {tp_size}, {name}")
    assert len({r["model"][name]["loss_value"] for r in results}) == 1, "ranks disagree on the loss"


@pytest.mark.parametrize("name", list(CASES))
def test_same_seed_builds_the_single_device_weights(run, name):
    _, results = run
    assert all(res["model"][name]["init_equal"] for res in results)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[3]])
def test_recurrent_steps_equal_the_single_device_steps(run, name):
    tp_size, results = run
    err = results[0]["model"][name]["step"]
    assert err <= 1e-5, f"seed {SEED}, TP {tp_size}: {err:.2e}"


def _replicated_kv(attn, tp_size):
    """Backward all-reduces of the key/value rows replicated on every rank (none when they split)."""
    kv = attn.get("num_heads_kv", attn["num_heads"])
    if kv % tp_size == 0:
        return []
    rows = 2 * kv * attn.get("head_dim", D_MODEL // attn["num_heads"])
    return [("all_reduce", rows * D_MODEL * F32)] + (
        [("all_reduce", rows * F32)] if attn.get("qkv_proj_bias", True) else []
    )


def _mixer_expected(fields, kind, sp, tp_size):
    act = BATCH * SEQLEN * D_MODEL * F32
    extra = []
    if kind == "attention":
        extra = _replicated_kv(fields["attn_cfg"], tp_size)
        if sp and fields["attn_cfg"].get("out_proj_bias", True):
            extra.append(("all_reduce", D_MODEL * F32))
    if sp:
        return [("all_gather", act), ("reduce_scatter", act)], [
            ("all_gather", act),
            ("reduce_scatter", act),
            ("all_reduce", D_MODEL * F32),
            *extra,
        ]
    return [("all_reduce", act)], [("all_reduce", act), *extra]


def _expected(name, sp, tp_size):
    fields, kind = BLOCK_CASES[name]
    if kind != "mamba":
        return _mixer_expected(fields, kind, sp, tp_size)
    mamba = _mixer_expected(fields, "mlp", sp, tp_size)  # Mamba-2 with its groups split communicates as an MLP
    mlp = _mixer_expected(fields, "mlp", sp, tp_size)
    return mamba[0] + mlp[0], mamba[1] + mlp[1]


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_each_block_communicates_as_megatron(run, name, sp):
    tp_size, results = run
    fwd, bwd = results[0]["comm"][(name, sp)]
    want_fwd, want_bwd = _expected(name, sp, tp_size)
    assert fwd == want_fwd
    assert sorted(bwd) == sorted(want_bwd)
