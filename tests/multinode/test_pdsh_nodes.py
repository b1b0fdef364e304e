"""DeepSpeed's default multi-node path: one `deepspeed --hostfile H` on the first node, pdsh/ssh to every node.

Two host names for one private sshd on loopback (`localhost`, `127.0.0.1`), 2 slots each. The
remote shells start with sshd's clean environment: what the ranks need (the torch-extension
cache and the PATH whose `ninja` built it, one thread) reaches them through `.deepspeed_env` in the
working directory, as on a cluster; PYTHONPATH is exported by DeepSpeed itself.
"""

import os
import subprocess
import time

import pytest

import sshd
from distributed import free_port
from harness import placement_rows, write_hostfile
from train_entry import DEEPSPEED, TRAIN_PY, read_metrics
from training_runs import assert_same_curve, train_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sshd.unavailable() is not None, reason=str(sshd.unavailable()))]


def test_pdsh_over_ssh_trains_the_one_node_curve_bit_for_bit(tmp_path):
    (tmp_path / ".deepspeed_env").write_text(
        f"TORCH_EXTENSIONS_DIR={os.environ['TORCH_EXTENSIONS_DIR']}\nPATH={os.environ['PATH']}\nOMP_NUM_THREADS=1\n"
    )
    hostfile = write_hostfile(tmp_path / "hostfile", {"localhost": 2, "127.0.0.1": 2})
    with sshd.loopback_sshd(tmp_path / "sshd") as daemon:
        env = {**os.environ, "PDSH_SSH_ARGS_APPEND": daemon.ssh_args}
        for name in ("TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS"):  # only .deepspeed_env may bring them
            env.pop(name, None)
        cmd = [
            str(DEEPSPEED),
            "--hostfile",
            str(hostfile),
            "--ssh_port",
            str(daemon.port),
            "--no_ssh_check",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(TRAIN_PY),
            *map(str, train_args(tmp_path)),
        ]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(f"pdsh/ssh, 2 hosts x 2 processes, 5 steps: {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert placement_rows(proc.stdout, 4) == [(0, 0), (0, 1), (1, 2), (1, 3)], proc.stdout[-3000:]
    assert_same_curve(read_metrics(tmp_path / "metrics.jsonl"), "pdsh/ssh, 2 hosts x 2 processes")
