"""``QueueFeed``: items from a producer that does not know the epoch length.

The producer marks the end of every epoch with ``END_OF_EPOCH``; each pass
over the dataset reads one epoch. The queue between them is bounded, so a
fast producer waits (back-pressure) instead of filling memory. Producers:

- a callable ``producer(put)``, run by kerasfeed in a daemon thread that
  starts at the first pass (or when the signature is inferred) and keeps
  running across epochs; ``put(item)`` blocks while the queue is full. When
  it returns, the data is over: the current epoch ends and a later pass
  raises a ``StreamError`` saying that the producer has stopped (never a
  silently empty epoch). If it raises, the pass that reaches that point
  raises a ``StreamError`` with the original error (after the items put before it).
- a bounded queue (``queue.Queue(maxsize=N)``, ``multiprocessing.Queue(N)``,
  anything with ``get(timeout=)``) that the user's own threads fill. An
  exception instance put into it fails the epoch with that error (the next
  pass skips the rest of that epoch); a ``timeout`` guards against a
  producer that died silently.

One pass reads the queue at a time: a pass opened while another is still
open supersedes it (``QueueFeed.open_pass``).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed.errors import StreamError
from kerasfeed.execution import thread_tasks
from kerasfeed.execution.waits import WaitScope
from kerasfeed.streams.options import END, NOT_READY, NothingRaised


class _EndOfEpoch:
    """The end-of-epoch sentinel; a singleton that survives pickling."""

    _instance: Optional["_EndOfEpoch"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):
        return (_EndOfEpoch, ())

    def __repr__(self) -> str:
        return "kerasfeed.END_OF_EPOCH"


END_OF_EPOCH = _EndOfEpoch()


class _ProducerDone:
    """Put by the producer thread when the producer returns or raises."""

    __slots__ = ("error",)

    def __init__(self, error: Optional[BaseException]):
        self.error = error


class ProducerStopped(NothingRaised):
    """A pass started after a callable producer returned: there is no data left."""

    def _subject(self) -> str:
        return f"{self.what} has stopped"


class QueueClosed(RuntimeError):
    """Raised by ``put`` once the dataset's feed is closed: the producer stops."""


def _producer_name(producer: Any) -> str:
    name = getattr(producer, "__qualname__", None) or type(producer).__name__
    return name.rpartition("<locals>.")[2]


class QueueFeed:
    """The producer side of ``from_queue``.

    Args:
        producer: a callable ``producer(put)`` or a bounded queue object.
        maxsize: the bound of the queue kerasfeed creates for a callable
            producer (ignored for a queue object, which has its own bound).
        timeout: seconds a pass may wait for the next item before it fails;
            None waits as long as it takes (a callable producer that dies is
            always detected).

    Raises:
        TypeError: ``producer`` is neither callable nor a queue.
        ValueError: an unbounded queue, or a bad ``maxsize``/``timeout``.
    """

    def __init__(self, producer: Any, *, maxsize: int = 64, timeout: Optional[float] = None):
        maxsize = _v.positive_int("maxsize", maxsize)
        self.timeout = _v.seconds("timeout", timeout)
        self._lock = threading.Lock()
        # One pass reads the queue at a time: a pass superseded by a newer
        # one (see ``open_pass``) must not take the newer pass's items.
        self._read_lock = threading.Lock()
        self._peeked: collections.deque = collections.deque()
        self._done: Optional[_ProducerDone] = None  # sticky once the producer finished
        self._epoch = 0
        self._skip_to_epoch_end = False
        self._active: Optional["QueuePass"] = None
        self._build_next = False  # the next pass is a model build's (``model_build_iterator``)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.produced = 0  # items put by a callable producer (for tests and stats)
        self._returned = False  # the callable producer returned or raised
        self._stats: Any = None  # a StatsCollector: each put item's make time (callable producers)
        self._free_since = 0.0  # when the producer began making its next item
        # Deleting the last iterator over the feed, or Ctrl-C, ends the consumer's wait
        # (``execution/waits.py``; see ``tfdata/chunks.py``).
        self.waits = WaitScope()
        if hasattr(producer, "get") and callable(producer.get):
            bound = getattr(producer, "maxsize", getattr(producer, "_maxsize", None))
            # multiprocessing.Queue() holds _maxsize 2**31 - 1 (SEM_VALUE_MAX), CPython's "no limit".
            if not isinstance(bound, int) or bound <= 0 or bound >= 2**31 - 1:
                raise ValueError(
                    "from_queue needs a bounded queue so that memory stays bounded: create it with a "
                    f"positive maxsize, e.g. queue.Queue(maxsize=64). Received: a queue with maxsize={bound!r}"
                )
            self._q = producer
            self._producer = None
            self.name = f"the queue {type(producer).__name__}"
        elif callable(producer):
            self._q = queue.Queue(maxsize)
            self._producer = producer
            self.name = f"the from_queue producer {_producer_name(producer)}"
        else:
            raise TypeError(
                "`producer` must be a callable `producer(put)` or a bounded queue (an object with "
                f"`get`, e.g. queue.Queue(maxsize=64)). Received: {producer!r}"
            )

    # ------------------------------------------------------------ producer
    def _start(self) -> None:
        with self._lock:
            if self._producer is None or self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, name="kerasfeed-queue-producer", daemon=True)
            thread_tasks.join_at_exit(self)  # the producer runs the user's code: NOTE [ Pool threads at exit ]
            self._thread.start()

    def _run(self) -> None:
        error = None
        self._free_since = time.perf_counter()
        try:
            self._producer(self.put)
        except QueueClosed:
            return
        except Exception as e:  # noqa: BLE001 - handed to the consumer, in order
            error = StreamError.from_exception(self.name, e, items_before=self.produced)
        self._returned = True  # a later put would land after the end: refused (``put``)
        try:
            self._put_blocking(_ProducerDone(error))
        except QueueClosed:
            pass

    def _put_blocking(self, item: Any) -> None:
        # Short timeouts so that a closed feed releases a blocked producer.
        while True:
            if self._closed:
                raise QueueClosed("kerasfeed: the from_queue dataset was closed; the producer stops.")
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def put(self, item: Any) -> None:
        """Puts an item or ``END_OF_EPOCH``; blocks while the queue is full.

        Raises:
            QueueClosed: the feed was closed; let it propagate to stop.
            RuntimeError: the producer had returned (a thread it handed ``put`` to outlived it).
        """
        if self._returned:
            raise RuntimeError(
                f"kerasfeed: put() was called after {self.name} returned; the stream "
                "had ended there, so this item would never be read. Return from the producer only after every "
                f"thread it hands `put` to is done. Received: a put after {self.produced} items"
            )
        stats = self._stats
        if stats is not None and item is not END_OF_EPOCH:
            # The producer's time since its previous put (or its start):
            # making this item. Time blocked in a full queue counts nowhere.
            end = time.perf_counter()
            stats.made(end - self._free_since, None, end)
        self._put_blocking(item)
        if item is not END_OF_EPOCH:
            self.produced += 1
        if stats is not None:
            self._free_since = time.perf_counter()

    def attach_stats(self, collector: Any) -> None:
        """Reports each item's make time to ``collector`` (a ``StatsCollector``) when kerasfeed runs the
        producer: its thread's time between ``put`` calls (a queue object's threads are not seen)."""
        if self._producer is not None:
            self._stats = collector

    # ------------------------------------------------------------ consumer
    def _get(self, timeout: Optional[float]) -> Any:
        """The next raw entry, or NOT_READY after ``timeout`` seconds."""
        if self._peeked:
            return self._peeked.popleft()
        if self._done is not None:
            return self._done
        try:
            if timeout is None:
                got = self._q.get()
            elif timeout <= 0:
                got = self._q.get(block=False)
            else:
                got = self._q.get(timeout=timeout)
        except queue.Empty:
            return NOT_READY
        if isinstance(got, _ProducerDone):
            self._done = got
        return got

    def peek(self, count: int) -> list[Any]:
        """Waits for the first ``count`` items (fewer if the data ends first); they stay queued for
        the first pass, in order.

        Raises:
            kerasfeed.StreamError: the producer raised before making them.
            TimeoutError: nothing came within ``timeout``.
        """
        self._start()
        items, seen = [], []
        try:
            while len(items) < count:
                got = self._get(self.timeout)
                if got is NOT_READY:
                    raise TimeoutError(
                        f"kerasfeed: from_queue waited {self.timeout} s for a first item from {self.name} "
                        "to infer the signature. Start the producer first, or pass `output_signature=`."
                    )
                if isinstance(got, _ProducerDone):
                    if got.error is not None and not items:
                        raise got.error
                    break
                seen.append(got)
                if isinstance(got, BaseException):
                    if not items:
                        raise StreamError.from_exception(self.name, got, items_before=0)
                    break
                if got is not END_OF_EPOCH:
                    items.append(got)
        finally:
            self._peeked.extend(seen)
        return items

    def open_pass(self) -> "QueuePass":
        """Starts reading the next epoch.

        A pass still open (an iterator peeked at and kept, one a traceback holds, one collected late)
        is superseded: as if dropped, the new pass starts after its epoch if it took items, and its
        next ``take`` raises instead of taking the new pass's items.
        """
        self._start()
        with self._read_lock, self._lock:
            if self._active is not None:
                self._active._leave(superseded=True)
            p = QueuePass(self, build=self._build_next)
            self._active, self._build_next = p, False
        return p

    def model_build_iterator(self) -> None:
        """The next pass is a model build's (NOTE [ A model build's pass over a stream ], ``tfdata/consumers.py``):
        the items it takes are read again by the pass after it."""
        with self._lock:
            self._build_next = True

    def close(self) -> None:
        """Stops the producer thread (its next ``put`` raises). Idempotent."""
        self._closed = True

    stop_at_exit = close

    def alive(self) -> list[threading.Thread]:
        return thread_tasks.running(self._thread)


class QueuePass:
    """One epoch of a ``QueueFeed``; same ``take``/``close`` as ``ShardPass``."""

    def __init__(self, feed: QueueFeed, build: bool = False):
        self._feed = feed
        self._ended = False
        self._superseded = False
        self._n = 0
        self._epoch = feed._epoch
        # A pass abandoned mid-epoch: this pass starts at the next epoch.
        self._skipping = feed._skip_to_epoch_end
        self._last = time.monotonic()
        # A model build's pass: the entries it took (items, the epoch's end), handed back when it goes.
        self._taken: Optional[list] = [] if build else None

    def take(self, timeout: Optional[float] = None) -> Any:
        """Returns ``(item, (epoch, item_number))``, ``NOT_READY`` or ``END``."""
        feed = self._feed
        with feed._read_lock:
            if self._superseded:
                self._ended = True
                raise StreamError(
                    f"{feed.name} (epoch {self._epoch})", "RuntimeError",
                    f"a newer pass over this from_queue dataset started while this one was open, after {self._n} "
                    "items: a queue is read one pass at a time, and the newer pass reads on from the next epoch. "
                    "Finish or delete an iterator before starting another pass.",
                    "(none: a newer pass started)\n", None, self._n,
                )
            return self._take(timeout)

    def _take(self, timeout: Optional[float]) -> Any:
        feed = self._feed
        if self._ended:
            return END
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = feed._get(remaining)
            if got is NOT_READY:
                if feed.timeout is not None and time.monotonic() - self._last > feed.timeout:
                    with feed._lock:
                        self._leave()  # the producer may go on with this epoch later: the next pass skips it
                    raise StreamError(
                        feed.name, "TimeoutError", f"no item for {feed.timeout} s (epoch {self._epoch}, "
                        f"after {self._n} items); is the producer still running?",
                        "(none: nothing raised, the producer went quiet)\n", None, self._n,
                    )
                return NOT_READY
            self._last = time.monotonic()
            if isinstance(got, _ProducerDone):
                self._end()
                if got.error is not None:
                    raise got.error
                if self._n == 0:
                    raise self._stopped_error()
                return END
            if got is END_OF_EPOCH:
                if self._skipping:
                    self._skipping = False
                    with feed._lock:
                        feed._skip_to_epoch_end = False
                    continue
                if self._taken is not None:
                    self._taken.append(got)
                self._end()
                return END
            if self._skipping:
                continue
            if self._taken is not None:  # a model build's: the next pass meets each again at its place, errors too
                self._taken.append(got)
            if isinstance(got, BaseException):
                with feed._lock:  # the rest of the failed epoch is skipped, up to its END_OF_EPOCH
                    self._leave(failed=True)
                raise StreamError.from_exception(f"{feed.name} (epoch {self._epoch})", got, items_before=self._n)
            n = self._n
            self._n += 1
            return got, (self._epoch, n)

    def pending(self) -> str:
        """What ``take`` waits for, for the stuck-wait notice."""
        return f"item {self._n} of epoch {self._epoch} from {self._feed.name}"

    def _stopped_error(self) -> "ProducerStopped":
        # An empty pass would train on nothing and Keras would report loss 0.
        feed = self._feed
        return ProducerStopped(
            feed.name, "ProducerStopped",
            f"it returned after {feed.produced} items, so epoch {self._epoch} has no data. "
            "A callable producer runs once across all epochs: make it put `kerasfeed.END_OF_EPOCH` after "
            "each epoch and loop for as many epochs as you train, or build a new dataset with "
            "`kerasfeed.from_queue(producer)` to read the data again. "
            f"Received: a pass started after the producer returned (epoch {self._epoch})",
            "(none: the producer returned normally)\n", None, 0,
        )

    def _end(self) -> None:
        self._ended = True
        self._feed._epoch = self._epoch + 1

    def _leave(self, *, superseded: bool = False, failed: bool = False) -> None:
        """Ends this pass before its epoch's end (``feed._lock`` held). Abandoned mid-epoch (a
        ``break``, ``take(k)``, a timeout, a newer pass) after taking items, or failed by an exception
        item: the next pass drops the rest of this epoch and reads the next one."""
        feed = self._feed
        if feed._active is self:
            feed._active = None
        if superseded:
            self._superseded = True
        taken, self._taken = self._taken, None
        if taken is not None:  # a model build's pass: the next pass reads what it took again (an error too)
            feed._peeked.extendleft(reversed(taken))
            feed._epoch, feed._skip_to_epoch_end = self._epoch, self._skipping
            self._ended = True
            return
        if not self._ended and (self._n > 0 or failed):
            feed._skip_to_epoch_end = feed._done is None
            feed._epoch = self._epoch + 1
        self._ended = True

    def close(self) -> None:
        feed = self._feed
        # A build's pass hands its items back to the queue's front: not while a take reads it.
        with (feed._read_lock if self._taken is not None else contextlib.nullcontext()), feed._lock:
            if feed._active is self:
                self._leave()
