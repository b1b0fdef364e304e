"""The activation estimate: what a micro-batch keeps is what autograd keeps on the Triton kernels
(run by Triton's interpreter here), and the whole follows the shapes: more tokens or more
micro-batches in flight keep more, recomputation, tensor and sequence parallelism keep less.
(How close it comes to a measured peak is a GPU check: mamba2-130m and 1.3b within 20% of
torch.cuda.max_memory_allocated.)"""

import json
import os

import pytest
import torch

from distributed import run_ranks
from megamamba.config import MambaConfig
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.lm import MambaLM
from megamamba.pipelines.memory.activations import kept_bytes, stage_activation_bytes
from saved_tensors import autograd_saved_bytes
from train_entry import ROOT

MODELS = ["mamba1-130m", "mamba2-130m", "mamba2-1.3b", "nemotron-h-8b"]


def _model(name: str) -> MambaConfig:
    return MambaConfig.from_json(str(ROOT / "launch/models" / f"{name}.json"))


def _whole_model(name: str, checkpoint_interval: int = 0, in_flight: int = 1, **changes) -> int:
    """The estimate for a one-stage run of model `name` (layers [0, n_layer + 3)), micro batch 4 x seq 2048
    under bf16 autocast unless `changes` say otherwise."""
    shape = RankShape(**{**dict(model=_model(name), micro_batch_size=4, seq_length=2048, act=2), **changes})
    last = shape.model.n_layer + 2
    return stage_activation_bytes(shape, 0, last + 1, last, checkpoint_interval, in_flight)


@pytest.mark.parametrize("name", MODELS)
def test_more_tokens_keep_more(name):
    base = _whole_model(name)
    assert _whole_model(name, micro_batch_size=8) > base
    assert _whole_model(name, seq_length=4096) > base


@pytest.mark.parametrize("name", MODELS)
def test_twice_the_tokens_keep_more_but_at_most_twice_as_much(name):
    """Activations are linear in the tokens, plus fixed parts (weight copies, the loss's chunk)."""
    one, two = _whole_model(name, micro_batch_size=4), _whole_model(name, micro_batch_size=8)
    assert one < two <= 2 * one


@pytest.mark.parametrize("name", MODELS)
def test_recomputation_keeps_less(name):
    none = _whole_model(name)
    for interval in (1, 2, 4):
        assert _whole_model(name, checkpoint_interval=interval) < none, interval


@pytest.mark.parametrize("name", MODELS + ["mamba2-7b"])
def test_tensor_parallelism_keeps_less_per_rank(name):
    """Also Mamba-2 with ngroups < TP, whose norm across the ranks keeps no float32 intermediates."""
    assert _whole_model(name, tp=2) < _whole_model(name)


@pytest.mark.parametrize("name", MODELS)
def test_sequence_parallelism_keeps_less_per_rank_than_tensor_parallelism_alone(name):
    assert _whole_model(name, tp=2, sequence_parallel=True) < _whole_model(name, tp=2)


@pytest.mark.parametrize("name", MODELS)
def test_each_micro_batch_in_flight_adds_the_same(name):
    one, two, three = (_whole_model(name, in_flight=k) for k in (1, 2, 3))
    assert one < two < three and three - two == two - one


def test_a_context_parallel_rank_keeps_its_slice_and_the_gathered_keys_and_values():
    """Half the sequence on each of 2 ranks: less than the whole, more than half (attention's k and v are whole)."""
    whole, half = _whole_model("nemotron-h-8b"), _whole_model("nemotron-h-8b", cp=2)
    assert whole / 2 < half < whole, (whole, half)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_keeps_less_than_float32(name):
    assert _whole_model(name) < _whole_model(name, act=4)


def _kept_by_autograd(model: MambaLM, input_ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the loss's backward, parameters excluded."""

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids, input_ids)

    return autograd_saved_bytes(model, forward)


ATTENTION = {"num_heads": 4, "num_heads_kv": 2, "head_dim": 16, "causal": True}
HYBRIDS = {  # tiny Mamba-2 hybrids: a pattern with rotary GQA and squared-ReLU MLPs; mamba_ssm's fields with
    # an MLP inside every block
    "pattern": {
        "hybrid_layer_pattern": "M-*-*M",
        "n_layer": 6,
        "d_intermediate": 96,
        "mlp_activation": "squared_relu",
        "attn_cfg": {**ATTENTION, "rotary_emb_dim": 8},
    },
    "mlp-inside-blocks": {"attn_layer_idx": [1], "n_layer": 3, "d_intermediate": 96, "attn_cfg": ATTENTION},
    # at TP 2: its one key/value head replicated, its MLPs split
    "pattern-kv-replicated": {
        "hybrid_layer_pattern": "M-*-*M",
        "n_layer": 6,
        "d_intermediate": 96,
        "mlp_activation": "squared_relu",
        "attn_cfg": {**ATTENTION, "num_heads_kv": 1, "rotary_emb_dim": 8},
    },
}


def _tiny(mixer: str) -> MambaConfig:
    if mixer in HYBRIDS:
        return MambaConfig.from_dict(
            {**json.loads((ROOT / "launch/models/tiny-mamba2.json").read_text()), **HYBRIDS[mixer]}
        )
    config = json.loads((ROOT / f"launch/models/tiny-{mixer}.json").read_text())
    if mixer == "mamba1":  # the interpreted selective scan's programs are channel blocks: half the width, half the time
        config["d_model"] //= 2
    return MambaConfig.from_dict(config)


# On the kernels: sequences end inside a chunk (Mamba-2's chunk is 32, the selective scan's 16).
BATCH, SEQLEN = 2, 40

SLOW_CASES = [
    ("mamba1", True),
    ("pattern", False),
    ("pattern", True),
    ("mlp-inside-blocks", False),
    ("mlp-inside-blocks", True),
]


@pytest.mark.parametrize(
    "mixer, autocast",
    [("mamba2", False), ("mamba2", True), *(pytest.param(m, a, marks=pytest.mark.slow) for m, a in SLOW_CASES)],
    ids=lambda v: v if isinstance(v, str) else ("bf16-autocast" if v else "float32"),
)
def test_what_a_micro_batch_keeps_is_what_autograd_keeps_on_the_triton_kernels(monkeypatch, mixer, autocast):
    """Hybrids without documents: CPU attention then runs SDPA's fused (flash) kernel, which keeps what the GPU's
    kernels keep (with documents the CPU path adds its boolean seqlen x seqlen mask, which the GPU never has).
    Mamba-1 (about 20 s interpreted) in bf16 only here: its float32 is checked at TP 2 below."""
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    config = _tiny(mixer)
    torch.manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQLEN))
    measured = _kept_by_autograd(MambaLM(config), input_ids, autocast)
    last = config.n_layer + 2
    estimated = kept_bytes(RankShape(config, BATCH, SEQLEN, act=2 if autocast else 4), 0, last + 1, last)
    print(f"{mixer} {'bf16 autocast' if autocast else 'float32'}: kept {measured} bytes, estimated {estimated}")
    assert abs(estimated - measured) <= 0.01 * measured, (measured, estimated)


def _kept_at_tp2(mixer: str, sequence_parallel: bool) -> list:
    """(measured, estimated) kept bytes of this TP rank, float32 then bf16 autocast."""
    os.environ["MEGAMAMBA_KERNELS"] = "triton"
    from megamamba.parallel.groups import ParallelGroups

    config = _tiny(mixer)
    tp = ParallelGroups(2, 1, 1).tensor_parallel(sequence_parallel)
    torch.manual_seed(0)
    model = MambaLM(config, tp=tp)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQLEN))
    last = config.n_layer + 2
    return [
        (
            _kept_by_autograd(model, input_ids, autocast),
            kept_bytes(
                RankShape(config, BATCH, SEQLEN, tp=2, sequence_parallel=sequence_parallel, act=2 if autocast else 4),
                0,
                last + 1,
                last,
            ),
        )
        for autocast in (False, True)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
@pytest.mark.parametrize("mixer", ["mamba1", "mamba2", "pattern-kv-replicated"])
def test_what_a_tensor_parallel_rank_keeps_is_what_autograd_keeps_on_the_triton_kernels(mixer, sequence_parallel):
    """Mamba-2's single B/C group is replicated over TP and its gated norm spans the ranks; so is the hybrid's
    one key/value head (its in_proj weight concatenated in float32)."""
    for rank, pairs in enumerate(run_ranks(_kept_at_tp2, 2, args=(mixer, sequence_parallel), timeout=600)):
        for (measured, estimated), precision in zip(pairs, ("float32", "bf16 autocast")):
            print(
                f"{mixer} tp 2 {'SP ' if sequence_parallel else ''}{precision} rank {rank}: kept {measured} bytes, "
                f"estimated {estimated}"
            )
            assert abs(estimated - measured) <= 0.01 * measured, (rank, precision, measured, estimated)
