"""A Mamba-3 hybrid (launch/models/tiny-mamba3-hybrid.json, M*-) trains through the real `deepspeed` launcher at
(dp, cp, tp, pp) = (1, 2, 2, 1) with sequence parallelism and packed documents crossing the context-parallel
rank edge, and its 5-step float32 loss curve equals the one-rank run's (spawned ranks, the same entry point)."""

import pytest

from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow

MIXER = "mamba3-hybrid"
TOLERANCE = 1e-4


def test_mamba3_hybrid_at_cp2_tp2_with_sp_trains_the_one_rank_loss_curve(train_runs, packed_documents):
    reference = train_runs.spawned(1, MIXER, flags=packed_documents)[0]["records"]
    run = train_runs.launched(4, MIXER, flags=[*packed_documents, "--cp", "2", "--tp", "2", "--sequence-parallel"])
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    curve, expected = losses(run["records"]), losses(reference)
    assert len(curve) == 5
    assert relative_curve_error(curve, expected) <= TOLERANCE, (curve, expected)
