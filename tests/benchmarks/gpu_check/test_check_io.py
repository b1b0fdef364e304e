"""The GPU check's plumbing: records are on disk as soon as they are written, and a shipped Triton
cache is found wherever it is unpacked."""

from benchmark_scripts import load_benchmark

check_io = load_benchmark("gpu_check/check_io")
Results, read_results = check_io.Results, check_io.read_results


def test_each_record_is_on_disk_when_written_and_a_cut_line_is_skipped(tmp_path):
    results = Results(str(tmp_path), "errors")
    results.write("error", op="ssd_chunk_scan", ours=1e-3)
    assert read_results(str(tmp_path))[0]["ours"] == 1e-3
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"section": "timings", "kind": "tim')  # a writer killed mid-line
    results.write("error", op="rmsnorm_gated", ours=2e-3)
    assert [r["op"] for r in read_results(str(tmp_path))] == ["ssd_chunk_scan"]


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
