"""A worker process that makes several items at once, for sources whose calls mostly wait (light).

NOTE [ A worker that makes several items at once ]
A worker process makes one item at a time: right for GIL-bound work and for
h5py, which serialise anyway. A source whose items mostly *wait* (an object
store 20 ms away; the remote HDF5 readers fetch byte ranges and inflate them
with zlib, both outside the GIL) would leave each worker idle for most of a
call, and on two cores more workers only add processes. Such a source says
so with an int attribute ``worker_threads``: its workers then run that many
loads at once, on daemon threads, and the pool keeps that many requests
(plus one) in flight per worker. Answers go back as they finish (the parent
matches them to requests by id). Order is kept where it matters:

- a ``SetState`` (what the consumer's epoch hooks changed) or a stream waits
  for the loads running, and the loads after it wait for it;
- a load of another pass waits for the running loads of the pass before:
  ``set_epoch`` changes the source that those loads read.

The global ``random``/``numpy.random`` are shared by the threads, so they
are not reseeded per item there: such a source draws from
``kerasfeed.item_rng()`` (per thread, per item), as on the threads executor.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

# At most this many loads at once in one worker (the attribute is a hint about I/O, not a pool size to trust).
MAX_WORKER_THREADS = 64
CLOSE_S = 5.0  # a leaving worker waits at most this long for its running loads (each has its own timeout too)


def worker_threads(source: Any) -> int:
    """The source's ``worker_threads`` (1 when it has none or it is not a positive int), capped."""
    n = getattr(source, "worker_threads", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return 1
    return min(n, MAX_WORKER_THREADS)


class ThreadedLoads:
    """Runs ``load(request)`` for up to ``threads`` requests at once (see the NOTE).

    Args:
        threads: loads at once.
        load: what each thread runs for a request (it answers the parent itself).
    """

    def __init__(self, threads: int, load: Callable[[Any], None]):
        self._load = load
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._running = 0
        self._epoch: Any = None
        self._threads = [threading.Thread(target=self._loop, name=f"kerasfeed-worker-load-{k}", daemon=True)
                         for k in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while True:
            request = self._tasks.get()
            if request is None:  # close()
                return
            try:
                self._load(request)
            except BaseException:  # noqa: BLE001 - the parent is gone (_Exit): the main thread sees it too
                pass
            finally:
                with self._idle:
                    self._running -= 1
                    if self._running == 0:
                        self._idle.notify_all()

    def submit(self, request: Any) -> None:
        """Starts ``request`` (a ``protocol.Load``); one of another pass first waits for the running ones."""
        if request.epoch != self._epoch:
            self.drain()
            self._epoch = request.epoch
        with self._idle:
            self._running += 1
        self._tasks.put(request)

    def drain(self, timeout: Optional[float] = None) -> None:
        """Waits until no load is running (at most ``timeout`` seconds)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._running, timeout)

    def close(self, timeout: float = CLOSE_S) -> None:
        """Lets the running loads end (their answers fail once the parent is gone) and the threads return,
        waiting at most ``timeout`` seconds in all. A daemon thread still inside a call when the interpreter
        exits is cut off there (Python 3.11: ``pthread_exit`` unwinding its C and C++ frames), which aborted
        a few workers of remote readers at exit with "terminate called without an active exception"."""
        deadline = time.monotonic() + timeout
        self.drain(timeout)
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


__all__ = ["MAX_WORKER_THREADS", "ThreadedLoads", "worker_threads"]
