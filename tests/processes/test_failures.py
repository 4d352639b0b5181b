"""Worker failures: crashes, kills, failing ``worker_init``, timeouts and bad
arguments give a ``WorkerError`` naming the worker, pid and cause.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest
from _kit import Kit

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.errors import WorkerError

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------- failures


class Crashy:
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 5:
            if self.how == "segv":
                ctypes.string_at(0)
            elif self.how == "exit":
                os._exit(3)
            elif self.how == "sleep":
                time.sleep(60)
        return np.full(2, i)


class ExitsOnce:
    """Item 5's first make ends its worker (``os._exit``); a marker file says it happened."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)
        return np.full(2, i)


def test_the_pass_after_a_worker_died_starts_new_workers(tmp_path):
    """Without retries= a dead worker fails its pass; the next pass runs on new workers (as the message says;
    it said "create the dataset (or executor) again to retry", and docs/reliability.md "every later pass
    raises that WorkerError")."""
    with kerasfeed.to_loader(ExitsOnce(tmp_path / "died"), executor="processes", workers=2) as loader:
        before = set(kerasfeed.executor_of(loader).pids)
        with pytest.raises(WorkerError, match=r"this pass fails, and the next pass starts new workers"):
            list(loader)
        assert [int(b[0]) for b in loader] == list(range(8))
        assert not before & set(kerasfeed.executor_of(loader).pids)


@pytest.mark.parametrize(
    "how, expect",
    [("segv", r"was killed by signal SIGSEGV \(11\)"), ("exit", r"exited unexpectedly with exit code 3")],
)
def test_crashing_worker_fails_fast_with_pid_and_cause(how, expect):
    ex = ProcessExecutor(Crashy(how), workers=2)
    try:
        assert ex.load(1, 0)[0] == 1
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=expect) as e:
            ex.load(5, 0)
        assert time.monotonic() - t0 < 10
        err = e.value
        assert err.pid in ex.pids and f"(pid {err.pid})" in str(err)
        assert "while loading Crashy[5]" in str(err) and "does not replace a dead or stopped worker within a pass" in str(err)
        if how == "segv":  # the worker's Python stack at the crash is in the message
            assert "in __getitem__" in str(err) and "Segmentation fault" in str(err)
            assert err.exitcode == -signal.SIGSEGV
        else:
            assert err.exitcode == 3
        # the pass is over: later items fail at once too, they do not hang
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=expect):
            ex.load(2, 0)
        assert time.monotonic() - t0 < 10
    finally:
        ex.close()


def test_sigkilled_busy_worker_fails_pending_and_later_items():
    ex = ProcessExecutor(Crashy("sleep"), workers=1)
    try:
        ex.wait_ready(60)
        pid = ex.pids[0]
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 0 \(pid {pid}\) of Crashy was killed by signal SIGKILL \(9\)"):
            ex.load(5, 0)  # sleeps 60 s in the worker
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerError, match="SIGKILL"):
            ex.load(1, 0)
    finally:
        ex.close()


def test_idle_worker_killed_between_items_is_reported():
    ex = ProcessExecutor(Crashy("none"), workers=2)
    try:
        assert ex.load(1, 0)[0] == 1
        victim = ex.pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(WorkerError, match=rf"\(pid {victim}\) of Crashy was killed by signal SIGKILL"):
            while time.monotonic() < deadline:  # the next items fail, well within 10 s
                ex.load(2, 0)
    finally:
        ex.close()


def test_failing_worker_init_is_reported_with_its_traceback():
    def broken_init():
        raise RuntimeError("cannot reach the bucket")

    ex = ProcessExecutor(Kit(), workers=1, worker_init=broken_init)
    try:
        with pytest.raises(WorkerError) as e:
            ex.load(0, 0)
        msg = str(e.value)
        assert "failed to start: RuntimeError: cannot reach the bucket" in msg
        assert "in broken_init" in msg and "Worker traceback" in msg
    finally:
        ex.close()


def test_timeout_stops_a_stuck_item():
    ex = ProcessExecutor(Crashy("sleep"), workers=1, timeout=0.5)
    try:
        ex.wait_ready(60)  # the worker's start-up is not the item's time (a busy machine took seconds)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not return Crashy\[5\] within timeout=0.5 s"):
            ex.load(5, 0)
        assert time.monotonic() - t0 < 20  # the item sleeps 60 s: the timeout, then the kill, 4x slower under load
    finally:
        ex.close()


def test_bad_arguments_say_what_was_received():
    with pytest.raises(ValueError, match=r"`workers` must be a positive int. Received: workers=0"):
        ProcessExecutor(Kit(), workers=0)
    with pytest.raises(ValueError, match=r"Received: in_flight_per_worker=-1"):
        ProcessExecutor(Kit(), workers=1, in_flight_per_worker=-1)
    with pytest.raises(TypeError, match=r"`worker_init` must be a callable or None. Received: worker_init=3"):
        ProcessExecutor(Kit(), workers=1, worker_init=3)


def test_a_death_is_blamed_on_the_load_that_reached_the_worker_first():
    """Request ids are given under the dispatcher's lock, the loads sent after it: two threads may send
    them in the other order, and a worker makes them in the order they arrive. A death was blamed on the
    lowest id pending, an item the worker had made already: that healthy item was left out under
    max_skipped and the one that killed the worker made again (1 run in 8 beside a CPU burner)."""
    from kerasfeed.execution.processes.dispatcher import Dispatcher
    from kerasfeed.execution.processes.lanes import Request, WorkerLane

    class Process:  # what a lane sends through
        id = 0

        def __init__(self):
            self.loads = []

        def send(self, message):
            self.loads.append(message.index)

    lane = WorkerLane(Process())
    made_first, made_second = Request(6, 14, 0), Request(8, 9, 1)
    lane.pending = {6: made_first, 8: made_second}
    Dispatcher.send_requests([(lane, made_second, 0)])  # the thread that got id 8 sends first
    assert lane.first_pending() is made_second
    Dispatcher.send_requests([(lane, made_first, 0)])
    assert lane.process.loads == [9, 14] and lane.first_pending() is made_second
    del lane.pending[8]  # answered: the worker runs item 14 now
    assert lane.first_pending() is made_first
    lane.pending[10] = Request(10, 3, 2)  # not sent yet: after every one sent
    assert lane.first_pending() is made_first


class _DiesAt13:
    def __len__(self):
        return 30

    def __getitem__(self, i):
        import kerasfeed

        if i == 13 and kerasfeed.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full((10,), i, np.int64)


def test_a_close_while_a_reader_closes_after_a_death_returns_once_the_workers_exited(tmp_path):
    """A worker's death makes its reader close the pool; the owner's close then returned at once, and the other
    worker outlived ``export`` by ~50 ms, its fds still held (a helper's report, 3 of 3)."""
    import psutil

    import kerasfeed

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for k in range(3):
        with pytest.raises(WorkerError):
            kerasfeed.export(_DiesAt13(), str(tmp_path / f"e{k}"), num_shards=4, executor="processes", workers=2,
                             progress=False)
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert left == [], [(p.pid, p.status()) for p in left]
