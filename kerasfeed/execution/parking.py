"""Parking: an executor whose pass failed stops its threads or workers once the pass is left.

NOTE [ Parking after a failed pass ]
====================================

A pass that fails (``source[i]`` raised, an item did not fit the signature)
usually ends its consumer, while its dataset, and its workers, often live on
where the owner cannot drop them (docs/reliability.md, *After a failed pass:
parking*). (A worker that died or timed out closes its whole pool at once
instead: see NOTE [ Worker process shutdown ].)

So the pipeline tells its executor when a load fails (``pass_failed``), and a
watch thread (one per failure, gone once it decides) looks at the executor's
loads every ``TICK_S``: once none is in progress and none started during a
whole tick, the executor *parks*: its pool threads end, or its worker
processes stop (shared memory released). A later ``plan`` or ``load`` starts
fresh ones (worker processes with the source as it is then: one start-up). A
new pass disarms the watch. A consumer that goes on after an error
(``ds.ignore_errors()``, a retry loop) keeps loading, so nothing parks under
it; a pause longer than a tick between its passes costs one start-up.

Errors that mean the consumer went away on purpose do not arm the watch
(``WaitAbandoned``: the iterator was deleted while a load waited; Ctrl-C).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Optional

from kerasfeed.execution import thread_tasks

TICK_S = 0.25  # how often the watch looks; the executor parks after one tick without a load


class ParkWatch:
    """Parks ``executor`` (weakly held; it provides ``Executor.activity`` and ``park``) once its failed
    pass is left (see the note above), looking every ``TICK_S`` seconds."""

    def __init__(self, executor: Any):
        self._ref = weakref.ref(executor)
        self._lock = threading.Lock()
        self._generation = 0
        self.armed = False
        self._epoch: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    def arm(self, epoch: int) -> None:
        """A load of pass ``epoch`` failed: start watching (re-arming while armed only moves the pass)."""
        if thread_tasks.exit_begun():  # the exit's own close failed the load: nothing to park, no thread to join
            return
        with self._lock:
            self._epoch = epoch
            if self.armed:
                return
            self.armed = True
            self._generation += 1
            generation = self._generation
        self._thread = threading.Thread(
            target=_watch, args=(self._ref, self, generation), name="kerasfeed-park-watch", daemon=True
        )
        thread_tasks.join_at_exit(self)  # NOTE [ Pool threads at exit ]
        self._thread.start()

    def pass_started(self, epoch: int) -> None:
        """Pass ``epoch`` is planned: the consumer went on, unless it is the
        failed pass itself (an endless pass plans block after block)."""
        if self.armed and epoch != self._epoch:
            self.armed = False

    def disarm(self) -> None:
        """Parked or closed: stop watching."""
        self.armed = False

    stop_at_exit = disarm

    def alive(self) -> list[threading.Thread]:
        return thread_tasks.running(self._thread)

    def current(self, generation: int) -> bool:
        return self.armed and self._generation == generation


def _watch(ref: "weakref.ref", watch: ParkWatch, generation: int) -> None:
    last = None
    while True:
        time.sleep(TICK_S)
        if not watch.current(generation):
            return
        executor = ref()
        if executor is None:
            return
        mark = executor.activity()
        if mark == last and mark[1] == 0 and executor.park(mark):
            watch.disarm()
            return
        last = mark
        del executor  # never hold it while sleeping


__all__ = ["ParkWatch", "TICK_S"]
