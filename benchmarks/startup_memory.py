"""Start-up host memory: peak RSS per rank until the engine is built, (1,1,1) against (1,2,2).

    python benchmarks/startup_memory.py [--model-config launch/models/mamba2-1.3b.json] [--max-ratio 0.35]

Runs launch/train.py's start-up (`prepare`, the process groups, `build_trainer`) with
launch/configs/tiny-cpu.json (ZeRO 1, float32) at (dp, tp, pp) = (1, 1, 1) on one rank, then at
(1, 2, 2) on four, never both at once, the stages holding equal numbers of blocks (`type:Block`: the
default cost partition gives the first stage more blocks, the last the head). Each rank is a freshly
spawned process on gloo with the environment the deepspeed launcher gives a rank, so its ru_maxrss is
its peak since process start; it reports that peak (GiB) and the seconds since its process started,
once its engine is built.
Prints both runs and the ratio of the largest (1,2,2) peak to the (1,1,1) peak; exits 1 when the
ratio is above --max-ratio.

Before each run it compares /proc/meminfo's MemAvailable with the run's estimate (per rank: the
process itself plus RSS_PER_PARAMETER_BYTE x its stage's float32 parameter bytes, as
`pipelines.memory.plan` counts them); while short it waits and looks again, and after
MEMORY_TRIES looks it exits 3 without running.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import resource
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DS_CONFIG = os.path.join(REPO, "launch/configs/tiny-cpu.json")
LAYOUTS = ((1, 1, 1), (1, 2, 2))  # (dp, tp, pp)
PARTITION = "type:Block"  # equal blocks per stage: each stage holds half the blocks, as the ratio's bound assumes
GiB = 2**30
PROCESS_GIB = 0.5  # a rank before its model: torch, DeepSpeed and the training data (measured 0.26-0.47)
RSS_PER_PARAMETER_BYTE = 3.5  # peak above that per stage parameter byte (measured 3.0 at (1,1,1), 3.5 at (1,2,2))
MEMORY_TRIES, MEMORY_WAIT_S = 10, 60
RANK_TIMEOUT_S = 1800


def seconds_since_process_start() -> float:
    """Seconds since this process started, from its start time in /proc (clock ticks after boot)."""
    with open("/proc/self/stat") as f:
        started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def load_train_script():
    """launch/train.py as a module."""
    spec = importlib.util.spec_from_file_location("megamamba_train_script", os.path.join(REPO, "launch", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, fn, args: tuple, world: int, port: int, results) -> None:
    """One spawned rank: the environment the deepspeed launcher gives it, then fn(*args) into `results`."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    results.put((rank, fn(*args)))


def run_ranks(fn, world: int, args: tuple, timeout: float) -> list:
    """fn(*args) on `world` freshly spawned processes, their results in rank order; a rank's exception is
    raised here, and ranks still running after `timeout` seconds are killed."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(
        _rank, args=(fn, args, world, port, results), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(f"{world} ranks did not finish within {timeout:.0f} s")
    found = dict(results.get() for _ in range(world))
    return [found[rank] for rank in range(world)]


def rank_startup(model_config: str, tp: int, pp: int) -> tuple:
    """(peak RSS in GiB, seconds since process start) of this rank once launch/train.py's start-up has built
    its engine; run on every rank of the layout (WORLD_SIZE = tp x pp)."""
    from deepspeed.utils import logger

    from megamamba.parallel.groups import init_distributed, shutdown_distributed
    from megamamba.pipelines.loop.engine import build_trainer

    logger.setLevel(logging.WARNING)
    script = load_train_script()
    args = script.parse_args(
        [
            "--deepspeed_config",
            DS_CONFIG,
            "--model-config",
            model_config,
            "--train-iters",
            "1",
            "--seq-length",
            "64",
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--partition-method",
            PARTITION,
        ]
    )
    plan = script.prepare(args, int(os.environ["WORLD_SIZE"]))
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's op build and the pipeline's partition
        init_distributed()
        build_trainer(
            plan.layout,
            plan.model,
            plan.engine_config,
            plan.optimizer,
            args.seed,
            args.partition_method,
            args.checkpoint_activations_interval,
            args.sequence_parallel,
            seq_length=args.seq_length,
        )
    seconds = seconds_since_process_start()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    shutdown_distributed()
    return peak, seconds


def estimated_gib(model_config: str, tp: int, pp: int) -> float:
    """What the ranks of a (1, tp, pp) run are expected to hold at their peaks together, GiB."""
    from megamamba.config import MambaConfig
    from megamamba.pipelines.config.layout import resolve_layout
    from megamamba.pipelines.memory.plan import RunShape, plan_memory

    with open(model_config) as f:
        model = MambaConfig.from_dict(json.load(f))
    with open(DS_CONFIG) as f:
        layout = resolve_layout(tp * pp, tp, pp, json.load(f))
    shape = RunShape(model, layout, 64, zero_stage=1, partition_method=PARTITION)
    stage_bytes = max(stage.parameters for stage in plan_memory(shape).stages)
    return tp * pp * (PROCESS_GIB + RSS_PER_PARAMETER_BYTE * stage_bytes / GiB)


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / GiB


def wait_for_memory(needed: float, what: str) -> bool:
    """True once MemAvailable covers `needed` GiB; False after MEMORY_TRIES looks MEMORY_WAIT_S apart."""
    for attempt in range(1, MEMORY_TRIES + 1):
        available = available_gib()
        if available >= needed:
            return True
        print(
            f"{what}: needs about {needed:.1f} GiB, MemAvailable is {available:.1f} GiB "
            f"(look {attempt} of {MEMORY_TRIES})",
            file=sys.stderr,
            flush=True,
        )
        if attempt < MEMORY_TRIES:
            time.sleep(MEMORY_WAIT_S)
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", default=os.path.join(REPO, "launch/models/mamba2-1.3b.json"))
    p.add_argument(
        "--max-ratio",
        type=float,
        default=0.35,
        help="largest (1,2,2) peak over the (1,1,1) peak above which the exit status is 1",
    )
    args = p.parse_args(argv)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))  # DeepSpeed's shm op
    import deepspeed
    import torch

    name = os.path.splitext(os.path.basename(args.model_config))[0]
    print(
        f"{name} start-up peak RSS per rank (torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, "
        f"{os.cpu_count()} CPUs, {available_gib():.1f} GiB available)",
        flush=True,
    )
    peaks = {}
    for dp, tp, pp in LAYOUTS:
        what = f"({dp},{tp},{pp}) on {tp * pp} rank{'s' if tp * pp > 1 else ''}"
        if not wait_for_memory(estimated_gib(args.model_config, tp, pp), what):
            print(f"startup_memory.py: not enough memory for {what}; it did not run", file=sys.stderr)
            return 3
        ranks = run_ranks(rank_startup, tp * pp, (args.model_config, tp, pp), RANK_TIMEOUT_S)
        peaks[(dp, tp, pp)] = max(peak for peak, _ in ranks)
        print(f"  {what}: " + ", ".join(f"{peak:.2f} GiB in {s:.0f} s" for peak, s in ranks), flush=True)
    ratio = peaks[LAYOUTS[1]] / peaks[LAYOUTS[0]]
    print(f"  largest (1,2,2) peak / (1,1,1) peak = {ratio:.2f} (at most {args.max_ratio})", flush=True)
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
