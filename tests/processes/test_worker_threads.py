"""A source's ``worker_threads``: one worker process makes several items at once, in order where it matters.

NOTE [ A worker that makes several items at once ] (execution/processes/worker_threads.py).
"""

from __future__ import annotations

import os
import time

import numpy as np

import kerasfeed
from kerasfeed.execution.processes.worker_threads import MAX_WORKER_THREADS, worker_threads


class Waits(kerasfeed.SceneSequence):
    """Each item waits (an object store far away) and records when it ran, in which process."""

    worker_threads = 4

    def __init__(self, log: str, n: int = 12, wait: float = 0.15):
        super().__init__()
        self.log, self.n, self.wait, self.scale = log, n, wait, 1

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t0 = time.monotonic()
        time.sleep(self.wait)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {t0} {time.monotonic()}\n")
        noise = kerasfeed.item_rng().integers(0, 1000)
        return np.array([i * self.scale, self.epoch, noise], np.int64)

    def on_epoch_end(self):
        self.scale += 1  # reaches the workers between passes (a SetState)


def _intervals(log):
    with open(log) as f:
        return [(int(p), float(a), float(b)) for p, a, b in (line.split() for line in f)]


def test_loads_overlap_in_one_worker_and_items_equal_the_threads_executor_s(tmp_path):
    log = str(tmp_path / "log")
    with kerasfeed.to_loader(Waits(log), executor="processes", workers=1, shuffle=True, seed=3) as ld:
        assert kerasfeed.executor_of(ld).options.in_flight_per_worker == 5  # 4 threads + 1 waiting
        got = [[b.tolist() for b in ld] for _ in range(3)]
    with kerasfeed.to_loader(Waits(str(tmp_path / "t")), executor="threads", shuffle=True, seed=3) as ld:
        want = [[b.tolist() for b in ld] for _ in range(3)]
    assert got == want  # order, values, item_rng draws, the state sent between passes and each item's pass
    assert [row[1] for p in got for row in p] == [e for e in range(3) for _ in range(12)]
    assert all(r[0] % (e + 1) == 0 for e, p in enumerate(got) for r in p)  # pass e saw scale e + 1
    spans = [(a, b) for pid, a, b in _intervals(log) if pid != os.getpid()]
    overlapping = sum(1 for k, (a, b) in enumerate(spans) for c, d in spans[k + 1:] if a < d and c < b)
    assert overlapping > 0, "one worker ran several items at once"


class Plain(Waits):
    worker_threads = None


def test_without_the_attribute_a_worker_makes_one_item_at_a_time(tmp_path):
    log = str(tmp_path / "log")
    with kerasfeed.to_loader(Plain(log, n=6, wait=0.05), executor="processes", workers=1) as ld:
        assert kerasfeed.executor_of(ld).options.in_flight_per_worker == 2
        list(ld)
    spans = sorted((a, b) for pid, a, b in _intervals(log) if pid != os.getpid())
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))


def test_the_attribute_is_read_as_a_positive_int_and_capped():
    class S:
        pass

    s = S()
    for value, expected in ((None, 1), (True, 1), (0, 1), (-3, 1), ("8", 1), (3, 3), (10**6, MAX_WORKER_THREADS)):
        s.worker_threads = value
        assert worker_threads(s) == expected, value


def test_closing_lets_running_loads_end_and_the_threads_return():
    """A leaving worker closes its load threads (``ThreadedLoads.close``): the loads running finish, then every
    thread returns, so none is cut off inside a call by the interpreter's exit (Python 3.11 aborted a few
    workers of remote readers so: "terminate called without an active exception"). A load that does not end
    is left after the timeout."""
    import threading

    from kerasfeed.execution.processes.worker_threads import ThreadedLoads

    class Req:
        epoch = 0

        def __init__(self, wait):
            self.wait = wait

    done = []
    loads = ThreadedLoads(3, lambda r: (time.sleep(r.wait), done.append(r.wait)))
    for w in (0.2, 0.3):
        loads.submit(Req(w))
    loads.close()
    assert sorted(done) == [0.2, 0.3]
    assert not any(t.is_alive() for t in loads._threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("kerasfeed-worker-load-")]

    stuck = ThreadedLoads(2, lambda r: time.sleep(r.wait))
    stuck.submit(Req(30))
    t0 = time.monotonic()
    stuck.close(timeout=0.3)
    assert time.monotonic() - t0 < 2  # bounded: a worker leaves even if a call hangs
    deadline = time.monotonic() + 5  # the idle thread got its end with the time spent: it returns at once
    while sum(t.is_alive() for t in stuck._threads) != 1:
        assert time.monotonic() < deadline, [t.is_alive() for t in stuck._threads]
        time.sleep(0.01)
