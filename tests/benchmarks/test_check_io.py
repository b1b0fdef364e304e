"""The GPU check's plumbing: records are on disk as soon as they are written, and a child past its
timeout is stopped (SIGTERM, then SIGKILL) together with its own children."""
import os
import sys
import time
from pathlib import Path

from benchmark_scripts import BENCHMARKS, load_benchmark

check_io = load_benchmark("check_io")
Results, read_results, run_logged = check_io.Results, check_io.read_results, check_io.run_logged


def test_each_record_is_on_disk_when_written_and_a_cut_line_is_skipped(tmp_path):
    results = Results(str(tmp_path), "errors")
    results.write("error", op="ssd_chunk_scan", ours=1e-3)
    assert read_results(str(tmp_path))[0]["ours"] == 1e-3
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"section": "timings", "kind": "tim')  # a writer killed mid-line
    results.write("error", op="rmsnorm_gated", ours=2e-3)
    assert [r["op"] for r in read_results(str(tmp_path))] == ["ssd_chunk_scan"]


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
    that session must not outlive it."""
    code = ("import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('check_io', {str(BENCHMARKS / 'check_io.py')!r})\n"
            "check_io = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(check_io)\n"
            "run_logged, stop_children_on_sigterm = check_io.run_logged, check_io.stop_children_on_sigterm\n"
            "stop_children_on_sigterm(grace=1.0)\n"
            "run_logged(['bash', '-c', 'echo $$ > inner; sleep 60'], 'inner.log', timeout=60)\n")
    status = run_logged([sys.executable, "-c", code], str(tmp_path / "outer.log"), timeout=3, cwd=tmp_path, grace=5)
    assert status["timed_out"] and status["rc"] == 143, (tmp_path / "outer.log").read_text()
    inner = int((tmp_path / "inner").read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{inner}") or "Z" in Path(f"/proc/{inner}/stat").read_text().split()[2]


def test_an_unpacked_triton_cache_is_found_in_its_new_folder(tmp_path, monkeypatch):
    """Triton names a kernel's files in its group file by absolute path: a cache moved elsewhere
    misses every kernel unless unpack_triton_cache points the groups at their new place."""
    import shutil
    import tarfile

    from triton.runtime.cache import FileCacheManager
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "made"))
    made = FileCacheManager("KERNELKEY")
    made.put_group("k.json", {"k.json": made.put("{}", "k.json"), "k.cubin": made.put(b"\0", "k.cubin", binary=True)})
    with tarfile.open(tmp_path / "cache.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "made" / "KERNELKEY", arcname="KERNELKEY")
    shutil.rmtree(tmp_path / "made")
    assert check_io.unpack_triton_cache(str(tmp_path / "cache.tar.gz"), str(tmp_path / "moved")) == 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "moved"))
    group = FileCacheManager("KERNELKEY").get_group("k.json")
    assert group == {name: str(tmp_path / "moved" / "KERNELKEY" / name) for name in ("k.json", "k.cubin")}
