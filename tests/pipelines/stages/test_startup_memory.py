"""Start-up memory: a rank materializes only its pipeline stage and tensor-parallel shards.

benchmarks/startup_memory.py on the Mamba-2 370M config: peak host memory (RSS) of each rank from
process start until its engine is built, at (dp, tp, pp) = (1, 1, 1) on one rank and (1, 2, 2) on
four. Each of the four holds about a quarter of the parameters (the first and last stages both
hold their half of the tied embedding), one full piece (layer, embedding) at a time while
initialising, and DeepSpeed's ZeRO flattening holds about 3x the stage's parameters at its peak.
Measured: (1,1,1) 4.57 GiB, (1,2,2) 1.66 GiB per rank (ratio 0.36), of which 0.26-0.47 GiB is the
process itself (torch, DeepSpeed, the training data). Before freed tensors were unmapped
(`pipelines.memory.host`) a (1,2,2) rank reached 2.0-2.2 GiB; before ranks built only their own
pieces, it also held the whole model once.
"""

import subprocess
import sys

import pytest

from train_entry import ROOT

MODEL = ROOT / "launch/models/mamba2-370m.json"


@pytest.mark.slow
def test_a_tp2_pp2_rank_starts_with_at_most_two_fifths_of_the_single_rank_memory():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/startup_memory.py"),
            "--model-config",
            str(MODEL),
            "--max-ratio",
            "0.4",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
