"""Packed short documents with seq_idx on: pipeline and tensor-parallel layouts train the (1,1,1) curve.

The dataset is tests/train_runs.py's `packed_documents`: the built-in corpus cut into its lines,
one short document each, so every 32-token sample holds several document boundaries. A run with
--no-reset-at-documents shows that the resets move the curve well beyond the tolerance (by 1.2e-3
over these 5 steps), so a stage that dropped seq_idx would fail the comparison.
"""

import pytest

from train_runs import losses, relative_curve_error

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
MIXER = "mamba2"


@pytest.fixture(scope="module")
def packed_reference(train_runs, packed_documents):
    (summary,) = train_runs.spawned(1, MIXER, packed_documents)
    return summary["records"]


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_packed_documents_train_the_single_rank_curve_at_pipeline_and_tensor_parallel_layouts(
    train_runs, packed_documents, packed_reference, tp, pp
):
    ranks = train_runs.spawned(tp * pp, MIXER, [*packed_documents, "--tp", str(tp), "--pp", str(pp)])
    for rank, summary in enumerate(ranks):
        for key in ("loss", "val_loss"):
            error = relative_curve_error(losses(summary["records"], key), losses(packed_reference, key))
            print(f"packed documents, (1,{tp},{pp}) rank {rank}: max relative {key} difference to (1,1,1) {error:.1e}")
            assert error <= TOLERANCE, (rank, key, losses(summary["records"], key), losses(packed_reference, key))


def test_resetting_at_documents_changes_the_curve_beyond_the_tolerance(train_runs, packed_documents, packed_reference):
    (unreset,) = train_runs.spawned(1, MIXER, [*packed_documents, "--no-reset-at-documents"])
    error = relative_curve_error(losses(unreset["records"]), losses(packed_reference))
    print(f"packed documents without resets: max relative loss difference {error:.1e}")
    assert error > 5 * TOLERANCE, error  # measured 1.2e-3: one of the 3 blocks alone moves it past 1e-4
