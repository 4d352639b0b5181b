"""``executor="processes"``: ``source[i]`` runs in persistent worker processes.

``ProcessExecutor`` is the one handle on its workers: it owns the ``Dispatcher`` and closes
it through ``weakref.finalize`` (NOTE [ Worker process shutdown ] in ``process.py``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

from kerasfeed import _handoff
from kerasfeed.errors import WorkerError, short_repr
from kerasfeed.execution.base import Executor, item_position
from kerasfeed.execution.parking import ParkWatch
from kerasfeed.execution.pickling import dumps_for_workers, dumps_task
from kerasfeed.execution.plan import rest_of_pass
from kerasfeed.execution.processes.dispatcher import Dispatcher
from kerasfeed.execution.processes.options import PoolOptions, workers_for
from kerasfeed.execution.processes.process import fresh_error
from kerasfeed.execution.processes.stream_sessions import StreamIterator
from kerasfeed.execution.processes.worker_threads import worker_threads
from kerasfeed.execution.retries import RetryCounts
from kerasfeed.execution.state_sync import StateTracker
from kerasfeed.sources.base import source_length, source_name


class ProcessExecutor(Executor):
    """Runs ``source[index]`` in worker processes; arrays return through shared memory.

    Use it for sources whose ``__getitem__`` holds the GIL (pure-Python work,
    per-point logic, PIL/json in Python) or h5py's global lock (HDF5 reads and
    decompression): threads cannot run those in parallel, processes can.

    The workers start when the executor is created, are reused across
    epochs, and stop on ``close()`` (or at the end of a ``with`` block),
    when the executor (or the dataset that holds it) is garbage collected,
    or at interpreter exit. Without ``retries``, a worker that dies fails the
    pass with ``kerasfeed.WorkerError`` and stops the other workers; the next
    pass starts new ones. With ``retries``, a worker that died or hung is
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
    # Workers hold their own copy of the source and call set_epoch themselves (each request
    # carries its epoch), so they may start the next pass early; its ``plan`` keeps those
    # items only if the consumer's hooks changed nothing else (execution/state_sync.py).
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
        options = PoolOptions(workers=workers, worker_init=worker_init, seed=seed,
                              in_flight_per_worker=in_flight_per_worker, timeout=timeout, worker_nice=worker_nice,
                              retries=retries, worker_max_items=worker_max_items, worker_max_rss=worker_max_rss)
        self._start(source, options)

    @classmethod
    def from_options(cls, source: Any, options: PoolOptions, *, name: Optional[str] = None) -> "ProcessExecutor":
        """The executor for ``source`` with options built (and checked) already. ``source`` None:
        workers that only run ``stream`` tasks (``from_generators``, ``from_files``), ``name``d in messages."""
        ex = cls.__new__(cls)
        ex._start(source, options, name)
        return ex

    def _start(self, source: Any, options: PoolOptions, name: Optional[str] = None) -> None:
        if source is not None:
            options = _no_more_workers_than_items(source, options)
            threads = worker_threads(source)
            if threads > 1:  # NOTE [ A worker that makes several items at once ] (worker.py)
                options = dataclasses.replace(options, in_flight_per_worker=max(options.in_flight_per_worker,
                                                                                threads + 1))
        self.options = options.resolved()  # workers and seed made concrete: every restart starts the same workers
        self.item_seed = self.options.seed if self.options.seed_given else None
        self._label = name or source_name(source)  # in messages
        self._source = source  # a parked pool's successor gets it as it is then
        self._restart_lock = threading.Lock()
        self._closed = False
        self._collector: Any = None
        self._watch = ParkWatch(self)
        self.counts = RetryCounts()  # over every pool this executor starts
        # (pass, {item left out after it killed a pool: that death's WorkerError})
        self._skipped: tuple[int, dict] = (-1, {})
        self._launch(None)

    def _launch(self, waits: Any) -> None:
        """Starts the workers (a first pool, or one after a parked or dead one) with the source as it is now."""
        with _handoff.mentioned() as named:  # the secrets the source names: its workers get only those
            payload = dumps_for_workers(self._source, self.options.worker_init)  # TypeError naming what cannot travel
        # What the workers' copy is: later passes send what changed since.
        self._state = StateTracker(self._source) if self._source is not None else None
        d = Dispatcher(payload, self.options, self._label, waits, self.counts, frozenset(named))
        d.stats = self._collector
        self._dispatcher = d
        self._finalizer = weakref.finalize(self, d.close)

    def _relaunch(self) -> None:
        # With the restart lock held: the old pool is closed (or closing); its waits go on.
        self._finalizer()
        self._launch(self._dispatcher.waits)

    @property
    def source(self) -> Any:
        """The source the workers run (each holds its own copy)."""
        return self._source

    @property
    def waits(self):  # see Executor.waits; the same scope across parked pools
        return self._dispatcher.waits

    def _live(self) -> Dispatcher:
        """The dispatcher, with workers started again if they were parked."""
        d = self._dispatcher
        if not d.parked:
            return d
        with self._restart_lock:
            if self._dispatcher.parked and not self._closed:
                self._relaunch()
            return self._dispatcher

    def _on_live(self, call: Callable[[Dispatcher], Any]) -> Any:
        # ``call`` on the live dispatcher; again on a new one if it was parked just before.
        d = self._live()
        try:
            return call(d)
        except WorkerError:
            if not d.parked or self._closed:
                raise
        return call(self._live())

    def load(self, index: int, epoch: int) -> Any:
        """Returns ``source[index]`` made by a worker that saw ``set_epoch(epoch)``.

        Thread-safe and blocking; the GIL is released while waiting.

        Raises:
            kerasfeed.ItemError: ``source[index]`` raised in the worker.
            kerasfeed.WorkerError: a worker died, failed to start or timed out.
        """
        index = item_position("ProcessExecutor", "index", index)
        epoch = item_position("ProcessExecutor", "epoch", epoch)
        if self._skipped[1] and self._skipped[0] == epoch and index in self._skipped[1]:
            # Left out after it killed a pool (item_skipped): never made again; its
            # load raises that death again, at the item's own position.
            raise self._skipped_error(index, epoch)
        return self._on_live(lambda d: d.load(index, epoch))

    def ready(self, index: int, epoch: int) -> bool:
        d = self._dispatcher
        return not d.parked and d.ready(int(index), int(epoch))

    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        """Starts making the items of pass ``epoch`` ahead, in this order (``Executor.plan``).

        ``load(i, epoch)`` for those items then picks up what the workers already made. A new
        plan (or a stream) drops the previous one; loads outside it still work, one request each.
        Once every item of this pass is requested, the workers go on with the first items of
        ``next_pass`` (within the same window), which its ``plan`` call keeps.
        """
        epoch = int(epoch)
        if next_pass is not None:
            next_pass = (int(next_pass[0]), next_pass[1])
        self._watch.pass_started(epoch)  # the consumer goes on
        self.fresh_if_failed()
        self._on_live(lambda d: self._plan(d, epoch, indices, next_pass))

    def fresh_if_failed(self) -> None:
        """A pass (planned, or of streams: ``streams/shards.py``) begins on a new pool if a worker's death
        failed this one (not parked yet). That death came while it made the pass's first items ahead, none
        loaded yet (or it failed the last pass, whose pool parks soon anyway): met again at its own item,
        the skip budget can leave that item out. It failed the new pass as it began, outside any budget."""
        d = self._dispatcher
        if d.failure is None or d.parked:
            return
        with self._restart_lock:
            if not self._closed and self._dispatcher is d:
                self._relaunch()

    def _plan(self, d: Dispatcher, epoch: int, indices: Sequence[int], next_pass: Any) -> None:
        # ``indices`` may be a lazy IndexView (read a window at a time). What changed in the source
        # since the workers' copy reaches them before any item of this pass (TypeError if it
        # cannot be pickled); items made ahead from the old copy are dropped.
        state = None
        if self._state is not None:
            d.check_usable()
            state, _ = _pickled_for(d, self._state.check)
        d.start_plan(epoch, indices, next_pass, state=state)
        if state is not None and d.replacements.wants_rebase():
            # The source is what the workers hold here: a successor's new start (NOTE [ Replacing a worker ]).
            d.replacements.rebase(_pickled_for(d, dumps_for_workers, self._source, self.options.worker_init), epoch,
                                  self._state.outside_since_start())

    def pass_failed(self, epoch: int) -> None:
        self._watch.arm(int(epoch))

    def _skipped_error(self, index: int, epoch: int) -> WorkerError:
        death = self._skipped[1][index]
        if death is not None:
            return fresh_error(death)
        return WorkerError(
            f"kerasfeed: {self._label}[{index}] of pass {epoch} was left out after a worker died (item_skipped); "
            f"it is not made again in this pass. Received: index={index}, epoch={epoch}",
            index=index,
        )

    def item_skipped(self, index: int, epoch: int) -> None:
        # With retries the pool goes on by itself (the worker was replaced); without, a death or
        # timeout closed it: a new one makes the rest of the pass. An item error leaves it usable.
        index, epoch = int(index), int(epoch)
        d = self._dispatcher
        if d.failure is None:
            return
        with self._restart_lock:
            if self._closed or self._dispatcher is not d:
                return
            self._relaunch()  # closing already (its reader thread): the rest of the pass is known after this
            new = self._dispatcher
            if self._skipped[0] != epoch:
                self._skipped = (epoch, {})
            self._skipped[1][index] = d.failure if d.failure.index == index else None
        rest = d.unfinished
        if rest is not None and rest[0] == epoch:
            _, indices, taken, next_pass = rest
            self._plan(new, epoch, rest_of_pass(indices, taken, index), next_pass)

    def activity(self) -> tuple[int, int]:
        d = self._dispatcher
        return d.loads, d.loading

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        return self._dispatcher.park(activity)

    def before_hook(self, name: str) -> None:
        # What the hook changes reaches the workers at the next ``plan``.
        if self._state is not None:
            self._state.before_hook(name)

    def after_hook(self, name: str) -> None:
        if self._state is not None:
            self._state.after_hook(name)

    def stream(self, fn: Callable[[Any], Any], arg: Any = None, *, name: Optional[str] = None) -> StreamIterator:
        """Iterates ``fn(arg)`` in a worker; its items come back through shared memory.

        The worker is reserved for the stream until it ends or the returned
        iterator is closed; at most ``in_flight_per_worker`` items are ahead
        of the consumer. ``fn`` and ``arg`` are sent by value (cloudpickle).

        Raises (from the iterator):
            kerasfeed.ItemError: the task raised; ``index`` is the number of
                items it had produced.
            kerasfeed.WorkerError: the worker died.
        """
        label = name or f"{getattr(fn, '__qualname__', type(fn).__name__)}({short_repr(arg, 40)})"
        d = self._live()
        payload = _pickled_for(d, dumps_task, fn, arg, label)
        lane, session = d.streams.start(payload, label)
        return StreamIterator(self, d.streams, lane, session)

    def parallel_calls(self) -> int:
        # The most items in flight (and in shared memory) at once: for a parallel map (instead of
        # the sequential map a planned pass needs), enough calls to keep every worker busy.
        return self.options.workers * self.options.in_flight_per_worker

    @property
    def workers(self) -> int:
        return self.options.workers

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, in worker id order."""
        return [lane.process.pid for lane in self._dispatcher.lanes]

    def attach_stats(self, collector: Any) -> None:
        """Also sends each item's make time, as the worker timed it, to ``collector``."""
        super().attach_stats(collector)
        self._collector = collector
        self._dispatcher.stats = collector

    def gauges(self) -> dict:
        """Figures of this instant, cheap enough to poll (``Executor.gauges``): ``ahead``,
        ``in_flight``, ``shm_bytes``, per worker ``id``, ``pid``, ``alive``, ``rss_mb``
        (``/proc/<pid>/statm``), and the counts of ``RetryCounts``; a stream-only executor
        (``source`` None) has no plan: only ``shm_bytes`` and ``workers``."""
        g = figures(self._dispatcher, full=False)
        if self._source is None:
            return {"shm_bytes": g["shm_bytes"], "workers": g["workers"]}
        return dict(g, **self.counts.as_dict(_POOL_COUNTS))

    def stats(self) -> dict:
        """Start-up time, memory, transport and consumer-side cost of the workers.

        Returns:
            A dict with ``workers``, ``startup_s`` (launch to ready, slowest
            worker), ``rss_mb_per_worker``, ``uss_mb_per_worker`` (memory only
            that worker uses), ``consumer_us_per_item`` (CPU time the
            consumer process spent per item: dispatch, answer handling and the
            copy out of shared memory), ``shm_bytes``, ``in_flight_limit``,
            ``items`` and ``per_worker`` details (pid, alive, whether
            TensorFlow/Keras were imported), and ``state``: how the source's
            state reaches the workers (``mode``, ``syncs``: passes that sent
            a change, ``sent_bytes``), and the counts of ``RetryCounts``
            (``retried_items``, ``replaced_workers``, ``recycled_workers``, ...).
        """
        out = dict(figures(self._dispatcher, full=True), **self.counts.as_dict(_POOL_COUNTS))
        if self._state is not None:
            out["state"] = {"mode": self._state.mode, "syncs": self._state.syncs, "sent_bytes": self._state.sent_bytes}
        return out

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until every worker has started (source unpickled, ``worker_init`` run)."""
        self._live().wait_ready(timeout)

    def close(self) -> None:
        """Stops the workers and frees the shared memory. Idempotent."""
        with self._restart_lock:  # no new pool after this
            self._closed = True
        self._watch.disarm()
        self._finalizer()
        if self._collector is not None:  # TensorFlow may keep the closed dataset: see ThreadExecutor.close
            self._collector.compact()

    @property
    def closed(self) -> bool:
        return self._closed or self._dispatcher.closed

    def __reduce__(self):
        raise TypeError("kerasfeed: a ProcessExecutor cannot be pickled (it owns processes).")

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<ProcessExecutor name={self.name!r} workers={self.workers}{why}>"


# What a pool counts (threads count ``abandoned_threads`` instead).
_POOL_COUNTS = ("retried_items", "requeued_items", "failed_items", "replaced_workers", "recycled_workers")


def _no_more_workers_than_items(source: Any, options: PoolOptions) -> PoolOptions:
    try:
        items = source_length(source, allow_infinite=True)
    except (TypeError, ValueError):  # the front end reports a bad source itself
        return options
    return dataclasses.replace(options, workers=workers_for(options.workers, items))


def figures(d: Dispatcher, *, full: bool) -> dict:
    """The workers' figures now: ``ProcessExecutor.gauges``'s (cheap: RSS from
    ``/proc/<pid>/statm``), or with ``full`` ``stats``'s (USS from the slower smaps walk)."""
    import psutil

    workers = []
    for lane in d.lanes:
        w = lane.process
        entry = {"id": w.id, "pid": w.pid, "alive": w.proc.poll() is None, "rss_mb": None}
        if full:
            rss = w.info.get("rss_bytes")
            entry.update(startup_s=w.info.get("launch_to_ready_s"), ready_rss_mb=None if rss is None else rss / 2**20,
                         tensorflow_imported=w.info.get("tensorflow_imported"),
                         keras_imported=w.info.get("keras_imported"), uss_mb=None)
        if entry["alive"]:
            try:
                mem = psutil.Process(w.pid).memory_full_info() if full else psutil.Process(w.pid).memory_info()
                entry["rss_mb"] = mem.rss / 2**20
                if full:
                    entry["uss_mb"] = mem.uss / 2**20
            except (psutil.Error, OSError):
                pass
        workers.append(entry)
    with d.lock:
        d.slots.collect_returned()
        shm_bytes, lent_bytes, lent_items = d.slots.shm_bytes(), d.slots.lent_bytes, d.slots.lent_items
    if not full:
        counts = d.request_counts()
        ahead = 0 if d.closed else counts.waiting  # a closed pool's made-ahead items are gone with it
        return {"ahead": ahead, "in_flight": counts.pending, "shm_bytes": shm_bytes, "workers": workers}
    startups = [e["startup_s"] for e in workers if e["startup_s"] is not None]
    rss = [e["rss_mb"] for e in workers if e["rss_mb"] is not None]
    uss = [e["uss_mb"] for e in workers if e["uss_mb"] is not None]
    consumer_s = d.consumer_cpu_s + sum(lane.process.reader_cpu_s for lane in d.lanes)
    return {
        "workers": len(d.lanes),
        "start_method": "spawn (fresh interpreter via subprocess)",
        "in_flight_limit": len(d.lanes) * d.in_flight_per_worker,
        "startup_s": max(startups) if len(startups) == len(workers) else None,
        "rss_mb_per_worker": sum(rss) / len(rss) if rss else None,
        "uss_mb_per_worker": sum(uss) / len(uss) if uss else None,
        "items": d.items,
        "consumer_us_per_item": consumer_s / d.items * 1e6 if d.items else None,
        "shm_bytes": shm_bytes,
        "lent_bytes": lent_bytes,
        "lent_items": lent_items,
        "per_worker": workers,
    }


def _pickled_for(d: Dispatcher, dump: Callable[..., Any], *args: Any) -> Any:
    """``dump(*args)``, a payload for pool ``d``'s workers: the hand-off entries it names join the pool's
    (NOTE [ Secrets travel to workers in memory, never with the source ])."""
    with _handoff.mentioned() as named:
        out = dump(*args)
    if not named <= d.handoff:
        d.handoff = d.handoff | named  # one rebinding: readers of the old set are never disturbed
    return out
