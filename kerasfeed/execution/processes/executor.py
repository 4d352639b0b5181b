"""``executor="processes"``: ``source[i]`` runs in persistent worker processes."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional, Sequence

from kerasfeed.errors import WorkerError
from kerasfeed.execution.base import Executor, item_position
from kerasfeed.execution.parking import ParkWatch
from kerasfeed.execution.plan import rest_of_pass
from kerasfeed.execution.processes.options import PoolOptions, workers_for
from kerasfeed.execution.processes.pool import WorkerPool
from kerasfeed.execution.processes.process import fresh_error
from kerasfeed.execution.retries import RetryCounts
from kerasfeed.sources.base import source_length


class ProcessExecutor(Executor):
    """Runs ``source[index]`` in worker processes; arrays return through shared memory.

    Use it for sources whose ``__getitem__`` holds the GIL (pure-Python work,
    per-point logic, PIL/json in Python) or h5py's global lock (HDF5 reads and
    decompression): threads cannot run those in parallel, processes can.

    The workers start when the executor is created, are reused across
    epochs, and stop on ``close()`` (or at the end of a ``with`` block),
    when the executor (or the dataset that holds it) is garbage collected,
    or at interpreter exit. Without ``retries``, a worker that dies fails the
    pass with ``kerasfeed.WorkerError`` and stops the other workers; workers
    are not restarted. With ``retries``, a worker that died or hung is
    replaced and its item made again (NOTE [ Replacing a worker ]). After a
    pass fails on an item and is left, the idle workers stop too, and the
    next pass starts fresh ones (NOTE [ Parking after a failed pass ]).

    Args:
        source: the indexable source; sent to each worker by value
            (cloudpickle), so classes defined in ``__main__`` or a notebook
            work. Open files lazily in ``__getitem__``. What the epoch
            hooks change in it later reaches the workers at the next pass
            boundary (``plan``): only the attributes that changed.
        workers: number of worker processes; None = ``default_workers()``
            (2 on 2 cores, CPUs - 1 up to 8, then CPUs - 2, at most 32: the
            consumer keeps CPU for the training loop). Never more than the
            source's items when it starts: a worker beyond them would only
            cost start-up and memory (a small validation set).
        worker_init: run once in each worker after the source arrives.
        seed: base seed of the workers' ``random``/``numpy.random``
            (worker ``k`` gets ``seed + k``); None draws one.
        in_flight_per_worker: items requested from each worker at a time.
        timeout: seconds one item may take before the pass fails; None
            waits as long as the worker is alive.
        worker_nice: nice steps (0-19) below this process the workers run,
            so that the training loop wins contended CPUs; 0 = the same
            priority; None = ``$KERASFEED_WORKER_NICE`` or 10.
        retries: further attempts of an item that raised, timed out or whose
            worker died (``PoolOptions.retries``); 0 fails at once.
        worker_max_items: replace a worker after it was sent this many items.
        worker_max_rss: replace a worker whose resident memory passed this
            many bytes after an item (at least 64 MB).

    Example:

    ```python
    with ProcessExecutor(my_sequence, workers=2) as ex:  # close() on leaving
        x, y = ex.load(0, epoch=0)
        ex.stats()["startup_s"], ex.stats()["rss_mb_per_worker"]
    ```
    """

    name = "processes"
    prefetches = True
    # Workers hold their own copy of the source and call set_epoch
    # themselves (each request carries its epoch), so they may start the next
    # pass early; its ``plan`` keeps those items only if the consumer's hooks
    # changed nothing else (see execution/state_sync.py).
    plans_next_pass = True

    def __init__(
        self,
        source: Any,
        *,
        workers: Optional[int] = None,
        worker_init: Optional[Callable[[], None]] = None,
        seed: Optional[int] = None,
        in_flight_per_worker: int = 2,
        timeout: Optional[float] = None,
        worker_nice: Optional[int] = None,
        retries: int = 0,
        worker_max_items: Optional[int] = None,
        worker_max_rss: Optional[int] = None,
    ):
        source_length(source, allow_infinite=True, owner="ProcessExecutor")  # a path, a number: say so here
        options = PoolOptions(
            workers=workers,
            worker_init=worker_init,
            seed=seed,
            in_flight_per_worker=in_flight_per_worker,
            timeout=timeout,
            worker_nice=worker_nice,
            retries=retries,
            worker_max_items=worker_max_items,
            worker_max_rss=worker_max_rss,
        )
        self._start(source, options)

    @classmethod
    def from_options(cls, source: Any, options: PoolOptions) -> "ProcessExecutor":
        """The executor for ``source`` with options built (and checked) already."""
        ex = cls.__new__(cls)
        ex._start(source, options)
        return ex

    def _start(self, source: Any, options: PoolOptions) -> None:
        options = _no_more_workers_than_items(source, options)
        self._source = source  # a parked pool's successor gets it as it is then
        self._restart_lock = threading.Lock()
        self._closed = False
        self._collector: Any = None
        self._watch = ParkWatch(self)
        self.counts = RetryCounts()  # over every pool this executor starts
        # (pass, {item left out after it killed a pool: that death's WorkerError})
        self._skipped: tuple[int, dict] = (-1, {})
        self.pool = WorkerPool(source, options, counts=self.counts)

    @property
    def source(self) -> Any:
        """The source the workers run (each holds its own copy)."""
        return self._source

    @property
    def waits(self):  # see Executor.waits; the same scope across parked pools
        return self.pool.waits

    def _live_pool(self) -> WorkerPool:
        """The pool, started again if it was parked."""
        pool = self.pool
        if not pool.parked:
            return pool
        with self._restart_lock:
            old = self.pool
            if old.parked and not self._closed:
                self._new_pool(old)
            return self.pool

    def _new_pool(self, old: WorkerPool) -> None:
        # With the restart lock held: a pool like ``old``, the source as it is now.
        self.pool = WorkerPool(self._source, old.options, name=old.name, waits=old.waits, counts=self.counts)
        if self._collector is not None:
            self.pool.observe(self._collector)

    def load(self, index: int, epoch: int) -> Any:
        index = item_position("ProcessExecutor", "index", index)
        epoch = item_position("ProcessExecutor", "epoch", epoch)
        if self._skipped[1] and self._skipped[0] == epoch and index in self._skipped[1]:
            # Left out after it killed a pool (item_skipped): never made again; its
            # load raises that death again, at the item's own position.
            raise self._skipped_error(index, epoch)
        pool = self._live_pool()
        try:
            return pool.load(index, epoch)
        except WorkerError:
            if not pool.parked or self._closed:
                raise
        return self._live_pool().load(index, epoch)  # it was parked just before this load

    def ready(self, index: int, epoch: int) -> bool:
        pool = self.pool
        return not pool.parked and pool.ready(int(index), int(epoch))

    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        self._watch.pass_started(int(epoch))  # the consumer goes on
        pool = self._live_pool()
        try:
            pool.plan(int(epoch), indices, next_pass)
            return
        except WorkerError:
            if not pool.parked or self._closed:
                raise
        self._live_pool().plan(int(epoch), indices, next_pass)

    def pass_failed(self, epoch: int) -> None:
        self._watch.arm(int(epoch))

    def _skipped_error(self, index: int, epoch: int) -> WorkerError:
        death = self._skipped[1][index]
        if death is not None:
            return fresh_error(death)
        return WorkerError(
            f"kerasfeed: {self.pool.name}[{index}] of pass {epoch} was left out after a worker died (item_skipped); "
            f"it is not made again in this pass. Received: index={index}, epoch={epoch}",
            index=index,
        )

    def item_skipped(self, index: int, epoch: int) -> None:
        # With retries the pool goes on by itself (the worker was replaced);
        # without, a death or timeout closed it: a new one makes the rest of
        # the pass (Executor.item_skipped). An item error leaves it usable.
        index, epoch = int(index), int(epoch)
        pool = self.pool
        if not pool.failed:
            return
        with self._restart_lock:
            if self._closed or self.pool is not pool:
                return
            pool.close()  # closing already (its reader thread): the rest of the pass is known after this
            self._new_pool(pool)
            new = self.pool
            if self._skipped[0] != epoch:
                self._skipped = (epoch, {})
            failure = pool.failure
            self._skipped[1][index] = failure if failure is not None and failure.index == index else None
        rest = pool.unfinished()
        if rest is not None and rest[0] == epoch:
            _, indices, taken, next_pass = rest
            new.plan(epoch, rest_of_pass(indices, taken, index), next_pass)

    def activity(self) -> tuple[int, int]:
        return self.pool.activity()

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        return self.pool.park(activity)

    def before_hook(self, name: str) -> None:
        self.pool.before_hook(name)

    def parallel_calls(self) -> int:
        # For a parallel map (when the caller asks for one instead of the
        # sequential map a planned pass needs): enough calls to keep every
        # worker busy, never more; extra calls would only queue in here.
        return self.pool.in_flight_limit

    @property
    def workers(self) -> int:
        return self.pool.num_workers

    def attach_stats(self, collector: Any) -> None:
        super().attach_stats(collector)
        self._collector = collector
        self.pool.observe(collector)

    def gauges(self) -> dict:
        """See ``WorkerPool.gauges``."""
        return self.pool.gauges()

    def stats(self) -> dict:
        """See ``WorkerPool.stats``."""
        return self.pool.stats()

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until every worker has started."""
        self._live_pool().wait_ready(timeout)

    def close(self) -> None:
        with self._restart_lock:  # no new pool after this
            self._closed = True
        self._watch.disarm()
        self.pool.close()
        stats = self.pool._dispatcher.stats
        if stats is not None:  # TensorFlow may keep the closed dataset: see ThreadExecutor.close
            stats.compact()

    def __reduce__(self):
        raise TypeError("kerasfeed: a ProcessExecutor cannot be pickled (it owns processes).")

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<ProcessExecutor name={self.name!r} workers={self.workers}{why}>"


def _no_more_workers_than_items(source: Any, options: PoolOptions) -> PoolOptions:
    try:
        items = source_length(source, allow_infinite=True)
    except (TypeError, ValueError):  # the front end reports a bad source itself
        return options
    return dataclasses.replace(options, workers=workers_for(options.workers, items))
