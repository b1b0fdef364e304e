"""Training runs measured on GPUs (benchmarks/measured_runs.json, from benchmarks/RESULTS.md) and the planner's
prediction of each: the same model, sequence, GPUs and batch split, every layout setting fixed as the run had it.
"""

import json
import os
from dataclasses import dataclass

from megamamba.config import MambaConfig
from megamamba.model.flops import training_flops_per_token
from megamamba.pipelines.planner.profile import Profile
from megamamba.pipelines.planner.search import Plan, Request, search

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch", "models")


@dataclass(frozen=True)
class MeasuredRun:
    """One GPU's run of `model` (launch/models/<model>.json) as benchmarks/RESULTS.md records it."""

    gpu: str
    date: str
    section: str
    engine: str
    model: str
    micro_batch_size: int
    grad_accum: int
    tokens_per_s: float
    peak_gib: float
    seq_length: int = 2048
    zero_stage: int = 1

    def config(self) -> MambaConfig:
        return MambaConfig.from_json(os.path.join(MODELS, f"{self.model}.json"))

    def mfu(self, peak_flops_per_s: float) -> float:
        return self.tokens_per_s * training_flops_per_token(self.config(), self.seq_length) / peak_flops_per_s


def load_runs(path: str) -> list:
    with open(path) as f:
        return [MeasuredRun(**run) for run in json.load(f)["runs"]]


def predict(run: MeasuredRun, profile: Profile) -> Plan:
    """The planner's plan for `run`'s layout on one GPU of `profile`."""
    fixed = dict(dp=1, cp=1, tp=1, pp=1, zero_stage=run.zero_stage, micro_batch_size=run.micro_batch_size)
    request = Request(
        run.config(),
        1,
        1,
        run.seq_length,
        run.micro_batch_size * run.grad_accum,
        profile.device_memory_bytes,
        fixed=fixed | {"recompute": False},
    )
    return search(request, profile).plans[0]
