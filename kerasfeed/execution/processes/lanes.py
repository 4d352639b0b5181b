"""What the dispatcher knows of each worker: its requests, stream and death.

Lock-free bookkeeping: the owner (the ``Dispatcher``) holds its lock around every
call. A ``WorkerLane`` is the parent-side counterpart of one ``WorkerLoop`` as far
as requests go; the process itself is its ``WorkerProcess``.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, NamedTuple, Optional

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes.process import WorkerProcess
from kerasfeed.execution.processes.slots import SlotTable


class Request:
    """One ``Load`` sent to a worker, and its answer: the reader thread fills ``spec`` and
    ``nbytes`` (or ``error``) and sets ``done``, then ``event``, which the caller waits on."""

    __slots__ = ("id", "index", "slot", "event", "spec", "nbytes", "error", "done", "abandoned", "planned", "order")

    def __init__(self, request_id: int, index: int, slot: int):
        self.id = request_id
        self.index = index
        self.slot = slot
        self.event = threading.Event()
        self.spec: Optional[bytes] = None
        self.nbytes = 0  # of the slot's segment the answer uses
        self.error: Optional[BaseException] = None
        self.done = False
        self.abandoned = False  # nobody will take the answer: its reader frees the slot
        self.planned = False  # sent by a plan and not taken by a load yet
        self.order: Optional[int] = None  # its place among the loads sent to the worker, once sent


class RequestCounts(NamedTuple):
    """A snapshot of the requests over all workers (``Dispatcher.request_counts``).

    Attributes:
        pending: sent and not answered.
        unreleased: made and not released yet (answered or not).
        waiting: answered plan requests no load has taken yet.
        streams: workers running a stream.
    """

    pending: int
    unreleased: int
    waiting: int
    streams: int


class WorkerLane:
    """One worker as the dispatcher sees it.

    Attributes:
        process: its ``WorkerProcess``.
        pending: requests sent and not answered, by id.
        busy: requests made and not released yet (answered or not).
        waiting: of those, answered plan requests no load has taken yet.
        stream: the ``StreamSession`` it runs, if any.
        death: the ``WorkerError`` that explains its death, once dead.
        sent: requests sent to it so far (for ``worker_max_items``).
        retiring: why it takes no more requests and is being replaced
            (``worker_max_items``/``worker_max_rss``), or None.
        successor_started: a worker to take its place was started.
        exit_sent: it was told to leave (retired, every request answered).
        stopped_for: why the pool killed it (a timeout), for its error.
        boot_failures: how many workers before it under its id in a row died
            before they were ready (a start-up that keeps failing is fatal).
    """

    def __init__(self, process: WorkerProcess):
        self.id = process.id
        self.process = process
        self.pending: dict[int, Request] = {}
        self.busy = 0
        self.waiting = 0
        self.stream: Optional[Any] = None
        self.death: Optional[WorkerError] = None
        self.sent = 0
        self.retiring: Optional[str] = None
        self.successor_started = False
        self.exit_sent = False
        self.stopped_for: Optional[str] = None
        self.boot_failures = 0
        self.send_lock = threading.Lock()  # the loads' order on the way to the worker (``Request.order``)
        self.sends = 0

    def first_pending(self) -> Optional[Request]:
        """The pending request the worker reached first: the one it runs (or died on, or is stuck on).
        A worker makes loads in the order they reach it; ids are given before they are sent, and two
        threads may send in the other order (a death was blamed on an item already made). Those not
        sent yet come last. (A worker with ``worker_threads`` runs several at once.)"""
        return min(self.pending.values(), default=None, key=lambda r: (math.inf if r.order is None else r.order, r.id))

    def usable(self) -> bool:
        return self.stream is None and self.death is None and self.retiring is None


class Lanes:
    """Every worker's lane, and the choice of a worker for a request.

    ``all`` holds the live lane of each worker id; one replaced while its process
    still answers requests (retiring) stays in ``retired`` until it leaves.

    Args:
        slots: the pool's slot table (a request holds one slot).
        in_flight_per_worker: requests one worker may have at once.
        max_items: ``worker_max_items``: a lane sent that many requests retires.
        on_retire: called (owner's lock held) with a lane that just retired.
    """

    def __init__(
        self,
        slots: SlotTable,
        in_flight_per_worker: int,
        max_items: Optional[int] = None,
        on_retire: Optional[Callable[[WorkerLane, str], None]] = None,
    ):
        self.all: list[WorkerLane] = []
        self.retired: list[WorkerLane] = []
        self._slots = slots
        self._limit = in_flight_per_worker
        self._max_items = max_items
        self._on_retire = on_retire
        self._next_worker = 0  # where the round-robin search starts

    def add(self, process: WorkerProcess) -> None:
        self.all.append(WorkerLane(process))

    def __iter__(self):
        return iter(self.all)

    def every(self) -> list[WorkerLane]:
        """The live lanes and the retired ones still running."""
        return self.all + self.retired

    def replace(self, old: WorkerLane, new: WorkerLane) -> None:
        """``new`` takes ``old``'s place (its worker id)."""
        self.all[self.all.index(old)] = new
        if old.death is None:  # still running (or leaving): close() must still reap it
            self.retired.append(old)

    def forget(self, lane: WorkerLane) -> None:
        """A retired lane's process is gone."""
        if lane in self.retired:
            self.retired.remove(lane)

    def __len__(self) -> int:
        return len(self.all)

    def least_busy(self, planned: bool) -> Optional[WorkerLane]:
        """The least loaded worker that can take one more request.

        A plan (``planned``) counts the requests a worker has not answered: answers
        waiting for their load must not stall the worker. A direct load counts every
        request not released except those answers (a stale plan must never block it),
        so that its slots stay bounded however many threads call ``load``.
        """
        best, best_load = None, 0
        n = len(self.all)
        for j in range(n):
            lane = self.all[(self._next_worker + j) % n]
            load = len(lane.pending) if planned else lane.busy - lane.waiting
            if lane.usable() and load < self._limit and (best is None or load < best_load):
                best, best_load = lane, load
        if best is not None:
            self._next_worker = (best.id + 1) % n
        return best

    def pick_idle(self) -> Optional[WorkerLane]:
        """A live worker with no request and no stream (for a stream), in turn."""
        idle = [lane for lane in self.all if lane.usable() and lane.busy == 0]
        if not idle:
            return None
        lane = idle[self._next_worker % len(idle)]
        self._next_worker += 1
        return lane

    def new_request(self, lane: WorkerLane, request_id: int, index: int) -> Request:
        """A request for ``index`` on ``lane``, holding one of its slots."""
        lane.busy += 1
        req = Request(request_id, index, self._slots.take(lane.id))
        lane.pending[req.id] = req
        lane.sent += 1
        if self._max_items is not None and lane.sent >= self._max_items and lane.retiring is None:
            lane.retiring = f"was sent worker_max_items={self._max_items} items"
            if self._on_retire is not None:
                self._on_retire(lane, lane.retiring)
        return req

    def slot_done(self, lane: WorkerLane, slot: int) -> None:
        """A request's slot is free again (the owner notifies its waiters)."""
        lane.busy -= 1
        self._slots.give_back(lane.id, slot)

    def abandon_pending(self) -> list[Request]:
        """Marks every unanswered request abandoned; returns them."""
        out = []
        for lane in self.every():
            for req in lane.pending.values():
                if not req.done:
                    req.abandoned = True
                    out.append(req)
        return out

    # ------------------------------------------------------------ queries
    def counts(self) -> "RequestCounts":
        lanes = self.every()
        return RequestCounts(
            sum(len(lane.pending) for lane in lanes),
            sum(lane.busy for lane in lanes),
            sum(lane.waiting for lane in lanes),
            sum(lane.stream is not None for lane in lanes),
        )

    def idle(self) -> bool:
        return all(
            lane.busy == 0 and lane.waiting == 0 and not lane.pending and lane.stream is None for lane in self.every()
        )
