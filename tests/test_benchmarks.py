"""Smoke tests of the benchmark registry and runner (benchmarks/) on tiny sizes.

They check structure, not speed: every way of feeding runs on every workload
(or says why it cannot), rates are positive, the serial loop is the 1.00x
reference, the markdown and JSON are written, no worker is left behind, and
the GPU-machine entry runs without TensorFlow.
"""

import json
import os
import pathlib
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import report, runner, ways, workloads  # noqa: E402
from tests._util import notf_python  # noqa: E402


def test_workload_items_have_the_documented_shapes(tmp_path):
    expected = {"cpu": ((32, 64, 64, 3), np.float32, (32,)), "io": ((32, 4), np.float32, (32,)),
                "big": ((32, 224, 224, 3), np.float32, (32,)), "h5": ((8, 4096, 6), np.float32, (8,)),
                "h5aug": ((8, 4096, 6), np.float32, (8,)),
                "decode": ((64, 96, 96, 3), np.uint8, (64,)), "h5img": ((64, 96, 96, 3), np.uint8, (64,))}
    assert set(expected) == set(workloads.REGISTRY)
    for name, (shape, dtype, labels) in expected.items():
        seq = workloads.make_workload(name, 3, tmp_path)
        x, y = seq[2]
        assert len(seq) == 3 and (x.shape, x.dtype, y.shape) == (shape, dtype, labels), name
    x, _ = workloads.make_workload("big", 3, tmp_path)[2]
    assert x[5, 6, 7, 2] == 2.0
    decode = workloads.make_workload("decode", 2, tmp_path)
    np.testing.assert_array_equal(decode[1][0], decode[1][0])  # seeded by the index: the same batch twice
    assert not np.array_equal(decode[0][0], decode[1][0])
    h5, h5aug = workloads.make_workload("h5", 3, tmp_path), workloads.make_workload("h5aug", 3, tmp_path)
    np.testing.assert_array_equal(h5aug.load(1)[0], h5[1][0])  # load is h5's slice; augment changes it
    assert not np.array_equal(h5aug[1][0], h5[1][0]) and np.array_equal(h5aug[1][0][..., 3:], h5[1][0][..., 3:])
    with pytest.raises(ValueError, match="Unknown workload 'gpu'.*Received: 'gpu'"):
        workloads.make_workload("gpu", 3, tmp_path)


def test_hdf5_files_are_gzip_chunked_and_reused(tmp_path):
    import h5py

    for make, name, shape, chunks in ((workloads.scene_file, "points", (16, 4096, 6), (8, 4096, 6)),
                                      (workloads.image_file, "images", (128, 96, 96, 3), (16, 96, 96, 3))):
        path = make(tmp_path, 2)
        with h5py.File(path, "r") as f:
            assert (f[name].shape, f[name].chunks, f[name].compression) == (shape, chunks, "gzip")
        mtime = path.stat().st_mtime_ns
        assert make(tmp_path, 2) == path and path.stat().st_mtime_ns == mtime


def test_h5_workload_pickles_before_and_after_reads(tmp_path):
    seq = workloads.make_workload("h5", 2, tmp_path)
    first = seq[1][0]
    copy = pickle.loads(pickle.dumps(seq))  # the open handle is not pickled
    np.testing.assert_array_equal(copy[1][0], first)
    assert copy._handles is not None and seq._handles[1] is not copy._handles[1]


def test_touch_reads_every_leaf():
    assert ways.touch((np.full((2, 3), 2.0), {"a": np.ones(4), "b": np.zeros(0)})) == 3.0


def test_registry_names_modes_and_missing_packages():
    assert len(ways.REGISTRY) == len({w.name for w in ways.REGISTRY.values()})
    loop, tf_fit = ways.Context("loop", "jax"), ways.Context("fit", "tensorflow")
    assert ways.REGISTRY["kerasfeed-processes"].title(loop, 15) == "kerasfeed `to_loader`, processes (workers=15)"
    assert ways.REGISTRY["kerasfeed-threads"].title(tf_fit) == "kerasfeed `to_dataset`, threads"
    assert "does not accept a torch DataLoader" in ways.REGISTRY["torch"].missing(tf_fit)
    assert ways.REGISTRY["kerasfeed-tfdata"].missing(ways.Context("graph")).startswith("n/a")
    ghost = ways.Way("ghost", "ghost", ways.REGISTRY["serial"].make, needs=("no_such_package_kf",))
    row = runner.measure(ghost, lambda: workloads.make_workload("io", 2, "."), loop, progress=lambda _: None)
    assert (row["status"], row["note"]) == ("skipped", "skipped: no_such_package_kf not installed")
    assert report.cell([row]) == "skipped: no_such_package_kf not installed"
    late = runner.run_config({"way": "serial", "workload": "io", "batches": 2, "cache_dir": ".", "deadline": 1.0})
    assert (late["status"], late["note"]) == ("skipped", "skipped: past the run's time budget")
    with pytest.raises(ValueError, match="Unknown way 'dali'.*Received: 'dali'"):
        ways.select(["serial"], ["dali"])


def test_loop_and_adapter_modes_deliver_whole_passes(tmp_path):
    def make():
        return workloads.make_workload("io", 5, tmp_path)

    for way, ctx in (("kerasfeed-threads", ways.Context("loop")), ("memory", ways.Context("loop")),
                     ("kerasfeed-threads", ways.Context("adapter", "tensorflow"))):
        row = runner.measure(ways.REGISTRY[way], make, ctx, min_timed_s=0, max_timed_epochs=2, progress=lambda _: None)
        assert row["status"] == "ok", (way, ctx, row.get("note"))
        assert row["batches"] == 5 and row["batches_per_s"] > 0 and len(row["timed_epochs_s"]) == 1
        assert "killed_after_close" not in row


def test_cells_ratios_and_rounds():
    rows = [{"way": w, "label": w, "workload": "io", "status": "ok", "batches_per_s": rate, "round": k}
            for k, pair in enumerate(((1000.0, 900.0), (1600.0, 1200.0), (1200.0, 1020.0)))
            for w, rate in zip(("memory", "kerasfeed-threads"), pair)]
    rows.append({"way": "kerasfeed-auto", "label": "auto", "workload": "io", "status": "error", "note": "x",
                 "round": 0})
    runner.add_ratios(rows, lambda r: r["way"] == "memory")
    assert [r["ratio"] for r in rows if r["way"] == "kerasfeed-threads"] == pytest.approx([0.9, 0.75, 0.85])
    md = "\n".join(report.table(rows, ["io"]))
    assert "| kerasfeed-threads | 1,020 (0.85×; 0.75–0.90) |" in md  # median rate, median ratio, range
    assert "| auto | error |" in md and report.cell(rows[1:2]) == "900 (0.90×)"


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    quoted = f"use `{report.README_START}` and `{report.README_END}`\n"  # mentioned inline: not the block
    readme.write_text(f"{quoted}intro\n{report.README_START}\nold\n{report.README_END}\noutro\n")
    report.update_readme(readme, "| new | table |\n")
    assert readme.read_text() == f"{quoted}intro\n{report.README_START}\n| new | table |\n{report.README_END}\noutro\n"
    (tmp_path / "plain.md").write_text("no markers")
    with pytest.raises(ValueError, match="plain.md"):
        report.update_readme(tmp_path / "plain.md", "x")


def test_save_results_writes_the_json_and_markdown_pair(tmp_path):
    results = {"rows": [{"way": "serial"}], "h5file": pathlib.Path("/data/x.h5"), "markdown": "| way |\n"}
    path = runner.save_results(tmp_path / "new", "fit_latest", results)
    assert path == tmp_path / "new" / "fit_latest.json"
    assert json.loads(path.read_text()) == {"rows": [{"way": "serial"}], "h5file": "/data/x.h5", "markdown": "| way |\n"}
    assert (tmp_path / "new" / "fit_latest.md").read_text() == "| way |\n"


def test_unknown_names_are_rejected_with_what_was_received():
    from benchmarks import run

    with pytest.raises(ValueError, match="Received: 'gpu'"):
        run.run_benchmark(workloads_=("gpu",), output_dir=None)
    with pytest.raises(ValueError, match="Received: 'dali'"):
        run.run_benchmark(only=("dali",), output_dir=None)
    with pytest.raises(ValueError, match="rounds"):
        run.run_benchmark(rounds=0, output_dir=None)


# --- the drain benchmark, end to end (benchmarks/run.py) ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--batches", "4", "--output-dir", str(out)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "latest.json").read_text())


def _expected_skip(name):
    """The reason a row may legitimately be skipped on this machine, or None."""
    package = {"torch": "torch", "grain-threads": "grain", "grain-mp": "grain"}.get(name)
    if package is not None:
        try:
            __import__(package)
        except ImportError:
            return f"skipped: {package} not installed"
    return None


def test_every_way_runs_on_every_workload(tiny_run):
    from benchmarks.run import DRAIN_WAYS

    _, _, res = tiny_run
    assert [w["name"] for w in res["ways"]] == list(DRAIN_WAYS)
    for wl in workloads.WORKLOADS:
        rows = {r["way"]: r for r in res["rows"] if r["workload"] == wl}
        assert sorted(rows) == sorted(DRAIN_WAYS), wl
        for name, r in rows.items():
            reason = _expected_skip(name)
            if reason is not None:
                assert (r["status"], r["note"]) == ("skipped", reason), (wl, r)
                continue
            assert r["status"] == "ok", (wl, name, r.get("note"))
            assert r["batches"] == 4 and r["batches_per_s"] > 0 and r["x_serial"] > 0
            assert r["timed_epoch_s"] > 0 and r["first_batch_s"] > 0 and r["main_cpu_us_per_batch"] >= 0
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
    for w in res["ways"]:
        assert f"| {w['label']} |" in md
    m = res["machine"]
    assert m["cores"] >= 1 and m["ram_gb"] > 0 and m["python"] and m["tensorflow"] and m["h5py"]
    for word in ("Python", "TensorFlow", "Keras", "h5py", res["date"]):
        assert word in md
    assert res["latency_line"]["x_serial"] > 0 and "5 ms latency source (io)" in md


def test_h5file_section_has_its_rows_and_the_raw_limit(tiny_run):
    _, _, res = tiny_run
    rows = {r["way"]: r for r in res["h5file"]["rows"]}
    assert set(rows) == {"serial", "kerasfeed-processes", "kerasfeed-threads", "keras-threads",
                         "keras-processes", "raw-h5py"}
    assert rows["raw-h5py"]["status"] == "ok" and rows["raw-h5py"]["batches_per_s"] > 0
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("note"))


def test_classic_section(tiny_run):
    _, _, res = tiny_run
    c = res["classic"]
    assert c["status"] == "ok", c.get("note")
    assert c["kerasfeed"]["items"] == 100 and c["from_generator"]["items"] == c["from_generator"]["measured_generators"]
    assert c["speedup"] > 0


# --- the GPU-machine entry, without TensorFlow (benchmarks/gpu.py) ----------------------------------------


def test_gpu_entry_runs_without_tensorflow(tmp_path):
    """Under a Python without TensorFlow (``.venv-notf``): one drain and one JAX fit configuration
    run, a missing package is a ``skipped`` row (not a crash), and the results and the short table
    come out (``make test`` builds that environment)."""
    python = notf_python("The GPU entry's test")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    # XLA's CPU optimizations take ~45 s on the loaded 2-core machine to compile this model's few ops.
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_backend_optimization_level=0")
    proc = subprocess.run(
        [python, str(ROOT / "benchmarks" / "gpu.py"), "--quick", "--output-dir", str(tmp_path), "--workloads",
         "decode", "--workers", "1", "--batches", "2", "--backends", "jax,torch", "--only",
         "kerasfeed-processes,kerasfeed-no-prefetch,grain-mp", "--sections", "drain,fit"],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert res["machine"]["tensorflow"] is None  # nothing here could have imported it
    rows = {(r["mode"], r.get("backend"), r["way"]): r for r in res["rows"]}
    for key in (("loop", None, "serial"), ("loop", None, "kerasfeed-processes"), ("fit", "jax", "memory"),
                ("fit", "jax", "kerasfeed-processes"), ("fit", "jax", "kerasfeed-no-prefetch")):
        assert rows[key]["status"] == "ok" and rows[key]["batches_per_s"] > 0, (key, rows[key].get("note"))
    assert rows[("fit", "jax", "memory")]["ratio"] == pytest.approx(1.0)
    for key, r in rows.items():
        if r["status"] != "ok":
            assert r["status"] == "skipped" and r["note"] in ("skipped: grain not installed",
                                                             "skipped: torch not installed"), (key, r)
            assert r["note"] in (tmp_path / "gpu.md").read_text()
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| fit torch: best peer |")  # the short table, last


def test_gpu_fit_runs_the_peers_at_the_largest_worker_count(monkeypatch):
    # Its first run on the GPU machine ran the fit peers at 8 workers while its tables said 15.
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "tensorflow"))
    from benchmarks import gpu

    def workers(mode, way, counts):
        return [c["workers"] for c in gpu._configs(mode, way, "decode", 4, counts, {})]

    assert workers("fit", "kerasfeed-processes", [1, 4, 8, 15]) == [8, 15]
    assert workers("loop", "kerasfeed-processes", [1, 4, 8, 15]) == [1, 4, 8, 15]
    assert "kerasfeed-cached" in gpu.FIT_WAYS  # the cache's GPU goal is measured when a device is lent
    for way in gpu.PEERS + ("kerasfeed-auto", "kerasfeed-cached", "kerasfeed-no-prefetch", "memory"):
        assert workers("fit", way, [1, 4, 8, 15]) == [15] == workers("loop", way, [1, 4, 8, 15])
    assert workers("fit", "kerasfeed-processes", [1, 2]) == [2]


def test_fit_contention_times_fit_per_variant_without_tensorflow(tmp_path):
    """benchmarks/fit_contention.py (issue 24's open question) under JAX on the CPU: each variant
    is a row with its rate and per-thread CPU, and a bad variant is named."""
    python = notf_python("The fit_contention test")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(ROOT), KERAS_BACKEND="jax", XLA_FLAGS="--xla_backend_optimization_level=0")
    cmd = [python, str(ROOT / "benchmarks" / "fit_contention.py"), "--output-dir", str(tmp_path), "--workers", "1",
           "--batches", "2", "--epochs", "2", "--model", "conv-small"]
    proc = subprocess.run(cmd + ["--variants", "memory,kf-prefetch0,kf-premade,kf-nice0"], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "fit_contention.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["memory", "kf-prefetch0", "kf-premade", "kf-nice0"]
    for r in rows:
        assert r["steps_per_s"] > 0 and len(r["epoch_rates"]) == 1 and r["threads_us"]["MainThread"] >= 0, r
    assert rows[1]["device"]["prefetch"] == 0 and "| kf-prefetch0 |" in proc.stdout
    assert "kerasfeed readers" in rows[2]["threads_us"], rows[2]  # the made-once source ran on worker processes
    from benchmarks import fit_contention

    with pytest.raises(ValueError, match=r"Unknown variant 'kf-fast'.*Received: 'kf-fast'"):
        fit_contention.run(["memory", "kf-fast"], workload="decode", workers=1, batches=2, epochs=2, burners=0,
                           cache_dir=str(tmp_path))


def test_fit_contention_premade_source_returns_the_workload_s_items_and_pickles_without_them(tmp_path):
    import pickle

    from benchmarks import fit_contention

    src = fit_contention.Premade("io", 3, str(tmp_path))
    ref = workloads.make_workload("io", 3, str(tmp_path))
    assert len(src) == 3
    for i in range(3):
        for a, b in zip(src[i], ref[i]):
            np.testing.assert_array_equal(a, b)
    assert src[1] is src[1]  # made once, then returned as it is
    assert pickle.loads(pickle.dumps(src))._items is None  # workers make their own


def test_cache_benchmark_runs_on_tiny_settings(tmp_path):
    """benchmarks/cache.py --quick: pass 0 against uncached, a kept directory's second run, one store per host."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache.py"), "--quick", "--workloads", "h5",
                          "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "cache_latest.json").read_text())
    assert result["rows"]["h5"]["pass0_ratio_per_item_made"][0] > 0
    second = result["kept"]["h5"][0]
    assert second["second_run_made"] == 0  # the kept directory served the second run's first epoch
    memory = result["memory"]["memory"]
    assert memory["stored_bytes"] >= 8 * 2 * 2**20  # 8 items of 2 MB
    assert sum(v["pss_kb"] for v in memory["pages"].values()) * 1024 <= 1.2 * memory["stored_bytes"]  # one copy
    assert "| h5 |" in (tmp_path / "cache_latest.md").read_text()


def test_the_remote_benchmark_runs_and_counts_what_it_reads(tmp_path):
    """benchmarks/remote.py --quick (a loopback store 20 ms away): every row drains whole
    passes, the remote rows' traffic is counted (every stored byte read at least once), the
    first batch takes one round trip after the metadata, and the ratio is that of the best rows."""
    out = tmp_path / "remote.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "remote.py"), "--quick", "--json", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {"local, threads", "local, processes", "remote, threads", "remote, processes"} <= set(rows)
    assert all(r["batches_per_s"] > 0 and len(r["rounds"]) >= 1 for r in rows.values())
    for name in ("remote, threads", "remote, processes"):  # a 148 KB file: its 64 KiB metadata reads count
        assert 1.0 <= rows[name]["bytes_read_per_byte_stored"] < 4, (name, rows[name])
        assert rows[name]["requests_per_batch"] > 0  # small datasets are fetched whole once per process
    # Present on every row; 0 is right here: this file is small enough to be read whole before the timed passes.
    assert all(r["store_cpu_us_per_batch"] >= 0 for r in rows.values())
    assert res["first_batch"]["remote"]["first_batch_round_trips"] == 1
    best = res["best"]
    assert res["ratio_remote_to_local"] == pytest.approx(best["remote"]["batches_per_s"] / best["local"]["batches_per_s"])


def test_the_remote_benchmarks_store_of_several_processes_serves_and_stops_whole(tmp_path):
    """``StoreProcess(procs=3)`` (``--store-procs``: a many-core reader measured against a store that is
    not one GIL): three processes answer ranges on one port, their CPU is summed, and ``stop`` ends all."""
    import urllib.request

    import psutil

    from benchmarks.remote import StoreProcess

    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 64)
    store = StoreProcess(str(tmp_path), 0.0, procs=3)
    try:
        pids = [store.proc.pid] + [c.pid for c in psutil.Process(store.proc.pid).children(recursive=True)]
        assert len(pids) == 3, pids
        for _ in range(6):  # new connections: whichever process accepts answers the same bytes
            req = urllib.request.Request(f"{store.url}/f.bin", headers={"Range": "bytes=10-19"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 206 and r.read() == bytes(range(10, 20))
        assert store.cpu_s() > 0
    finally:
        store.stop()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if psutil.pid_exists(p)]
        time.sleep(0.05)


@pytest.mark.parametrize("bad, named", [(["--store-procs", "0"], "--store-procs 0"),
                                        (["--executors", "thread"], "--executors thread")])
def test_the_remote_benchmark_refuses_bad_options_by_name(bad, named):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "remote.py"), *bad], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"Received: {named}" in proc.stderr, proc.stderr[-1000:]


def test_the_remote_benchmark_on_a_many_core_machine_reuses_its_file(tmp_path):
    """remote.py as run on the 16-core machine: the processes rows alone, no h5py-over-fsspec rows, a store of
    two processes (whose traffic is not counted: each process counts only its own), the file made once in
    ``--file-dir`` and reused by the next run."""
    args = [sys.executable, str(ROOT / "benchmarks" / "remote.py"), "--quick", "--no-fsspec", "--executors",
            "processes", "--store-procs", "2", "--file-dir", str(tmp_path / "files")]
    mtimes = []
    for run in range(2):
        out = tmp_path / f"remote{run}.json"
        proc = subprocess.run([*args, "--json", str(out)], cwd=str(ROOT), capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        res = json.loads(out.read_text())
        assert set(res["rows"]) == {"local, processes", "remote, processes"} and res["store_procs"] == 2
        assert res["rows"]["remote, processes"]["requests_per_batch"] is None
        assert res["first_batch"]["h5py over fsspec"]["round_trips"] is None
        assert res["first_batch"]["remote"]["first_batch_round_trips"] == 1
        files = sorted(p.name for p in (tmp_path / "files").iterdir())
        assert files == ["scenes-128x64.h5"], files
        mtimes.append((tmp_path / "files" / files[0]).stat().st_mtime_ns)
    assert mtimes[0] == mtimes[1]  # made once


@pytest.mark.parametrize("mode", ["graph", "load"])
def test_the_graph_passes_benchmark_times_fit_through_either_path(tmp_path, monkeypatch, mode):
    """benchmarks/graph_passes.py's one configuration: a rate, with the threshold set for the mode."""
    import kerasfeed.tfdata.stored_items as stored_items
    from benchmarks import graph_passes

    monkeypatch.setattr(stored_items, "MIN_PASS_ITEMS", stored_items.MIN_PASS_ITEMS)  # restored after
    monkeypatch.setattr(stored_items, "MIN_PASS_ITEMS_INT32", stored_items.MIN_PASS_ITEMS_INT32)
    assert graph_passes.one("io", 6, mode, str(tmp_path)) > 0
    assert stored_items.MIN_PASS_ITEMS == (0 if mode == "graph" else 10**12)


def test_fit_ab_alternates_the_ways_epochs_in_one_process(tmp_path):
    """benchmarks/fit_ab.py: every way trains every round on whole epochs, each round's ratio is against the
    first way's epoch of that round, and the summary is their median."""
    import statistics

    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fit_ab.py"), "--workload", "cpu", "--ways",
                           "memory,kerasfeed-cached", "--batches", "6", "--rounds", "3", "--warmup", "1",
                           "--json", str(out)], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ways"] == ["memory", "kerasfeed-cached"] and len(res["rounds"]) == 3
    for r, row in enumerate(res["rounds"]):
        assert all(row[w]["batches_per_s"] > 0 and row[w]["main_cpu_us"] > 0 for w in res["ways"])
        want = row["kerasfeed-cached"]["batches_per_s"] / row["memory"]["batches_per_s"]
        assert res["ratios"]["kerasfeed-cached"][r] == pytest.approx(want)
    assert res["ratios"]["memory"] == [1.0] * 3
    assert res["summary"]["kerasfeed-cached"]["ratio"] == pytest.approx(statistics.median(res["ratios"]["kerasfeed-cached"]))
    assert "| kerasfeed-cached |" in proc.stdout


@pytest.mark.parametrize("bad, named", [(["--ways", "memory"], "['memory']"), (["--ways", "memory,nope"], "nope"),
                                        (["--rounds", "0"], "--rounds 0")])
def test_fit_ab_refuses_bad_options_by_name(bad, named, capsys):
    # In this process (a script's start-up imports TensorFlow, 5-10 s, before argparse refuses): a refusal is
    # argparse's exit 2 with the name on stderr; an exception other than SystemExit (a traceback) fails here.
    # test_fit_ab_alternates_the_ways_epochs_in_one_process runs the script itself.
    from benchmarks import fit_ab

    with pytest.raises(SystemExit) as exit_:
        fit_ab.main(["--workload", "cpu", *bad])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named in err and "Traceback" not in err, err[-1500:]
