"""Strict mode (tests/strict_collectives.py) fails on what NCCL would refuse, as a GPU run would."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import strict_collectives
from distributed import run_ranks


def _planted_host_tensor():
    strict_collectives.treat_as_project(__file__)
    flag = torch.tensor([1.0])  # the bug: no device, as StopRequest's flag once was
    dist.all_reduce(flag)


def _device_tensor():
    strict_collectives.treat_as_project(__file__)
    flag = torch.tensor([1.0], device="cpu")
    dist.all_reduce(flag)
    moved = (torch.zeros(2) + 1).to("cpu")
    dist.all_reduce(moved)
    return flag.item(), moved.tolist()


def _derived_host_tensor():
    strict_collectives.treat_as_project(__file__)
    total = torch.zeros(1) * 2 + torch.ones(1)
    dist.all_reduce(total)


def _large_object():
    dist.all_gather_object([None] * dist.get_world_size(), b"x" * (strict_collectives.OBJECT_CAP + 1))


def _small_object():
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"rank": dist.get_rank(), "name": "metadata"})
    return out


def _counted_syncs():
    strict_collectives.treat_as_project(__file__)
    mode = strict_collectives.MODE
    before = len(mode.syncs)
    x = torch.ones(3, device="cpu")
    x.sum().item()
    bool(x.max() > 0)
    x.tolist()
    return mode.syncs[before:]


def test_host_tensor_in_a_collective_fails_in_strict_mode():
    with pytest.raises(
        strict_collectives.StrictCollectiveError, match=r"host tensor made at .*test_strict_collectives.py"
    ):
        run_ranks(_planted_host_tensor, 2)


def test_the_same_collective_with_a_device_tensor_passes():
    assert run_ranks(_device_tensor, 2) == [(2.0, [2.0, 2.0])] * 2


def test_operations_on_host_tensors_give_host_tensors():
    with pytest.raises(strict_collectives.StrictCollectiveError, match="host tensor"):
        run_ranks(_derived_host_tensor, 2)


def test_a_planted_host_tensor_passes_on_gloo_without_strict_mode():
    run_ranks(_planted_host_tensor, 2, strict=False)


def test_object_collective_above_the_cap_fails():
    with pytest.raises(strict_collectives.StrictCollectiveError, match=r"all_gather_object carries a \d+-byte object"):
        run_ranks(_large_object, 2)


def test_object_collective_with_small_metadata_passes():
    assert run_ranks(_small_object, 2)[0] == [{"rank": 0, "name": "metadata"}, {"rank": 1, "name": "metadata"}]


def test_host_synchronizations_of_project_code_are_counted():
    syncs = run_ranks(_counted_syncs, 1)[0]
    assert [s.rsplit(" ", 1)[-1] for s in syncs] == ["item", "__bool__", "tolist"], syncs


def test_processes_started_by_tests_run_in_strict_mode():
    code = (
        "import sys, torch.distributed as d; "
        "print('strict_collectives' in sys.modules, hasattr(d.all_reduce, '__wrapped__'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_uninstall_leaves_a_launched_process_without_strict_mode():
    """What tests/conftest.py does in a pytest-xdist worker, which starts in strict mode like any launched process."""
    code = (
        "import strict_collectives, torch, torch.distributed as d; strict_collectives.uninstall(); "
        "print(strict_collectives.MODE, d.all_reduce.__code__.co_filename == strict_collectives.__file__, "
        "torch._C._len_torch_function_stack())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.split() == ["None", "False", "0"], out.stdout + out.stderr
