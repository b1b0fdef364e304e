"""The planner's predictions beside the training runs measured on GPUs: per run, tokens/s, peak memory and MFU.

    python benchmarks/planner_vs_measured.py [--runs benchmarks/measured_runs.json]

Each run of benchmarks/measured_runs.json (copied from benchmarks/RESULTS.md, with its date and section) is
predicted with its GPU's shipped profile (launch/profiles/), its layout fixed as it ran. Printed: a markdown table,
the band the tokens/s ratios fall in, and the highest MFU predicted against the best any run measured on that
GPU. Exit status 1 when a tokens/s prediction is off by more than BAND, or a predicted MFU exceeds the best
measured MFU on its GPU by more than MFU_MARGIN.
"""

import argparse
import contextlib
import os
import sys

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs its accelerator choice to stdout: keep the table clean
    from megamamba.pipelines.planner.measured_runs import load_runs, predict
    from megamamba.pipelines.planner.profile import load_profile
    from megamamba.pipelines.planner.search import MFU_MARGIN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = {"H200": "h200.json", "H100": "h100-80gb.json", "A100": "a100-80gb.json"}
BAND = 0.30  # predicted tokens/s within 30% of measured
GiB = 2**30


def table(runs: list) -> tuple:
    """(markdown lines, tokens/s ratios, {gpu: (highest predicted MFU, best measured MFU)})."""
    lines = [
        "| date | GPU | engine | model | micro x accum | tokens/s measured | predicted | ratio "
        "| peak GiB measured | predicted | ratio | MFU measured | predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios, mfus = [], {}
    for run in runs:
        profile = load_profile(os.path.join(REPO, "launch", "profiles", PROFILES[run.gpu]))
        plan = predict(run, profile)
        predicted, measured_mfu = plan.tokens_per_s_per_gpu, run.mfu(profile.mfu_flops_per_s)
        memory = plan.memory.total / GiB
        ratios.append(predicted / run.tokens_per_s)
        highest, best = mfus.get(run.gpu, (0.0, 0.0))
        mfus[run.gpu] = (max(highest, plan.mfu), max(best, measured_mfu))
        lines.append(
            f"| {run.date} | {run.gpu} | {run.engine} | {run.model} | {run.micro_batch_size} x {run.grad_accum} "
            f"| {run.tokens_per_s:,.0f} | {predicted:,.0f} | {predicted / run.tokens_per_s:.2f} "
            f"| {run.peak_gib:.1f} | {memory:.1f} | {memory / run.peak_gib:.2f} "
            f"| {measured_mfu:.1%} | {plan.mfu:.1%} |"
        )
    return lines, ratios, mfus


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=os.path.join(REPO, "benchmarks", "measured_runs.json"))
    args = p.parse_args(argv)
    lines, ratios, mfus = table(load_runs(args.runs))
    print("\n".join(lines))
    inside = all(abs(r - 1) <= BAND for r in ratios)
    print(
        f"\npredicted / measured tokens/s {min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} runs: "
        f"{'within' if inside else 'outside'} the {BAND:.0%} band"
    )
    capped = True
    for gpu, (highest, best) in mfus.items():
        capped &= highest <= best + MFU_MARGIN
        print(
            f"{gpu}: highest predicted MFU {highest:.1%}, best measured {best:.1%} "
            f"({'within' if highest <= best + MFU_MARGIN else 'above'} it + {MFU_MARGIN:.0%})"
        )
    return 0 if inside and capped else 1


if __name__ == "__main__":
    sys.exit(main())
