"""Smoke test of the benchmark harness (benchmarks/run.py) on tiny sizes.

It checks structure, not speed: every way of feeding runs on every workload
(or says why it cannot), rates are positive, the serial loop is the 1.00x
reference, the markdown and JSON are written, and no worker is left behind.
"""

import json
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import peers, workloads  # noqa: E402


def test_workload_items_have_the_field_notes_shapes(tmp_path):
    cpu = workloads.make_workload("cpu", 3, tmp_path)
    x, y = cpu[2]
    assert (x.shape, x.dtype, y.shape) == ((32, 64, 64, 3), np.float32, (32,))
    io = workloads.make_workload("io", 3, tmp_path)
    x, y = io[1]
    assert x.shape == (32, 4) and np.all(x == 1.0)
    big = workloads.make_workload("big", 3, tmp_path)
    x, _ = big[2]
    assert (x.shape, x.dtype) == ((32, 224, 224, 3), np.float32) and x[5, 6, 7, 2] == 2.0
    h5 = workloads.make_workload("h5", 3, tmp_path)
    assert len(h5) == 3
    x, y = h5[1]
    assert (x.shape, x.dtype, y.shape) == ((8, 4096, 6), np.float32, (8,))
    with pytest.raises(ValueError, match="Unknown workload 'gpu'"):
        workloads.make_workload("gpu", 3, tmp_path)


def test_h5_workload_file_is_gzip_chunked_by_8_scenes_and_reused(tmp_path):
    import h5py

    path = workloads.scene_file(tmp_path, 2)
    with h5py.File(path, "r") as f:
        d = f["points"]
        assert (d.shape, d.chunks, d.compression) == ((16, 4096, 6), (8, 4096, 6), "gzip")
    mtime = path.stat().st_mtime_ns
    assert workloads.scene_file(tmp_path, 2) == path and path.stat().st_mtime_ns == mtime


def test_h5_workload_pickles_before_and_after_reads(tmp_path):
    seq = workloads.make_workload("h5", 2, tmp_path)
    first = seq[1][0]
    copy = pickle.loads(pickle.dumps(seq))  # the open handle is not pickled
    np.testing.assert_array_equal(copy[1][0], first)
    assert copy._handles is not None and seq._handles[1] is not copy._handles[1]


def test_touch_reads_every_leaf():
    assert peers.touch((np.full((2, 3), 2.0), {"a": np.ones(4), "b": np.zeros(0)})) == 3.0


def test_unknown_names_are_rejected_with_what_was_received():
    from benchmarks import run

    with pytest.raises(ValueError, match="Received: 'gpu'"):
        run.run_benchmark(workloads_=("gpu",), output_dir=None)
    with pytest.raises(ValueError, match="Received: 'dali'"):
        run.run_benchmark(only=("dali",), output_dir=None)


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    from benchmarks import run

    readme = tmp_path / "README.md"
    quoted = f"use `{run.README_START}` and `{run.README_END}`\n"  # mentioned inline: not the block
    readme.write_text(f"{quoted}intro\n{run.README_START}\nold\n{run.README_END}\noutro\n")
    run.update_readme(readme, "| new | table |\n")
    assert readme.read_text() == f"{quoted}intro\n{run.README_START}\n| new | table |\n{run.README_END}\noutro\n"
    (tmp_path / "plain.md").write_text("no markers")
    with pytest.raises(ValueError, match="plain.md"):
        run.update_readme(tmp_path / "plain.md", "x")


def test_save_results_writes_the_json_and_markdown_pair(tmp_path):
    from benchmarks.harness import save_results

    results = {"rows": [{"way": "serial"}], "h5file": pathlib.Path("/data/x.h5"), "markdown": "| way |\n"}
    path = save_results(tmp_path / "new", "fit_latest", results)
    assert path == tmp_path / "new" / "fit_latest.json"
    assert json.loads(path.read_text()) == {"rows": [{"way": "serial"}], "h5file": "/data/x.h5", "markdown": "| way |\n"}
    assert (tmp_path / "new" / "fit_latest.md").read_text() == "| way |\n"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--batches", "4",
         "--output-dir", str(out)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "latest.json").read_text())


def _expected_na(name):
    """The reason a row may legitimately be n/a on this machine, or None."""
    from kerasfeed.execution.factory import EXECUTOR_NAMES

    if name == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch not installed"
    if name == "kerasfeed-processes" and "processes" not in EXECUTOR_NAMES:
        return "not available"
    if name == "kerasfeed-auto" and "auto" not in EXECUTOR_NAMES:
        return "not available"
    return None


def test_every_way_runs_on_every_workload(tiny_run):
    _, _, res = tiny_run
    names = [w.name for w in peers.ways()]
    assert [w["name"] for w in res["ways"]] == names
    for wl in workloads.WORKLOADS:
        rows = {r["way"]: r for r in res["rows"] if r["workload"] == wl}
        assert sorted(rows) == sorted(names), wl
        for name, r in rows.items():
            reason = _expected_na(name)
            if reason is not None:
                assert r["status"] == "n/a" and reason in r["note"], (wl, r)
                continue
            assert r["status"] == "ok", (wl, name, r.get("note"))
            assert r["batches"] == 4
            assert r["batches_per_s"] > 0 and r["x_serial"] > 0
            assert r["timed_epoch_s"] > 0 and r["first_batch_s"] > 0
            assert r["main_cpu_us_per_batch"] >= 0
            assert "killed_after_close" not in r, (wl, name, "workers outlived close()")
        assert rows["serial"]["x_serial"] == pytest.approx(1.0)


def test_process_rows_report_workers_and_memory(tiny_run):
    _, _, res = tiny_run
    for r in res["rows"]:
        if r["status"] != "ok":
            continue
        if r["way"] in ("torch", "kerasfeed-processes"):  # persistent workers
            assert len(r["workers"]) == 2, (r["workload"], r["way"], r["workers"])
        if r["way"] == "keras-processes":  # a pool per epoch: may be gone when sampled
            assert len(r["workers"]) <= 2, (r["workload"], r["way"], r["workers"])
        assert all(w["rss_mb"] > 1 for w in r["workers"])
        if r["way"] in ("serial", "tf-map", "tf-from-generator", "kerasfeed-threads"):
            assert r["workers"] == []
        if r["way"] == "kerasfeed-auto":
            assert r["picked"] in ("threads", "processes") and r["note"]


def test_markdown_table_machine_and_sections(tiny_run):
    out, stdout, res = tiny_run
    md = (out / "latest.md").read_text()
    assert md == res["markdown"] and md in stdout
    assert "| way of feeding | cpu | h5 | io | big |" in md
    for w in peers.ways():
        assert f"| {w.label} |" in md
    m = res["machine"]
    assert m["cores"] >= 1 and m["ram_gb"] > 0 and m["python"] and m["tensorflow"] and m["h5py"]
    for word in ("Python", "TensorFlow", "Keras", "h5py", res["date"]):
        assert word in md
    lat = res["latency_line"]
    assert lat["x_serial"] > 0 and "5 ms latency source (io)" in md


def test_h5file_section_has_its_rows_and_the_raw_limit(tiny_run):
    _, _, res = tiny_run
    h5 = res["h5file"]
    rows = {r["way"]: r for r in h5["rows"]}
    assert set(rows) == {"serial", "kerasfeed-processes", "kerasfeed-threads", "keras-threads",
                         "keras-processes", "raw-h5py"}
    assert rows["raw-h5py"]["status"] == "ok" and rows["raw-h5py"]["batches_per_s"] > 0
    for name, r in rows.items():
        assert r["status"] == "ok" or _expected_na(name), (name, r.get("note"))


def test_classic_section_runs_when_from_generators_exists(tiny_run):
    import kerasfeed

    _, _, res = tiny_run
    c = res["classic"]
    if "from_generators" not in dir(kerasfeed):
        assert c["status"] == "n/a" and "from_generators" in c["note"]
        return
    assert c["status"] == "ok", c.get("note")
    assert c["kerasfeed"]["items"] == 100 and c["from_generator"]["items"] == c["from_generator"]["measured_generators"]
    assert c["speedup"] > 0
