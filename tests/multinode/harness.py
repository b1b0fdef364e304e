"""Simulated nodes on one machine: one real `deepspeed` launcher per node, as a scheduler would start them.

    hostfile = write_hostfile(tmp / "hostfile", {"node0": 2, "node1": 2})
    nodes = [start_node(hostfile, r, port, script, args, cwd=tmp, log=tmp / f"node{r}.log") for r in (0, 1)]
    codes = [wait_node(n, timeout=300) for n in nodes]

Each node is `deepspeed --hostfile H --no_ssh --node_rank R --master_addr A --master_port P script ...`
in its own session (process group), so `kill_node` can SIGKILL every process of that node — the
launcher, DeepSpeed's per-node `launch.py` and its ranks — and nothing else. `prefix` runs the
launcher under another command (e.g. `ip netns exec <ns>`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from train_entry import DEEPSPEED


def write_hostfile(path: Path, slots_per_host: dict) -> Path:
    path.write_text("".join(f"{host} slots={slots}\n" for host, slots in slots_per_host.items()))
    return path


@dataclass
class Node:
    rank: int
    proc: subprocess.Popen
    log: Path
    _log_file: IO

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def launcher_env(**extra) -> dict:
    """The test's environment for the ranks: one thread each, this checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def start_node(
    hostfile: Path,
    node_rank: int,
    master_port: int,
    script: Path,
    args: list,
    *,
    cwd: Path,
    log: Path,
    master_addr: str = "127.0.0.1",
    env: Optional[dict] = None,
    prefix: tuple = (),
) -> Node:
    """Start node `node_rank`'s launcher in its own session; stdout and stderr go to `log`."""
    cmd = [
        *prefix,
        str(DEEPSPEED),
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        "--node_rank",
        str(node_rank),
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
        str(script),
        *map(str, args),
    ]
    log_file = open(log, "w")
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or launcher_env(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    return Node(node_rank, proc, log, log_file)


def node_alive(node: Node) -> bool:
    """Whether any process of the node's session is still running (the launcher or one of its ranks)."""
    alive = _session_has_processes(node.proc.pid)
    node.proc.poll()  # reap the launcher after the scan, so a node found gone has its exit status
    return alive


def _session_has_processes(sid: int) -> bool:
    """Whether a live (not zombie) process belongs to session `sid`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # session id, state
                return True
    return False


def kill_node(node: Node) -> None:
    """SIGKILL every process of the node's session (launcher and ranks)."""
    try:
        os.killpg(node.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.proc.wait()


def wait_node(node: Node, timeout: float) -> Optional[int]:
    """The launcher's exit status, or None if it is still running after `timeout` seconds."""
    try:
        return node.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def stop_all(nodes: list) -> None:
    for node in nodes:
        kill_node(node)
        node._log_file.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2) -> float:
    """Poll until `predicate()` is true; return the seconds it took, or raise naming `what`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)
    return time.monotonic() - start


def placement_rows(output: str, world: int) -> list:
    """(node rank, global rank) of each row of the start-up placement table in a launcher's `output`
    (global rank 0 prints it from what every rank reported of itself; a pdsh host prefix is ignored)."""
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if f"placement: {world} ranks on" in line)
    rows = [line.split()[-6:] for line in lines[first + 2 : first + 2 + world]]  # node, rank, local, dp, tp, pp
    return [(int(node), int(rank)) for node, rank, *_ in rows]
