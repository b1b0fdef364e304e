"""Global batches are fixed by (seed, step): any data-parallel split reads the same samples, restarts replay nothing."""
import pytest
import torch

from megamamba.byte_tokenizer import ByteTokenizer
from megamamba.global_batches import GlobalBatches, split_train_valid, tokenize

SEED = 7


@pytest.fixture(scope="module")
def stream():
    return torch.arange(10_000, dtype=torch.int64) % 257


@pytest.mark.parametrize("dp, micro", [(1, 2), (2, 2), (4, 1), (2, 3), (6, 1)])
def test_rank_slices_of_any_layout_concatenate_to_the_global_batch(stream, dp, micro):
    data = GlobalBatches(stream, seq_length=17, global_batch_size=12, seed=SEED)
    for step in (0, 5):
        inputs, labels = data.global_batch(step)
        parts = [mb for r in range(dp) for mb in data.micro_batches(step, r, dp, micro)]
        assert all(x.shape == (micro, 17) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), inputs), (dp, micro, step)
        assert torch.equal(torch.cat([y for _, y in parts]), labels), (dp, micro, step)


def test_labels_are_the_inputs_shifted_by_one_token_of_the_stream(stream):
    data = GlobalBatches(stream, seq_length=9, global_batch_size=4, seed=SEED)
    inputs, labels = data.global_batch(3)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    for row_in, row_lab in zip(inputs, labels):
        start = int(row_in[0])  # the stream is arange % 257: a window is consecutive values mod 257
        assert torch.equal(row_in, (torch.arange(9) + start) % 257)
        assert torch.equal(row_lab, (torch.arange(1, 10) + start) % 257)


def test_a_restart_at_step_s_reads_what_the_uninterrupted_run_reads(stream):
    data = GlobalBatches(stream, seq_length=8, global_batch_size=4, seed=SEED)
    uninterrupted = data.iterate(0, dp_rank=1, dp_size=2, micro_batch_size=1)
    seen = [next(uninterrupted) for _ in range(2 * 6)]
    resumed = GlobalBatches(stream, seq_length=8, global_batch_size=4, seed=SEED).iterate(
        3, dp_rank=1, dp_size=2, micro_batch_size=1)
    for (x, y), (rx, ry) in zip(seen[2 * 3:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_steps_and_seeds_draw_different_batches(stream):
    a = GlobalBatches(stream, seq_length=8, global_batch_size=4, seed=SEED)
    b = GlobalBatches(stream, seq_length=8, global_batch_size=4, seed=SEED + 1)
    assert not torch.equal(a.global_batch(0)[0], a.global_batch(1)[0])
    assert not torch.equal(a.global_batch(0)[0], b.global_batch(0)[0])


def test_a_split_that_leaves_partial_micro_batches_is_refused(stream):
    data = GlobalBatches(stream, seq_length=8, global_batch_size=6, seed=SEED)
    with pytest.raises(ValueError, match="global batch 6"):
        data.micro_batches(0, 0, 4, 1)
    with pytest.raises(ValueError, match="micro-batches of 4"):
        data.micro_batches(0, 0, 1, 4)


def test_documents_end_with_the_end_of_document_token_and_validation_is_held_out():
    tok = ByteTokenizer()
    ids = tokenize(["ab", "c"], tok)
    assert ids.tolist() == [97, 98, tok.eod, 99, tok.eod]
    train, valid = split_train_valid(torch.arange(100), 0.1)
    assert train.numel() == 90 and torch.equal(valid, torch.arange(90, 100))


def test_data_files_are_one_document_each_and_a_missing_one_is_named(tmp_path):
    from megamamba.corpus import default_corpus
    from megamamba.global_batches import read_documents

    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    assert read_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]) == ["first", "second"]
    assert read_documents([]) == default_corpus()  # the built-in Python documentation
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_documents([str(tmp_path / "nope.txt")])
