"""The multi-rank harness: results in rank order, ranks see the caller's environment as it is at the call, a
rank's exception re-raised, hangs time out."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import RemoteTraceback, run_ranks

pytestmark = pytest.mark.slow


def _rank_summary(scale):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale, os.environ["LOCAL_RANK"], torch.get_num_threads()


def _environment_variable(name):
    return os.environ.get(name)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("rank one is broken")
    dist.barrier()  # rank 0 blocks here until it is stopped


def _hang():
    time.sleep(60)


def test_results_come_back_in_rank_order_with_the_launcher_environment():
    assert run_ranks(_rank_summary, 2, args=(10.0,)) == [(0, 2, 10.0, "0", 1), (1, 2, 10.0, "1", 1)]


def test_ranks_see_the_callers_environment_as_it_is_at_each_call(monkeypatch):
    """Ranks fork from a server that starts at a worker's first call with the environment of then: a variable
    changed or removed later reaches the ranks changed or removed."""
    name = "MEGAMAMBA_TEST_VARIABLE"

    def seen(world):
        return run_ranks(_environment_variable, world, args=(name,), init_process_group=False)

    monkeypatch.setenv(name, "first")
    assert seen(1) == ["first"]
    monkeypatch.setenv(name, "second")
    assert seen(2) == ["second", "second"]
    monkeypatch.delenv(name)
    assert seen(1) == [None]


def test_a_rank_exception_is_reraised_with_its_traceback():
    with pytest.raises(KeyError, match="rank one is broken") as info:
        run_ranks(_fail_on_rank_one, 2, timeout=60)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "rank 1 of 2" in str(cause) and "_fail_on_rank_one" in str(cause)


def test_a_hang_fails_after_the_timeout_naming_the_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 8 s"):
        run_ranks(_hang, 2, timeout=8, init_process_group=False)
    assert time.monotonic() - start < 30
