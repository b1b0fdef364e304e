"""A private sshd on 127.0.0.1 for DeepSpeed's default pdsh/ssh launch path, with keys of its own.

    with loopback_sshd(tmp) as sshd:
        env = {**os.environ, "PDSH_SSH_ARGS_APPEND": sshd.ssh_args}   # then: deepspeed --ssh_port sshd.port ...

Nothing of the user's is touched (no ~/.ssh, no system sshd configuration): host key, client key,
authorized_keys, configuration and pid file live in the given directory; the daemon listens
on 127.0.0.1 at a free port. Host names that reach it: `localhost` and `127.0.0.1`, two names
for the hostfile, hence two nodes to the launcher. On exit the daemon and every process started
through it are killed by process id. Needs root (sshd's privilege separation), sshd, ssh,
ssh-keygen and pdsh (scripts/ci_multinode_deps.sh installs them); `unavailable()` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # compiled into Debian's sshd; the ssh service creates it at start


@dataclass(frozen=True)
class LoopbackSSHD:
    port: int
    key: Path
    pid: int

    @property
    def ssh_args(self) -> str:
        """ssh options for pdsh (PDSH_SSH_ARGS_APPEND) to use this daemon's key without asking."""
        return (
            f"-i {self.key} -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=no "
            f"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        )


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sshd's privilege separation needs root"
    for tool in (SSHD, "ssh", "ssh-keygen", "pdsh"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/ci_multinode_deps.sh installs it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list:
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with status {proc.returncode}: {proc.stderr.read()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"sshd did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


@contextmanager
def loopback_sshd(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    port = _free_port()
    config = directory / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {directory / 'host_key'}\nPidFile {directory / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {directory / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
    )
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(port, proc)
        yield LoopbackSSHD(port, directory / "client_key", proc.pid)
    finally:
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
