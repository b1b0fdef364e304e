"""A training step makes one host synchronization from project code, whatever the depth and accumulation.

Counted by strict mode (tests/strict_collectives.py): `.item()`, `.tolist()`, `bool()`/`float()` of
a tensor, `.cpu()`, blocking host-to-device copies, made by megamamba, its kernels and pipelines
or launch/train.py. On a GPU each one stalls the host until the device's queue drains.
"""
import json
import os

import pytest

import strict_collectives
from distributed import run_ranks
from train_entry import ROOT, load_train_script

STEPS = 6  # steady state: the steps between the first (start-up, log line) and the last (log line)


def _count_syncs_per_step(argv, extensions_dir):
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    script = load_train_script()
    syncs, starts = strict_collectives.MODE.syncs, []
    build = script.build_trainer

    def counting_build_trainer(*args, **kwargs):
        trainer = build(*args, **kwargs)
        step = trainer.train_step

        def train_step(batches):
            starts.append(len(syncs))
            return step(batches)

        trainer.train_step = train_step
        return trainer

    script.build_trainer = counting_build_trainer
    script.main(argv)
    return [syncs[a:b] for a, b in zip(starts[1:-1], starts[2:])]


@pytest.mark.slow
@pytest.mark.parametrize("mixer,world,flags,zero", [
    ("mamba2", 1, [], 1), ("mamba2", 1, [], 0), ("mamba2", 2, ["--pp", "2"], 1), ("mamba2", 2, ["--tp", "2"], 0),
    ("mamba1", 1, [], 1), ("mamba1", 2, ["--pp", "2"], 0),
])
def test_one_host_synchronization_per_step_at_any_depth_and_accumulation(tmp_path, mixer, world, flags, zero):
    counts = {}
    for n_layer, micro in ((2, 4), (4, 1)):  # grad accumulation 8 / (micro x dp)
        model = tmp_path / f"{mixer}-{n_layer}.json"
        model.write_text(json.dumps({**json.loads((ROOT / f"launch/models/tiny-{mixer}.json").read_text()),
                                     "n_layer": n_layer}))
        ds = tmp_path / f"ds-{micro}.json"
        ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": micro,
                                  "zero_optimization": {"stage": zero}, "steps_per_print": 10**6}))
        argv = ["--deepspeed_config", str(ds), "--model-config", str(model), "--train-iters", str(STEPS),
                "--seq-length", "32", "--log-interval", "1000", *flags]
        per_step = run_ranks(_count_syncs_per_step, world, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False,
                             timeout=300)
        counts[(n_layer, micro)] = per_step
    for (n_layer, micro), per_rank in counts.items():
        for rank, steps in enumerate(per_rank):
            assert [len(s) for s in steps] == [1] * (STEPS - 2), (n_layer, micro, rank, steps)
