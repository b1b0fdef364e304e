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
    """Per steady-state step: project code's host syncs and DeepSpeed's device synchronizations;
    and the dtypes DeepSpeed would reduce gradients in (`comm_dtype`, set under torch_autocast)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    from deepspeed.accelerator import get_accelerator

    script = load_train_script()
    syncs, device_syncs, starts, comm_dtypes = strict_collectives.MODE.syncs, [], [], set()
    accelerator = get_accelerator()
    synchronize = accelerator.synchronize

    def counting_synchronize(*args, **kwargs):
        device_syncs.append(1)
        return synchronize(*args, **kwargs)

    accelerator.synchronize = counting_synchronize
    from megamamba.pipelines.job import run

    build = run.build_trainer

    def counting_build_trainer(*args, **kwargs):
        trainer = build(*args, **kwargs)
        comm_dtypes.update(str(getattr(p, "comm_dtype", None)) for _, _, p in trainer.named_parameters())
        step = trainer.train_step

        def train_step(batches):
            starts.append((len(syncs), len(device_syncs)))
            return step(batches)

        trainer.train_step = train_step
        return trainer

    run.build_trainer = counting_build_trainer
    script.main(argv)
    steady = list(zip(starts[1:-1], starts[2:]))
    return {
        "syncs": [syncs[a:b] for (a, _), (b, _) in steady],
        "device_syncs": [b - a for (_, a), (_, b) in steady],
        "comm_dtypes": sorted(comm_dtypes),
    }


def _run(tmp_path, mixer, world, flags, ds, n_layer):
    model = tmp_path / f"{mixer}-{n_layer}.json"
    model.write_text(
        json.dumps({**json.loads((ROOT / f"launch/models/tiny-{mixer}.json").read_text()), "n_layer": n_layer})
    )
    ds_path = tmp_path / f"ds-{abs(hash(json.dumps(ds, sort_keys=True)))}.json"
    ds_path.write_text(json.dumps({"train_batch_size": 8, "steps_per_print": 10**6, **ds}))
    argv = [
        "--deepspeed_config",
        str(ds_path),
        "--model-config",
        str(model),
        "--train-iters",
        str(STEPS),
        "--seq-length",
        "32",
        "--log-interval",
        "1000",
        *flags,
    ]
    return run_ranks(
        _count_syncs_per_step,
        world,
        args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]),
        init_process_group=False,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mixer,world,flags,zero",
    [
        ("mamba2", 1, [], 1),
        ("mamba2", 2, ["--pp", "2"], 1),
        ("mamba2", 2, ["--tp", "2"], 0),
        ("mamba1", 2, ["--pp", "2"], 0),
    ],
)
def test_one_host_synchronization_per_step_at_any_depth_and_accumulation(tmp_path, mixer, world, flags, zero):
    for n_layer, micro in ((2, 4), (4, 1)):  # gradient accumulation 8 / (micro x dp)
        ds = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": zero}}
        for rank, counted in enumerate(_run(tmp_path, mixer, world, flags, ds, n_layer)):
            assert [len(s) for s in counted["syncs"]] == [1] * (STEPS - 2), (n_layer, micro, rank, counted["syncs"])
            assert counted["device_syncs"] == [0] * (STEPS - 2), (n_layer, micro, rank)


@pytest.mark.slow
def test_bf16_autocast_steps_reduce_gradients_in_float32_without_device_synchronizations(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 1},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    }
    (counted,) = _run(tmp_path, "mamba2", 1, [], ds, 2)
    assert counted["comm_dtypes"] == ["None"]
    assert [len(s) for s in counted["syncs"]] == [1] * (STEPS - 2) and counted["device_syncs"] == [0] * (STEPS - 2)
