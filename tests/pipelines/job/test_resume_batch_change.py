"""A resume at another global batch size on another number of ranks continues the sample stream where it stopped.

Uninterrupted: 64 samples (--train-samples) at global batch 8 on dp=2, 8 steps, saving after step 4.
Resumed from that checkpoint at global batch 16 on dp=4: steps 4 and 5 train on exactly the
samples 32..63 that the uninterrupted run's steps 4..7 trained on (sample numbers and token rows),
the run ends when its 64 samples are done, and the LR follows the samples: resumed step 5 runs
the LR of uninterrupted step 6.
"""

import json

import pytest

from distributed import run_ranks
from resume_runs import COMMON
from sample_log import run_train_logging_samples

pytestmark = pytest.mark.slow

SAMPLES, SAVE_AT = 64, 4
FLAGS = [f for f in COMMON if f not in ("--train-iters", "8")] + ["--train-samples", str(SAMPLES)]


def _ds_config(resume_runs) -> str:
    """ZeRO-1, micro-batch 2, no train_batch_size: --global-batch-size sets it."""
    path = resume_runs.root / "ds-zero1-no-batch.json"
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "steps_per_print": 1000000})
    )
    return str(path)


def _run(resume_runs, dp: int, global_batch: int, flags) -> dict:
    out = resume_runs.new_dir()
    argv = [
        "--deepspeed_config",
        _ds_config(resume_runs),
        "--model-config",
        resume_runs.model_config(),
        "--metrics-jsonl",
        str(out / "metrics.jsonl"),
        "--global-batch-size",
        str(global_batch),
        *FLAGS,
        *flags,
    ]
    ranks = run_ranks(
        run_train_logging_samples, dp, args=(argv, resume_runs.extensions_dir), init_process_group=False, timeout=600
    )
    samples = sorted(s for r in ranks for s in r["samples"])
    return {"records": ranks[0]["records"], "samples": samples}


@pytest.fixture(scope="module")
def uninterrupted(resume_runs):
    save = resume_runs.new_dir() / "ckpt"
    run = _run(resume_runs, 2, 8, ["--save", str(save), "--save-interval", str(SAVE_AT)])
    assert [r["step"] for r in run["records"]] == list(range(SAMPLES // 8))
    return {**run, "checkpoint": save / f"step_{SAVE_AT:06d}"}


def test_the_checkpoint_records_the_consumed_samples_and_the_stream(uninterrupted):
    extra = json.loads((uninterrupted["checkpoint"] / "trainer_state.json").read_text())["extra"]
    stream = extra["stream"]
    assert stream["consumed_samples"] == SAVE_AT * 8 and stream["global_batch_size"] == 8
    assert (stream["seq_length"], stream["seed"], stream["reset_at_documents"]) == (32, 1234, True)
    assert stream["tokenizer"]["identity"] == "bytes"
    assert [d["weight"] for d in stream["data"]] == ["1"] and stream["data"][0]["tokens"] > 0
    assert stream["data"][0]["fingerprint"].startswith("sha256:")
    assert extra["lr_plan"]["global_batch_size"] == 8 and extra["lr_plan"]["position"] == str(SAVE_AT)


def test_resuming_at_global_batch_16_on_4_ranks_trains_on_the_samples_the_uninterrupted_run_would(
    resume_runs, uninterrupted
):
    resumed = _run(resume_runs, 4, 16, ["--load", str(uninterrupted["checkpoint"])])
    assert [r["step"] for r in resumed["records"]] == [SAVE_AT, SAVE_AT + 1]  # 32 samples left / 16 per step
    rest = [s for s in uninterrupted["samples"] if s[0] >= SAVE_AT * 8]
    assert [n for n, _ in resumed["samples"]] == list(range(SAVE_AT * 8, SAMPLES))
    assert resumed["samples"] == rest, "the resumed run's token rows differ from the uninterrupted run's"
    lrs = [r["lr"] for r in uninterrupted["records"]]
    assert [r["lr"] for r in resumed["records"]] == [lrs[SAVE_AT], lrs[SAVE_AT + 2]]
