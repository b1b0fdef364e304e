"""How a checkpoint travels at (2,1,2) with ZeRO-1: files per rank, object collectives carry metadata.

Four spawned ranks run launch/train.py with every object collective wrapped: during a save or a
load each payload is pickled and measured (under NCCL an object collective is copied onto the
device, and its destination allocates world size x the largest payload). Every write of tensors
is counted per rank. Then: no payload above CAP; each rank writes the ZeRO partition it updates
(its fragments of the fp32 masters and moments) and its RNG file, and the ranks' writes add up
to the checkpoint; a second run resumes bit-identically and finds every optimizer state tensor
where torch's AdamW keeps it for its (flat ZeRO) parameter.
"""

import pickle

import pytest
import torch

from distributed import run_ranks
from megamamba.checkpoint import Checkpoint
from train_entry import run_train

pytestmark = pytest.mark.slow

CAP = 4096  # bytes per payload; the rule is "small metadata", docs/architecture.md asks for a few KB
LAYOUT = (2, 1, 2)
OBJECT_COLLECTIVES = {
    "gather_object": lambda obj, *a, **k: [obj],
    "all_gather_object": lambda out, obj, *a, **k: [obj],
    "broadcast_object_list": lambda objs, *a, **k: objs,
    "scatter_object_list": lambda out, objs=None, *a, **k: objs or [],
}


def _placement(optimizer) -> list:
    """(key, matches) per optimizer state tensor: its dtype and device equal those torch's AdamW gives a
    parameter like its own in the same group (`step`: float32 on the device when fused or capturable)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            like = torch.nn.Parameter(torch.zeros(2, dtype=p.dtype, device=p.device))
            reference = torch.optim.AdamW([like], fused=group.get("fused"), capturable=group.get("capturable", False))
            like.grad = torch.ones_like(like)
            reference.step()
            for key, value in optimizer.state[p].items():
                ref = reference.state[like][key]
                out.append((key, torch.is_tensor(value) and (value.dtype, value.device) == (ref.dtype, ref.device)))
    return out


def _measured_rank(argv, extensions_dir):
    """One rank of train.py; returns its summary with the checkpoint's object payloads, tensor writes and placement."""
    import torch.distributed as dist

    from megamamba.checkpoint import files
    from megamamba.pipelines.job import checkpointing

    seen = {"payloads": [], "written": [], "placement": []}
    active = []

    for name, objects in OBJECT_COLLECTIVES.items():
        original = getattr(dist, name)

        def wrapped(*args, _name=name, _objects=objects, _original=original, **kwargs):
            if active:
                seen["payloads"] += [(_name, len(pickle.dumps(o))) for o in _objects(*args, **kwargs)]
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)

    def write_tensors(path, tensors, *args, _original=files.write_tensors, **kwargs):
        seen["written"].append((path.rsplit("/", 1)[-1], sum(t.numel() * t.element_size() for t in tensors.values())))
        return _original(path, tensors, *args, **kwargs)

    files.write_tensors = write_tensors

    def measured(original, after=None):
        def run(*args, **kwargs):
            active.append(1)
            try:
                result = original(*args, **kwargs)
            finally:
                active.pop()
            if after:
                after(*args)
            return result

        return run

    def placement(trainer, *_):
        zero = checkpointing._zero(trainer)
        seen["placement"] = _placement(zero.optimizer if zero is not None else trainer.engine_optimizer())

    checkpointing.save = measured(checkpointing.save)
    checkpointing.open_for_run = measured(checkpointing.open_for_run)
    checkpointing.load = measured(checkpointing.load, after=placement)
    return {**run_train(argv, extensions_dir), **seen}


def _run(resume_runs, flags):
    out = resume_runs.new_dir()
    ranks = run_ranks(
        _measured_rank,
        4,
        args=(resume_runs.argv(out, LAYOUT, 1, flags), resume_runs.extensions_dir),
        init_process_group=False,
        timeout=400,
    )
    return ranks


def _stage_bytes(path: str, stage_files: list) -> int:
    """Tensor bytes of the given files of a checkpoint."""
    from safetensors import safe_open

    total = 0
    for name in stage_files:
        with safe_open(f"{path}/{name}", "pt") as f:
            total += sum(t.numel() * t.element_size() for t in map(f.get_tensor, f.keys()))
    return total


@pytest.fixture(scope="module")
def saved(resume_runs, tmp_path_factory):
    save = tmp_path_factory.mktemp("transport") / "ckpt"
    ranks = _run(resume_runs, ["--train-iters", "3", "--save", str(save), "--save-interval", "2"])
    return ranks, save


def test_a_pipeline_save_moves_tensors_through_files_and_each_rank_writes_only_its_partition(saved):
    ranks, save = saved
    payloads = [p for r in ranks for p in r["payloads"]]
    print(f"object collectives during 2 saves: {len(payloads)} payloads, largest {max(n for _, n in payloads)} B")
    assert payloads and all(n <= CAP for _, n in payloads), sorted(payloads, key=lambda p: -p[1])[:5]

    path = str(save / "step_000002")
    ckpt = Checkpoint(path)  # every sha256 checked
    assert ckpt.model_tensors().keys() and len(ckpt.optimizer_tensors()) > 0
    per_save = [r["written"][: len(r["written"]) // 2] for r in ranks]
    assert [[name for name, _ in files] for files in per_save] == [
        [f"model-rank-{r:05d}.safetensors", f"optimizer-rank-{r:05d}.safetensors", f"rng-rank-{r:05d}.safetensors"]
        for r in range(4)
    ]
    written = [sum(n for _, n in files[:2]) for files in per_save]
    total = _stage_bytes(path, [name for files in per_save for name, _ in files[:2]])
    print(f"tensor bytes written per rank per save: {written}; the checkpoint holds {total}")
    assert sum(written) == total and max(written) < total / 2


def test_a_pipeline_resume_is_exact_and_puts_optimizer_state_where_torch_adamw_keeps_it(resume_runs, saved):
    ranks, save = saved
    resumed = _run(resume_runs, ["--train-iters", "3", "--load", str(save / "step_000002")])
    assert [r["step"] for r in resumed[0]["records"]] == [2]
    assert resumed[0]["records"][0]["loss"] == ranks[0]["records"][2]["loss"]
    for r in resumed:
        keys = sorted({k for k, _ in r["placement"]})
        assert keys == ["exp_avg", "exp_avg_sq", "step"] and all(ok for _, ok in r["placement"]), r["placement"]
    payloads = [p for r in resumed for p in r["payloads"]]
    assert all(n <= CAP for _, n in payloads), payloads
