"""Worker processes replaced while the pool runs: after a death or a hang (``retries``), or recycled.

NOTE [ Replacing a worker ]
===========================

Without ``retries``, ``worker_max_items`` or ``worker_max_rss`` a pool never
starts a worker after its first ones (NOTE [ Worker process shutdown ] in
``process.py``). With them, a worker is replaced by a fresh process under the
same worker id (``get_worker_info().id`` stays in ``0 .. workers-1``; the
successor writes fresh segments into the pool's slots as they come free):

- **Died or hung** (``retries > 0``): the reader thread that sees the death
  answers every request pending on the worker with a ``WorkerError`` (it
  names the oldest one, the item it died on, so only that item counts an
  attempt: NOTE [ Retries happen in the load that waits for the item ] in
  ``execution/retries.py``), and starts a successor. A hang is a
  ``timeout=`` that expired: the waiting load kills the worker and goes on
  waiting; the death comes through the same path, explained as the timeout.
  A worker that died before it was ready made no item: its requests are all
  sent again, none counts an attempt. Not replaced (the pool fails as
  without retries): a worker whose start-up raised (``InitError``: it would
  again), the ``retries``-th worker in a row under one id to die before it
  was ready (an OOM kill during start-up is worth another try; a crash that
  repeats is not), one running a stream, and any death once the pool failed
  or closed.
- **Recycled** (``worker_max_items``, ``worker_max_rss``): the lane *retires*:
  it takes no more requests (exactly ``worker_max_items`` are sent to it; the
  worker checks its memory after each item and sends ``Retire``), its
  successor starts at once, and the retiring worker makes the requests
  already sent to it (at most ``in_flight_per_worker``), then is sent
  ``Exit``. Nothing is re-sent, lost or made twice, no item waits for a
  start-up; for a moment the pool runs one process more.
- **The successor's source** is the workers' own copy, not the consumer's
  object (which ``on_epoch_end`` may already have changed for a pass the
  workers have not started): the payload the pool started with, then every
  ``SetState`` sent since, in order (``state_sync.py``), before any request;
  so it holds what the other workers hold, epoch state included, and runs
  ``worker_init``. Once the kept states outweigh the payload (and 1 MB), the
  pool pickles the source anew at a pass boundary, where the consumer's
  source is the synced one, and drops them.
- **Ordering.** A successor gets ``Init`` and the states before its lane
  joins the pool (no request can overtake them), under ``state_lock``, which
  ``send_state`` also holds: a state sent meanwhile reaches it exactly once.
  Launching (fork + exec) happens on a thread of its own, never in a reader
  thread (it would hold up the answers it reads) nor under the pool's lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import cloudpickle

from kerasfeed import _handoff
from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol
from kerasfeed.execution.processes.lanes import WorkerLane
from kerasfeed.execution.processes.process import WorkerProcess, fresh_error
from kerasfeed.execution.retries import RetryCounts

logger = logging.getLogger("kerasfeed")

REBASE_MIN_BYTES = 2**20  # kept states past this and the payload: pickled anew (the NOTE)
# A successor's state after a rebased payload: no change, only the pass (whose set_epoch the payload holds).
_NO_CHANGE = cloudpickle.dumps((None, None), protocol=5)  # state_sync.apply_state: (instance change, outside change)


class Replacements:
    """Starts successors of dead, hung or retiring workers; keeps what they need.

    Args:
        d: the pool's ``Dispatcher`` (its lock guards the lanes).
        payload: the pickled source and ``worker_init`` the pool started with.
        options: the pool's ``PoolOptions``.
        reader: the reader-thread target for a new lane (``read_loop`` bound to ``d``).
        counts: where replacements are counted (the executor's, across pools).
    """

    def __init__(
        self,
        d: Any,
        payload: bytes,
        options: Any,
        reader: Callable[[WorkerLane], None],
        counts: RetryCounts,
    ):
        self._d = d
        self._reader = reader
        self.counts = counts
        self.enabled = options.replaces_workers
        self.on_death = options.retries  # 0: deaths are fatal
        self.max_rss = options.worker_max_rss
        self._payload = payload if self.enabled else b""
        self._states: list[tuple[int, bytes]] = []
        self._state_bytes = 0
        self.state_lock = threading.Lock()
        self.launching: list[WorkerProcess] = []  # started, not yet in the pool (the pool's lock)

    # ------------------------------------------------------------ state
    def send_state(self, epoch: int, state: bytes) -> None:
        """Sends a pass's ``SetState`` to every live worker, and keeps it for successors."""
        with self.state_lock:
            if self.enabled:
                self._states.append((epoch, state))
                self._state_bytes += len(state)
            for lane in list(self._d.lanes.every()):
                try:
                    lane.process.send(protocol.SetState(epoch, state, _handoff.entries(self._d.handoff)))
                except OSError:
                    pass  # the worker died: its reader reports it

    def wants_rebase(self) -> bool:
        """The kept states outweigh the payload: time for ``rebase``."""
        return self.enabled and self._state_bytes > max(len(self._payload), REBASE_MIN_BYTES)

    def rebase(self, payload: bytes, epoch: int, outside: bytes = _NO_CHANGE) -> None:
        """``payload``: the source pickled right after pass ``epoch``'s state was sent; ``outside``: the class
        attributes and module globals changed since the start (``StateTracker.outside_since_start``)."""
        with self.state_lock:
            self._payload, self._states, self._state_bytes = payload, [(epoch, outside)], 0

    # ------------------------------------------------------------ recycling
    def retire(self, lane: WorkerLane, why: str) -> None:
        """With the pool's lock held: ``lane`` takes no more requests; its successor starts."""
        if lane.retiring is None:
            lane.retiring = why
        if not lane.successor_started:
            lane.successor_started = True
            self._start_successor(lane)

    def over_memory(self, lane: WorkerLane, rss: int) -> None:
        """The worker said it passed ``worker_max_rss`` (its reader thread)."""
        with self._d.lock:
            self.retire(lane, f"used {rss / 2**20:.0f} MB, past worker_max_rss={self.max_rss}")
        self.answered(lane)

    def answered(self, lane: WorkerLane) -> None:
        """After an answer from ``lane`` (its reader thread): a retiring lane with nothing pending leaves."""
        if lane.retiring is None:
            return
        with self._d.lock:
            leave = not lane.pending and not lane.exit_sent and lane.death is None
            if leave:
                lane.exit_sent = True
        if leave:
            lane.process.send_quietly(protocol.Exit())

    # ------------------------------------------------------------ deaths
    def worker_gone(self, lane: WorkerLane, code: Optional[int]) -> bool:
        """``lane``'s process ended (its reader thread, after reaping it). True if handled here (a
        retired worker that left as told, or one replaced); False: the pool fails (``readers``)."""
        d = self._d
        proc = lane.process
        early = not proc.ready.is_set()  # died during start-up: no item was made
        with d.lock:
            retired = lane.exit_sent and not lane.pending
            if retired:
                d.lanes.forget(lane)
            replace = (
                not retired
                and self.on_death
                and d.failure is None
                and not d.closed
                and lane.stream is None
                and not (early and (proc.init_error is not None or lane.boot_failures + 1 >= self.on_death))
            )
        if retired:
            proc.release()
            self.counts.add("recycled_workers")
            return True
        if not replace:
            return False
        head, details = proc.explain_exit(code)
        with d.lock:
            mine, first = list(lane.pending.values()), lane.first_pending()  # first: its item
            index = first.index if first is not None and not early else None
            during = f" while loading {d.name}[{index}]" if index is not None else ""
            during += " before it was ready" if early else ""
            err = WorkerError(
                f"kerasfeed: worker {lane.id} (pid {proc.pid}) of {d.name} {lane.stopped_for or head}{during}; "
                "a new worker took its place." + (f"\n\n{details}" if details else ""),
                worker_id=lane.id,
                pid=proc.pid,
                exitcode=code,
                index=index,
            )
            lane.death = err
            lane.pending.clear()
            for req in mine:
                req.error = fresh_error(err)
                if req is not first:
                    # Died with the worker, not of it: a requeue, not an attempt (retries.Attempts.counts). By
                    # index alone, a next pass's request for the same item would count as one.
                    req.error.index = None
                d.settle(lane, req)
            start = not lane.successor_started
            lane.successor_started = True
            d.lanes.forget(lane)
        # Counted before the waiters wake: one of them may retry, finish the pass
        # and read the count before this thread runs again.
        self.counts.add("replaced_workers")
        for req in mine:
            req.event.set()
        proc.release()
        logger.warning("%s", str(err).splitlines()[0])
        if start:
            self._start_successor(lane)
        return True

    # ------------------------------------------------------------ successors
    def _start_successor(self, lane: WorkerLane) -> None:
        threading.Thread(
            target=self._successor, args=(lane,), name=f"kerasfeed-worker-{lane.id}-successor", daemon=True
        ).start()

    def _successor(self, old: WorkerLane) -> None:
        d = self._d
        with self.state_lock:  # see NOTE [ Replacing a worker ]: ordering
            try:
                proc = WorkerProcess.launch(old.id)
            except BaseException as e:  # noqa: BLE001 - the pool cannot keep its size: it fails
                d.record_failure(
                    WorkerError(
                        f"kerasfeed: worker {old.id} of {d.name} could not be replaced: {type(e).__name__}: {e}",
                        worker_id=old.id,
                    )
                )
                d.close()
                return
            with d.lock:
                joined = not d.closed
                if joined:
                    self.launching.append(proc)  # close() kills it meanwhile
            if joined:
                messages = [protocol.Init(d.init_config(old.id, self._payload))]
                messages += [protocol.SetState(epoch, state) for epoch, state in self._states]  # Init's handoff
                for message in messages:
                    try:
                        proc.send(message, d.init_fds() if isinstance(message, protocol.Init) else ())
                    except OSError:
                        break  # it died while booting (or the pool closed): its reader says why
            new = WorkerLane(proc)
            if old.death is not None and not old.process.ready.is_set():
                new.boot_failures = old.boot_failures + 1
            with d.lock:
                if proc in self.launching:
                    self.launching.remove(proc)
                joined = joined and not d.closed
                if joined:  # before the state lock is let go: a state sent next reaches it
                    d.lanes.replace(old, new)
                    d.cv.notify_all()  # loads waiting for a free slot
        if not joined:
            proc.kill()
            proc.reap()
            proc.release()
            return
        proc.start_reader(self._reader, new)
        with d.lock:
            sends = d.fill_plans()
        d.send_requests(sends)

    def stop_launching(self) -> None:
        """At close (lock held, ``closed`` set): kills processes being started; ``_successor`` reaps them."""
        for proc in self.launching:
            proc.kill()


__all__ = ["Replacements", "REBASE_MIN_BYTES"]
