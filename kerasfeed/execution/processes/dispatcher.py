"""Requests, pass plans, reader threads, failure propagation and close ordering.

Counterpart of ``worker.py``'s ``WorkerLoop.run`` (the loop that answers
``Load`` requests). The ``Dispatcher`` owns the pool's one lock; the units
it drives hold none: ``WorkerProcess`` (``process.py``), ``SlotTable``
(``slots.py``), ``PassPlan`` (``execution/plan.py``) and ``StreamSessions``
(``stream_sessions.py``, which uses this lock).

- **Plans** (``pass_plans.py``): when a pass starts, ``start_plan`` requests
  its items ahead (and then the next pass's), and each worker's reader
  thread sends the next request the moment an answer arrives: a worker never
  waits for the consumer to ask. ``load`` then only picks up the answer, so
  tf.data can call it sequentially.
- **Direct loads**: a ``load`` outside the current plan (another pass
  iterated at the same time, a direct call) takes a slot on the least busy
  worker, sends its own request and waits (without the GIL) for the reader.
- **Failures and close**: see NOTE [ Worker process shutdown ] in ``process.py``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sys
import threading
import time
from typing import Any, Optional, Sequence

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol, shm
from kerasfeed.execution.processes.lanes import Lanes, Request, RequestCounts, WorkerLane
from kerasfeed.execution.processes.pass_plans import PassPlans, PlanStatus, Send
from kerasfeed.execution.processes.process import GRACE_S, NO_RESTART, WorkerProcess, fresh_error
from kerasfeed.execution.processes.slots import SlotTable, fd_limit_message
from kerasfeed.execution.processes.stream_sessions import StreamSessions
from kerasfeed.execution.waits import WaitScope

logger = logging.getLogger("kerasfeed")

_POLL_S = 0.5
_READER_POLL_S = 1.0


class Dispatcher:
    """The pool's state and its one lock; shared by the ``WorkerPool`` handle
    and the reader threads (which must not keep the handle alive).

    Args:
        payload: the cloudpickled source and ``worker_init``.
        options: the ``PoolOptions``.
        name: the pool's name in error messages.
    """

    def __init__(self, payload: bytes, options: Any, name: str):
        self.options = options
        self.name = name
        self.owner_pid = os.getpid()
        self.in_flight_per_worker = options.in_flight_per_worker
        self.lock = threading.RLock()  # re-entrant: close() may run from GC anywhere
        self.cv = threading.Condition(self.lock)
        self.closed = False
        self.failure: Optional[WorkerError] = None
        self.waits = WaitScope()  # the iterator deleted or Ctrl-C ends a wait (execution/waits.py)
        self._ids = itertools.count()
        self.items = 0
        self.consumer_cpu_s = 0.0
        self.stats: Any = None  # a kerasfeed StatsCollector: gets each item's make time
        self.slots = SlotTable(options.workers, self.in_flight_per_worker)
        self.streams = StreamSessions(self)
        self.lanes = Lanes(self.slots, self.in_flight_per_worker)
        self.plans = PassPlans(self.lanes, self.slots, self.new_id, self.in_flight_per_worker)
        try:
            for wid in range(options.workers):
                self.lanes.add(WorkerProcess.launch(wid))
            for lane in self.lanes:
                init = {
                    "worker_id": lane.id,
                    "num_workers": options.workers,
                    "seed": options.seed + lane.id,
                    "nice": options.worker_nice,
                    "sys_path": list(sys.path),
                    "payload": payload,
                }
                try:
                    lane.process.send(protocol.Init(init))
                except OSError:
                    pass  # died while booting: its reader reports why
                lane.process.start_reader(self._read_loop, lane)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self.lanes:
            while not lane.process.ready.wait(_POLL_S):
                self.check_usable()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"kerasfeed: worker {lane.id} (pid {lane.process.pid}) was not ready within {timeout} s"
                    )

    # ------------------------------------------------------------ reader threads
    def _read_loop(self, lane: WorkerLane) -> None:
        proc = lane.process
        try:
            while True:
                if not proc.wait_readable(_READER_POLL_S):
                    if not proc.alive():  # died, yet a grandchild holds the socket
                        break
                    continue
                t0 = time.thread_time()
                msg, fds = proc.recv()
                self._handle(lane, msg, fds)
                proc.reader_cpu_s += time.thread_time() - t0
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # At the fd limit the kernel silently drops passed fds; report
                # that, not a dead worker (this one is fine: stop it).
                what = (
                    f"a shared-memory segment from worker {lane.id} (pid {proc.pid}) of {self.name} "
                    f"could not be received ({e.strerror})"
                )
                self.record_failure(WorkerError(fd_limit_message(what), worker_id=lane.id, pid=proc.pid))
                proc.kill()
        except (EOFError, ValueError):
            pass
        except BaseException:  # never lose the reason silently
            logger.exception("kerasfeed: reader thread of worker %d failed", lane.id)
        finally:
            self._worker_gone(lane)

    def _handle(self, lane: WorkerLane, msg: protocol.ToParent, fds: list[int]) -> None:
        if isinstance(msg, (protocol.ItemDone, protocol.ItemFailed)):
            if isinstance(msg, protocol.ItemDone):
                self.slots.map_segment(lane.id, msg.slot, fds, msg.new_size)
                stats = self.stats
                if stats is not None:  # timed by the worker itself
                    stats.made(msg.make_s, lane.id, time.perf_counter(), busy_s=msg.make_s + msg.write_s)
            with self.lock:
                req = lane.pending.pop(msg.request_id, None)
                if req is None:
                    return
                if isinstance(msg, protocol.ItemDone):
                    req.spec, req.nbytes = msg.spec, msg.nbytes
                else:
                    req.error = msg.error
                req.done = True
                if req.abandoned:  # its caller was interrupted: free the slot here
                    self._slot_done(lane, req.slot)
                elif req.planned:
                    lane.waiting += 1
                sends = self._fill_plans()
            req.event.set()
            self._send_requests(sends)
        elif isinstance(msg, (protocol.StreamItem, protocol.StreamEnd, protocol.StreamFailed)):
            self.streams.on_message(lane, msg, fds)
        elif isinstance(msg, protocol.Ready):
            lane.process.mark_ready(msg.info, self.name)
        elif isinstance(msg, protocol.InitError):
            lane.process.init_error = msg
        else:
            for fd in fds:
                os.close(fd)

    def _worker_gone(self, lane: WorkerLane) -> None:
        # See NOTE [ Worker process shutdown ] in process.py.
        if self.closed:
            return
        proc = lane.process
        code = proc.reap()
        if self.closed:
            return
        head, details = proc.explain_exit(code)
        with self.lock:
            # A worker runs its requests in order: the oldest one pending on
            # it is the item it died on.
            mine = sorted(lane.pending.values(), key=lambda r: r.id)
            index = mine[0].index if mine else None
            during = f" while loading {self.name}[{index}]" if index is not None else ""
            err = WorkerError(
                f"kerasfeed: worker {lane.id} (pid {proc.pid}) of {self.name} {head}{during}.\n{NO_RESTART}"
                + (f"\n\n{details}" if details else ""),
                worker_id=lane.id,
                pid=proc.pid,
                exitcode=code,
                index=index,
            )
            lane.death = err
            if self.failure is None:
                self.failure = err
            first = self.failure  # e.g. a timeout that made us kill this worker
            # The pass stops: items pending on the other workers fail too
            # (their answers, if they come, free their slots as abandoned).
            pending = self.lanes.abandon_pending()
            lane.pending.clear()
            st = lane.stream
            self.cv.notify_all()
        logger.info("%s", str(err).splitlines()[0])
        for req in pending:
            req.error = fresh_error(first)
            req.event.set()
        if st is not None:
            st.queue.put(protocol.WorkerDied(first))

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
            raise WorkerError(f"kerasfeed: the worker pool of {self.name} is closed; create the dataset again.")

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

    def pick_idle_lane(self) -> Optional[WorkerLane]:
        return self.lanes.pick_idle()

    # ------------------------------------------------------------ requests
    def _slot_done(self, lane: WorkerLane, slot: int) -> None:
        # With the lock held: a load's slot is free again.
        self.lanes.slot_done(lane, slot)
        self.cv.notify_all()

    def _acquire(self, index: int) -> tuple[WorkerLane, Request]:
        wait = None
        with self.cv:
            while True:
                self.check_usable()
                self.slots.collect_returned()
                best = self.lanes.least_busy(planned=False)
                if best is not None:
                    return best, self.lanes.new_request(best, self.new_id(), index)
                wait = wait or self.waits.begin()
                self.cv.wait(_POLL_S)
                wait.check(f"a free slot for {self.name}[{index}]")

    @staticmethod
    def _send_requests(sends: list[Send]) -> None:
        for lane, req, epoch in sends:
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
        """Starts requesting the items of pass ``epoch`` in this order; then,
        once all are requested, the first ones of ``next_pass``.

        ``state``: the source changed (``state_sync``): every worker gets it
        before any request of this pass, and what was made ahead from the old
        state is dropped."""
        if state is not None:
            with self.cv:
                self.check_usable()
                self.drop_plans()  # nothing new is requested until the state is out
            for lane in self.lanes:
                try:
                    lane.process.send(protocol.SetState(epoch, state))
                except OSError:
                    pass  # the worker died: its reader reports it
        with self.cv:
            self.check_usable()
            self.plans.start(epoch, indices, next_pass)
            self.cv.notify_all()  # dropped requests may have freed slots
            sends = self._fill_plans()
        self._send_requests(sends)

    def drop_plans(self) -> None:
        # With the lock held.
        self.plans.drop_all()
        self.cv.notify_all()

    def _fill_plans(self) -> list[Send]:
        # With the lock held; the caller sends them after releasing it.
        if self.closed or self.failure is not None:
            return []
        sends = self.plans.fill()
        if sends:
            self.cv.notify_all()
        return sends

    def _take_planned(self, index: int, epoch: int) -> Optional[tuple[WorkerLane, Request]]:
        with self.cv:
            self.check_usable()
            return self.plans.take(index, epoch)

    # ------------------------------------------------------------ load
    def _lend_or_copy(self, lane: WorkerLane, req: Request) -> tuple[Any, bool]:
        """The answered item, lent (zero-copy) when the budget allows, else copied."""
        spec = shm.loads_spec(req.spec)
        seg = self.slots.segment(lane.id, req.slot)
        nbytes = req.nbytes
        with self.lock:
            self.slots.collect_returned()
            lend = seg is not None and self.slots.try_lend(lane.id, nbytes)
        if not lend:
            return shm.decode(spec, seg), False
        on_return = self.slots.loan_returned(lane.id, req.slot, nbytes)
        try:
            return shm.lend(spec, seg, nbytes, on_return), True
        except BaseException:
            on_return()
            raise

    def _release(self, lane: WorkerLane, req: Request, cpu_s: float = 0.0, lent: bool = False) -> None:
        with self.cv:
            if req.abandoned:
                pass  # its reader frees the slot when the answer comes
            elif lent:
                lane.busy -= 1  # the slot comes back through the slot table's returned loans
            else:
                self._slot_done(lane, req.slot)
            if cpu_s:
                self.consumer_cpu_s += cpu_s
                self.items += 1
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
                    err = WorkerError(
                        f"kerasfeed: worker {lane.id} (pid {proc.pid}) did not return {self.name}[{req.index}] within "
                        f"timeout={timeout} s; the worker was stopped.\n{NO_RESTART}",
                        worker_id=lane.id,
                        pid=proc.pid,
                        index=req.index,
                    )
                    self.record_failure(err)
                    proc.kill()  # its reader fails whatever else was pending
                    raise err
        except BaseException:
            # Interrupted (Ctrl-C in the main thread) or timed out: the answer
            # may still come; make sure its slot is freed either way.
            with self.lock:
                if req.done:
                    self._slot_done(lane, req.slot)
                else:
                    req.abandoned = True
            raise

    def load(self, index: int, epoch: int) -> Any:
        t0 = time.thread_time()
        taken = self._take_planned(index, epoch)
        if taken is None:
            lane, req = self._acquire(index)
            try:
                lane.process.send(protocol.Load(req.id, index, epoch, req.slot))
            except OSError:
                pass  # the worker died: its reader fails this request
        else:
            lane, req = taken
        cpu = time.thread_time() - t0
        self._wait(lane, req)
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
                    sends = self._fill_plans()
                self._send_requests(sends)
        return item

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

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """See NOTE [ Worker process shutdown ] in process.py (this is its order)."""
        if os.getpid() != self.owner_pid:
            # A forked copy (e.g. a fork-based multiprocessing worker): the
            # sockets and processes belong to the parent; touching them (a
            # shutdown() acts on the shared socket) would break its pool.
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.plans.forget()
            pending = [req for lane in self.lanes for req in lane.pending.values()]
            for lane in self.lanes:
                lane.pending.clear()
            streams = [lane.stream for lane in self.lanes if lane.stream is not None]
            self.cv.notify_all()
        for req in pending:
            req.error = WorkerError(
                f"kerasfeed: the worker pool of {self.name} was closed while {self.name}[{req.index}] was loading."
            )
            req.event.set()
        for st in streams:
            st.queue.put(protocol.WorkerDied(WorkerError(f"kerasfeed: the worker pool of {self.name} was closed.")))
        for lane in self.lanes:
            lane.process.ask_to_stop()
        deadline = time.monotonic() + GRACE_S
        for lane in self.lanes:
            lane.process.terminate_after(deadline)
        for lane in self.lanes:
            lane.process.kill_after(GRACE_S)
        for lane in self.lanes:
            lane.process.release()
            self.slots.close_segments(lane.id)
