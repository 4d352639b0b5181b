"""The benchmark harness: the machine, one configuration timed, its processes accounted for.

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

import gc
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks import peers  # noqa: E402

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


def descendants() -> List[psutil.Process]:
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
    return [p for p in descendants() if p.pid not in before and not _is_infrastructure(p)]


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


def wait_for_exit(before: set, timeout: float = 10.0) -> List[int]:
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
    before = {p.pid for p in descendants()}
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
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others
        result.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        try:
            if feed is not None:
                feed.close()
        except Exception as e:  # noqa: BLE001 - reported in the row
            result.setdefault("close_error", f"{type(e).__name__}: {e}")
        closer = getattr(seq, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:  # noqa: BLE001 - the feed's error is already in the row
                pass
        feed = seq = None
        gc.collect()
        killed = wait_for_exit(before)
        if killed:
            result["killed_after_close"] = killed
        result["main_rss_mb_after"] = psutil.Process().memory_info().rss / 2**20
    if result["status"] == "ok":
        rss = mean([w["rss_mb"] for w in result["workers"]])
        progress(f"  {label}{way.name:22s} {result['batches_per_s']:9.1f} batches/s"
                 f"  first batch {result['first_batch_s']:.2f}s"
                 f"  main CPU {result['main_cpu_us_per_batch']:.0f} µs/batch"
                 + (f"  {len(result['workers'])} workers, {rss:.0f} MB RSS each" if result["workers"] else ""))
    else:
        progress(f"  {label}{way.name:22s} {result['note']}")
    return result


def mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def save_results(out_dir: Any, stem: str, results: Dict[str, Any]) -> pathlib.Path:
    """Writes ``results`` to ``<out_dir>/<stem>.json`` and its ``"markdown"``
    entry to ``<out_dir>/<stem>.md`` (creating ``out_dir``); returns the JSON path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    (out / f"{stem}.md").write_text(results["markdown"])
    return path


# --- the sections ------------------------------------------------------------------------


def select_ways(all_ways: Sequence[peers.Way], only: Optional[Sequence[str]]) -> List[peers.Way]:
    if not only:
        return list(all_ways)
    return [w for w in all_ways if w.name in only or w.name == "serial"]


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    serial = next((r for r in rows if r["way"] == "serial" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and serial is not None:
            r["x_serial"] = r["batches_per_s"] / serial["batches_per_s"]
