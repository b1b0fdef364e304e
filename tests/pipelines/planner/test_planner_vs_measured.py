"""The shipped H200 profile against the runs measured on that GPU (benchmarks/measured_runs.json, from
benchmarks/RESULTS.md): tokens/s within 30% of every run, and no predicted MFU above the best measured plus 5
points."""

import importlib.util
import os

from train_entry import ROOT


def test_h200_predictions_are_within_the_band_of_every_measured_run(capsys):
    spec = importlib.util.spec_from_file_location("vs", os.path.join(ROOT, "benchmarks", "planner_vs_measured.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    out = capsys.readouterr().out
    assert "over 9 runs: within the 30% band" in out
    assert "H200: highest predicted MFU" in out and "(within it + 5%)" in out
