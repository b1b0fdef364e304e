"""Tensor-parallel model layouts without processes: refusals, TP size 1, one rank's shards.

Building a TP model communicates nothing, so one rank of a larger group can be built here with
a stand-in group object; anything that did communicate would fail on it.
"""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.model.mamba2 import Mamba2
from megamamba.parallel import TensorParallel, comm_counter
from megamamba.parallel.tensor.model_layout import LayoutError, check_sequence_length
from model_checks import parameters_not_their_slices, rank_of


def mamba2(d_model=32, headdim=8, ngroups=1, **fields):
    ssm = {"layer": "Mamba2", "d_state": 6, "headdim": headdim, "ngroups": ngroups, "chunk_size": 8}
    return MambaConfig(d_model=d_model, n_layer=2, vocab_size=37, pad_vocab_size_multiple=1, ssm_cfg=ssm, **fields)


def mamba1(d_model=32):
    ssm = {"layer": "Mamba1", "d_state": 5, "dt_rank": 3}
    return MambaConfig(d_model=d_model, n_layer=2, vocab_size=37, pad_vocab_size_multiple=1, ssm_cfg=ssm)


def test_mamba2_heads_not_divisible_by_tp_are_refused_naming_both():
    cfg = mamba2(d_model=24)  # d_inner 48 / headdim 8 = 6 heads
    with pytest.raises(LayoutError, match=r"splits the heads.*nheads = 6 .*not divisible by TP = 4"):
        MambaLM(cfg, tp=rank_of(4))
    with pytest.raises(LayoutError, match=r"nheads = 6"):
        Mamba2(24, cfg.mixer_options, tp=rank_of(4))


def test_mamba2_groups_neither_dividing_nor_divisible_by_tp_are_refused():
    cfg = mamba2(d_model=24, ngroups=3)  # 6 heads in 3 groups
    with pytest.raises(LayoutError, match=r"ngroups = 3 does neither at TP = 2"):
        MambaLM(cfg, tp=rank_of(2))


def test_mamba1_d_inner_not_divisible_by_tp_is_refused():
    with pytest.raises(LayoutError, match=r"d_inner channels.*d_inner = 36 .*not divisible by TP = 8"):
        MambaLM(mamba1(d_model=18), tp=rank_of(8))


def test_sequence_parallel_seqlen_not_divisible_by_tp_is_refused_before_any_work():
    with pytest.raises(LayoutError, match=r"seqlen = 100 is not divisible by TP = 8"):
        check_sequence_length(100, 8, sequence_parallel=True)
    check_sequence_length(100, 8, sequence_parallel=False)
    model = MambaLM(mamba1(), tp=rank_of(8, sp=True))
    with comm_counter.capture() as records, pytest.raises(LayoutError, match=r"seqlen = 100 .*TP = 8"):
        model(torch.zeros(1, 100, dtype=torch.long))
    assert records == []


def test_generation_is_refused_under_sequence_parallelism():
    model = MambaLM(mamba2(), tp=rank_of(2, sp=True))
    cache = model.allocate_inference_cache(1)
    with pytest.raises(ValueError, match="not sequence-parallel"):
        model.step(torch.zeros(1, dtype=torch.long), cache)


@pytest.mark.parametrize("cfg", [mamba1(), mamba2(ngroups=2)], ids=["mamba1", "mamba2"])
def test_tp_size_one_is_the_plain_model(cfg):
    torch.manual_seed(5)
    plain = MambaLM(cfg)
    torch.manual_seed(5)
    single = MambaLM(cfg, tp=TensorParallel(sequence_parallel=True))
    assert single.tp is None and type(single.backbone.embedding) is type(plain.backbone.embedding)
    assert [type(m) for m in single.modules()] == [type(m) for m in plain.modules()]
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(6))
    with comm_counter.capture() as records:
        out = single(ids)
    assert records == [] and torch.equal(out, plain(ids))


@pytest.mark.parametrize(
    "cfg,tp_size,rank",
    [(mamba2(ngroups=1), 4, 3), (mamba2(ngroups=4), 2, 1), (mamba1(), 4, 2)],
    ids=["mamba2_one_group_tp4", "mamba2_four_groups_tp2", "mamba1_tp4"],
)
def test_one_ranks_parameters_are_its_slices_of_the_single_device_init(cfg, tp_size, rank):
    assert parameters_not_their_slices(cfg, tp_size, rank, seed=7) == []


def test_mamba2_one_group_at_tp4_holds_a_quarter_of_the_heads_and_all_of_b_c():
    mixer = MambaLM(mamba2(ngroups=1), tp=rank_of(4, 1)).backbone.layers[0].mixer
    # d_inner 64, 8 heads of 8, d_state 6: per rank z 16, x 16, dt 2; B, C 6 + 6 replicated
    assert mixer.in_proj.weight.shape == (16 + 16 + 2, 32) and mixer.in_proj.weight_replicated.shape == (12, 32)
    assert mixer.conv1d.weight.shape == (16, 1, 4) and mixer.conv1d.weight_replicated.shape == (12, 1, 4)
    assert mixer.A_log.shape == mixer.D.shape == mixer.dt_bias.shape == (2,)
    assert mixer.norm.weight.shape == (16,) and mixer.norm.group_size == 64
    assert mixer.out_proj.weight.shape == (32, 16)
    assert mixer.own_group == 0 and mixer.norm_groups_across_ranks == 1


def test_extra_vocab_rows_for_tp_are_zero_and_live_on_the_last_rank():
    # vocab 37 at TP 4: 40 rows, 10 per rank; rank 3 holds ids 30..36 and 3 padding rows
    model = MambaLM(mamba1(), tp=rank_of(4, 3))
    weight = model.backbone.embedding.weight
    assert weight.shape == (10, 32)
    assert torch.equal(weight[7:], torch.zeros(3, 32)) and (weight[:7] != 0).all()
    assert model.lm_head.weight is weight
