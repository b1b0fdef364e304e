"""Start-up memory: a rank materializes only its pipeline stage and tensor-parallel shards.

Peak host memory (RSS) of each rank from process start until its engine is built, for the
Mamba-2 370M config at (dp, tp, pp) = (1, 1, 1) on one rank and (1, 2, 2) on four: each of the
four holds about a quarter of the parameters (the first and last stages both hold their half
of the tied embedding), and one full piece (layer, embedding) at a time while initialising.
Measured: (1,1,1) 4.59 GiB, (1,2,2) 2.02-2.12 GiB per rank, of which 0.47 GiB is the process
itself (torch, DeepSpeed) and most of the rest DeepSpeed's ZeRO flattening (about 3x the stage's
parameters at its peak). Before ranks built only their own pieces, a (1,2,2) rank also held
the whole model once (about 3.5 GiB in all).
"""
import os
import resource
import time

import pytest

from distributed import run_ranks
from train_entry import ROOT, load_train_script

MODEL = ROOT / "launch/models/mamba2-370m.json"
DS_CONFIG = ROOT / "launch/configs/tiny-cpu.json"


def _build(model, flags, extensions_dir):
    """Peak RSS (GiB) and seconds from process start until this rank's engine is built."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    script = load_train_script()
    from megamamba.parallel.groups import init_distributed, shutdown_distributed

    args = script.parse_args(["--deepspeed_config", str(DS_CONFIG), "--model-config", str(model),
                              "--train-iters", "1", "--seq-length", "64", *flags])
    started = time.monotonic()
    plan = script.prepare(args, int(os.environ["WORLD_SIZE"]))
    init_distributed()
    script.build_trainer(plan.layout, plan.model, plan.engine_config, plan.optimizer, args.seed, args.partition_method,
                         args.checkpoint_activations_interval)
    seconds = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    shutdown_distributed()
    return peak, seconds


@pytest.mark.slow
def test_a_tp2_pp2_rank_starts_with_at_most_half_the_single_rank_memory():
    extensions = os.environ["TORCH_EXTENSIONS_DIR"]
    (whole,) = run_ranks(_build, 1, args=(MODEL, [], extensions), init_process_group=False, timeout=600)
    split = run_ranks(_build, 4, args=(MODEL, ["--tp", "2", "--pp", "2"], extensions), init_process_group=False,
                      timeout=600)
    print(f"mamba2-370m start-up peak RSS: (1,1,1) {whole[0]:.2f} GiB in {whole[1]:.0f} s; (1,2,2) per rank "
          + ", ".join(f"{peak:.2f} GiB in {s:.0f} s" for peak, s in split))
    assert max(peak for peak, _ in split) <= 0.5 * whole[0], (whole, split)
