"""The machine a benchmark runs on, and the processes each configuration starts (found, measured, ended)."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import platform
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import psutil

_INFRASTRUCTURE = ("resource_tracker", "semaphore_tracker", "forkserver")  # outlive configurations on purpose


class PeakRss:
    """``with PeakRss() as rss:``: ``rss.growth`` is this process's peak RSS growth (bytes) over the block,
    sampled every 5 ms by a thread and once more at its end."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._done = threading.Event()
        self.growth = 0

    def __enter__(self) -> "PeakRss":
        self._base = self._proc.memory_info().rss
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            self._sample()
            time.sleep(0.005)

    def _sample(self) -> None:
        self.growth = max(self.growth, self._proc.memory_info().rss - self._base)

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._watcher.join()
        self._sample()


def thread_cpu_us(group: Callable[[Optional[str]], str]) -> Dict[str, float]:
    """CPU so far (µs) of this process's threads (Linux ``schedstat``), summed by ``group(name)``;
    the name is the Python thread's, None for threads Python did not start (the frameworks')."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        key = group(names.get(int(tid)))
        out[key] = out.get(key, 0.0) + ns / 1e3
    return out


# --- the machine ----------------------------------------------------------------------------


def version(*dists: str) -> Optional[str]:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cpu_model() -> str:
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
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def machine_info() -> Dict[str, Any]:
    """The machine and library versions (read from package metadata: nothing heavy is imported)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info: Dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "cores_usable": usable,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for name, dists in (("tensorflow", ("tensorflow", "tensorflow-cpu")), ("keras", ("keras",)), ("jax", ("jax",)),
                        ("torch", ("torch",)), ("grain", ("grain",)), ("h5py", ("h5py",)), ("numpy", ("numpy",)),
                        ("kerasfeed", ("kerasfeed",))):
        info[name] = version(*dists)
    info["copy_gbs"] = round(copy_bandwidth_gbs(), 1)
    info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


# --- processes -----------------------------------------------------------------------------


def descendants() -> List[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def new_workers(before: set) -> List[psutil.Process]:
    out = []
    for p in descendants():
        try:
            if p.pid not in before and not any(w in " ".join(p.cmdline()) for w in _INFRASTRUCTURE):
                out.append(p)
        except psutil.Error:
            continue  # gone already
    return out


def sample_workers(before: set, into: Dict[int, Dict[str, float]]) -> None:
    """Records the peak RSS/USS (MB) of the processes this configuration started."""
    for p in new_workers(before):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            mem = p.memory_full_info()
        except psutil.Error:
            continue
        if mem.rss == 0:  # exiting: its memory is already released
            continue
        old = into.get(p.pid, {"rss_mb": 0.0, "uss_mb": 0.0})
        into[p.pid] = {"rss_mb": max(old["rss_mb"], mem.rss / 2**20),
                       "uss_mb": max(old["uss_mb"], getattr(mem, "uss", 0) / 2**20)}


def workers_cpu(procs: Sequence[psutil.Process]) -> Dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def wait_for_exit(before: set, timeout: float = 10.0) -> List[int]:
    """Waits until the processes started since ``before`` are gone; returns the pids it had to kill."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not new_workers(before):
            return []
        time.sleep(0.05)
    killed = []
    for p in new_workers(before):
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    psutil.wait_procs([psutil.Process(pid) for pid in killed if psutil.pid_exists(pid)], timeout=5)
    return killed
