"""Requests, pass plans, parking and close ordering (the reader threads: ``readers.py``).

Counterpart of ``worker.py``'s ``WorkerLoop.run``. The ``Dispatcher`` owns the
pool's one lock; the units it drives hold none (``StreamSessions`` uses this one).

- **Plans** (``pass_plans.py``): when a pass starts, ``start_plan`` requests
  its items ahead (and then the next pass's), and each worker's reader
  thread sends the next request the moment an answer arrives: a worker never
  waits for the consumer to ask. ``load`` then only picks up the answer, so
  tf.data can call it sequentially.
- **Direct loads**: a ``load`` outside the current plan (another pass
  iterated at the same time, a direct call) takes a slot on the least busy
  worker, sends its own request and waits (without the GIL) for the reader.
- **Failures and close**: NOTE [ Worker process shutdown ] in ``process.py``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Optional, Sequence

from kerasfeed import _handoff
from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol, shm, shutdown
from kerasfeed.execution.processes.lanes import Lanes, Request, RequestCounts, WorkerLane
from kerasfeed.execution.processes.pass_plans import PassPlans, PlanStatus, Send
from kerasfeed.execution.processes.process import NO_RESTART, WorkerProcess, fresh_error
from kerasfeed.execution.processes.readers import read_loop
from kerasfeed.execution.processes.replacement import Replacements
from kerasfeed.execution.processes.slots import SlotTable
from kerasfeed.execution.processes.stream_sessions import StreamSessions
from kerasfeed.execution.retries import Attempts, RetryCounts
from kerasfeed.execution.waits import WaitScope

logger = logging.getLogger("kerasfeed")

_POLL_S = 0.5


class Dispatcher:
    """The pool's state and its one lock; shared by the ``ProcessExecutor`` handle
    and the reader threads (which must not keep the handle alive).

    Args:
        payload: the cloudpickled source and ``worker_init``.
        options: the ``PoolOptions``.
        name: the pool's name in error messages.
        waits: the ``WaitScope`` of the pool's loads (a new one if None).
        counts: where retries and replaced workers are counted (a new one if None).
        handoff: the ``_handoff`` tokens the payload names (its workers get those entries only).
    """

    def __init__(
        self,
        payload: bytes,
        options: Any,
        name: str,
        waits: Optional[WaitScope] = None,
        counts: Optional[RetryCounts] = None,
        handoff: frozenset = frozenset(),
    ):
        self.options = options
        self.handoff = frozenset(handoff)  # replaced by a larger one as later payloads name more (states, streams)
        self.retries = options.retries
        self.name = name
        self.owner_pid = os.getpid()
        self.in_flight_per_worker = options.in_flight_per_worker
        self.lock = threading.RLock()  # re-entrant: close() may run from GC anywhere
        self.cv = threading.Condition(self.lock)
        self.closed = False
        self.shut_down = threading.Event()  # set once a close's workers exited (shutdown.py)
        self.closer: Optional[threading.Thread] = None  # the thread that closes it
        self.parked = False  # closed by ``park``: the executor starts a new pool on its next use
        self.failure: Optional[WorkerError] = None
        # The iterator deleted or Ctrl-C ends a wait (execution/waits.py); an
        # executor that restarts its pool after parking hands the same scope on.
        self.waits = waits if waits is not None else WaitScope(options.timeout)
        self.loads = 0  # loads started, and in progress (for parking: NOTE [ Parking after a failed pass ])
        self.loading = 0
        self.acquiring = 0  # direct loads waiting for a slot (the plans wait for them)
        self._ids = itertools.count()
        self.items = 0
        self.consumer_cpu_s = 0.0
        self.stats: Any = None  # a kerasfeed StatsCollector: gets each item's make time
        self.unfinished: Any = None  # the rest of the pass being read when the pool closed (PassPlans.unfinished)
        self.slots = SlotTable(options.workers, self.in_flight_per_worker)
        self.streams = StreamSessions(self)
        reader = functools.partial(read_loop, self)
        self.counts = counts if counts is not None else RetryCounts()
        self.replacements = Replacements(self, payload, options, reader, self.counts)
        self.lanes = Lanes(self.slots, self.in_flight_per_worker, options.worker_max_items, self.replacements.retire)
        self.plans = PassPlans(self.lanes, self.slots, self.new_id, self.in_flight_per_worker)
        self._sys_path = list(sys.path)
        try:
            for wid in range(options.workers):
                self.lanes.add(WorkerProcess.launch(wid))
            for lane in self.lanes:
                try:
                    lane.process.send(protocol.Init(self.init_config(lane.id, payload)), self.init_fds())
                except OSError:
                    pass  # died while booting: its reader reports why
                lane.process.start_reader(reader, lane)
        except BaseException:
            self.close()
            raise

    def init_config(self, worker_id: int, payload: bytes) -> dict:
        """The ``protocol.Init`` config of worker ``worker_id`` (a first one or a successor)."""
        options = self.options
        return {
            "worker_id": worker_id,
            "num_workers": options.workers,
            "seed": options.seed + worker_id,
            "base_seed": options.seed,  # the items' (sources/item_random.py)
            "seed_given": bool(options.seed_given),
            "nice": options.worker_nice,
            "sys_path": self._sys_path,
            "payload": payload,
            "max_rss": options.worker_max_rss,
            "cache": None if options.item_cache is None else options.item_cache.described(),
            # NOTE [ Secrets travel to workers in memory, never with the source ]: only the pool's own.
            "handoff": _handoff.entries(self.handoff),
        }

    def init_fds(self) -> tuple:
        """The fds sent with every ``protocol.Init``: the item store's, with cache= (sent as they are: NOTE
        [ The item store ])."""
        return () if self.options.item_cache is None else self.options.item_cache.fds()

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self.lanes:
            while not lane.process.ready.wait(_POLL_S):
                self.check_usable()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"kerasfeed: worker {lane.id} (pid {lane.process.pid}) was not ready within {timeout} s"
                    )

    # ------------------------------------------------------------ shared with StreamSessions
    def check_usable(self) -> None:
        """Raises if the pool failed, is closed, or belongs to another process."""
        if os.getpid() != self.owner_pid:
            raise WorkerError(
                f"kerasfeed: the worker pool of {self.name} belongs to process {self.owner_pid}; it cannot be "
                f"used from the forked process {os.getpid()}. Create the dataset in that process instead."
            )
        if self.failure is not None:
            raise fresh_error(self.failure)
        if self.closed:
            why = " (parked after a failed pass)" if self.parked else ""
            raise WorkerError(f"kerasfeed: the worker pool of {self.name} is closed{why}; create the dataset "
                              "(or loader) again.")

    def record_failure(self, err: WorkerError) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = err

    def count_item(self, cpu_s: float) -> None:
        with self.lock:
            self.consumer_cpu_s += cpu_s
            self.items += 1

    def new_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------ requests
    def slot_done(self, lane: WorkerLane, slot: int) -> None:
        # With the lock held.
        self.lanes.slot_done(lane, slot)
        self.cv.notify_all()

    def settle(self, lane: WorkerLane, req: Request) -> None:
        """With the lock held: ``req`` (no longer pending) has its answer or error; the caller
        sets its event after the lock."""
        req.done = True
        if req.abandoned:  # its caller was interrupted: free the slot here
            self.slot_done(lane, req.slot)
        elif req.planned:
            lane.waiting += 1
            self.cv.notify_all()  # no longer counted against a direct load's slots

    def _request(self, index: int, epoch: int) -> tuple[WorkerLane, Request]:
        """Takes a slot for a direct load and sends its request.

        A direct load that waits for a slot goes before the plans: while one waits
        (``acquiring``), ``fill_plans`` sends nothing, so a slot an answer frees is its
        (else the plan's refill takes every freed slot and the load waits until the plan's
        answers pile up: the first item of a pass started while an abandoned one still has
        requests in flight, or of a second loader on the same executor)."""
        waited = False
        try:
            with self.cv:
                wait = None
                while True:
                    self.check_usable()
                    self.slots.collect_returned()
                    best = self.lanes.least_busy(planned=False)
                    if best is not None:
                        self.loading += 1
                        req = self.lanes.new_request(best, self.new_id(), index)
                        break
                    if wait is None:
                        wait, waited = self.waits.begin(), True
                        self.acquiring += 1
                    self.cv.wait(_POLL_S)
                    wait.check(f"a free slot for {self.name}[{index}]")
            self.send_requests([(best, req, epoch)])
        finally:
            if waited:
                with self.cv:
                    self.acquiring -= 1
                    sends = self.fill_plans()
                self.send_requests(sends)
        return best, req

    @staticmethod
    def send_requests(sends: list[Send]) -> None:
        for lane, req, epoch in sends:
            with lane.send_lock:  # the order the worker makes them in (``WorkerLane.first_pending``)
                req.order, lane.sends = lane.sends, lane.sends + 1
                try:
                    lane.process.send(protocol.Load(req.id, req.index, epoch, req.slot))
                except OSError:
                    pass  # the worker died: its reader fails this request

    # ------------------------------------------------------------ plans
    def start_plan(
        self,
        epoch: int,
        indices: Sequence[int],
        next_pass: Optional[tuple[int, Sequence[int]]] = None,
        state: Optional[bytes] = None,
    ) -> None:
        """Starts requesting the items of pass ``epoch`` in this order; then, once all are
        requested, the first ones of ``next_pass``. ``state``: the source changed (``state_sync``):
        every worker gets it before any request of this pass; what was made ahead is dropped."""
        if state is not None:
            with self.cv:
                self.check_usable()
                self.drop_plans()  # nothing new is requested until the state is out
            self.replacements.send_state(epoch, state)  # successors get it too
        with self.cv:
            self.check_usable()
            # A source whose hooks changed it as this pass began will likely change again at the next begin,
            # which would drop what the workers made of that pass ahead: none is made for it then.
            self.plans.start(epoch, indices, next_pass if state is None else None)
            self.cv.notify_all()  # dropped requests may have freed slots
            sends = self.fill_plans()
        self.send_requests(sends)

    def drop_plans(self) -> None:
        # With the lock held.
        self.plans.drop_all()
        self.cv.notify_all()

    def fill_plans(self) -> list[Send]:
        # With the lock held; the caller sends them after releasing it. Nothing while a direct
        # load waits for a slot: it goes first (``_request``).
        if self.closed or self.failure is not None or self.acquiring:
            return []
        sends = self.plans.fill()
        if sends:
            self.cv.notify_all()
        return sends

    def _take_planned(self, index: int, epoch: int) -> Optional[tuple[WorkerLane, Request]]:
        with self.cv:
            self.check_usable()
            self.loads += 1
            taken = self.plans.take(index, epoch)
            if taken is not None:
                self.loading += 1
            return taken

    def ready(self, index: int, epoch: int) -> bool:
        """Whether ``load(index, epoch)`` would not wait: its planned request was answered, or
        the pool failed or closed (the load raises at once)."""
        with self.lock:
            if self.failure is not None or self.closed:
                return True
            plan = self.plans.plan
            handle = None if plan is None else plan.peek(index, epoch)
        if handle is None or not handle[1].event.is_set():
            return False
        return handle[1].error is None or not self.retries  # a failed one is made again first

    # ------------------------------------------------------------ load
    def _lend_or_copy(self, lane: WorkerLane, req: Request) -> tuple[Any, bool]:
        """The answered item, lent (zero-copy) when the budget allows, else copied."""
        try:
            if req.spec == protocol.IN_STORE:  # cache=: read where the worker stored it (its slot stays free)
                return self.options.item_cache.store.get(req.index), False
            spec = shm.loads_spec(req.spec)
            seg = self.slots.segment(lane.id, req.slot)
            with self.lock:
                self.slots.collect_returned()
                lend = seg is not None and self.slots.try_lend(lane.id, req.nbytes, seg.size)
            if not lend:
                return shm.decode(spec, seg), False
            on_return = self.slots.loan_returned(lane.id, req.slot, seg.size)
            try:
                return shm.lend(spec, seg, req.nbytes, on_return), True
            except BaseException:
                on_return()
                raise
        except (ValueError, TypeError, AttributeError, BufferError):
            # Another worker's failure closed the pool (and unmapped its
            # segments) while this answer was read: report that failure.
            if self.failure is not None or self.closed:
                self.check_usable()
            raise

    def _release(self, lane: WorkerLane, req: Request, cpu_s: float = 0.0, lent: bool = False) -> None:
        with self.cv:
            self.loading -= 1
            if req.abandoned:
                pass  # its reader frees the slot when the answer comes
            elif lent:
                lane.busy -= 1  # the slot comes back through the slot table's returned loans
            else:
                self.slot_done(lane, req.slot)
            if cpu_s:
                self.count_item(cpu_s)
            self.cv.notify_all()

    def _wait(self, lane: WorkerLane, req: Request) -> None:
        timeout = self.options.timeout
        since = time.monotonic()
        proc = lane.process
        try:
            wait = None if req.event.is_set() else self.waits.begin()
            while not req.event.wait(_POLL_S):
                wait.check(lambda: f"{self.name}[{req.index}] (worker {lane.id}, pid {proc.pid})")
                deadline = proc.deadline(since, timeout)  # the clock starts once the worker is ready
                if deadline is not None and time.monotonic() > deadline and not req.event.is_set():
                    if self.retries:
                        # Replaced, not fatal: its reader answers what was
                        # pending on it (NOTE [ Replacing a worker ]).
                        if lane.stopped_for is None:
                            lane.stopped_for = f"did not return an item within timeout={timeout} s and was stopped"
                            proc.kill()
                        continue
                    # A worker makes its requests in the order sent: the oldest one pending is what it is stuck
                    # on, this one may only wait behind it (blamed, it was left out in the stuck one's place).
                    with self.lock:
                        stuck = (lane.first_pending() or req).index
                    behind = "" if stuck == req.index else f" ({self.name}[{req.index}] waited behind it)"
                    err = WorkerError(
                        f"kerasfeed: worker {lane.id} (pid {proc.pid}) did not return {self.name}[{stuck}] within "
                        f"timeout={timeout} s{behind}; the worker was stopped.\n{NO_RESTART}",
                        worker_id=lane.id,
                        pid=proc.pid,
                        index=stuck,
                    )
                    self.record_failure(err)
                    proc.kill()  # its reader fails whatever else was pending
                    raise err
        except BaseException:
            # Interrupted (Ctrl-C) or timed out: the answer may still come; its slot is freed either way.
            with self.lock:
                self.loading -= 1
                if req.done:
                    self.slot_done(lane, req.slot)
                else:
                    req.abandoned = True
            raise

    def load(self, index: int, epoch: int) -> Any:
        t0 = time.thread_time()
        taken = self._take_planned(index, epoch)
        if taken is None:
            lane, req = self._request(index, epoch)
        else:
            lane, req = taken
        cpu = time.thread_time() - t0
        self._wait(lane, req)
        if req.error is not None:
            if self.retries:
                lane, req = self._retry(index, epoch, lane, req)
            else:
                self.counts.add("failed_items")  # its only attempt
        t1 = time.thread_time()
        item, lent = None, False
        try:
            if req.error is not None:
                raise req.error
            item, lent = self._lend_or_copy(lane, req)
        finally:
            self._release(lane, req, cpu + time.thread_time() - t1 if req.error is None else 0.0, lent)
            if taken is not None:
                with self.lock:
                    sends = self.fill_plans()
                self.send_requests(sends)
        return item

    def _retry(self, index: int, epoch: int, lane: WorkerLane, req: Request) -> tuple[WorkerLane, Request]:
        """Makes the item again while its attempts allow (NOTE [ Retries happen in the load that waits
        for the item ]); returns the last request, its error the final one if it failed."""
        attempts = Attempts(index, self.retries)
        while req.error is not None:
            counted = attempts.counts(req.error)
            if not attempts.again(req.error):
                self.counts.add("failed_items")
                req.error = attempts.final(req.error)
                break
            self._release(lane, req)
            self.counts.add("retried_items" if counted else "requeued_items")
            lane, req = self._request(index, epoch)  # ahead of the plans, on any worker
            self._wait(lane, req)
        return lane, req

    # ------------------------------------------------------------ queries
    def request_counts(self) -> RequestCounts:
        with self.lock:
            return self.lanes.counts()

    def plan_status(self) -> PlanStatus:
        with self.lock:
            return self.plans.status()

    def idle(self) -> bool:
        """No request made and not released, no answer waiting, no stream."""
        with self.lock:
            return self.lanes.idle()

    # ------------------------------------------------------------ shutdown (shutdown.py)
    park = shutdown.park
    close = shutdown.close  # NOTE [ Worker process shutdown ] in process.py
