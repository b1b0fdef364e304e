"""A save at (2,2,2) with ZeRO-1 on 8 ranks: no rank's memory grows by more than its own shard, and the
checkpoint loaded at (1,1,1) holds every tensor bit-identical to the (2,2,2) run's assembled state.

Each of 8 spawned ranks runs launch/train.py (a Mamba-2 of d_model 512, 4 layers, so a shard is
megabytes, far above the noise; 257 vocabulary rows, so TP 2 pads one, and one B/C group, so TP
keeps them in a replicated partner parameter) with `checkpointing.save` wrapped: before the save the rank resets
its peak resident memory (writing 5 to /proc/self/clear_refs resets VmHWM), after it reads the
peak; the growth is that peak minus the resident memory before. Its own shard is the state it
updates: the fp32 masters and both Adam moments of its ZeRO partition (12 bytes per element of
its flat partitions). After the save the ranks gather their stage's full state as a gathering
writer would (TP all-gather, DP all-reduce: DeepSpeed's safe_get_full_*) and each stage's first
rank writes it down. One rank then builds the (1,1,1) ZeRO-1 trainer, loads the checkpoint with
`checkpointing.load`, and compares every master, moment and step with that assembled state.
"""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from distributed import run_ranks
from train_entry import load_train_script, run_train

pytestmark = pytest.mark.slow

LAYOUT = (2, 2, 2)
MOMENTS = ("exp_avg", "exp_avg_sq")


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _assembled_state(trainer) -> dict:
    """The stage's full fp32 masters, moments and step under mamba_ssm names (collective over TP and DP)."""
    from types import SimpleNamespace

    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megamamba.parallel import full_tensors
    from megamamba.pipelines.job import checkpointing

    rename = trainer.mamba_name
    zero = checkpointing._zero(trainer)
    (step,) = {s["step"].item() for s in zero.optimizer.state.values()}
    # full_tensors reads only a module's named_parameters: the stage's, from the trainer
    stage = SimpleNamespace(named_parameters=lambda: [(n, p) for n, _, p in trainer.named_parameters()])
    state = {rename(n): t for n, t in full_tensors(stage, trainer.tp, select=safe_get_full_fp32_param).items()}
    for key in MOMENTS:
        gathered = full_tensors(stage, trainer.tp, select=lambda p, key=key: safe_get_full_optimizer_state(p, key))
        state |= {f"{rename(n)}/{key}": t for n, t in gathered.items()}
    return {k: t.detach().clone().contiguous() for k, t in state.items()} | {"step": torch.tensor(step)}


def _saving_rank(argv, extensions_dir, out):
    """One (2,2,2) rank: its save's memory growth and own shard; the stage's first rank writes the assembled state."""
    from megamamba.pipelines.job import checkpointing

    seen = {}
    original = checkpointing.save

    def save(trainer, config, *args, **kwargs):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _memory_kib("VmRSS")
        path = original(trainer, config, *args, **kwargs)
        seen["growth"] = (_memory_kib("VmHWM") - before) * 1024
        zero = checkpointing._zero(trainer)
        seen["own"] = 12 * sum(flat.numel() for flat in zero.single_partition_of_fp32_groups)
        state = _assembled_state(trainer)
        seen["stage"] = 12 * sum(t.numel() for k, t in state.items() if "/" not in k and k != "step")
        if trainer.dp_rank == 0 and trainer.tensor_rank == 0:
            save_file(state, os.path.join(out, f"assembled-stage{trainer.pipe_rank}.safetensors"))
        seen["path"] = path
        return path

    checkpointing.save = save
    return {**run_train(argv, extensions_dir), **seen}


def _loading_rank(argv, extensions_dir, checkpoint_path):
    """The (1,1,1) ZeRO-1 trainer with the checkpoint loaded: its masters, moments and step under mamba_ssm names."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megamamba.parallel.groups import init_distributed, shutdown_distributed
    from megamamba.pipelines.job import checkpointing
    from megamamba.pipelines.loop.engine import build_trainer

    script = load_train_script()
    args = script.parse_args(argv)
    plan = script.prepare(args, 1)
    init_distributed()
    trainer = build_trainer(
        plan.layout,
        plan.model,
        plan.engine_config,
        plan.optimizer,
        args.seed,
        args.partition_method,
        args.checkpoint_activations_interval,
        seq_length=args.seq_length,
    )
    checkpoint = checkpointing.open_for_run(checkpoint_path, None, plan.model)
    checkpointing.load(trainer, checkpoint, plan.model)
    state = {}
    for _, name, p in trainer.named_parameters():
        state[name] = safe_get_full_fp32_param(p).clone()
        state |= {f"{name}/{key}": safe_get_full_optimizer_state(p, key).clone() for key in MOMENTS}
    (step,) = {s["step"].item() for s in checkpointing._zero(trainer).optimizer.state.values()}
    shutdown_distributed()
    return state | {"step": torch.tensor(step)}


def test_a_2_2_2_save_grows_no_rank_by_more_than_its_shard_and_loads_at_1_1_1_bit_identically(resume_runs):
    out = resume_runs.new_dir()
    save = out / "ckpt"
    config = ["--model-config", resume_runs.model_config(d_model=512, pad_vocab_size_multiple=1)]
    argv = resume_runs.argv(out, LAYOUT, 1, ["--train-iters", "2", "--save", str(save)])
    argv[argv.index("--model-config") : argv.index("--model-config") + 2] = config
    ranks = run_ranks(
        _saving_rank, 8, args=(argv, resume_runs.extensions_dir, str(out)), init_process_group=False, timeout=600
    )
    print("rank: save growth / own shard / the stage a gathering writer holds (MiB)")
    for rank, r in enumerate(ranks):
        print(f"  {rank}: {r['growth'] / 2**20:.2f} / {r['own'] / 2**20:.2f} / {r['stage'] / 2**20:.2f}")
    assert all(r["growth"] <= r["own"] for r in ranks), [(r["growth"], r["own"]) for r in ranks]

    assembled = {}
    for stage in range(LAYOUT[2]):
        part = load_file(str(out / f"assembled-stage{stage}.safetensors"))
        assembled |= {k: t for k, t in part.items() if k not in assembled}  # a tied embedding: stage 0's
    single = resume_runs.argv(out, (1, 1, 1), 1, ["--train-iters", "2"])
    single[single.index("--model-config") : single.index("--model-config") + 2] = config
    (loaded,) = run_ranks(
        _loading_rank,
        1,
        args=(single, resume_runs.extensions_dir, ranks[0]["path"]),
        init_process_group=False,
        timeout=300,
    )
    assert loaded.keys() == assembled.keys()
    differ = sorted(k for k in assembled if not torch.equal(loaded[k], assembled[k]))
    assert not differ, differ
