"""A command run in its own process group, its output streamed to a log, with a hard timeout after
which the whole group is stopped: how the GPU check runs its sections and launch/train.py, and how
the training benchmark runs launch/train.py (a launcher's ranks must not outlive it on a GPU)."""

import os
import signal
import subprocess
import time

_RUNNING: set[int] = set()  # process groups run_logged has started and not yet reaped


def run_logged(cmd, log: str, timeout: float, env=None, cwd=None, grace: float = 10.0) -> dict:
    """Run `cmd` in its own process group, its stdout and stderr streamed to `log`; past `timeout`
    seconds the whole group gets SIGTERM (train.py saves and stops on it), then SIGKILL after
    `grace`. Returns dict(rc, seconds, timed_out)."""
    start = time.time()
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        _RUNNING.add(proc.pid)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc, grace)
        finally:
            _signal_group(proc.pid, signal.SIGKILL)  # strays of a finished group (e.g. a launcher's ranks)
            _RUNNING.discard(proc.pid)
    return dict(rc=proc.returncode, seconds=round(time.time() - start, 1), timed_out=timed_out)


def _stop_group(proc, grace: float) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_children_on_sigterm(grace: float = 5.0) -> None:
    """On SIGTERM (the driver's timeout), stop the groups run_logged started, which live in their own
    sessions and would outlive this process on the GPU, then exit with 143."""

    def handler(signum, frame):
        for pid in list(_RUNNING):
            _signal_group(pid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and any(_alive(pid) for pid in _RUNNING):
            time.sleep(0.2)
        for pid in list(_RUNNING):
            _signal_group(pid, signal.SIGKILL)
        os._exit(143)

    signal.signal(signal.SIGTERM, handler)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
