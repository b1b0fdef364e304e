"""A command run with a log and a hard timeout (megamamba.testing.processes): its exit status, and past
its timeout it is stopped (SIGTERM, then SIGKILL) together with its own children."""

import os
import sys
import time
from pathlib import Path

from megamamba.testing import processes
from megamamba.testing.processes import run_logged


def test_a_child_that_ignores_sigterm_is_killed_with_its_children(tmp_path):
    log = tmp_path / "child.log"
    script = "trap 'echo got TERM' TERM; sleep 60 & echo $! > pid; echo started; wait; sleep 60"
    start = time.time()
    status = run_logged(["bash", "-c", script], str(log), timeout=1.5, cwd=tmp_path, grace=1.0)
    assert status["timed_out"] and status["rc"] != 0 and time.time() - start < 10
    assert "started" in log.read_text() and "got TERM" in log.read_text()
    grandchild = int((tmp_path / "pid").read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


def test_a_finished_child_reports_its_exit_status(tmp_path):
    status = run_logged(["bash", "-c", "echo hi; exit 3"], str(tmp_path / "log"), timeout=30)
    assert status == {"rc": 3, "seconds": status["seconds"], "timed_out": False}
    assert (tmp_path / "log").read_text() == "hi\n"


def test_a_stopped_section_stops_the_groups_it_started(tmp_path):
    """A section runs launch/train.py in a session of its own; when the driver stops the section,
    that session must not outlive it. The section loads the module by its path: importing megamamba
    (torch) would take longer than the timeout here."""
    code = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('processes', {processes.__file__!r})\n"
        "processes = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(processes)\n"
        "processes.stop_children_on_sigterm(grace=1.0)\n"
        "processes.run_logged(['bash', '-c', 'echo $$ > inner; sleep 60'], 'inner.log', timeout=60)\n"
    )
    status = run_logged([sys.executable, "-c", code], str(tmp_path / "outer.log"), timeout=3, cwd=tmp_path, grace=5)
    assert status["timed_out"] and status["rc"] == 143, (tmp_path / "outer.log").read_text()
    inner = int((tmp_path / "inner").read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{inner}") or "Z" in Path(f"/proc/{inner}/stat").read_text().split()[2]
