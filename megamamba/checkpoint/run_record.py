"""What a run consumed and planned, recorded in each checkpoint and checked when it resumes.

The data stream (addressed by consumed samples, so another global batch size continues it) and
the LR plan: a change to either is refused with one message naming every difference and the
override (OVERRIDE_DATA_CHECK, Megatron's OVERRIDE_SCHEDULE). The records: docs/checkpoints.md.
"""

import dataclasses
from fractions import Fraction
from typing import NamedTuple, Optional

from megamamba.checkpoint.files import CheckpointError

STREAM, LR_PLAN = "stream", "lr_plan"
OVERRIDE_DATA_CHECK = "--override-data-check"
OVERRIDE_SCHEDULE = "--override-opt_param-scheduler"


def stream_record(batches, tokenizer, tokenizer_spec: str, consumed_samples: int) -> dict:
    """The record of a run whose training batches are `batches` (a PackedGlobalBatches), after `consumed_samples`."""
    return {
        "consumed_samples": consumed_samples,
        "global_batch_size": batches.global_batch_size,
        "seq_length": batches.seq_length,
        "seed": batches.seed,
        "reset_at_documents": batches.reset_at_documents,
        "tokenizer": {"name": tokenizer_spec, "identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size},
        "data": batches.identity(),
    }


def _blend(data: list) -> str:
    return " + ".join(
        f"{d['weight']} {d['prefix']} ({d['documents']} documents, {d['tokens']} tokens, {d['fingerprint'][:19]})"
        for d in data
    )


def _tokenizer(record: dict) -> str:
    return f"{record['name']!r} ({record['identity'][:19]}, {record['vocab_size']} ids)"


# (record key, what the message calls it, the part compared, how a value is shown)
_STREAM_FIELDS = (
    ("data", "data", lambda d: [(d_["weight"], d_["documents"], d_["tokens"], d_["fingerprint"]) for d_ in d], _blend),
    ("tokenizer", "tokenizer", lambda t: t["identity"], _tokenizer),
    ("seq_length", "--seq-length", lambda v: v, repr),
    ("seed", "--seed", lambda v: v, repr),
    ("reset_at_documents", "reset at documents (--no-reset-at-documents)", lambda v: v, repr),
)


def stream_differences(saved: dict, run: dict) -> list:
    """ "what: checkpoint X, run Y" for everything the sample stream depends on that differs."""
    return [
        f"{label}: checkpoint {show(saved[key])}, run {show(run[key])}"
        for key, label, compared, show in _STREAM_FIELDS
        if compared(saved[key]) != compared(run[key])
    ]


class ResumePoint(NamedTuple):
    step: int
    consumed_samples: int
    changes: list  # what differs from the checkpoint and is honoured (batch size) or overridden
    warning: Optional[str]  # the position could only be assumed (a checkpoint without the record)


def resume_point(extra: dict, step: int, run: dict, override: bool, source: str) -> ResumePoint:
    """Where a run with stream record `run` resumes from a checkpoint of `step` holding `extra`.

    CheckpointError naming every difference of the stream and OVERRIDE_DATA_CHECK, unless `override`.
    """
    saved = extra.get(STREAM)
    batch = run["global_batch_size"]
    if saved is None:
        return ResumePoint(
            step,
            step * batch,
            [],
            f"{source} records no data position (written before it was "
            f"recorded): assuming step {step} x global batch {batch} = {step * batch} samples consumed",
        )
    differences = stream_differences(saved, run)
    if differences and not override:
        raise CheckpointError(
            f"{source} was trained on another sample stream: {'; '.join(differences)}. Resume with "
            f"the checkpoint's settings, or pass {OVERRIDE_DATA_CHECK} to continue from sample "
            f"{saved['consumed_samples']} with the new ones"
        )
    changes = [f"overridden ({OVERRIDE_DATA_CHECK}): {d}" for d in differences]
    if saved["global_batch_size"] != batch:
        changes.insert(0, f"global batch {saved['global_batch_size']} -> {batch}")
    return ResumePoint(step, saved["consumed_samples"], changes, None)


def schedule_fields(schedule) -> dict:
    return {"kind": type(schedule).__name__, **dataclasses.asdict(schedule)}


def lr_plan_record(schedule, global_batch_size: int, position) -> dict:
    """The LR plan of a run: its step schedule, the global batch its steps were planned at, the next position."""
    return {"schedule": schedule_fields(schedule), "global_batch_size": global_batch_size, "position": str(position)}


def lr_plan_differences(saved: dict, schedule) -> list:
    """ "field: checkpoint X, run Y" for every field of the LR plan that differs."""
    a, b = saved["schedule"], schedule_fields(schedule)
    return [f"{k}: checkpoint {a.get(k)!r}, run {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_lr_plan(saved: dict, schedule, override: bool, source: str) -> list:
    """The differences `override` accepts ([] when equal); CheckpointError naming them and OVERRIDE_SCHEDULE."""
    differences = lr_plan_differences(saved, schedule)
    if differences and not override:
        raise CheckpointError(
            f"{source} was trained with another LR plan: {'; '.join(differences)}. Resume with the "
            f"checkpoint's LR flags, or pass {OVERRIDE_SCHEDULE} to follow the new plan from here"
        )
    return differences


def saved_position(saved: dict) -> Fraction:
    return Fraction(saved["position"])
