"""A persistent pool of worker processes: start-up, dispatch, death detection
and shutdown.

Design (see also ``worker.py`` and ``shm.py``):

- **Start**: each worker is a fresh interpreter started with ``subprocess``
  (fork + immediate exec, i.e. spawn semantics: safe while TensorFlow threads
  run, and the user's ``__main__`` is never re-imported). The source travels
  by value (cloudpickle) in the first message. Workers start when the pool is
  created and live until it is closed: across epochs, passes and datasets.
- **Transport**: a *slot* is a shared-memory segment that grows to the
  largest item it carried and is reused. A request names a free slot of its
  worker; the worker writes the item's arrays into it and answers with a
  small spec. The consumer then *lends* the item: its arrays are views of the
  slot, handed to TensorFlow without a copy, and the slot is free again when
  the last of them is gone (see ``shm.lend``). Small items (under
  ``_LEND_MIN_BYTES``) are copied out and their slot freed at once, and so
  are items past a budget of lent ones (``_MAX_LENT_PER_WORKER`` per worker,
  ``_MAX_LENT_BYTES`` in all), so a consumer that keeps
  every item never blocks the workers. Requests in flight are bounded by
  ``workers * in_flight_per_worker``; shared memory by
  ``in_flight_per_worker + _MAX_LENT_PER_WORKER`` segments per worker.
- **Dispatch**: when a pass starts, ``plan(epoch, indices)`` gives the pool
  the order its items will be asked in. The pool then requests them ahead,
  up to ``in_flight_per_worker`` per worker and a window of items done but
  not taken yet, and each worker's reader thread sends that worker its next
  request the moment an answer arrives: a worker never waits for the
  consumer to ask. ``load(i)`` then only picks up the answer, so tf.data can
  call it sequentially (no parallel map, no thread hops per item). A ``load``
  outside the current plan (another pass iterated at the same time, a direct
  call) takes a slot on the least busy worker, sends its own request, and
  blocks (without the GIL) until the reader hands back the answer.
- **Death**: one reader thread per worker sees EOF on the worker's socket the
  moment it dies (and polls its liveness every second as a backstop). The
  pending items of a dead worker, and every later item, fail with a
  ``WorkerError`` naming the pid and the signal or exit code. The pool does
  NOT restart workers: a crash in native code usually repeats, and a loud
  stop is better than a pass that silently loses items.
- **Shutdown**: ``close()`` (also run when the pool is garbage collected and
  at interpreter exit) closes the sockets, so workers leave at once; a worker
  still busy after 1 s gets SIGTERM, then SIGKILL. Workers also leave by
  themselves when the parent dies. Workers ignore SIGINT: Ctrl-C interrupts
  the consumer, not the items being made.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import numbers
import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from kerasfeed.errors import WorkerError
from kerasfeed.execution.plan import PassPlan
from kerasfeed.execution.processes import shm
from kerasfeed.execution.processes.channel import Channel
from kerasfeed.execution.processes.pickling import dumps_for_workers, dumps_task

logger = logging.getLogger("kerasfeed")

_BOOT = "from kerasfeed.execution.processes.worker import main; main()"
_POLL_S = 0.5
# Lent items: enough for tf.data's buffers (the map's results in order, the
# prefetch) and the consumer; past this the consumer copies items instead.
_MAX_LENT_PER_WORKER = 16
_MAX_LENT_BYTES = 256 * 2**20
# Smaller items are copied: malloc reuses small blocks (no page faults), so
# lending would save little and only multiply slots.
_LEND_MIN_BYTES = 256 * 2**10
_GRACE_S = 1.0
_NO_RESTART = (
    "kerasfeed does not restart workers: create the dataset (or executor) again to retry, "
    "or use executor='threads' to debug the source in the main process."
)


def default_workers() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """Options of a ``WorkerPool``.

    Args:
        workers: number of worker processes; None = the usable CPU count.
        in_flight_per_worker: items requested from one worker at a time (one
            being made, the next ones queued); bounds memory and latency.
        seed: base seed; worker ``k`` seeds ``random`` and ``numpy.random``
            with ``seed + k``. None draws one from the OS.
        timeout: seconds one item may take before the pass fails with a
            ``WorkerError``; None waits as long as the worker is alive.
    """

    workers: Optional[int] = None
    in_flight_per_worker: int = 2
    seed: Optional[int] = None
    timeout: Optional[float] = None

    def __post_init__(self):
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
            object.__setattr__(self, name, int(value))

        if self.workers is None:
            object.__setattr__(self, "workers", default_workers())
        else:
            positive_int("workers", self.workers)
        positive_int("in_flight_per_worker", self.in_flight_per_worker)
        if self.seed is None:
            object.__setattr__(self, "seed", int.from_bytes(os.urandom(7), "little"))
        elif isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None. Received: seed={self.seed!r}")
        else:
            object.__setattr__(self, "seed", int(self.seed))
        if self.timeout is not None and (isinstance(self.timeout, bool) or not self.timeout > 0):
            raise ValueError(f"`timeout` must be a positive number of seconds or None. Received: timeout={self.timeout!r}")


class _Request:
    __slots__ = ("id", "index", "slot", "event", "spec", "nbytes", "error", "done", "abandoned", "ahead")

    def __init__(self, rid: int, index: int, slot: int):
        self.id = rid
        self.index = index
        self.slot = slot
        self.event = threading.Event()
        self.spec: Optional[bytes] = None
        self.nbytes = 0  # of the slot's segment the answer uses
        self.error: Optional[BaseException] = None
        self.done = False
        self.abandoned = False
        self.ahead = False  # sent ahead by a plan and not taken by a load yet


class _Stream:
    def __init__(self, sid: int, name: str):
        self.id = sid
        self.name = name
        self.queue: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.held: set[int] = set()  # slots whose item the consumer has not copied yet
        self.slots: list[int] = []  # the worker's slots this stream writes into
        self.ended = False
        self.cancelled = False


class _Worker:
    def __init__(self, wid: int, proc: subprocess.Popen, chan: Channel, crash_fd: int, slots: int):
        self.id = wid
        self.proc = proc
        self.pid = proc.pid
        self.chan = chan
        self.crash_fd = crash_fd
        self.segments: dict[int, shm.Segment] = {}
        self.free = list(range(slots))  # slots neither in flight, lent nor streaming
        self.next_slot = slots
        self.busy = 0  # requests made and not released yet (answered or not)
        self.waiting = 0  # of those: answered plan requests no load has taken yet
        self.lent = 0  # items whose slot the consumer still reads
        self.pending: dict[int, _Request] = {}
        self.stream: Optional[_Stream] = None
        self.launched = time.perf_counter()
        self.ready = threading.Event()
        self.info: dict = {}
        self.init_error: Optional[tuple] = None
        self.death: Optional[WorkerError] = None
        self.reader: Optional[threading.Thread] = None
        self.reader_cpu_s = 0.0  # written by its reader thread only


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "stopped answering (its channel closed while it kept running) and was killed"
    if code < 0:
        sig = -code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        why = {
            signal.SIGKILL: " (SIGKILL: `kill -9` or the kernel's out-of-memory killer)",
            signal.SIGSEGV: " (a crash in native code, e.g. a C extension)",
            signal.SIGBUS: " (a crash in native code, or shared memory exhausted)",
            signal.SIGABRT: " (aborted by native code)",
        }.get(sig, "")
        return f"was killed by signal {name} ({sig}){why}"
    return f"exited unexpectedly with exit code {code}"


class _Core:
    """The pool's state; shared by the user-facing handle and the reader
    threads (which must not keep the handle alive)."""

    def __init__(self, payload: bytes, options: PoolOptions, name: str):
        self.options = options
        self.name = name
        self.owner_pid = os.getpid()
        self.k = options.in_flight_per_worker
        self.lock = threading.RLock()  # re-entrant: close() may run from GC anywhere
        self.cv = threading.Condition(self.lock)
        self.closed = False
        self.failure: Optional[WorkerError] = None
        self.ids = itertools.count()
        self.rr = 0
        self.items = 0
        self.consumer_cpu_s = 0.0
        self.lent_bytes = 0
        self.lent_items = 0  # items handed over without a copy (the rest were copied)
        # (worker, slot, nbytes) of lent items whose last view is gone; filled
        # by finalizers (any thread, any moment: a lock-free append only).
        self.returned: "collections.deque[tuple]" = collections.deque()
        self.plan: Optional[PassPlan] = None  # its handles: (worker, request)
        # The pass expected next, started once ``plan`` has started all its
        # items (from ``next_pass``); adopted by the plan call that matches it.
        self.follow: Optional[PassPlan] = None
        self.follow_spec: Optional[tuple[int, Sequence[int]]] = None
        self.workers: list[_Worker] = []
        try:
            for wid in range(options.workers):
                self.workers.append(self._launch(wid))
            for w in self.workers:
                init = {
                    "worker_id": w.id,
                    "num_workers": options.workers,
                    "seed": options.seed + w.id,
                    "sys_path": list(sys.path),
                    "payload": payload,
                }
                try:
                    w.chan.send(("init", init))
                except OSError:
                    pass  # died while booting: its reader reports why
                w.reader = threading.Thread(
                    target=self._read_loop, args=(w,), name=f"kerasfeed-worker-{w.id}-reader", daemon=True
                )
                w.reader.start()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ start-up
    def _launch(self, wid: int) -> _Worker:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        crash_r, crash_w = os.pipe()
        env = dict(os.environ)
        env["KERASFEED_LIGHT_WORKER"] = "1"
        env["PYTHONUNBUFFERED"] = "1"  # a worker's prints show up before it dies
        # kerasfeed must import in the child even when the parent found it
        # through a sys.path tweak rather than an install.
        root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["kerasfeed"].__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(child_sock.fileno()), str(crash_w)],
                pass_fds=(child_sock.fileno(), crash_w),
                env=env,
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except BaseException:
            parent_sock.close()
            os.close(crash_r)
            raise
        finally:
            child_sock.close()
            os.close(crash_w)
        os.set_blocking(crash_r, False)
        return _Worker(wid, proc, Channel(parent_sock), crash_r, self.k)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self.workers:
            while not w.ready.wait(_POLL_S):
                self._raise_if_unusable()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"kerasfeed: worker {w.id} (pid {w.pid}) was not ready within {timeout} s")

    # ------------------------------------------------------------ reader side
    def _read_loop(self, w: _Worker) -> None:
        poller = select.poll()
        try:
            poller.register(w.chan.sock, select.POLLIN)
            while True:
                if not poller.poll(1000):
                    if w.proc.poll() is not None:  # died, yet a grandchild holds the socket
                        break
                    continue
                t0 = time.thread_time()
                msg, fds = w.chan.recv()
                self._handle(w, msg, fds)
                w.reader_cpu_s += time.thread_time() - t0
        except (EOFError, OSError, ValueError):
            pass
        except BaseException:  # noqa: BLE001 - never lose the reason silently
            logger.exception("kerasfeed: reader thread of worker %d failed", w.id)
        finally:
            self._worker_gone(w)

    def _map_segment(self, w: _Worker, slot: int, fds: list[int], size: Optional[int]) -> None:
        if not fds:
            return
        for extra in fds[1:]:
            os.close(extra)
        old = w.segments.get(slot)
        w.segments[slot] = shm.Segment(fds[0], size)
        if old is not None:
            old.close()

    def _handle(self, w: _Worker, msg: tuple, fds: list[int]) -> None:
        kind = msg[0]
        if kind in ("item", "error"):
            if kind == "item":
                self._map_segment(w, msg[2], fds, msg[4])
            with self.lock:
                req = w.pending.pop(msg[1], None)
                if req is None:
                    return
                if kind == "item":
                    req.spec, req.nbytes = msg[3], msg[5]
                else:
                    req.error = msg[2]
                req.done = True
                if req.abandoned:  # its caller was interrupted: free the slot here
                    self._slot_done(w, req.slot)
                elif req.ahead:
                    w.waiting += 1
                sends = self._fill_plan()
            req.event.set()
            self._send_requests(sends)
        elif kind == "ready":
            w.info = dict(msg[1], launch_to_ready_s=time.perf_counter() - w.launched)
            w.ready.set()
            if w.info.get("tensorflow_imported") and w.id == 0:
                logger.warning(
                    "kerasfeed: worker processes of %s imported TensorFlow while unpickling the source or in "
                    "worker_init (start-up %.1f s; about 500 MB per worker). If the source does not need it, "
                    "define it in a module that does not import tensorflow/keras (or in __main__/a notebook).",
                    self.name,
                    w.info["launch_to_ready_s"],
                )
        elif kind == "init_error":
            w.init_error = msg[1:]
        elif kind == "stream_item":
            self._map_segment(w, msg[3], fds, msg[5])
            with self.lock:
                st = w.stream
                if st is None or st.id != msg[1] or st.cancelled:
                    return
                st.held.add(msg[3])
            st.queue.put(msg)
        elif kind in ("stream_end", "stream_error"):
            with self.lock:
                st = w.stream
                if st is None or st.id != msg[1]:
                    return
                st.ended = True
                self._maybe_release_stream(w, st)
            st.queue.put(msg)
        else:
            for fd in fds:
                os.close(fd)

    def _maybe_release_stream(self, w: _Worker, st: _Stream) -> None:
        # Called with the lock held. The worker's slots go back to loads only
        # when the stream is over AND the consumer no longer reads any slot.
        if st.ended and (st.cancelled or not st.held) and w.stream is st:
            w.stream = None
            w.free.extend(st.slots)
            self.cv.notify_all()

    def _crash_text(self, w: _Worker) -> str:
        try:
            data = os.read(w.crash_fd, 1 << 16)
        except (OSError, ValueError):
            return ""
        return data.decode("utf-8", "replace").strip()

    def _worker_gone(self, w: _Worker) -> None:
        if self.closed:
            return
        code: Optional[int]
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
            code = None
        if self.closed:
            return
        details = ""
        if w.init_error is not None:
            etype, emsg, tb = w.init_error
            head = f"failed to start: {etype}: {emsg}"
            details = f"Worker traceback:\n{tb}"
        elif not w.ready.is_set() and code == 0:
            head = "exited before it was ready"
        else:
            head = _describe_exit(code)
        crash = self._crash_text(w)
        if crash:
            details = f"Python stacks of the worker when it crashed:\n{crash}"
        with self.lock:
            # A worker runs its requests in order: the oldest one pending on
            # it is the item it died on.
            mine = sorted(w.pending.values(), key=lambda r: r.id)
            index = mine[0].index if mine else None
            during = f" while loading {self.name}[{index}]" if index is not None else ""
            err = WorkerError(
                f"kerasfeed: worker {w.id} (pid {w.pid}) of {self.name} {head}{during}.\n{_NO_RESTART}"
                + (f"\n\n{details}" if details else ""),
                worker_id=w.id,
                pid=w.pid,
                exitcode=code,
                index=index,
            )
            w.death = err
            if self.failure is None:
                self.failure = err
            first = self.failure  # e.g. a timeout that made us kill this worker
            # The pass stops: items pending on the other workers fail too
            # (their answers, if they come, free their slots as abandoned).
            pending = []
            for other in self.workers:
                for req in other.pending.values():
                    if not req.done:
                        req.abandoned = True
                        pending.append(req)
            w.pending.clear()
            st = w.stream
            self.cv.notify_all()
        logger.info("%s", str(err).splitlines()[0])
        for req in pending:
            req.error = self._worker_error(first)
            req.event.set()
        if st is not None:
            st.queue.put(("dead", first))

    def _worker_error(self, err: WorkerError) -> WorkerError:
        # A fresh exception per raise: one object raised in many threads would
        # collect everyone's traceback.
        return WorkerError(str(err), err.worker_id, err.pid, err.exitcode, err.index)

    # ------------------------------------------------------------ consumer side
    def _raise_if_unusable(self) -> None:
        if os.getpid() != self.owner_pid:
            raise WorkerError(
                f"kerasfeed: the worker pool of {self.name} belongs to process {self.owner_pid}; it cannot be "
                f"used from the forked process {os.getpid()}. Create the dataset in that process instead."
            )
        if self.failure is not None:
            raise self._worker_error(self.failure)
        if self.closed:
            raise WorkerError(f"kerasfeed: the worker pool of {self.name} is closed; create the dataset again.")

    @staticmethod
    def _take_slot(w: _Worker) -> int:
        # The lowest free slot: its segment most likely exists already. A new
        # slot (its segment made by the worker on first use) only when every
        # slot is in flight or lent, which the lending budget bounds.
        if w.free:
            slot = min(w.free)
            w.free.remove(slot)
            return slot
        slot = w.next_slot
        w.next_slot += 1
        return slot

    def _slot_done(self, w: _Worker, slot: int) -> None:
        # With the lock held: a load's slot is free again.
        w.busy -= 1
        w.free.append(slot)
        self.cv.notify_all()

    def _collect_returned(self) -> None:
        # With the lock held.
        while self.returned:
            w, slot, nbytes = self.returned.popleft()
            w.lent -= 1
            self.lent_bytes -= nbytes
            w.free.append(slot)

    def _least_busy(self, ahead: bool) -> Optional[_Worker]:
        # With the lock held: the least loaded worker that can take one more
        # request. A plan (``ahead``) counts the requests a worker has not
        # answered: answers waiting for their load must not stall the worker.
        # A direct load counts every request not released, except those
        # answers (a stale plan must never block it), so that its slots stay
        # bounded however many threads call ``load``.
        best, best_load = None, 0
        n = len(self.workers)
        for j in range(n):
            w = self.workers[(self.rr + j) % n]
            load = len(w.pending) if ahead else w.busy - w.waiting
            if w.stream is None and w.death is None and load < self.k and (best is None or load < best_load):
                best, best_load = w, load
        if best is not None:
            self.rr = (best.id + 1) % n
        return best

    def _new_request(self, w: _Worker, index: int) -> _Request:
        # With the lock held.
        w.busy += 1
        req = _Request(next(self.ids), index, self._take_slot(w))
        w.pending[req.id] = req
        return req

    def _acquire(self, index: int) -> tuple[_Worker, _Request]:
        with self.cv:
            while True:
                self._raise_if_unusable()
                self._collect_returned()
                best = self._least_busy(ahead=False)
                if best is not None:
                    return best, self._new_request(best, index)
                self.cv.wait(_POLL_S)

    # ------------------------------------------------------------ plans
    def start_plan(
        self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None
    ) -> None:
        """Starts requesting the items of pass ``epoch`` in this order; then,
        once all are requested, the first ones of ``next_pass``."""
        with self.cv:
            self._raise_if_unusable()
            follow = self.follow
            if follow is not None and follow.is_pass(epoch, indices):
                # The workers already started this pass: keep what they made.
                self.follow = None
                self._drop(self.plan)
                self.plan = follow
            else:
                self._drop_plan()
                self.plan = PassPlan(epoch, indices, window=self._window())
            self.follow_spec = next_pass
            sends = self._fill_plan()
        self._send_requests(sends)

    def _window(self) -> int:
        # Requested and not taken yet, over the plan and its follow-up.
        return len(self.workers) * (self.k + 1)

    def _drop_plan(self) -> None:
        # With the lock held: the plan, the next pass started after it, and
        # the one that would have been.
        plan, follow = self.plan, self.follow
        self.plan = self.follow = self.follow_spec = None
        self._drop(plan)
        self._drop(follow)

    def _drop(self, plan: Optional[PassPlan]) -> None:
        # With the lock held: requests sent ahead and never taken give their
        # slot back (now if answered, else when the answer comes).
        if plan is None:
            return
        for w, req in plan.drop():
            req.ahead = False
            if req.done:
                w.waiting -= 1
                self._slot_done(w, req.slot)
            else:
                req.abandoned = True

    def _fill_plan(self) -> list[tuple[_Worker, _Request, int]]:
        # With the lock held: requests the plan (then its follow-up) may send
        # now; the caller sends them after releasing the lock.
        sends: list[tuple[_Worker, _Request, int]] = []
        if self.closed or self.failure is not None:
            return sends
        if self.plan is None and self.follow is None and self.follow_spec is None:
            return sends
        self._collect_returned()
        room = self._window() - sum(p.outstanding for p in (self.plan, self.follow) if p is not None)
        if self.plan is not None:
            room = self._start(self.plan, room, sends)
        if self.plan is None or self.plan.all_started:  # only then the next pass
            if self.follow is None and self.follow_spec is not None:
                epoch, indices = self.follow_spec
                self.follow, self.follow_spec = PassPlan(epoch, indices, window=self._window()), None
            if self.follow is not None:
                self._start(self.follow, room, sends)
        if sends:
            self.cv.notify_all()
        return sends

    def _start(self, plan: PassPlan, room: int, sends: list) -> int:
        # With the lock held: requests up to ``room`` more items of ``plan``
        # (appended to ``sends``); returns the room left.
        while room > 0 and not plan.all_started:
            w = self._least_busy(ahead=True)
            if w is None:
                break
            index = plan.next_index()
            if index is None:
                break
            req = self._new_request(w, index)
            req.ahead = True
            plan.started(index, (w, req))
            sends.append((w, req, plan.epoch))
            room -= 1
        return room

    @staticmethod
    def _send_requests(sends: list[tuple[_Worker, _Request, int]]) -> None:
        for w, req, epoch in sends:
            try:
                w.chan.send(("load", req.id, req.index, epoch, req.slot))
            except OSError:
                pass  # the worker died: its reader fails this request

    def _take_planned(self, index: int, epoch: int) -> Optional[tuple[_Worker, _Request]]:
        """The plan's request for ``index``; None if the caller must request
        it itself (not in the current plan, or not sent yet)."""
        with self.cv:
            self._raise_if_unusable()
            plan = self.plan
            if plan is None:
                return None
            _, handle = plan.take(index, epoch)
            if plan.finished:
                self.plan = None
            if handle is None:
                # Not planned, or asked ahead of the plan (a parallel map far
                # ahead, a direct load): the caller requests it and the plan
                # skips it. Waiting for the plan could wait for ever on items
                # that nobody takes.
                return None
            w, req = handle
            req.ahead = False
            if req.done:
                w.waiting -= 1
            return w, req

    def _lend_or_copy(self, w: _Worker, req: _Request) -> tuple[Any, bool]:
        """The answered item, lent (zero-copy) when the budget allows, else copied."""
        spec = pickle.loads(req.spec)
        seg = w.segments.get(req.slot)
        nbytes = req.nbytes
        with self.lock:
            self._collect_returned()
            lend = (
                seg is not None
                and nbytes >= _LEND_MIN_BYTES
                and w.lent < _MAX_LENT_PER_WORKER
                and self.lent_bytes + nbytes <= _MAX_LENT_BYTES
            )
            if lend:
                w.lent += 1
                self.lent_bytes += nbytes
                self.lent_items += 1
        if not lend:
            return shm.decode(spec, seg), False
        returned = self.returned
        entry = (w, req.slot, nbytes)
        try:
            return shm.lend(spec, seg, nbytes, lambda: returned.append(entry)), True
        except BaseException:
            returned.append(entry)
            raise

    def _release(self, w: _Worker, req: _Request, cpu_s: float = 0.0, lent: bool = False) -> None:
        with self.cv:
            if req.abandoned:
                pass  # its reader frees the slot when the answer comes
            elif lent:
                w.busy -= 1  # the slot comes back through `returned`
            else:
                self._slot_done(w, req.slot)
            if cpu_s:
                self.consumer_cpu_s += cpu_s
                self.items += 1
            self.cv.notify_all()

    def _wait(self, w: _Worker, req: _Request) -> None:
        timeout = self.options.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not req.event.wait(_POLL_S):
                if deadline is not None and time.monotonic() > deadline and not req.event.is_set():
                    err = WorkerError(
                        f"kerasfeed: worker {w.id} (pid {w.pid}) did not return {self.name}[{req.index}] within "
                        f"timeout={timeout} s; the worker was stopped.\n{_NO_RESTART}",
                        worker_id=w.id,
                        pid=w.pid,
                        index=req.index,
                    )
                    with self.lock:
                        if self.failure is None:
                            self.failure = err
                    w.proc.kill()  # its reader fails whatever else was pending
                    raise err
        except BaseException:
            # Interrupted (Ctrl-C in the main thread) or timed out: the answer
            # may still come; make sure its slot is freed either way.
            with self.lock:
                if req.done:
                    self._slot_done(w, req.slot)
                else:
                    req.abandoned = True
            raise

    def load(self, index: int, epoch: int) -> Any:
        t0 = time.thread_time()
        taken = self._take_planned(index, epoch)
        if taken is None:
            w, req = self._acquire(index)
            try:
                w.chan.send(("load", req.id, index, epoch, req.slot))
            except OSError:
                pass  # the worker died: its reader fails this request
        else:
            w, req = taken
        cpu = time.thread_time() - t0
        self._wait(w, req)
        t1 = time.thread_time()
        item, lent = None, False
        try:
            if req.error is not None:
                raise req.error
            item, lent = self._lend_or_copy(w, req)
        finally:
            self._release(w, req, cpu + time.thread_time() - t1 if req.error is None else 0.0, lent)
            if taken is not None:
                with self.lock:
                    sends = self._fill_plan()
                self._send_requests(sends)
        return item

    # ------------------------------------------------------------ streams
    def start_stream(self, payload: bytes, name: str) -> tuple[_Worker, _Stream]:
        with self.cv:
            while True:
                self._raise_if_unusable()
                self._collect_returned()
                self._drop_plan()  # a stream needs an idle worker
                idle = [w for w in self.workers if w.stream is None and w.death is None and w.busy == 0]
                if idle:
                    w = idle[self.rr % len(idle)]
                    self.rr += 1
                    st = _Stream(next(self.ids), name)
                    st.slots = [self._take_slot(w) for _ in range(self.k)]
                    w.stream = st
                    break
                self.cv.wait(_POLL_S)
        try:
            w.chan.send(("stream", st.id, payload, list(st.slots), name))
        except OSError:
            pass
        return w, st

    def stream_next(self, w: _Worker, st: _Stream) -> Any:
        timeout = self.options.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg = st.queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self.closed:
                    raise WorkerError(f"kerasfeed: the worker pool of {self.name} is closed.") from None
                if deadline is not None and time.monotonic() > deadline:
                    err = WorkerError(
                        f"kerasfeed: worker {w.id} (pid {w.pid}) produced no item of {st.name} within "
                        f"timeout={timeout} s; the worker was stopped.\n{_NO_RESTART}",
                        worker_id=w.id,
                        pid=w.pid,
                    )
                    with self.lock:
                        if self.failure is None:
                            self.failure = err
                    w.proc.kill()
                    raise err from None
        kind = msg[0]
        if kind == "stream_item":
            slot = msg[3]
            t1 = time.thread_time()
            try:
                item = shm.decode(pickle.loads(msg[4]), w.segments.get(slot))
            finally:
                with self.lock:
                    st.held.discard(slot)
                    ended = st.ended
                    self._maybe_release_stream(w, st)
                if not ended:
                    try:
                        w.chan.send(("credit", st.id, slot))
                    except OSError:
                        pass
            with self.lock:
                self.consumer_cpu_s += time.thread_time() - t1
                self.items += 1
            return item
        if kind == "stream_end":
            raise StopIteration
        if kind == "stream_error":
            raise msg[2]
        if kind == "dead":
            raise self._worker_error(msg[1])
        raise WorkerError(f"kerasfeed: unexpected stream message {kind!r}")

    def cancel_stream(self, w: _Worker, st: _Stream, blocking: bool = True) -> None:
        with self.lock:
            if st.cancelled:
                return
            st.cancelled = True
            st.held.clear()
            ended = st.ended
            self._maybe_release_stream(w, st)
        if not ended and not self.closed:
            msg = ("cancel", st.id)
            if blocking:
                _send_quietly(w.chan, msg)
            elif not _send_quietly(w.chan, msg, nowait=True):
                # From a finalizer this very thread may hold the send lock:
                # never block there, send from a helper thread instead.
                threading.Thread(target=_send_quietly, args=(w.chan, msg), daemon=True).start()

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        if os.getpid() != self.owner_pid:
            # A forked copy (e.g. a fork-based multiprocessing worker): the
            # sockets and processes belong to the parent; touching them (a
            # shutdown() acts on the shared socket) would break its pool.
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.plan = self.follow = self.follow_spec = None
            pending = [(w, r) for w in self.workers for r in w.pending.values()]
            for w in self.workers:
                w.pending.clear()
            streams = [w.stream for w in self.workers if w.stream is not None]
            self.cv.notify_all()
        for w, req in pending:
            req.error = WorkerError(f"kerasfeed: the worker pool of {self.name} was closed while {self.name}[{req.index}] was loading.")
            req.event.set()
        for st in streams:
            st.queue.put(("dead", WorkerError(f"kerasfeed: the worker pool of {self.name} was closed.")))
        # EOF on their socket makes idle workers leave at once.
        for w in self.workers:
            try:
                w.chan.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.terminate()
        for w in self.workers:
            try:
                w.proc.wait(timeout=_GRACE_S)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        me = threading.current_thread()
        for w in self.workers:
            if w.reader is not None and w.reader is not me and w.reader.is_alive():
                w.reader.join(timeout=2)
            w.chan.sock.close()
            for seg in w.segments.values():
                seg.close()  # a lent segment stays mapped until its last view is gone
            w.segments.clear()
            try:
                os.close(w.crash_fd)
            except OSError:
                pass
            w.crash_fd = -1

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            psutil = None
        workers = []
        for w in self.workers:
            entry = {
                "id": w.id,
                "pid": w.pid,
                "alive": w.proc.poll() is None,
                "startup_s": w.info.get("launch_to_ready_s"),
                "ready_rss_mb": w.info["rss_bytes"] / 2**20 if "rss_bytes" in w.info else None,
                "tensorflow_imported": w.info.get("tensorflow_imported"),
                "keras_imported": w.info.get("keras_imported"),
                "rss_mb": None,
                "uss_mb": None,
            }
            if psutil is not None and entry["alive"]:
                try:
                    mem = psutil.Process(w.pid).memory_full_info()
                    entry["rss_mb"] = mem.rss / 2**20
                    entry["uss_mb"] = mem.uss / 2**20
                except (psutil.Error, OSError):
                    pass
            workers.append(entry)
        startups = [e["startup_s"] for e in workers if e["startup_s"] is not None]
        rss = [e["rss_mb"] for e in workers if e["rss_mb"] is not None]
        uss = [e["uss_mb"] for e in workers if e["uss_mb"] is not None]
        with self.lock:
            self._collect_returned()
            shm_bytes = sum(s.size for w in self.workers for s in w.segments.values())
            lent_bytes = self.lent_bytes
        items = self.items
        return {
            "workers": len(self.workers),
            "start_method": "spawn (fresh interpreter via subprocess)",
            "in_flight_limit": len(self.workers) * self.k,
            "startup_s": max(startups) if len(startups) == len(workers) else None,
            "rss_mb_per_worker": sum(rss) / len(rss) if rss else None,
            "uss_mb_per_worker": sum(uss) / len(uss) if uss else None,
            "items": items,
            "consumer_us_per_item": (self.consumer_cpu_s + sum(w.reader_cpu_s for w in self.workers)) / items * 1e6
            if items
            else None,
            "shm_bytes": shm_bytes,
            "lent_bytes": lent_bytes,
            "lent_items": self.lent_items,
            "per_worker": workers,
        }


def _send_quietly(chan: Channel, message: tuple, nowait: bool = False) -> bool:
    """Sends unless the peer is gone; False only if ``nowait`` and the send
    lock was busy."""
    try:
        return chan.send(message, nowait=nowait)
    except OSError:
        return True


class WorkerPool:
    """Persistent worker processes that make items of a source, or stream
    the items of generator tasks, through shared memory.

    Workers start when the pool is created and stay until ``close()``, until
    the pool is garbage collected, or until the interpreter exits.

    Args:
        source: an indexable source (sent to every worker by value, with
            cloudpickle), or None for a pool that only runs streaming tasks.
        workers: number of worker processes; None = the usable CPU count.
        worker_init: a callable run once in each worker, after the source is
            unpickled; ``kerasfeed.get_worker_info()`` works inside it.
        seed: base seed; worker ``k`` seeds ``random`` and ``numpy.random``
            with ``seed + k``.
        in_flight_per_worker: items requested from one worker at a time.
        timeout: seconds an item may take before the pass fails; None = no
            limit (a dead worker is always detected).
        name: a name for error messages; defaults to the source's class name.

    Raises:
        TypeError: the source or ``worker_init`` cannot be pickled (the
            message names the attribute), or ``worker_init`` is not callable.
        ValueError: a bad option.

    Example:

    ```python
    pool = WorkerPool(my_source, workers=2)
    x, y = pool.load(3, epoch=0)             # my_source[3], made in a worker
    for item in pool.stream(make_items, 7):  # iterates make_items(7) in a worker
        ...
    pool.close()
    ```
    """

    def __init__(
        self,
        source: Any = None,
        *,
        workers: Optional[int] = None,
        worker_init: Optional[Callable[[], None]] = None,
        seed: Optional[int] = None,
        in_flight_per_worker: int = 2,
        timeout: Optional[float] = None,
        name: Optional[str] = None,
    ):
        if worker_init is not None and not callable(worker_init):
            raise TypeError(f"`worker_init` must be a callable or None. Received: worker_init={worker_init!r}")
        self.options = PoolOptions(workers=workers, in_flight_per_worker=in_flight_per_worker, seed=seed, timeout=timeout)
        self.name = name or (type(source).__name__ if source is not None else "pool")
        payload = dumps_for_workers(source, worker_init)
        self._core = _Core(payload, self.options, self.name)
        # Runs on close(), on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._core.close)

    @property
    def num_workers(self) -> int:
        return self.options.workers

    @property
    def in_flight_limit(self) -> int:
        """The most items that can be in flight (and in shared memory) at once."""
        return self.options.workers * self.options.in_flight_per_worker

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._core.workers]

    def load(self, index: int, epoch: int = 0) -> Any:
        """Returns ``source[index]`` made by a worker that saw ``set_epoch(epoch)``.

        Thread-safe and blocking; the GIL is released while waiting.

        Raises:
            kerasfeed.ItemError: ``source[index]`` raised in the worker.
            kerasfeed.WorkerError: a worker died, failed to start or timed out.
        """
        return self._core.load(index, epoch)

    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        """Starts making the items of pass ``epoch`` ahead, in this order.

        ``load(i, epoch)`` for those items then picks up what the workers
        already made. A new plan (or a stream) drops the previous one; loads
        outside the current plan still work, one request each.

        ``next_pass``: ``(epoch, indices)`` of the pass expected next. Once
        every item of this pass is requested, the workers go on with the first
        items of that one (within the same window), and the ``plan`` call for
        it keeps them; a ``plan`` call for anything else drops them. Workers
        do not idle while the consumer builds its next iterator.
        """
        # PassPlan converts the indices, once per pass (they may be a long array).
        follow = None if next_pass is None else (int(next_pass[0]), next_pass[1])
        self._core.start_plan(int(epoch), indices, follow)

    def stream(self, fn: Callable[[Any], Any], arg: Any = None, *, name: Optional[str] = None) -> "StreamIterator":
        """Iterates ``fn(arg)`` in a worker; its items come back through shared memory.

        The worker is reserved for the stream until it ends or the returned
        iterator is closed; at most ``in_flight_per_worker`` items are ahead
        of the consumer. ``fn`` and ``arg`` are sent by value (cloudpickle).

        Raises (from the iterator):
            kerasfeed.ItemError: the task raised; ``index`` is the number of
                items it had produced.
            kerasfeed.WorkerError: the worker died.
        """
        label = name or f"{getattr(fn, '__qualname__', type(fn).__name__)}({_short(arg)})"
        payload = dumps_task(fn, arg, label)
        w, st = self._core.start_stream(payload, label)
        return StreamIterator(self, w, st)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until every worker has started (source unpickled, ``worker_init`` run)."""
        self._core.wait_ready(timeout)

    def stats(self) -> dict:
        """Start-up time, memory, transport and consumer-side cost of the pool.

        Returns:
            A dict with ``workers``, ``startup_s`` (launch to ready, slowest
            worker), ``rss_mb_per_worker``, ``uss_mb_per_worker`` (memory only
            that worker uses), ``consumer_us_per_item`` (CPU time the
            consumer process spent per item: dispatch, answer handling and the
            copy out of shared memory), ``shm_bytes``, ``in_flight_limit``,
            ``items`` and ``per_worker`` details (pid, alive, whether
            TensorFlow/Keras were imported).
        """
        return self._core.stats()

    def close(self) -> None:
        """Stops the workers and frees the shared memory. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __reduce__(self):
        raise TypeError("kerasfeed: a WorkerPool cannot be pickled (it owns processes).")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<WorkerPool {self.name!r} workers={self.num_workers} {state}>"


def _short(obj: Any, limit: int = 40) -> str:
    r = repr(obj)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class StreamIterator(Iterator[Any]):
    """Items of one streaming task; close it (or drop it) to stop the task early."""

    def __init__(self, pool: WorkerPool, w: _Worker, st: _Stream):
        self._pool = pool  # keeps the pool (and its workers) alive while iterating
        self._core = pool._core
        self._w = w
        self._st = st
        self._done = False

    @property
    def name(self) -> str:
        return self._st.name

    @property
    def worker_pid(self) -> int:
        return self._w.pid

    def __iter__(self) -> "StreamIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            return self._core.stream_next(self._w, self._st)
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):
                self._done = True
            raise

    def close(self) -> None:
        """Stops the task (if still running) and frees its worker."""
        if not self._done:
            self._done = True
            self._core.cancel_stream(self._w, self._st)

    def __del__(self):
        try:
            if not self._done:
                self._done = True
                self._core.cancel_stream(self._w, self._st, blocking=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
