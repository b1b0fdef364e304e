"""What a checkpoint records of its run, and what a resume does with it (no process group, fast).

The stream record (consumed samples, data, tokenizer, sequence length, seed, document resets)
decides where a resume continues and refuses what would silently change the sample stream; the
LR plan record refuses a changed LR plan; a continued LR plan follows the samples consumed.
"""

import copy
from fractions import Fraction

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.checkpoint import CheckpointError, open_checkpoint, save_training_checkpoint
from megamamba.checkpoint.run_record import (
    OVERRIDE_DATA_CHECK,
    OVERRIDE_SCHEDULE,
    check_lr_plan,
    lr_plan_record,
    resume_point,
    stream_record,
)
from megamamba.checkpoint.training import load_training_checkpoint
from megamamba.data.batches import fingerprint
from megamamba.data.training_data import DocumentTokens, training_data
from megamamba.schedule.lr_continued import ContinuedSchedule
from megamamba.schedule.lr_schedule import LRSchedule
from train_entry import ROOT

MODEL = MambaConfig.from_json(str(ROOT / "launch/models/tiny-mamba2.json"))
SOURCE = "ckpt/step_000004"


@pytest.fixture(scope="module")
def data():
    return training_data(MODEL, "bytes", [], [], 32, 8, 1234)


@pytest.fixture(scope="module")
def saved(data):
    """The stream record of a checkpoint after 4 steps of global batch 8."""
    return stream_record(data.train, data.tokenizer, "bytes", 32)


def test_a_global_batch_of_16_from_sample_32_is_steps_4_and_5_at_global_batch_8(data):
    at_8 = data.train
    at_16 = training_data(MODEL, "bytes", [], [], 32, 16, 1234).train
    got = torch.cat([b[0] for b in at_16.micro_batches_at(32, 0, 1, 16)])
    steps_4_and_5 = [b[0] for first in (32, 40) for b in at_8.micro_batches_at(first, 0, 1, 8)]
    assert torch.equal(got, torch.cat(steps_4_and_5))


def test_a_resume_continues_at_the_recorded_consumed_samples_and_names_a_changed_batch(saved):
    run = {**saved, "consumed_samples": 0, "global_batch_size": 16}
    point = resume_point({"stream": saved}, 4, run, False, SOURCE)
    assert (point.step, point.consumed_samples, point.warning) == (4, 32, None)
    assert point.changes == ["global batch 8 -> 16"]


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("seq_length", 64, "--seq-length: checkpoint 32, run 64"),
        ("seed", 7, "--seed: checkpoint 1234, run 7"),
        ("reset_at_documents", False, "reset at documents (--no-reset-at-documents): checkpoint True, run False"),
        (
            "tokenizer",
            {"name": "t.model", "identity": "sha256:abc", "vocab_size": 300},
            "tokenizer: checkpoint 'bytes' (bytes, 257 ids), run 't.model' (sha256:abc, 300 ids)",
        ),
        (
            "data",
            [{"weight": "1", "prefix": "other", "documents": 9, "tokens": 900, "fingerprint": "sha256:0123"}],
            "run 1 other (9 documents, 900 tokens, sha256:0123)",
        ),
    ],
    ids=["seq-length", "seed", "reset-at-documents", "tokenizer", "data"],
)
def test_a_change_of_the_sample_stream_is_refused_naming_it_and_the_override(saved, key, value, named):
    run = {**saved, key: value}
    with pytest.raises(CheckpointError) as e:
        resume_point({"stream": saved}, 4, run, False, SOURCE)
    message = str(e.value)
    assert message.startswith(f"{SOURCE} was trained on another sample stream: ") and "\n" not in message
    assert named in message and OVERRIDE_DATA_CHECK in message, message
    point = resume_point({"stream": saved}, 4, run, True, SOURCE)
    assert point.consumed_samples == 32 and len(point.changes) == 1
    assert point.changes[0].startswith(f"overridden ({OVERRIDE_DATA_CHECK}): ") and named in point.changes[0]


def test_moved_data_with_the_same_contents_resumes(saved):
    run = copy.deepcopy(saved)
    run["data"][0]["prefix"] = "/elsewhere/corpus"
    assert resume_point({"stream": saved}, 4, run, False, SOURCE).changes == []


def test_the_fingerprint_follows_the_contents_not_the_name():
    documents = [[1, 2, 3], [4, 5], [6]]
    same = fingerprint(DocumentTokens("a", documents)) == fingerprint(DocumentTokens("b", documents))
    edited = fingerprint(DocumentTokens("a", [[1, 2, 3], [9, 5], [6]]))
    moved = fingerprint(DocumentTokens("a", [[1, 2], [3, 4, 5], [6]]))
    assert same and len({fingerprint(DocumentTokens("a", documents)), edited, moved}) == 3


def test_a_checkpoint_without_a_stream_record_assumes_step_times_global_batch(saved):
    point = resume_point({"args": {}}, 4, {**saved, "global_batch_size": 16}, False, SOURCE)
    assert point.consumed_samples == 64
    assert point.warning == (
        f"{SOURCE} records no data position (written before it was recorded): assuming step 4 "
        "x global batch 16 = 64 samples consumed"
    )


def test_a_changed_lr_plan_is_refused_naming_megatrons_override():
    saved = lr_plan_record(LRSchedule(1e-3, 1e-4, 1, 8), 8, 4)
    run = LRSchedule(2e-3, 1e-4, 1, 8)
    with pytest.raises(CheckpointError, match=rf"peak: checkpoint 0.001, run 0.002.*{OVERRIDE_SCHEDULE}"):
        check_lr_plan(saved, run, False, SOURCE)
    assert check_lr_plan(saved, run, True, SOURCE) == ["peak: checkpoint 0.001, run 0.002"]
    assert check_lr_plan(saved, LRSchedule(1e-3, 1e-4, 1, 8), False, SOURCE) == []


def test_a_continued_lr_plan_moves_on_by_the_samples_each_step_consumes():
    plan = LRSchedule(1e-3, 1e-4, 1, 8)
    doubled = ContinuedSchedule(plan, 8, 16, epoch=4, position=Fraction(4))
    assert [doubled(e) for e in (4, 5, 6)] == [plan(4), plan(6), plan(8)]
    halved = ContinuedSchedule(plan, 16, 8, epoch=2, position=Fraction(2))
    assert halved(3) == plan(2.5) and halved.total_iters == 8


def _single_process_run(tmp_path):
    torch.manual_seed(0)
    model = MambaLM(MambaConfig.from_json(str(ROOT / "launch/models/tiny-mamba2.json")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 17))
    model(ids[:, :-1]).logsumexp(-1).mean().backward()
    optimizer.step()
    save_training_checkpoint(str(tmp_path), 1, model, optimizer)
    return model


def test_no_load_optim_loads_the_weights_and_leaves_the_optimizer_fresh(tmp_path):
    trained = _single_process_run(tmp_path)
    model = MambaLM(trained.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model, optimizer, load_optim=False)
    assert step == 1 and optimizer.state_dict()["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))


def test_no_load_rng_leaves_the_rng_states_as_they_are(tmp_path):
    trained = _single_process_run(tmp_path)
    model = MambaLM(trained.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model, optimizer, load_rng=False)
    assert torch.equal(torch.get_rng_state(), before)
    load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model, optimizer)
    assert not torch.equal(torch.get_rng_state(), before)
