"""Generator streams: a worker iterates a task and its items come back in order.

Counterpart of ``WorkerLoop.stream``. A session reserves one idle worker (no
request pending, no other stream) until the task ends and the consumer no
longer reads any of its slots, or until it is cancelled. The worker writes at
most ``in_flight_per_worker`` items ahead: each ``StreamItem`` takes one of the
session's slots, which the consumer gives back with a ``Credit`` once the item
is copied out. Failures reach the consumer as ``WorkerDied`` on the session's
queue (NOTE [ Worker process shutdown ] in ``process.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Optional

from kerasfeed import _handoff
from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol, shm
from kerasfeed.execution.processes.process import STREAM_NO_RESTART, fresh_error
from kerasfeed.execution.waits import WaitAbandoned

_POLL_S = 0.5


class StreamSession:
    """One running stream: its queue of messages for the consumer and its slots.

    Args:
        stream_id: the id its worker messages carry.
        name: the task's name, for error messages.
        slots: the worker's slots the stream writes into.
    """

    def __init__(self, stream_id: int, name: str, slots: list[int]):
        self.id = stream_id
        self.name = name
        self.slots = slots
        # StreamItem, StreamEnd, StreamFailed, WorkerDied: filled by the reader thread.
        self.queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.held: set[int] = set()  # slots whose item the consumer has not copied yet
        self.ended = False
        self.cancelled = False
        self.started_at: Optional[float] = None  # when the worker had unpickled the task (StreamStarted)
        self.cancelled_at: Optional[float] = None


class StreamSessions:
    """Starts, feeds and stops the streams of a pool.

    Holds no lock of its own: it uses the pool's one lock (its owner's ``cv``),
    lanes (``lane.stream`` is the session a worker runs) and slot table.

    Args:
        owner: the ``Dispatcher``.
    """

    def __init__(self, owner: Any):
        self._owner = owner

    def start(self, payload: bytes, name: str) -> tuple[Any, StreamSession]:
        """Reserves an idle worker (waiting for one) and starts the task there."""
        owner = self._owner
        wait = None
        with owner.cv:
            while True:
                owner.check_usable()
                owner.slots.collect_returned()
                owner.drop_plans()  # a stream needs an idle worker
                lane = owner.lanes.pick_idle()
                if lane is not None:
                    slots = [owner.slots.take(lane.id) for _ in range(owner.in_flight_per_worker)]
                    st = StreamSession(owner.new_id(), name, slots)
                    lane.stream = st
                    break
                # The consumer deleted: give the producer thread up (see next()).
                wait = wait or owner.waits.begin(interrupts=False, notice=False)
                owner.cv.wait(_POLL_S)
                self._stop_stuck_cancelled()
                wait.check(f"a free worker for {name}")
        try:
            handoff = _handoff.entries(owner.handoff)  # what the task names (executor._pickled_for) among them
            lane.process.send(protocol.StartStream(st.id, payload, list(st.slots), name, handoff))
        except OSError:
            pass  # the worker died: its reader reports it to the session
        return lane, st

    def _stop_stuck_cancelled(self) -> None:
        # With the lock held. A stream cancelled while its worker made an item (the probe's, an
        # abandoned pass's) holds that worker until the item is made; nobody reads it any more, so
        # its item timeout is kept here: an item not made ``timeout`` s after the cancel stops it.
        owner = self._owner
        for lane in owner.lanes.all:
            st = lane.stream
            if st is None or not st.cancelled or st.ended or st.cancelled_at is None or lane.death is not None:
                continue
            timeout = owner.options.timeout
            deadline = lane.process.deadline(st.cancelled_at, timeout)
            if deadline is not None and time.monotonic() > deadline:
                self._stop_worker(lane.process, f"still made an item of {st.name}, stopped earlier, {timeout} s "
                                                f"later (timeout={timeout} s)")

    def _stop_worker(self, proc: Any, what: str) -> WorkerError:
        """Kills ``proc`` for ``what`` it did; returns the ``WorkerError`` the pool now fails with."""
        err = WorkerError(f"kerasfeed: worker {proc.id} (pid {proc.pid}) {what}; the worker was stopped.\n"
                          f"{STREAM_NO_RESTART}",
                          worker_id=proc.id, pid=proc.pid)
        self._owner.record_failure(err)
        proc.kill()
        return err

    def on_message(self, lane: Any, msg: Any, fds: list[int]) -> None:
        """A stream message from ``lane``'s worker (its reader thread)."""
        owner = self._owner
        if isinstance(msg, protocol.StreamStarted):
            with owner.lock:
                st = lane.stream
                if st is not None and st.id == msg.stream_id:
                    st.started_at = time.monotonic()
            return
        if isinstance(msg, protocol.StreamItem):
            owner.slots.map_segment(lane.id, msg.slot, fds, msg.new_size)
            stats = owner.stats
            if stats is not None:  # timed by the worker itself
                stats.made(msg.make_s, lane.id, time.perf_counter(), busy_s=msg.make_s + msg.write_s)
            with owner.lock:
                st = lane.stream
                if st is None or st.id != msg.stream_id or st.cancelled:
                    return
                st.held.add(msg.slot)
            st.queue.put(msg)
        else:  # StreamEnd or StreamFailed
            with owner.lock:
                st = lane.stream
                if st is None or st.id != msg.stream_id:
                    return
                st.ended = True
                self.release_if_done(lane, st)
            st.queue.put(msg)

    def release_if_done(self, lane: Any, st: StreamSession) -> None:
        # With the lock held. The slots go back to loads only when the stream is over AND the
        # consumer no longer reads any of them.
        if st.ended and (st.cancelled or not st.held) and lane.stream is st:
            lane.stream = None
            self._owner.slots.give_back_all(lane.id, st.slots)
            self._owner.cv.notify_all()

    def next(self, lane: Any, st: StreamSession) -> Any:
        """The session's next item (blocking); StopIteration at its end."""
        owner = self._owner
        proc = lane.process
        timeout = owner.options.timeout
        since = time.monotonic()
        # Runs in a producer thread: when the last iterator over the stream is deleted, or its
        # pass is closed (``StreamIterator.stop``), it gives up instead of waiting on for a stuck
        # worker. The consumer's own wait (``tfdata/chunks.py``) sees Ctrl-C and gives the notice.
        wait = owner.waits.begin(interrupts=False, notice=False)
        while True:
            try:
                msg = st.queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if st.cancelled:
                    raise StopIteration from None
                wait.check(st.name)
                if owner.closed:
                    raise WorkerError(f"kerasfeed: the worker pool of {owner.name} is closed.") from None
                # The clock starts once the worker is ready and has unpickled the task (importing its
                # module, TensorFlow perhaps, is start-up, not the task's time).
                started = st.started_at
                deadline = None if started is None else proc.deadline(max(since, started), timeout)
                if deadline is not None and time.monotonic() > deadline:
                    raise self._stop_worker(proc, f"produced no item of {st.name} within timeout={timeout} s") from None
        if isinstance(msg, protocol.StreamItem):
            t1 = time.thread_time()
            try:
                item = self._decode(lane, msg)
            finally:
                with owner.lock:
                    st.held.discard(msg.slot)
                    ended = st.ended
                    self.release_if_done(lane, st)
                if not ended:
                    proc.send_quietly(protocol.Credit(st.id, msg.slot))
            owner.count_item(time.thread_time() - t1)
            return item
        if isinstance(msg, protocol.StreamEnd):
            raise StopIteration
        if isinstance(msg, protocol.StreamFailed):
            raise msg.error
        if isinstance(msg, protocol.WorkerDied):
            raise fresh_error(msg.error)
        raise WorkerError(f"kerasfeed: unexpected stream message. Received: {msg!r:.200}")

    def _decode(self, lane: Any, msg: protocol.StreamItem) -> Any:
        owner = self._owner
        try:
            return shm.decode(shm.loads_spec(msg.spec), owner.slots.segment(lane.id, msg.slot))
        except (ValueError, TypeError, AttributeError, BufferError):
            # The worker's death closed the pool (unmapping the segments) before this item was
            # read: report the death, as a load does (``Dispatcher._lend_or_copy``).
            if owner.failure is not None or owner.closed:
                owner.check_usable()
            raise

    def cancel(self, lane: Any, st: StreamSession, blocking: bool = True) -> None:
        """Stops the task if it still runs and frees the worker."""
        owner = self._owner
        with owner.lock:
            if st.cancelled:
                return
            st.cancelled = True
            st.cancelled_at = time.monotonic()
            st.held.clear()
            ended = st.ended
            self.release_if_done(lane, st)
        if not ended and not owner.closed:
            msg = protocol.Cancel(st.id)
            if blocking:
                lane.process.send_quietly(msg)
            elif not lane.process.send_quietly(msg, nowait=True):
                # From a finalizer this very thread may hold the send lock:
                # never block there, send from a helper thread instead.
                threading.Thread(target=lane.process.send_quietly, args=(msg,), daemon=True).start()


class StreamIterator(Iterator[Any]):
    """Items of one streaming task; close it (or drop it) to stop the task early."""

    def __init__(self, pool: Any, sessions: StreamSessions, lane: Any, session: StreamSession):
        self._pool = pool  # keeps the pool (and its workers) alive while iterating
        self._sessions = sessions
        self._lane = lane
        self._session = session
        self._done = False

    @property
    def name(self) -> str:
        return self._session.name

    @property
    def worker_pid(self) -> int:
        return self._lane.process.pid

    @property
    def task_started(self) -> bool:
        """Whether the worker has unpickled the task (``StreamStarted``): before, it is starting up."""
        return self._session.started_at is not None

    def __iter__(self) -> "StreamIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._sessions.next(self._lane, self._session)
        except WaitAbandoned:
            self.close()  # nobody reads on: stop the task (if the worker ever listens)
            raise
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                self._done = True
            raise

    def stop(self) -> None:
        """Like ``close`` but never blocks, from any thread: a waiting ``next`` ends with StopIteration."""
        if not self._done:
            self._done = True
            self._sessions.cancel(self._lane, self._session, blocking=False)

    def close(self) -> None:
        """Stops the task (if still running) and frees its worker."""
        if not self._done:
            self._done = True
            self._sessions.cancel(self._lane, self._session)

    def __del__(self):
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

