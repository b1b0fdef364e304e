"""Mamba-3 hybrids (M*-) train through the real `deepspeed` launcher at five (dp, cp, tp, pp) layouts, with packed
documents crossing the context-parallel rank edges, and their 5-step float32 loss curves equal the one-rank run's
(spawned ranks, the same entry point).

Each layout runs one variant, SISO (launch/models/tiny-mamba3-hybrid.json) or MIMO (the same hybrid with
tiny-mamba3-mimo.json's ssm_cfg: rank 2, output norm), chosen so that each variant crosses every kind of rank
edge: data (2,1,1,1) MIMO and (2,2,1,2) SISO; context (1,2,2,1) and (2,2,1,2) SISO, (1,4,1,1) MIMO; tensor
(1,2,2,1) SISO with sequence parallelism, (1,1,2,2) MIMO; pipeline (1,1,2,2) MIMO and (2,2,1,2) SISO. A launched
run costs the suite 10-30 s, so running both variants everywhere would double that for no new rank edge.
"""

import pytest

from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4

LAYOUTS = [
    # (dp, cp, tp, pp), mixer, extra flags
    ((2, 1, 1, 1), "mamba3-mimo-hybrid", []),
    ((1, 1, 2, 2), "mamba3-mimo-hybrid", []),
    ((1, 2, 2, 1), "mamba3-hybrid", ["--sequence-parallel"]),
    ((1, 4, 1, 1), "mamba3-mimo-hybrid", []),
    ((2, 2, 1, 2), "mamba3-hybrid", []),
]


@pytest.mark.parametrize("layout, mixer, extra", LAYOUTS, ids=[f"{m}-{lay}" for lay, m, _ in LAYOUTS])
def test_mamba3_hybrid_layout_trains_the_one_rank_loss_curve(train_runs, packed_documents, layout, mixer, extra):
    dp, cp, tp, pp = layout
    reference = train_runs.spawned(1, mixer, flags=packed_documents)[0]["records"]
    flags = [*packed_documents, "--cp", str(cp), "--tp", str(tp), "--pp", str(pp), *extra]
    run = train_runs.launched(dp * cp * tp * pp, mixer, flags=flags)
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    curve, expected = losses(run["records"]), losses(reference)
    assert len(curve) == 5
    error = relative_curve_error(curve, expected)
    print(f"{mixer} {layout}: max relative loss difference to (1,1,1,1) {error:.1e}")
    assert error <= TOLERANCE, (curve, expected)
