"""Sharding metadata and the full <-> local conversions, on simulated ranks (no processes)."""

import pytest
import torch
from torch import nn

from megamamba.parallel import (
    ColumnParallelLinear,
    Component,
    RowParallelLinear,
    Shard,
    TensorParallel,
    VocabParallelEmbedding,
    assemble_full,
    full_tensors,
    local_shard,
    tp_padded_vocab_size,
)
from megamamba.testing.numerics import relative_error

IN_PROJ = (
    Component("z", 8),
    Component("x", 12),
    Component("B", 3, sharded=False),
    Component("C", 3, sharded=False),
    Component("dt", 4),
)


def _round_trip(full, shard, tp_size, partner=None):
    locals_by_rank = [local_shard(full, shard, tp_size, r) for r in range(tp_size)]
    replicated = None if partner is None else local_shard(full, partner, tp_size, 0)
    return locals_by_rank, assemble_full(shard, locals_by_rank, replicated)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_plain_shard_then_assemble_is_exact(tp_size, dim):
    full = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    shard = Shard("weight", dim, (Component("w", full.shape[dim]),))
    locals_by_rank, back = _round_trip(full, shard, tp_size)
    assert torch.equal(back, full)
    assert torch.equal(torch.cat(locals_by_rank, dim), full)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_component_shards_hold_a_slice_of_every_component(tp_size):
    comps = (Component("z", 8), Component("x", 12), Component("B", 4), Component("C", 4), Component("dt", 4))
    full = torch.randn(32, 5, generator=torch.Generator().manual_seed(2))
    shard = Shard("weight", 0, comps)
    locals_by_rank, back = _round_trip(full, shard, tp_size)
    assert torch.equal(back, full)
    blocks = full.split([c.size for c in comps])
    for r, local in enumerate(locals_by_rank):
        expected = torch.cat([block.chunk(tp_size)[r] for block in blocks])
        assert torch.equal(local, expected)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_replicated_components_round_trip_through_their_partner(tp_size):
    full = torch.randn(30, 5, generator=torch.Generator().manual_seed(3))
    shard = Shard("weight", 0, IN_PROJ)
    partner = Shard("weight", 0, IN_PROJ, replicated_part=True, grad_reduced=True)
    locals_by_rank, back = _round_trip(full, shard, tp_size, partner)
    assert torch.equal(back, full)
    assert torch.equal(local_shard(full, partner, tp_size, tp_size - 1), full[20:26])
    assert locals_by_rank[0].shape[0] == (8 + 12 + 4) // tp_size


@pytest.mark.parametrize("vocab,tp_size", [(13, 1), (13, 2), (13, 4), (16, 4), (5, 4)])
def test_vocab_padding_is_added_by_sharding_and_dropped_by_assembling(vocab, tp_size):
    full = torch.randn(vocab, 6, generator=torch.Generator().manual_seed(4))
    padded = tp_padded_vocab_size(vocab, tp_size)
    shard = Shard("weight", 0, (Component("vocab", vocab),), pad=padded - vocab)
    locals_by_rank, back = _round_trip(full, shard, tp_size)
    assert torch.equal(back, full)
    stacked = torch.cat(locals_by_rank)
    assert stacked.shape[0] == padded
    assert torch.equal(stacked[vocab:], torch.zeros(padded - vocab, 6))


def test_tp_padded_vocab_size_rounds_up_to_the_tp_size():
    assert [tp_padded_vocab_size(50280, t) for t in (1, 2, 3, 8)] == [50280, 50280, 50280, 50280]
    assert [tp_padded_vocab_size(13, t) for t in (1, 2, 4, 8)] == [13, 14, 16, 16]


def test_indivisible_component_is_refused_naming_it():
    shard = Shard("weight", 0, (Component("x", 6),))
    with pytest.raises(ValueError, match=r"weight\.x = 6 is not divisible by the tensor-parallel size 4"):
        local_shard(torch.zeros(6, 2), shard, 4, 0)


def test_full_tensor_of_wrong_size_is_refused():
    shard = Shard("weight", 0, IN_PROJ)
    with pytest.raises(ValueError, match="has 29 along dim 0, its components .* sum to 30"):
        local_shard(torch.zeros(29, 2), shard, 2, 0)


def test_assembling_without_the_replicated_partner_is_refused():
    shard = Shard("weight", 0, IN_PROJ)
    with pytest.raises(ValueError, match="need a replicated partner"):
        assemble_full(shard, [torch.zeros(12, 2), torch.zeros(12, 2)])


def test_parameters_say_how_they_are_sharded():
    from deepspeed.runtime.utils import is_model_parallel_parameter  # what DeepSpeed's grad norm reads

    tp = TensorParallel()
    col = ColumnParallelLinear(5, 30, tp, components=IN_PROJ)
    row = RowParallelLinear(6, 4, tp)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert col.weight.tp_shard.components == IN_PROJ
    assert not col.weight_replicated.tensor_model_parallel and col.weight_replicated.tp_shard.grad_reduced
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert not row.bias.tensor_model_parallel and row.bias.partition_dim == -1
    assert is_model_parallel_parameter(col.weight) and not is_model_parallel_parameter(col.weight_replicated)
    assert is_model_parallel_parameter(row.weight) and not is_model_parallel_parameter(row.bias)


def test_layers_at_tp1_draw_the_same_full_weights_as_torch_modules():
    tp = TensorParallel()
    pairs = [
        (lambda: ColumnParallelLinear(5, 30, tp, components=IN_PROJ), lambda: nn.Linear(5, 30)),
        (lambda: RowParallelLinear(6, 4, tp), lambda: nn.Linear(6, 4)),
        (lambda: VocabParallelEmbedding(13, 6, tp), lambda: nn.Embedding(13, 6)),
    ]
    for ours, theirs in pairs:
        torch.manual_seed(5)
        full = full_tensors(ours(), tp)
        torch.manual_seed(5)
        ref = theirs().state_dict()
        assert full.keys() == ref.keys()
        for key in ref:
            assert torch.equal(full[key], ref[key]), key


def test_column_layer_at_tp1_computes_the_fused_linear():
    tp = TensorParallel()
    torch.manual_seed(6)
    layer = ColumnParallelLinear(5, 30, tp, components=IN_PROJ)
    torch.manual_seed(6)
    ref = nn.Linear(5, 30).double()
    x = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(7))
    out, expected = layer(x), ref(x.double())
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= 1e-6


def test_component_sizes_must_sum_to_out_features():
    with pytest.raises(ValueError, match="sum to 30, not out_features = 31"):
        ColumnParallelLinear(5, 31, TensorParallel(), components=IN_PROJ)


def test_gather_output_with_replicated_components_is_refused():
    with pytest.raises(ValueError, match="gather_output=True with replicated components"):
        ColumnParallelLinear(5, 30, TensorParallel(), components=IN_PROJ, gather_output=True)
