"""kerasfeed benchmark: every way of feeding the four workloads (docs/field_notes.md, *Four workloads*), in one run.

Run ``make bench`` (or ``python benchmarks/run.py``); ``--quick`` for a small
run. It prints markdown tables of batches/s and the ratio to a plain serial
loop, with the machine and the date, and writes
``benchmarks/results/latest.json`` and ``latest.md``. See
``benchmarks/README.md`` for what each row measures.

How a configuration (one way of feeding x one workload) is measured:

1. A fresh source object is made and the feed is built (``build``).
2. Epoch 1 runs untimed for the rate: it holds the one-off start-up (workers
   starting, files opening, signature probing). ``first batch s`` is the
   wall time from the start of ``build`` to the first batch of epoch 1;
   ``one-off s`` is ``build + epoch 1 - timed epoch``.
3. Epoch 2 is timed; fast configurations time a few more epochs (up to
   ``max_timed_epochs`` while the timed total is below ``min_timed_s``) and
   keep the best, so per-epoch costs (a pool rebuilt every epoch) stay in.
4. Every batch is consumed as a training loop would: one value of every
   array is read through a zero-copy view (no model).
5. The feed is closed and the harness waits until every process it started
   is gone (killing stragglers by pid after 10 s, and saying so) before the
   next configuration starts.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks import peers, workloads  # noqa: E402

DEFAULT_OUTPUT_DIR = ROOT / "benchmarks" / "results"

# Batches per epoch. Full: each configuration's epoch lasts ~0.3-10 s on 2 cores
# (the slowest peers set the size); the whole run stays well under 15 minutes.
FULL_BATCHES = {"cpu": 300, "h5": 200, "io": 1000, "big": 150}
QUICK_BATCHES = {"cpu": 40, "h5": 24, "io": 120, "big": 16}
SECTIONS = ("main", "h5file", "classic")
CLASSIC_GENERATORS = 100

# Processes that outlive a configuration on purpose (shared by all of them).
_INFRASTRUCTURE = ("resource_tracker", "semaphore_tracker", "forkserver")


# --- the machine ------------------------------------------------------------------


def _version(*dists: str) -> Optional[str]:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def copy_bandwidth_gbs(nbytes: int = 32 * 224 * 224 * 3 * 4, repeats: int = 20) -> float:
    """``np.copyto`` rate of a big batch: the physical floor of moving one."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def machine_info() -> Dict[str, Any]:
    import tensorflow as tf

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": _version("keras"),
        "h5py": _version("h5py"),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "kerasfeed": _version("kerasfeed"),
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


# --- processes -----------------------------------------------------------------------


def _descendants() -> List[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _is_infrastructure(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return True  # gone already
    return any(word in cmd for word in _INFRASTRUCTURE)


def _new_workers(before: set) -> List[psutil.Process]:
    return [p for p in _descendants() if p.pid not in before and not _is_infrastructure(p)]


def _sample_workers(before: set, into: Dict[int, Dict[str, float]]) -> None:
    """Records RSS/USS (MB) of the processes started by this configuration."""
    for p in _new_workers(before):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            mem = p.memory_full_info()
            rss, uss = mem.rss / 2**20, getattr(mem, "uss", 0.0) / 2**20
        except psutil.Error:
            continue
        if rss == 0:  # exiting: its memory is already released
            continue
        old = into.get(p.pid, {"rss_mb": 0.0, "uss_mb": 0.0})
        into[p.pid] = {"rss_mb": max(old["rss_mb"], rss), "uss_mb": max(old["uss_mb"], uss)}


def _workers_cpu(procs: Sequence[psutil.Process]) -> Dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _wait_for_exit(before: set, timeout: float = 10.0) -> List[int]:
    """Waits until the processes this configuration started are gone.

    Returns the pids that had to be killed (a leak worth reporting).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _new_workers(before)
        if not left:
            return []
        time.sleep(0.05)
    killed = []
    for p in _new_workers(before):
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    psutil.wait_procs([psutil.Process(pid) for pid in killed if psutil.pid_exists(pid)], timeout=5)
    return killed


# --- one configuration ----------------------------------------------------------------


def run_config(way: peers.Way, make_seq: Callable[[], Any], *, min_timed_s: float,
               max_timed_epochs: int, progress: Callable[[str], None] = print,
               label: str = "") -> Dict[str, Any]:
    """Builds ``way`` on a fresh source, runs its epochs, closes it. Never raises."""
    result: Dict[str, Any] = {"way": way.name, "label": way.label, "measures": way.measures}
    missing = way.available()
    if missing:
        result.update(status="n/a", note=missing)
        progress(f"  {label}{way.name:22s} {missing}")
        return result
    before = {p.pid for p in _descendants()}
    memory: Dict[int, Dict[str, float]] = {}
    feed = seq = None
    checksum = 0.0
    try:
        seq = make_seq()
        n = len(seq)
        if way.keras_workers is not None:
            seq.workers, seq.use_multiprocessing = way.keras_workers
        t0 = time.perf_counter()
        feed = way.build(seq)
        build_s = time.perf_counter() - t0
        first_batch_s = None
        count = 0
        for count, batch in enumerate(feed.epoch(), 1):
            checksum += peers.touch(batch)
            if count == 1:
                first_batch_s = time.perf_counter() - t0
            if count in (1, n // 2):  # pools rebuilt per epoch are gone by its end
                _sample_workers(before, memory)
        epoch1_s = time.perf_counter() - t0 - build_s
        if count != n:
            raise RuntimeError(f"epoch 1 delivered {count} batches, expected {n}")

        timed: List[Dict[str, float]] = []
        while len(timed) < max_timed_epochs:
            procs = [p for p in _new_workers(before)]
            wcpu0 = _workers_cpu(procs)
            c0, t = time.process_time(), time.perf_counter()
            count = 0
            if feed.drain is not None:
                count, touched = feed.drain()
                checksum += touched
            else:
                for count, batch in enumerate(feed.epoch(), 1):
                    checksum += peers.touch(batch)
            wall = time.perf_counter() - t
            main_cpu = time.process_time() - c0
            wcpu1 = _workers_cpu(procs)
            if count != n:
                raise RuntimeError(f"epoch {len(timed) + 2} delivered {count} batches, expected {n}")
            persistent = bool(wcpu0) and all(pid in wcpu1 for pid in wcpu0)
            worker_cpu = sum(wcpu1[pid] - wcpu0[pid] for pid in wcpu0) if persistent else None
            timed.append({"wall_s": wall, "main_cpu_s": main_cpu, "worker_cpu_s": worker_cpu})
            if sum(e["wall_s"] for e in timed) >= min_timed_s:
                break
        _sample_workers(before, memory)
        best = min(timed, key=lambda e: e["wall_s"])
        info = feed.info()
        result.update(
            status="ok",
            batches=n,
            batches_per_s=n / best["wall_s"],
            timed_epoch_s=best["wall_s"],
            timed_epochs_s=[e["wall_s"] for e in timed],
            epoch_rates_median=n / statistics.median(e["wall_s"] for e in timed),
            build_s=build_s,
            epoch1_s=epoch1_s,
            first_batch_s=first_batch_s,
            one_off_s=max(0.0, build_s + epoch1_s - best["wall_s"]),
            main_cpu_us_per_batch=best["main_cpu_s"] / n * 1e6,
            worker_cpu_us_per_batch=(None if best["worker_cpu_s"] is None
                                     else best["worker_cpu_s"] / n * 1e6),
            workers=[{"pid": pid, **m} for pid, m in sorted(memory.items())],
            executor=info or None,
            checksum=checksum,
        )
        picked = (info or {}).get("name")
        if way.name == "kerasfeed-auto" and picked:
            result["picked"] = picked
            result["note"] = info.get("reason") or f"picked {picked}"
    except Exception as e:  # one broken configuration must not lose the others
        result.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        try:
            if feed is not None:
                feed.close()
        except Exception as e:
            result.setdefault("close_error", f"{type(e).__name__}: {e}")
        closer = getattr(seq, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:
                pass
        feed = seq = None
        gc.collect()
        killed = _wait_for_exit(before)
        if killed:
            result["killed_after_close"] = killed
        result["main_rss_mb_after"] = psutil.Process().memory_info().rss / 2**20
    if result["status"] == "ok":
        rss = _mean([w["rss_mb"] for w in result["workers"]])
        progress(f"  {label}{way.name:22s} {result['batches_per_s']:9.1f} batches/s"
                 f"  first batch {result['first_batch_s']:.2f}s"
                 f"  main CPU {result['main_cpu_us_per_batch']:.0f} µs/batch"
                 + (f"  {len(result['workers'])} workers, {rss:.0f} MB RSS each" if result["workers"] else ""))
    else:
        progress(f"  {label}{way.name:22s} {result['note']}")
    return result


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


# --- the sections ------------------------------------------------------------------------


def _select(all_ways: Sequence[peers.Way], only: Optional[Sequence[str]]) -> List[peers.Way]:
    if not only:
        return list(all_ways)
    return [w for w in all_ways if w.name in only or w.name == "serial"]


def _ratios(rows: List[Dict[str, Any]]) -> None:
    serial = next((r for r in rows if r["way"] == "serial" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and serial is not None:
            r["x_serial"] = r["batches_per_s"] / serial["batches_per_s"]


class _RawH5(peers.Feed):
    """The limit of the h5 rows: h5py slice reads in a plain loop, file already open."""

    def __init__(self, path: str, num_batches: int, scenes: int = workloads.H5_SCENES_PER_BATCH):
        import h5py

        self.file = h5py.File(path, "r")
        self.points, self.labels = self.file["points"], self.file["labels"]
        self.n, self.scenes = num_batches, scenes

    def epoch(self):
        for i in range(self.n):
            a = i * self.scenes
            yield self.points[a:a + self.scenes], self.labels[a:a + self.scenes]

    def close(self):
        self.file.close()


def _h5slice_available() -> bool:
    try:
        import kerasfeed

        return getattr(kerasfeed, "H5SliceSequence", None) is not None
    except (ImportError, AttributeError):
        return False


def h5file_section(path: pathlib.Path, n: int, main_rows: List[Dict[str, Any]],
                   only: Optional[Sequence[str]], process_workers: int, timing: Dict[str, Any],
                   progress: Callable[[str], None]) -> Dict[str, Any]:
    """Gzip-chunked scene file: kerasfeed vs Keras vs serial vs raw h5py on a gzip-chunked scene file."""
    names = ("serial", "kerasfeed-processes", "kerasfeed-threads",
             "keras-threads", "keras-processes")
    chosen = [w for w in peers.ways(process_workers) if w.name in names]
    chosen.sort(key=lambda w: names.index(w.name))
    raw = peers.Way("raw-h5py", "raw sequential h5py read (the limit)",
                    lambda _seq: _RawH5(str(path), n),
                    measures="h5py.File opened once; points[a:b], labels[a:b] in a loop, no class")
    if only:
        chosen = [w for w in chosen if w.name in only or w.name == "serial"]
    if _h5slice_available():
        import kerasfeed

        def make_seq():
            return kerasfeed.H5SliceSequence(str(path), ("points", "labels"),
                                             workloads.H5_SCENES_PER_BATCH)
        source = "kerasfeed.H5SliceSequence(path, ('points', 'labels'), 8)"
        reuse = {}
    else:
        def make_seq():
            return workloads.H5Scenes(str(path), n)
        source = "benchmarks.workloads.H5Scenes (kerasfeed.H5SliceSequence not available)"
        # Same class, same file as the main table's h5 column: reuse those rows.
        reuse = {r["way"]: r for r in main_rows if r.get("workload") == "h5"}
    progress(f"[h5file] {source}, {n} batches of 8 scenes x 4096 points x 6 float32 (gzip, chunks of 8 scenes)")
    rows = []
    for way in chosen + [raw]:
        if way.name in reuse:
            row = dict(reuse[way.name])
            row["note"] = (row.get("note", "") + " (from the main table's h5 column)").strip()
            progress(f"  [h5file] {way.name:22s} reused from the main table")
        else:
            row = run_config(way, make_seq, progress=progress, label="[h5file] ", **timing)
        rows.append(row)
    _ratios(rows)
    kp = next((r for r in rows if r["way"] == "kerasfeed-processes" and r["status"] == "ok"), None)
    target = None
    if kp is not None and "x_serial" in kp:
        target = {"x_serial": kp["x_serial"], "target": 1.5, "met": kp["x_serial"] >= 1.5}
    return {"source": source, "path_name": path.name, "batches": n, "rows": rows, "target": target}


def classic_section(quick: bool, progress: Callable[[str], None]) -> Dict[str, Any]:
    """100 slow generators: 100 generators that each sleep 0.1 s then yield one image/mask pair."""
    try:
        import kerasfeed

        from_generators = getattr(kerasfeed, "from_generators")
    except (ImportError, AttributeError):
        progress("[classic] n/a (not available: kerasfeed.from_generators does not exist yet)")
        return {"status": "n/a", "note": "n/a (not available: kerasfeed.from_generators does not exist yet)"}
    import itertools

    import tensorflow as tf

    total = CLASSIC_GENERATORS
    measured = 5 if quick else 10  # the chained baseline is ~0.1 s per generator
    spec = (tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE, tf.float32),
            tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE[:2] + (1,), tf.uint8))
    out: Dict[str, Any] = {"generators": total, "sleep_s": workloads.CLASSIC_SLEEP_S}

    def run_pass(ds) -> tuple:
        t = time.perf_counter()
        count = 0
        for count, item in enumerate(ds, 1):
            peers.touch(item)
        return time.perf_counter() - t, count

    # Baseline: one from_generator over the generators chained one after another.
    ds = tf.data.Dataset.from_generator(
        lambda: itertools.chain.from_iterable(workloads.classic_generator(k) for k in range(measured)),
        output_signature=spec)
    wall, count = run_pass(ds)
    out["from_generator"] = {
        "measured_generators": measured, "measured_s": wall, "items": count,
        "extrapolated_s": wall * total / measured,
        "note": f"measured on {measured} generators and scaled by {total}/{measured} (it is linear: one at a time)",
    }
    before = {p.pid for p in _descendants()}
    kf_ds = None
    try:
        t = time.perf_counter()
        try:  # the same signature the baseline gets, so neither probes
            kf_ds = from_generators(workloads.classic_generator, total, executor="threads",
                                    output_signature=spec)
        except TypeError:
            kf_ds = from_generators(workloads.classic_generator, total)
        build_s = time.perf_counter() - t
        passes = []
        for _ in range(2):
            wall, count = run_pass(kf_ds)
            if count != total:
                raise RuntimeError(f"a pass delivered {count} items, expected {total}")
            passes.append(wall)
        out["kerasfeed"] = {"passes_s": passes, "best_s": min(passes), "items": total, "build_s": build_s,
                            "call": "kerasfeed.from_generators(classic_generator, 100, executor='threads', "
                                    "output_signature=...)"}
        out["speedup"] = out["from_generator"]["extrapolated_s"] / min(passes)
        out["target"] = {"speedup": out["speedup"], "target": 20.0, "met": out["speedup"] >= 20.0}
        out["status"] = "ok"
    except Exception as e:
        out.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        ex = getattr(kf_ds, "_kerasfeed_executor", None)
        if ex is not None and hasattr(ex, "close"):
            ex.close()
        ds = kf_ds = None
        gc.collect()
        _wait_for_exit(before)
    if out["status"] == "ok":
        progress(f"[classic] from_generator chained: {out['from_generator']['extrapolated_s']:.2f} s for {total} "
                 f"(measured {measured}); kerasfeed: {out['kerasfeed']['best_s']:.3f} s; "
                 f"{out['speedup']:.1f}x faster")
    else:
        progress(f"[classic] {out['note']}")
    return out


# --- the whole run ----------------------------------------------------------------------


def run_benchmark(*, quick: bool = False, workloads_: Sequence[str] = workloads.WORKLOADS,
                  only: Optional[Sequence[str]] = None,
                  batches: Optional[Union[int, Dict[str, int]]] = None,
                  process_workers: int = 2, sections: Sequence[str] = SECTIONS,
                  output_dir: Optional[os.PathLike] = DEFAULT_OUTPUT_DIR,
                  progress: Callable[[str], None] = print) -> Dict[str, Any]:
    """Runs the benchmark and returns the results (also written to ``output_dir``).

    Args:
        quick: small sizes (a minute or so) instead of the full run.
        workloads_: which of ``cpu``, ``h5``, ``io``, ``big`` to run.
        only: way names to run (the serial loop always runs: it is the
            reference); None runs every way.
        batches: batches per epoch: an int for every workload, or a dict
            such as ``{"io": 60}`` overriding some of the sizes.
        process_workers: worker processes for kerasfeed processes and PyTorch.
        sections: among ``main`` (the table), ``h5file`` (the gzip-chunked scene file
            rows) and ``classic`` (100 slow generators).
        output_dir: where ``latest.json`` / ``latest.md`` go (and the cached
            HDF5 file, under ``cache/``); None writes nothing (the HDF5 file
            then goes to a temporary directory).
        progress: called with one line per configuration.

    Returns:
        A JSON-able dict: ``machine``, ``date``, ``settings``, ``rows``,
        ``latency_line``, ``h5file``, ``classic`` and ``markdown``.
    """
    import tempfile

    for w in workloads_:
        if w not in workloads.WORKLOADS:
            raise ValueError(f"Unknown workload {w!r}; expected some of {workloads.WORKLOADS}. Received: {w!r}")
    for s in sections:
        if s not in SECTIONS:
            raise ValueError(f"Unknown section {s!r}; expected some of {SECTIONS}. Received: {s!r}")
    known = {w.name for w in peers.ways(process_workers) + peers.extra_ways()} | {"raw-h5py"}
    for name in only or ():
        if name not in known:
            raise ValueError(f"Unknown way {name!r}; expected some of {sorted(known)}. Received: {name!r}")

    # Worker processes (spawned by kerasfeed, PyTorch or Keras) import the
    # workload classes by module name: make the repository importable there.
    pythonpath = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in pythonpath.split(os.pathsep):
        os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")

    tmp = None
    if output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kerasfeed-bench-")
        cache_dir = pathlib.Path(tmp.name)
    else:
        cache_dir = pathlib.Path(output_dir) / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    sizes = dict(QUICK_BATCHES if quick else FULL_BATCHES)
    if isinstance(batches, dict):
        sizes.update({k: int(v) for k, v in batches.items()})
    elif batches is not None:
        sizes = {k: int(batches) for k in sizes}
    if any(v < 2 for v in sizes.values()):
        raise ValueError(f"Every workload needs at least 2 batches per epoch. Received: batches={batches!r}")
    # Full runs time up to 4 s per configuration: this machine has slow
    # phases lasting seconds (every process ~30% slower), and a window that
    # short can sit entirely in one; the best epoch of a longer one rarely does.
    timing = {"min_timed_s": 0.3 if quick else 4.0, "max_timed_epochs": 2 if quick else 10}
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed benchmark, {date}, {'quick' if quick else 'full'} run on "
             f"{machine['cpu']} ({machine['cores_usable']} cores), load {machine['loadavg_start']}")
    all_ways = _select(peers.ways(process_workers), only)
    all_ways += [w for w in peers.extra_ways() if only and w.name in only]

    rows: List[Dict[str, Any]] = []
    try:
        if "main" in sections:
            for wl in workloads_:
                n = sizes[wl]
                if wl == "h5":
                    workloads.scene_file(cache_dir, n)  # made once, outside any timing
                progress(f"[{wl}] {n} batches per epoch")
                wl_rows = []
                for way in all_ways:
                    row = run_config(way, lambda wl=wl, n=n: workloads.make_workload(wl, n, cache_dir),
                                     progress=progress, **timing)
                    row["workload"] = wl
                    wl_rows.append(row)
                _ratios(wl_rows)
                rows += wl_rows

        latency = _latency_line(rows)
        h5file = None
        if "h5file" in sections:
            n = sizes["h5"]
            h5file = h5file_section(workloads.scene_file(cache_dir, n), n, rows, only,
                                    process_workers, timing, progress)
        classic = None
        if "classic" in sections and (not only or "classic" in only):
            classic = classic_section(quick, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {
        "date": date,
        "machine": machine,
        "settings": {"quick": quick, "batches": {w: sizes[w] for w in workloads_},
                     "workloads": list(workloads_), "only": list(only) if only else None,
                     "process_workers": process_workers, "sections": list(sections), **timing},
        "workloads": list(workloads_),
        "ways": [{"name": w.name, "label": w.label, "measures": w.measures} for w in all_ways],
        "rows": rows,
        "latency_line": latency,
        "h5file": h5file,
        "classic": classic,
        "elapsed_s": time.perf_counter() - started,
    }
    results["markdown"] = to_markdown(results)
    if output_dir is not None:
        out = pathlib.Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "latest.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "latest.md").write_text(results["markdown"])
    return results


def _latency_line(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    kt = next((r for r in rows if r.get("workload") == "io" and r["way"] == "kerasfeed-threads"), None)
    if kt is None or kt["status"] != "ok" or "x_serial" not in kt:
        return None
    return {"x_serial": kt["x_serial"], "batches_per_s": kt["batches_per_s"],
            "target": 20.0, "met": kt["x_serial"] >= 20.0}


# --- markdown ----------------------------------------------------------------------------


def _fmt(x: Optional[float], digits: int = 0) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}"


def _rate(x: float) -> str:
    return _fmt(x, 1 if x < 100 else 0)


def _cell(r: Optional[Dict[str, Any]]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return "n/a" if r["status"] == "n/a" else "error"
    ratio = f" ({r['x_serial']:.2f}×)" if "x_serial" in r else ""
    return f"{_rate(r['batches_per_s'])}{ratio}"


def _detail_rows(rows: List[Dict[str, Any]], with_workload: bool = True) -> List[str]:
    head = (["workload"] if with_workload else []) + [
        "way", "batches/s", "× serial", "timed epoch s", "first batch s", "one-off s",
        "main CPU µs/batch", "worker CPU µs/batch", "workers × RSS (USS) MB", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r.get("workload", "")] if with_workload else []
        if r["status"] == "ok":
            ws = r.get("workers") or []
            mem = (f"{len(ws)} × {_mean([w['rss_mb'] for w in ws]):.0f} "
                   f"({_mean([w['uss_mb'] for w in ws]):.0f})") if ws else "–"
            cells += [r["way"], _rate(r["batches_per_s"]),
                      f"{r['x_serial']:.2f}" if "x_serial" in r else "–",
                      _fmt(r["timed_epoch_s"], 3), _fmt(r["first_batch_s"], 2), _fmt(r["one_off_s"], 2),
                      _fmt(r["main_cpu_us_per_batch"]), _fmt(r["worker_cpu_us_per_batch"]), mem,
                      f"picked {r['picked']}" if r.get("picked") else r.get("note", "")]
        else:
            cells += [r["way"], "n/a" if r["status"] == "n/a" else "error", "", "", "", "", "", "", "",
                      r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return lines


def to_markdown(res: Dict[str, Any]) -> str:
    m = res["machine"]
    wls = res["workloads"]
    rows = res["rows"]
    s = res["settings"]
    out = [
        f"### Benchmark ({'quick' if s['quick'] else 'full'} run, {res['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores_usable']} usable cores of {m['cores']}, {m['ram_gb']} GB RAM; "
        f"{m['platform']}. Python {m['python']}, TensorFlow {m['tensorflow']}, Keras {m['keras']}, "
        f"h5py {m['h5py']}, numpy {m['numpy']}, torch {m['torch'] or 'not installed'}, "
        f"kerasfeed {m['kerasfeed']}. Large copy: {m['copy_gbs']} GB/s. "
        f"Load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}.",
        "",
    ]
    if rows or res.get("h5file"):
        out += ["Batches per epoch: " + ", ".join(f"{w} {s['batches'][w]}" for w in wls)
                + f". Rate = batches / best timed epoch (epoch 2, plus up to {s['max_timed_epochs'] - 1} more "
                  f"while the timed total is under {s['min_timed_s']} s); start-up is in the detail table.", ""]
    if rows:
        out += ["#### Batches/s (× the serial loop)", "",
                "| way of feeding | " + " | ".join(wls) + " |", "| --- |" + " --- |" * len(wls)]
        for way in res["ways"]:
            by = {r["workload"]: r for r in rows if r["way"] == way["name"]}
            if by:
                out.append(f"| {way['label']} | " + " | ".join(_cell(by.get(w)) for w in wls) + " |")
        notes = sorted({r["note"] for r in rows if r["status"] != "ok" and r.get("note")})
        if notes:
            out += [""] + [f"- {n}" for n in notes]
        auto = [f"- {r['workload']}: **{r.get('picked', '?')}**. {r.get('note', '')}" for r in rows
                if r["way"] == "kerasfeed-auto" and r["status"] == "ok"]
        if auto:
            out += ["", "What kerasfeed `auto` picked, and why:", ""] + auto
        lat = res.get("latency_line")
        if lat:
            out += ["", f"5 ms latency source (io): kerasfeed threads = {lat['x_serial']:.1f}× the serial loop "
                        f"({_rate(lat['batches_per_s'])} batches/s); target ≥ 20×: "
                        f"{'met' if lat['met'] else 'NOT met'}."]
        kp = [r for r in rows if r["way"] == "kerasfeed-processes" and r["status"] == "ok"]
        if kp:
            out += ["", "#### kerasfeed processes path", "",
                    "Consumer CPU = CPU time of the whole main process (tf.data runtime, the executor's "
                    "consumer side, the loop) in the timed epoch per batch; the executor's own figure is "
                    "its consumer-side time per item as it reports it (all epochs). Worker start-up is the "
                    "executor's (spawn to ready), first batch is build + first batch of epoch 1.", "",
                    "| workload | batches/s | consumer CPU µs/batch | executor consumer µs/item "
                    "| worker CPU µs/batch | worker start-up s | first batch s "
                    "| workers | RSS per worker MB | USS per worker MB |",
                    "|" + " --- |" * 10]
            for r in kp:
                ws = r.get("workers") or []
                st = (r.get("executor") or {}).get("stats") or {}
                st = st if isinstance(st, dict) else {}
                rss = _mean([w["rss_mb"] for w in ws]) if ws else st.get("rss_mb_per_worker")
                uss = _mean([w["uss_mb"] for w in ws]) if ws else st.get("uss_mb_per_worker")
                out.append(f"| {r['workload']} | {_rate(r['batches_per_s'])} | {_fmt(r['main_cpu_us_per_batch'])} | "
                           f"{_fmt(st.get('consumer_us_per_item'))} | {_fmt(r['worker_cpu_us_per_batch'])} | "
                           f"{_fmt(st.get('startup_s'), 2)} | {_fmt(r['first_batch_s'], 2)} | "
                           f"{len(ws) or st.get('workers', '–')} | {_fmt(rss)} | {_fmt(uss)} |")
        out += ["", "#### Details", ""] + _detail_rows(rows)
    h5 = res.get("h5file")
    if h5:
        out += ["", "#### Gzip-chunked scene file", "",
                f"Source: {h5['source']}; {h5['batches']} batches of 8 scenes × 4096 points × 6 float32, "
                "gzip, chunks of 8 scenes.", ""]
        out += _detail_rows(h5["rows"], with_workload=False)
        if h5.get("target"):
            t = h5["target"]
            out += ["", f"kerasfeed processes = {t['x_serial']:.2f}× serial; target ≥ 1.5×: "
                        f"{'met' if t['met'] else 'NOT met'}."]
    c = res.get("classic")
    if c:
        out += ["", "#### 100 slow generators", ""]
        if c.get("status") == "ok":
            fg, kf = c["from_generator"], c["kerasfeed"]
            out += [f"Each of {c['generators']} generators sleeps {c['sleep_s']} s, then yields one "
                    f"image/mask pair.", "",
                    "| way | seconds for all | note |", "| --- | --- | --- |",
                    f"| `from_generator` over the chained generators | {fg['extrapolated_s']:.2f} | "
                    f"{fg['note']} ({fg['measured_s']:.2f} s measured) |",
                    f"| `{kf['call']}` | {kf['best_s']:.3f} | best of 2 passes |",
                    "", f"Speed-up {c['speedup']:.1f}×; target ≥ 20×: {'met' if c['target']['met'] else 'NOT met'}."]
        else:
            out.append(c.get("note", "n/a"))
    out += ["", f"Whole run: {res['elapsed_s']:.0f} s."]
    return "\n".join(out) + "\n"


# --- command line ---------------------------------------------------------------------------


README_START = "<!-- benchmark-results:start -->"
README_END = "<!-- benchmark-results:end -->"


def update_readme(path: os.PathLike, markdown: str) -> None:
    """Replaces the block between the benchmark-results markers of ``path``."""
    import re

    path = pathlib.Path(path)
    text = path.read_text()
    # The markers must stand alone on their lines (docs may quote them inline).
    block = re.compile(rf"^{re.escape(README_START)}$.*?^{re.escape(README_END)}$", re.M | re.S)
    if not block.search(text):
        raise ValueError(f"{path} has no '{README_START}' ... '{README_END}' block (each marker alone "
                         f"on its line) to replace. Received: path={str(path)!r}")
    new = f"{README_START}\n{markdown.strip()}\n{README_END}"
    path.write_text(block.sub(lambda _: new, text, count=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                        help="comma-separated, among cpu,h5,io,big")
    parser.add_argument("--only", default=None,
                        help="comma-separated way names, e.g. kerasfeed-threads,keras-threads "
                             "(serial always runs); 'classic' selects the 100 slow generators")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch for every workload")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes for kerasfeed processes and PyTorch (default 2)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated among main,h5file,classic")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="do not run: re-render the markdown of a saved results JSON")
    parser.add_argument("--update-readme", metavar="PATH", action="append", default=[],
                        help=f"replace the {README_START} ... {README_END} block of PATH with the "
                             "results (repeatable), e.g. benchmarks/README.md")
    args = parser.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    if args.render:
        res = json.loads(pathlib.Path(args.render).read_text())
        res["markdown"] = to_markdown(res)
    else:
        try:
            res = run_benchmark(quick=args.quick, workloads_=split(args.workloads),
                                only=split(args.only) if args.only else None, batches=args.batches,
                                process_workers=args.workers, sections=split(args.sections),
                                output_dir=args.output_dir)
        except ValueError as e:
            parser.error(str(e))
        print(f"Wrote {pathlib.Path(args.output_dir) / 'latest.json'} and latest.md")
    print()
    print(res["markdown"])
    for path in args.update_readme:
        update_readme(path, res["markdown"])
        print(f"Updated the results block of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
