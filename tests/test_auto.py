"""``executor="auto"``: threads or processes, chosen by probing the source, with the reason."""

from __future__ import annotations

import logging
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution.auto import Probe, decide, make_auto_executor, probe_source
from kerasfeed.execution.factory import make_executor
from kerasfeed.execution.processes.options import PoolOptions

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PurePython:
    """~2-3 ms of pure-Python arithmetic per item (GIL-bound), a small batch."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        s = 0
        for k in range(50_000):
            s += k * k % 7
        return np.full((16, 64), s + i, np.float32), np.int64(i)


class Waits:
    """5 ms of latency (a network store), tiny items."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        time.sleep(0.005)
        return np.full(4, i, np.float32)


class LockedPurePython(PurePython):
    """GIL-bound, but holds a lock: cannot be sent to worker processes."""

    def __init__(self):
        self.lock = threading.Lock()


def _probe(**kw):
    base = dict(wall_s=0.002, cpu_s=0.002, runqueue_s=0.0, nbytes=100_000, copy_s=20e-6, parallelism_2_threads=1.0, calls=10)
    base.update(kw)
    return Probe(**base)


# ---------------------------------------------------------------- the decision rules


def test_decide_waiting_source_gets_threads():
    name, reason = decide(_probe(wall_s=0.005, cpu_s=0.0001, parallelism_2_threads=0.1), workers=2, cpus=2)
    assert name == "threads" and "mostly waits" in reason and "2% on the CPU" in reason


def test_decide_busy_machine_is_not_mistaken_for_waiting():
    # 8 ms wall, but 6 ms of it waiting for a CPU that other processes held
    name, reason = decide(_probe(wall_s=0.008, cpu_s=0.0019, runqueue_s=0.006), workers=2, cpus=2)
    assert name == "processes" and "95% on the CPU" in reason


def test_decide_gil_releasing_source_gets_threads():
    name, reason = decide(_probe(parallelism_2_threads=1.8), workers=2, cpus=2)
    assert name == "threads" and "releases the GIL" in reason and "on 1.8 CPUs at once" in reason


def test_decide_gil_releasing_source_with_large_items_gets_processes():
    name, reason = decide(_probe(parallelism_2_threads=1.7, nbytes=19_267_584, copy_s=0.002), workers=2, cpus=2)
    assert name == "processes" and "18.4 MB" in reason and "without a copy" in reason


def test_decide_gil_bound_source_gets_processes_with_numbers():
    name, reason = decide(_probe(), workers=2, cpus=2)
    assert name == "processes"
    assert "GIL-bound" in reason and "2 workers predicted at" in reason and "with threads" in reason


def test_decide_transport_bound_source_stays_in_threads():
    # 19 MB made in 1 ms but 9 ms to copy: both ways copy it once, and the
    # copies share the memory bus, so making it in parallel saves too little
    name, reason = decide(_probe(wall_s=0.001, cpu_s=0.001, nbytes=19_267_584, copy_s=0.009, parallelism_2_threads=1.0), 2, 2)
    assert name == "threads" and "18.4 MB" in reason and "would cost about what it saves" in reason


def test_decide_one_cpu_gets_threads():
    name, reason = decide(_probe(), workers=2, cpus=1)
    assert name == "threads" and "only 1 CPU" in reason


# ---------------------------------------------------------------- probing real sources


def test_probe_measures_waiting_and_cpu_bound_sources():
    waits = probe_source(Waits())
    assert waits.wall_s >= 0.005 and waits.cpu_s < waits.wall_s / 3
    assert waits.nbytes == 16 and waits.calls == 10
    busy = probe_source(PurePython())
    assert busy.cpu_s > (busy.wall_s - busy.runqueue_s) / 3 and busy.nbytes == 16 * 64 * 4
    assert busy.parallelism_2_threads < 1.5  # the GIL lets one thread run at a time


def test_auto_picks_threads_for_a_waiting_source(caplog):
    with caplog.at_level(logging.INFO, logger="kerasfeed"):
        ex = make_auto_executor(Waits())
    try:
        assert ex.name == "threads"
        assert ex.reason.startswith("auto chose threads:") and "mostly waits" in ex.reason
        assert ex.probe.wall_s >= 0.005
        assert any("executor='auto' for Waits: auto chose threads" in r.getMessage() for r in caplog.records)
        assert "reason=" in repr(ex)
    finally:
        ex.close()


def test_auto_picks_processes_for_pure_python_work():
    ex = make_auto_executor(PurePython(), PoolOptions(workers=2))
    try:
        assert ex.name == "processes", ex.reason
        assert ex.reason.startswith("auto chose processes:") and "GIL-bound" in ex.reason
        x, i = ex.load(7, 0)
        assert int(i) == 7 and x.shape == (16, 64)
    finally:
        ex.close()


def test_auto_falls_back_to_threads_when_the_source_cannot_be_pickled():
    ex = make_auto_executor(LockedPurePython(), PoolOptions(workers=2))
    try:
        assert ex.name == "threads"
        assert "processes would help" in ex.reason and "`source.lock`" in ex.reason
    finally:
        ex.close()


def test_factory_knows_auto_and_processes_and_rejects_others():
    ex = make_executor("auto", Waits())
    assert ex.name == "threads"
    with pytest.raises(ValueError, match=r"one of \('threads', 'processes', 'auto'\).*Received: 'fork'"):
        make_executor("fork", Waits())


def test_to_dataset_with_auto_executor():
    class Seq(kerasfeed.SceneSequence):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            s = 0
            for k in range(30_000):
                s += k % 3
            return np.full((2, 3), i, np.float32), np.full((2, 1), s, np.float32)

    ds = kerasfeed.to_dataset(Seq(), executor="auto", workers=2)
    ex = ds._kerasfeed_executor
    try:
        assert ex.name in ("threads", "processes") and ex.reason.startswith(f"auto chose {ex.name}")
        xs = [int(x.numpy()[0, 0]) for x, _ in ds]
        assert xs == list(range(6))
    finally:
        ex.close()
