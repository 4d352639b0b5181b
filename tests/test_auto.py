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
from kerasfeed.execution import auto
from kerasfeed.execution.auto import Probe, decide, make_auto_executor, predict, probe_source
from kerasfeed.execution.auto_probe import PROBE_BUDGET_S
from kerasfeed.execution.factory import make_executor
from kerasfeed.execution.processes.options import PoolOptions, default_workers

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


# ---------------------------------------------------------------- at the machine's worker and core count
# Probe figures of the issue-24 workloads (batches of 64 images 96x96x3, 1.77 MB):
# decode: 19 ms/batch serially, ~5 ms of it GIL-held Python, 1.6 CPUs on two threads;
# h5: gzip slices under h5py's lock; io: 5 ms waits; big: a 19 MB np.full.
DECODE = dict(wall_s=1 / 52, cpu_s=1 / 52, nbytes=1_769_472, copy_s=150e-6, parallelism_2_threads=1.6)
H5 = dict(wall_s=1 / 64, cpu_s=0.97 / 64, nbytes=1_769_472, copy_s=150e-6, parallelism_2_threads=1.0)
IO = dict(wall_s=0.005, cpu_s=0.0001, nbytes=16, copy_s=1e-6, parallelism_2_threads=0.05)


@pytest.mark.parametrize("workers, cpus", [(2, 2), (14, 16), (15, 16), (32, 64), (62, 64)])
def test_a_partly_gil_bound_source_goes_to_processes_once_cores_allow(workers, cpus):
    """Two threads on 1.6 CPUs look GIL-free, but the GIL-held quarter caps threads
    near 4x one thread (Amdahl) on any machine, while processes scale with workers."""
    name, reason = decide(_probe(**DECODE), workers, cpus)
    assert name == "processes", reason
    assert "on 1.6 CPUs at once" in reason and "about 25% of its CPU time holds the GIL" in reason
    assert "threads reach at most 4.0x one thread" in reason
    assert f"{workers} workers predicted at ~" in reason and f"with threads on {cpus} CPUs" in reason
    pred = predict(_probe(**DECODE), workers, cpus)
    # Threads stay under Amdahl's cap; processes scale with the workers up to the memory bus.
    assert pred.threads < 4.0 * 52
    assert pred.processes > min(0.95 * min(workers, cpus) * 52, 0.99 / pred.transport_s)
    if cpus == 16:
        # The 16-core figures: threads made 134 batches/s, 15 processes 797.
        assert 120 < pred.threads < 200 and 600 < pred.processes < 1000 * workers / 15


@pytest.mark.parametrize("cpus", [2, 16, 64])
def test_io_goes_to_threads_and_h5_to_processes_at_every_core_count(cpus):
    workers = default_workers(cpus)
    name, reason = decide(_probe(**IO), workers, cpus)
    assert name == "threads" and "mostly waits" in reason and f"{workers} workers predicted at" in reason
    pred = predict(_probe(**IO), workers, cpus)
    # 64 waits in flight vs one per worker
    assert pred.threads == pytest.approx(1 / (0.005 / 64 + 1e-6)) and pred.processes == pytest.approx(workers / (0.005 + 1e-6))
    name, reason = decide(_probe(**H5), workers, cpus)
    assert name == "processes" and "GIL-bound" in reason and f"on {cpus} CPUs" in reason
    assert predict(_probe(**H5), workers, cpus).processes > 0.8 * workers * 64  # ~one serial rate per worker


def test_predictions_follow_amdahl_and_the_core_count():
    """Threads: the GIL-held part one call after another, the rest over min(threads, cpus)."""
    p = _probe(**DECODE)
    preds = [predict(p, default_workers(c), c) for c in (2, 16, 64)]
    assert [q.cpus for q in preds] == [2, 16, 64] and [q.workers for q in preds] == [2, 14, 32]
    gil, par = preds[0].gil_s, preds[0].parallel_s
    assert gil == pytest.approx(p.cpu_s / 4) and par == pytest.approx(p.cpu_s * 3 / 4)  # 2/1.6 - 1 = 25 %
    for q in preds:
        assert 1 / q.threads == pytest.approx(gil + par / q.cpus + p.copy_s)  # to_dataset's copy
        assert q.threads < 1 / gil  # never past the GIL-held part
    assert preds[0].threads < preds[1].threads < preds[2].threads
    assert preds[0].processes < preds[1].processes < preds[2].processes
    # to_loader hands numpy arrays over: threads pay no copy in the consumer.
    assert 1 / predict(p, 14, 16, "numpy").threads == pytest.approx(gil + par / 16)


def test_big_items_on_two_cores_depend_on_the_front_end():
    """19 MB items: to_dataset's threads pay TensorFlow's copy, to_loader's do not (2 cores:
    to_loader threads made 332 batches/s where processes made 185)."""
    quiet = _probe(wall_s=3.24e-3, cpu_s=3.24e-3, nbytes=19_267_584, copy_s=0.85e-3, parallelism_2_threads=1.7)
    name, reason = decide(quiet, 2, 2, handover="tensorflow")
    assert name == "processes" and "TensorFlow would copy each one" in reason
    name, reason = decide(quiet, 2, 2, handover="numpy")
    assert name == "threads" and "2 workers predicted at" in reason, reason
    # A machine whose bus one core fills: two threads overlap nothing; writing the
    # item does not speed up in processes either (a copy's worth counted on the bus).
    busy_bus = _probe(wall_s=3.8e-3, cpu_s=3.8e-3, nbytes=19_267_584, copy_s=2.9e-3, parallelism_2_threads=0.96)
    name, reason = decide(busy_bus, 2, 2, handover="numpy")
    assert name == "threads" and "would cost about what it saves" in reason and "to_loader hands" in reason
    pred = predict(busy_bus, 2, 2, handover="numpy")
    assert pred.threads > 1.4 * pred.processes and pred.transport_s == pytest.approx(2.9e-3 + 3.8e-3 + auto.PROCESS_OVERHEAD_S)


def test_a_busy_probe_keeps_large_memory_bound_items_in_threads_under_to_loader():
    """19 MB np.full probed on a busy machine (issue 46): two threads overlapped nothing (0.5 CPUs), which reads as
    GIL-bound; making it takes ~3 copies' worth, so it is memory-bus work a worker would do too and then copy again
    (measured: threads 600-980, processes 317-517 batches/s). to_dataset keeps its own rule (TensorFlow copies)."""
    busy = _probe(wall_s=1.73e-3, cpu_s=1.73e-3, nbytes=19_267_584, copy_s=0.64e-3, parallelism_2_threads=0.5)
    name, reason = decide(busy, 2, 2, handover="numpy")
    assert name == "threads" and "would cost about what it saves" in reason and "to_loader hands" in reason, reason
    pred = predict(busy, 2, 2, handover="numpy")
    assert pred.transport_s == pytest.approx(0.64e-3 + 1.73e-3 + auto.PROCESS_OVERHEAD_S)
    # A slow GIL-bound item of the same size still goes to processes: making it is mostly not the bus.
    slow = _probe(wall_s=20e-3, cpu_s=20e-3, nbytes=19_267_584, copy_s=0.64e-3, parallelism_2_threads=1.0)
    assert decide(slow, 2, 2, handover="numpy")[0] == "processes"
    assert predict(slow, 2, 2, handover="numpy").transport_s == pytest.approx(0.64e-3 * 4 + auto.PROCESS_OVERHEAD_S)


def test_predict_refuses_an_unknown_handover():
    with pytest.raises(ValueError, match=r"`handover` must be one of \('tensorflow', 'numpy'\). Received: handover='torch'"):
        predict(_probe(), 2, 2, handover="torch")


def test_auto_decides_for_the_default_worker_count_of_this_machine(monkeypatch):
    """workers=None: the decision is for default_workers() on the usable CPUs."""
    monkeypatch.setattr(auto, "usable_cpus", lambda: 16)
    ex = make_auto_executor(Waits())
    try:
        assert ex.name == "threads" and "14 workers predicted at" in ex.reason and "on 16 CPUs" in ex.reason
    finally:
        ex.close()


def test_auto_decides_for_the_workers_a_small_source_gets(monkeypatch):
    """A 3-item source starts 3 workers at most (ProcessExecutor): the prediction is for 3, not 14."""
    monkeypatch.setattr(auto, "usable_cpus", lambda: 16)

    class ThreeWaits(Waits):
        def __len__(self):
            return 3

    for workers in (None, 8):
        ex = make_auto_executor(ThreeWaits(), PoolOptions(workers=workers))
        try:
            assert "3 workers predicted at" in ex.reason and "on 16 CPUs" in ex.reason, ex.reason
        finally:
            ex.close()


# ---------------------------------------------------------------- probing real sources


def test_probe_measures_waiting_and_cpu_bound_sources():
    waits = probe_source(Waits())
    assert waits.wall_s >= 0.005 and waits.cpu_s < waits.wall_s / 3
    assert waits.nbytes == 16 and waits.calls == 10  # a warm-up, 3 timed, 3 on each of two threads
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
    with pytest.raises(ValueError, match=r"one of \('threads', 'processes', 'auto'\) \(or 'ray'.*Received: 'fork'"):
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


def test_one_slow_item_among_fast_ones_keeps_the_probe_within_its_budget():
    """Item 1 takes 50 ms, the others nothing: the two-thread probe repeated every index as often as a fast
    one allows (~290 times), so to_loader(executor="auto") took 13-15 s and called item 1 about 500 times."""
    calls = {1: 0}

    class OneSlowItem:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i == 1:
                calls[1] += 1
                time.sleep(0.05)
            return np.full(4, i, np.float32)

    probe = probe_source(OneSlowItem())
    assert calls[1] <= 2 + 2 * (PROBE_BUDGET_S / 2 / 0.05 + 1), calls  # each thread stops at its deadline
    assert probe.concurrent_error is None


def test_a_two_thread_probe_that_raised_is_named_in_the_reason():
    """It said "the two-thread probe was skipped: items are slow" for items of about 1 ms."""

    class MainThreadOnly:
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("only on the main thread")
            return np.full(4, sum(range(20000)) + i, np.float32)

    probe = probe_source(MainThreadOnly())
    assert probe.parallelism_2_threads is None and probe.concurrent_error == "RuntimeError: only on the main thread"
    _, reason = decide(probe, workers=2, cpus=2)
    assert "the two-thread probe failed, an item made on a second thread raised RuntimeError: only on the main " \
        "thread" in reason, reason


class PerThreadBuffer:
    """Waits as a remote read does and writes each item into its calling thread's own buffer."""

    def __init__(self, n=12):
        self.n, self._local = n, threading.local()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.005)
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.zeros(4, np.float32)
        buf[:] = i
        return buf

    def __getstate__(self):
        return {"n": self.n}

    def __setstate__(self, state):
        self.__init__(state["n"])


def test_auto_with_cache_stores_the_probed_items_of_a_source_that_reuses_its_buffers(tmp_path):
    """The probe kept its items to store them once it was done; by then the buffers held item 3: items 0-2 were
    served as item 3 in every pass, and kept so in a directory for the next run."""
    for cache in ("memory", str(tmp_path / "kept")):
        with kerasfeed.to_loader(PerThreadBuffer(), batch_size=None, executor="auto", cache=cache, copy=True) as loader:
            passes = [[float(b[0]) for b in loader] for _ in range(2)]
        assert passes == [[float(i) for i in range(12)]] * 2, (cache, passes)
