"""Packed, blended global batches: deterministic, resumable, layout-free, honouring weights and boundaries."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from data_fixtures import EOD, labelled_documents, write_dataset
from megamamba.data.batches import PackedGlobalBatches, open_blend
from megamamba.data.blend import BlendSchedule, parse_blend
from megamamba.data.indexed import IndexedDataset
from megamamba.data.packing import DocumentPacker, segment_ids

SEQ = 23  # odd, and longer than many documents, shorter than some


@pytest.fixture
def two_datasets(tmp_path):
    """Dataset A: documents labelled 1..60, dataset B: 1001..1040 (each token is its document's label)."""
    a = write_dataset(str(tmp_path / "a"), labelled_documents(60, seed=1, first_label=1))
    b = write_dataset(str(tmp_path / "b"), labelled_documents(40, seed=2, first_label=1001))
    return [IndexedDataset(a), IndexedDataset(b)]


def batches(datasets, weights=(0.7, 0.3), gbs=8, seed=5, **kw):
    return PackedGlobalBatches(datasets, list(weights), SEQ, gbs, seed, **kw)


def test_resumed_iteration_yields_what_an_uninterrupted_one_does(two_datasets):
    data = batches(two_datasets)
    uninterrupted = [mb for step in range(11) for mb in data.micro_batches_at(8 * step, 0, 1, 2)]  # 4 per step
    fresh = PackedGlobalBatches(two_datasets, [0.7, 0.3], SEQ, 8, 5)  # resumed after 6 steps of 8 samples
    resumed = [mb for step in range(6, 11) for mb in fresh.micro_batches_at(8 * step, 0, 1, 2)]
    for i, got in enumerate(resumed):
        want = uninterrupted[4 * 6 + i]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"micro-batch {i} after resuming at step 6 differs"


@pytest.mark.parametrize("dp", [2, 4])
def test_global_batch_is_the_same_at_any_data_parallel_size(two_datasets, dp):
    data = batches(two_datasets, gbs=8)
    for step in (0, 3, 17):
        ref = data.rows_at(8 * step, 8 * step + 8)
        parts = [mb for rank in range(dp) for mb in data.micro_batches(step, rank, dp, 8 // dp // 2 or 1)]
        for k, name in enumerate(("inputs", "labels", "seq_idx")):
            joined = torch.cat([p[k] for p in parts])
            assert torch.equal(joined, ref[k]), f"step {step} dp {dp}: {name} differ from the dp=1 global batch"


def test_batch_shapes_and_types(two_datasets):
    inputs, labels, seq_idx = batches(two_datasets).rows_at(16, 24)
    assert inputs.shape == labels.shape == seq_idx.shape == (8, SEQ)
    assert inputs.dtype == labels.dtype == torch.int64 and seq_idx.dtype == torch.int32
    assert torch.equal(inputs[:, 1:], labels[:, :-1]), "labels are not the inputs shifted by one"


def test_seq_idx_steps_exactly_at_document_boundaries(two_datasets):
    inputs, labels, seq_idx = batches(two_datasets).rows_at(64, 80)
    for row in range(16):
        x, s = inputs[row].numpy(), seq_idx[row].numpy()
        assert s[0] == 0
        steps = (np.flatnonzero(np.diff(s)) + 1).tolist()
        ends = (np.flatnonzero(x[1:] == EOD) + 1).tolist()
        assert steps == ends, f"row {row}: seq_idx steps at {steps}, end-of-document tokens at {ends}"
        # A segment is one document: after its leading end-of-document token, one label and no other EOD.
        for seg in np.unique(s):
            body = x[s == seg]
            body = body[1:] if body[0] == EOD else body
            assert len(set(body.tolist())) <= 1 and EOD not in body, f"row {row} segment {seg} mixes documents: {body}"


def test_reset_off_gives_no_seq_idx(two_datasets):
    on = batches(two_datasets).rows_at(8, 16)
    off = batches(two_datasets, reset_at_documents=False).rows_at(8, 16)
    assert off[2] is None
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


def test_segment_ids_begin_at_the_end_of_document_token():
    # stream positions 0..7; documents end (their EOD) at 2 and 5: [a a E b b E c c]
    assert segment_ids(np.array([2, 5, 9]), 8).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # a window starting on an end-of-document token: ids start at 0 all the same
    assert segment_ids(np.array([0, 3]), 5).tolist() == [0, 0, 0, 1, 1]


def test_blend_counts_stay_within_the_number_of_datasets_of_the_weights():
    weights = [Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)]
    schedule = BlendSchedule(weights)
    assigned = schedule.assign(0, 6000)
    counts = np.zeros(3)
    worst = 0.0
    for j, (i, q) in enumerate(assigned):
        assert q == counts[i], f"sample {j}: dataset {i} skipped or repeated a sample number"
        counts[i] += 1
        worst = max(worst, float(np.abs(counts - np.array([float(w) for w in weights]) * (j + 1)).max()))
    assert worst <= len(weights) + 1, f"blend deviates by {worst} samples from the weights"


def test_blend_is_honoured_in_the_batches(two_datasets):
    data = batches(two_datasets, weights=(0.7, 0.3))
    from_a = (data.rows_at(0, 300)[0] < 1000).all(dim=1).sum().item()
    # 300 samples at weight 0.7 -> 210 from A, within the schedule's bound of n + 1 = 3 samples
    assert abs(from_a - 210) <= 3, from_a


def test_blend_ranges_agree_with_the_whole_sequence():
    schedule = BlendSchedule([0.01, 0.2, 0.79])
    whole = schedule.assign(0, 3000)
    for first, stop in [(0, 1), (1, 2), (17, 1000), (2999, 3000), (1500, 1500)]:
        assert schedule.assign(first, stop) == whole[first:stop], (first, stop)


def test_tiny_weights_still_get_their_share():
    assigned = BlendSchedule([0.001, 0.999]).assign(0, 10_000)
    assert sum(1 for i, _ in assigned if i == 0) == 10


@pytest.mark.parametrize(
    "args,expected",
    [
        (["a"], [(1, "a")]),
        (["0.7", "a", "0.3", "b"], [(Fraction(7, 10), "a"), (Fraction(3, 10), "b")]),
        (["2", "a", "6", "b"], [(Fraction(1, 4), "a"), (Fraction(3, 4), "b")]),
    ],
)
def test_blend_list_is_parsed_and_normalised(args, expected):
    assert parse_blend(args) == expected


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "no dataset given"),
        (["0.5", "a", "b"], "expected pairs"),
        (["x", "a", "0.5", "b"], "weight 'x' is not a number"),
        (["0", "a", "1", "b"], "weight '0' must be positive"),
    ],
)
def test_bad_blend_lists_fail_clearly(args, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(args)


def test_open_blend_checks_the_vocabulary(two_datasets):
    prefixes = [two_datasets[0].prefix, two_datasets[1].prefix]
    datasets, weights = open_blend(["1", prefixes[0], "3", prefixes[1]], vocab_size=1041)
    assert weights == [Fraction(1, 4), Fraction(3, 4)] and len(datasets) == 2
    with pytest.raises(ValueError, match="token id 1040 is outside the vocabulary of 1000 ids"):
        open_blend(["1", prefixes[0], "3", prefixes[1]], vocab_size=1000)


def test_an_epoch_visits_every_sample_once_and_the_next_reshuffles(two_datasets):
    packer = DocumentPacker(two_datasets[0], SEQ, seed=3, key=0)
    n = packer.samples_per_epoch
    epoch0 = [packer.sample(q)[0] for q in range(n)]
    stream = np.concatenate([t[:-1] for t in epoch0])
    assert len(stream) == n * SEQ
    # every document's tokens appear, in total, once per epoch (up to the dropped tail)
    counts = np.bincount(stream, minlength=61)
    lengths = np.diff(two_datasets[0].offsets)
    assert (counts[1:] <= lengths - 1).all()
    assert counts[1:].sum() >= (lengths - 1).sum() - SEQ - 1
    assert not all(np.array_equal(packer.sample(n + q)[0], epoch0[q]) for q in range(n))


def test_dataset_shorter_than_one_sample_is_refused(tmp_path):
    ds = IndexedDataset(write_dataset(str(tmp_path / "s"), [[1, 2, 0]]))
    with pytest.raises(ValueError, match=r"3 tokens cannot fill one sample of seq_length \+ 1 = 24 tokens"):
        DocumentPacker(ds, SEQ, seed=0, key=0)


def test_seed_changes_the_batches_and_not_the_data(two_datasets):
    a, b = batches(two_datasets, seed=1).rows_at(0, 8)[0], batches(two_datasets, seed=2).rows_at(0, 8)[0]
    assert not torch.equal(a, b)
    assert torch.equal(a, batches(two_datasets, seed=1).rows_at(0, 8)[0])


@pytest.mark.parametrize("window", [(0, SEQ), (0, 5), (5, 12), (11, SEQ), (22, SEQ)])
def test_a_window_of_a_sample_is_that_slice_of_the_whole_sample(two_datasets, window):
    packer = DocumentPacker(two_datasets[0], SEQ, seed=3, key=0)
    lo, hi = window
    for q in range(3 * packer.samples_per_epoch):
        tokens, ids = packer.sample(q)
        part_tokens, part_ids = packer.sample(q, window)
        assert np.array_equal(part_tokens, tokens[lo : hi + 1]), f"sample {q}"
        assert np.array_equal(part_ids, ids[lo:hi]) and part_ids.dtype == np.int32, f"sample {q}"


@pytest.mark.parametrize("window", [(5, 5), (-1, 3), (3, SEQ + 1)])
def test_a_window_outside_the_sample_is_refused(two_datasets, window):
    with pytest.raises(ValueError, match="window"):
        DocumentPacker(two_datasets[0], SEQ, seed=3, key=0).sample(0, window)
