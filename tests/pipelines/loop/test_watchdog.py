"""The step watchdog: a process whose next step boundary does not come in time exits 1 with one message;
a paused watchdog (saves, evaluations) waits."""

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import time
from megamamba.observe import console_log
from megamamba.pipelines.loop.faults import Watchdog
console_log.configure()
w = Watchdog(0.5)
w.beat()
{body}
print("survived", flush=True)
"""


def run(body: str):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def test_a_stalled_step_ends_the_process_with_one_message():
    proc, _ = run("time.sleep(30)")
    assert proc.returncode == 1 and "survived" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "train.py: error: rank 0: no training step finished in 0.5 s "
        "(--step-timeout): a peer has probably died; exiting"
    )


def test_a_paused_watchdog_lets_slow_work_finish():
    proc, _ = run("with w.paused():\n    time.sleep(1.5)\nw.beat()")
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-2000:]
