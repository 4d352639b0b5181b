"""One pass over many shards: producers run ahead, the consumer interleaves.

Every shard (a generator, a file's samples) is iterated by its own producer
thread (the user's generator itself under the threads executor, a worker
process's stream under processes: the scheduler does not care which), which
puts items into a bounded buffer: up to ``max_open`` shards run at once,
started in pass order, so a slow shard never stalls the others and memory
stays within ``max_open * buffer_size`` items. The consumer takes items

- ``deterministic=True``: in exactly the order of
  ``tf.data.Dataset.interleave(cycle_length, block_length)`` over the shards
  (round-robin over ``cycle_length`` open shards, ``block_length`` items each;
  an exhausted shard's place goes to the next shard), whatever the timing;
- ``deterministic=False``: in arrival order, whichever shard is ready first.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from kerasfeed.errors import ItemError, StreamError, WorkerError
from kerasfeed.execution import thread_tasks
from kerasfeed.sampling.views import as_view
from kerasfeed.sources.base import close_quietly
from kerasfeed.streams.options import END, NOT_READY, InterleaveOptions

# How long a shard failed by the pool's closing waits for the dead worker's own error.
_CAUSE_WAIT_S = 5.0


class _Shard:
    __slots__ = ("pos", "id", "buf", "count", "taken", "done", "error", "space", "started", "open", "opening", "pid",
                 "it")

    def __init__(self, pos: int, shard_id: int, lock: threading.Lock):
        self.pos = pos
        self.id = shard_id
        self.buf: collections.deque = collections.deque()
        self.count = 0  # items produced, not yet taken
        self.taken = 0  # items handed to the consumer
        self.done = False  # the producer finished (exhausted, failed or stopped)
        self.error: Optional[BaseException] = None
        self.space = threading.Condition(lock)  # the producer waits here when full
        self.started = False
        self.open = False  # holds a running slot
        self.opening = False  # waiting for a worker process to take it (ordered_start)
        self.pid: Optional[int] = None  # the worker process running it, if any
        self.it: Any = None  # its iterator, when it can be stopped from outside (a worker's stream)


class ShardPass:
    """One pass over ``order`` (shard ids, in the order they are opened).

    Args:
        order: the shard ids of this pass, in opening order (a sequence or a
            lazy ``IndexView``: read a position at a time).
        open_shard: ``open_shard(shard_id)`` returns the shard's items as an
            iterator; called in the shard's producer thread.
        options: an ``InterleaveOptions``.
        describe: ``describe(shard_id)`` names a shard in error messages.
        name: prefix of the producer threads' names.
        stats: a ``StatsCollector`` that gets each item's make time, timed in
            its producer thread (the shard's opening counts into its first
            item; waiting for buffer space counts nowhere), or None. Only for
            shards that run in the producer thread: a worker process times its own.

    Items come out of ``take()``; ``close()`` stops the producers (each
    finishes the item it is making, then closes its iterator).
    """

    def __init__(self, order: Sequence[int], open_shard: Callable[[int], Iterator[Any]], options: InterleaveOptions,
                 describe: Callable[[int], str], name: str = "shard", stats: Any = None):
        self._open_shard, self._stats, self._describe, self._name = open_shard, stats, describe, name
        self._block = options.block_length
        self._cap = options.buffer_size
        self._max_open = options.max_open
        self._det = options.deterministic
        self._ordered_start = options.ordered_start
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # the consumer waits here
        self._turn = threading.Condition(self._lock)  # ordered_start: whose turn to open
        self._next_turn = 0
        # The pass's shard order is read a position at a time (it may be a lazy
        # IndexView); only the shards started and not finished are kept.
        self._order = as_view(order)
        self._shards: dict[int, _Shard] = {}  # position -> a shard started, not finished yet
        self._n = len(self._order)
        self._stopped = False
        self._failed: Optional[BaseException] = None  # raised again by every later take()
        self._superseded: Optional[str] = None  # why a newer pass closed this one (``supersede``)
        self._fatal: Optional[BaseException] = None  # a dead worker: fails the pass at once
        self._open = 0
        self._next_start = 0
        # deterministic interleave state (mirrors tf.data's InterleaveDataset)
        self._cycle: list[Optional[_Shard]] = [None] * options.cycle_length
        self._ci = self._bi = self._num_open = self._next_open = 0
        self._end_of_input = False
        # arrival-order state
        self._arrivals: collections.deque = collections.deque()
        self._ended = 0
        # A producer inside the user's generator runs on after a close: joined at exit (NOTE [ Pool threads at exit ]).
        self._threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
        thread_tasks.join_at_exit(self)
        with self._lock:
            self._launch()

    # ------------------------------------------------------------ producers
    def _launch(self) -> None:
        while not self._stopped and self._open < self._max_open and self._next_start < self._n:
            self._start_next()

    def _shard(self, pos: int) -> _Shard:
        sh = self._shards.get(pos)
        if sh is None:
            sh = self._shards[pos] = _Shard(pos, int(self._order[pos]), self._lock)
        return sh

    def _start_next(self) -> None:
        sh = self._shard(self._next_start)
        self._next_start += 1
        sh.started = sh.open = True
        self._open += 1
        thread = threading.Thread(target=self._produce, args=(sh,), name=f"kerasfeed-{self._name}-{sh.id}", daemon=True)
        self._threads.add(thread)
        thread.start()

    def _produce(self, sh: _Shard) -> None:
        it = None
        n = 0
        t0 = 0.0  # when the producer began making the next item
        error: Optional[BaseException] = None
        try:
            if self._ordered_start:
                with self._lock:
                    while self._next_turn != sh.pos and not self._stopped:
                        self._turn.wait()
                try:
                    if not self._stopped:
                        t0 = time.perf_counter()
                        sh.opening = True
                        it = iter(self._open_shard(sh.id))
                        sh.pid = getattr(it, "worker_pid", None)
                        if hasattr(it, "stop"):
                            sh.it = it
                finally:
                    sh.opening = False
                    with self._lock:
                        self._next_turn += 1
                        self._turn.notify_all()
            else:
                t0 = time.perf_counter()
                it = iter(self._open_shard(sh.id))
            stats = self._stats
            while it is not None and not self._stopped:
                try:
                    item = next(it)
                except StopIteration:
                    break
                if stats is not None:
                    end = time.perf_counter()
                    stats.made(end - t0, None, end)
                if not self._put(sh, item):
                    break
                n += 1
                if stats is not None:
                    t0 = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            error = e
        finally:
            sh.it = None
            close_quietly(it)
            if error is None:
                self._finish(sh, None)
            else:
                # A worker that died under this very shard fails the pass at once;
                # other shards that merely could not start fail in their turn.
                fatal = isinstance(error, WorkerError) and error.pid == getattr(it, "worker_pid", None)
                self._finish(sh, self._wrap(sh, error, n, fatal), fatal)

    def _wrap(self, sh: _Shard, e: BaseException, n: int, running: bool = False) -> BaseException:
        what = self._describe(sh.id)
        if isinstance(e, WorkerError):
            context = f"while running {what}" if running else f"{what} could not start"
            wrapped = WorkerError(f"{e}\n({context})", e.worker_id, e.pid, e.exitcode, e.index)
            return wrapped.with_traceback(e.__traceback__)
        if isinstance(e, StreamError):
            return e
        if isinstance(e, ItemError):  # raised in a worker process: index = items it had made
            return StreamError(what, e.exc_type, e.exc_message, e.traceback_text, sh.id, e.index, e.worker_id, e.pid)
        return StreamError.from_exception(what, e, index=sh.id, items_before=n)

    def _put(self, sh: _Shard, item: Any) -> bool:
        with self._lock:
            while sh.count >= self._cap and not self._stopped:
                sh.space.wait()
            if self._stopped:
                return False
            if self._det:
                sh.buf.append(item)
            else:
                self._arrivals.append((sh, item))
            sh.count += 1
            self._ready.notify()
        return True

    def _finish(self, sh: _Shard, error: Optional[BaseException], fatal: bool = False) -> None:
        with self._lock:
            sh.done = True
            sh.error = error
            if fatal and self._fatal is None:
                self._fatal = error
            if not self._det:
                self._arrivals.append((sh, END))
            self._release(sh)
            self._ready.notify()

    def _release(self, sh: _Shard) -> None:
        """Frees ``sh``'s running slot once it is finished and fully taken."""
        if sh.open and sh.done and sh.count == 0:
            sh.open = False
            self._open -= 1
            self._launch()

    # ------------------------------------------------------------ consumer
    def take(self, timeout: Optional[float] = None) -> Any:
        """Returns the next ``(item, (shard_id, item_number))``.

        Args:
            timeout: seconds to wait for it; None waits as long as it takes,
                0 does not wait.

        Returns:
            The pair, ``NOT_READY`` if nothing came within ``timeout``, or
            ``END`` when the pass is over.

        Raises:
            kerasfeed.StreamError: a shard raised (in order: after the items
                it made before raising, in deterministic mode).
            kerasfeed.WorkerError: a worker process died (at once).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._superseded is not None:
                raise RuntimeError(self._superseded)
            try:
                got = self._take_det(deadline) if self._det else self._take_any(deadline)
            except BaseException as e:
                self._failed = e
                raise
            if self._superseded is not None and (got is END or got is NOT_READY):  # woken by the close
                raise RuntimeError(self._superseded)
            return got

    def supersede(self, why: str) -> None:
        """Closes the pass for a newer one that needs its workers; every later ``take`` raises ``why``."""
        with self._lock:
            if self._stopped:
                return
            self._superseded = why
        self.close()

    def _wait(self, deadline: Optional[float]) -> bool:
        if deadline is None:
            self._ready.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._ready.wait(remaining)
        return True

    def _cause(self, error: BaseException) -> BaseException:
        """The error to raise for a shard that failed with ``error`` (lock held).

        A shard failed only because another worker's death closed the pool (a
        ``WorkerError`` that is not fatal) may finish before the dead worker's
        shard records its fatal error. The pool is closed, so every running
        shard ends promptly: wait for them, and raise the dead worker's own
        error (naming its shard) when there is one.
        """
        if not isinstance(error, WorkerError):
            return error
        until = time.monotonic() + _CAUSE_WAIT_S  # a bound, never a hang
        while self._fatal is None and time.monotonic() < until and any(
            s.started and not s.done and s.count < self._cap for s in self._shards.values()  # full ones wait on us
        ):
            self._ready.wait(0.1)
        return self._fatal if self._fatal is not None else error

    def _pop(self, sh: _Shard, item: Any) -> tuple:
        sh.count -= 1
        n = sh.taken
        sh.taken += 1
        sh.space.notify()
        if sh.done and sh.count == 0:
            self._release(sh)
        return item, (sh.id, n)

    def _advance(self) -> None:
        self._bi = 0
        self._ci = (self._ci + 1) % len(self._cycle)

    def _take_det(self, deadline: Optional[float]) -> Any:
        while True:
            if self._fatal is not None:
                raise self._fatal
            if self._end_of_input and self._num_open == 0:
                return END
            sh = self._cycle[self._ci]
            if sh is not None:
                if sh.count:
                    out = self._pop(sh, sh.buf.popleft())
                    self._bi += 1
                    if self._bi == self._block:
                        self._advance()
                    return out
                if sh.done:
                    if sh.error is not None:
                        raise self._cause(sh.error)
                    self._shards.pop(sh.pos, None)  # ended and taken: forgotten
                    self._cycle[self._ci] = None
                    self._num_open -= 1
                    self._advance()
                    continue
                if not self._wait(deadline):
                    return NOT_READY
            elif not self._end_of_input:
                if self._next_open < self._n:
                    sh = self._shard(self._next_open)
                    self._next_open += 1
                    while not sh.started:  # only if max_open < cycle_length; kept safe anyway
                        self._start_next()
                    self._cycle[self._ci] = sh
                    self._num_open += 1
                else:
                    self._end_of_input = True
            else:
                self._advance()

    def _take_any(self, deadline: Optional[float]) -> Any:
        while True:
            if self._fatal is not None:
                raise self._fatal
            if self._arrivals:
                sh, item = self._arrivals.popleft()
                if item is END:
                    self._ended += 1
                    self._shards.pop(sh.pos, None)  # ended and taken: forgotten
                    if sh.error is not None:
                        raise self._cause(sh.error)
                    continue
                return self._pop(sh, item)
            if self._ended == self._n:
                return END
            if not self._wait(deadline):
                return NOT_READY

    def starting(self) -> bool:
        """Whether a shard waits for a free worker process, or its worker is still unpickling its task
        (importing its module): start-up, which the pass's timeout does not count (``tfdata/chunks.py``).

        A free worker: one may still finish the item it was making for a stream stopped before this
        pass (the probe's, an abandoned pass's); the pool stops it if that takes over ``timeout``."""
        with self._lock:
            return any(sh.open and not sh.done and (sh.opening or getattr(sh.it, "task_started", True) is False)
                       for sh in self._shards.values())

    def pending(self) -> str:
        """What ``take`` waits for, for the stuck-wait notice."""
        with self._lock:
            if self._det:
                sh = self._cycle[self._ci]
                if sh is None:
                    return f"the next shard of a pass over {self._n}"
                where = f" in worker pid {sh.pid}" if sh.pid is not None else ""
                return f"item {sh.taken} of {self._describe(sh.id)}{where}"
            running = [sh for sh in self._shards.values() if sh.open and not sh.done]
            names = ", ".join(
                self._describe(sh.id) + (f" in worker pid {sh.pid}" if sh.pid else "") for sh in running[:4]
            )
            more = f" and {len(running) - 4} more" if len(running) > 4 else ""
            return f"an item of any running shard ({names}{more})"

    # ------------------------------------------------------------ shutdown
    def alive(self) -> list[threading.Thread]:
        """The producers still running (a closed pass's included)."""
        return [t for t in thread_tasks.listed(self._threads) if t.is_alive()]

    def close(self) -> None:
        """Stops the producers; items not taken yet are dropped. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for sh in self._shards.values():
                if sh.started:
                    sh.space.notify_all()
                sh.buf.clear()
            self._arrivals.clear()
            self._ready.notify_all()
            self._turn.notify_all()
            streams = [sh.it for sh in self._shards.values() if sh.it is not None]
        # A producer waiting for a worker's next item would wait for a stuck
        # worker forever: stop its stream (it then ends, and closes it).
        for it in streams:
            try:
                it.stop()
            except Exception:  # noqa: BLE001 - never fail a close
                pass

    stop_at_exit = close  # NOTE [ Pool threads at exit ]
