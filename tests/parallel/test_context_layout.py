"""Context-parallel layouts that cannot work are refused before any work, naming the numbers."""

from types import SimpleNamespace

import pytest
import torch

from megamamba.parallel.context.context_parallel import ContextParallel, check_context_layout, sequence_slice
from megamamba.parallel.tensor.model_layout import LayoutError


def test_a_sequence_not_divisible_by_the_context_size_is_refused():
    with pytest.raises(LayoutError, match="seqlen = 30 is not divisible by CP 4"):
        check_context_layout(30, 4, d_conv=4)


def test_with_sequence_parallelism_the_slices_split_across_tp_too():
    check_context_layout(32, 4, d_conv=4, tp_size=2)
    with pytest.raises(LayoutError, match=r"not divisible by CP 4 x TP 2 \(sequence parallelism\) = 8"):
        check_context_layout(36, 4, d_conv=4, tp_size=2, sequence_parallel=True)


def test_slices_shorter_than_the_conv_history_are_refused():
    with pytest.raises(LayoutError, match="d_conv - 1 = 3 tokens .* = 2 are shorter"):
        check_context_layout(8, 4, d_conv=4)


def test_one_rank_accepts_any_length():
    check_context_layout(7, 1, d_conv=4)


def test_each_rank_takes_its_consecutive_slice():
    t = torch.arange(12).reshape(1, 12)
    slices = [sequence_slice(t, SimpleNamespace(size=3, rank=r)).tolist() for r in range(3)]  # only size, rank read
    assert slices == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9, 10, 11]]]


def test_a_context_group_larger_than_one_needs_a_process_group():
    with pytest.raises(ValueError, match="context-parallel size 2 > 1 needs a process group"):
        ContextParallel(None, 2, 0)
