"""The loss-spike rule of --loss-spike-factor: above factor x the running median, after a warm-up."""

import pytest

from megamamba.pipelines.loop.faults import SPIKE_MIN_HISTORY, SPIKE_WINDOW, LossSpikes


def test_no_loss_is_judged_before_the_history_fills_and_none_without_a_factor():
    spikes, off = LossSpikes(2.0), LossSpikes(None)
    assert not any(spikes.is_spike(x) for x in [1.0] + [100.0] * (SPIKE_MIN_HISTORY - 1))
    assert not any(off.is_spike(x) for x in [1.0] * 20 + [1e9])


def test_a_loss_above_factor_times_the_median_is_a_spike_and_stays_out_of_the_history():
    spikes = LossSpikes(3.0)
    for x in [4.0, 3.0, 2.0, 2.5] * 3:
        assert not spikes.is_spike(x)
    assert spikes.threshold() == pytest.approx(3.0 * 2.75)
    assert spikes.is_spike(9.0) and spikes.is_spike(50.0)
    assert spikes.threshold() == pytest.approx(3.0 * 2.75) and not spikes.is_spike(8.0)
    assert len(spikes.recent) <= SPIKE_WINDOW


@pytest.mark.parametrize("factor", [1.0, 0.5, -2.0])
def test_a_factor_that_is_not_above_1_is_refused(factor):
    with pytest.raises(ValueError, match=rf"--loss-spike-factor {factor}: must be > 1"):
        LossSpikes(factor)
