"""A persistent pool of worker processes that make items through shared memory.

``WorkerPool`` is the façade; the work is split by concern (each unit names
its counterpart on the worker side, ``worker.py``):

- ``protocol.py``         one type per message, both directions
- ``process.py``          ``WorkerProcess``: launch, send, explain an exit, stop;
                          holds NOTE [ Worker process shutdown ]
- ``slots.py``            ``SlotTable``: shared-memory slots and the lending budget
- ``lanes.py``            ``WorkerLane``/``Lanes``: each worker's requests, choice of a worker
- ``pass_plans.py``       ``PassPlans``: the pass requested ahead and the next pass
- ``stream_sessions.py``  ``StreamSessions``: generator streams, ``StreamIterator``
- ``dispatcher.py``       ``Dispatcher``: the one lock, ``load`` (and its retries),
                          plans
- ``shutdown.py``         parking and close ordering
- ``readers.py``          the reader threads: answers, failure propagation
- ``replacement.py``      ``Replacements``: successors of dead, hung or recycled
                          workers; holds NOTE [ Replacing a worker ]
- ``options.py``          ``PoolOptions``

Workers start when the pool is created (fresh interpreters, the source sent
by value) and live until it is closed: across epochs, passes and datasets.
Without ``retries`` a worker that dies fails the pass loudly and is not
restarted (NOTE [ Worker process shutdown ] in ``process.py``); with it, or
with ``worker_max_items``/``worker_max_rss``, workers are replaced.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

from kerasfeed.execution.processes.dispatcher import Dispatcher
from kerasfeed.execution.processes.lanes import RequestCounts
from kerasfeed.execution.processes.options import PoolOptions, default_workers
from kerasfeed.execution.processes.pass_plans import PlanStatus
from kerasfeed.execution.processes.pickling import dumps_for_workers, dumps_task
from kerasfeed.execution.processes.stream_sessions import StreamIterator, short_repr
from kerasfeed.execution.retries import RetryCounts
from kerasfeed.execution.state_sync import StateTracker

__all__ = ["WorkerPool", "PoolOptions", "StreamIterator", "default_workers"]


class WorkerPool:
    """Persistent worker processes that make items of a source, or stream
    the items of generator tasks, through shared memory.

    Workers start when the pool is created and stay until ``close()``, until
    the pool is garbage collected, or until the interpreter exits.

    Args:
        source: an indexable source (sent to every worker by value, with
            cloudpickle), or None for a pool that only runs streaming tasks.
        options: a ``PoolOptions`` (workers, worker_init, seed,
            in_flight_per_worker, timeout), built once by the caller; the
            pool keeps a resolved copy (``workers``/``seed`` made concrete).
            ``worker_init`` runs once in each worker, after the source is
            unpickled; ``kerasfeed.get_worker_info()`` works inside it.
        name: a name for error messages; defaults to the source's class name.
        waits: the ``WaitScope`` of its loads (``execution/waits.py``); a new
            one if None (an executor that restarts its pool passes its own).
        counts: the ``RetryCounts`` to add to (likewise).

    Raises:
        TypeError: the source or ``worker_init`` cannot be pickled (the
            message names the attribute), or ``worker_init`` is not callable.
        ValueError: a bad option.

    Example:

    ```python
    pool = WorkerPool(my_source, PoolOptions(workers=2))
    x, y = pool.load(3, epoch=0)             # my_source[3], made in a worker
    for item in pool.stream(make_items, 7):  # iterates make_items(7) in a worker
        ...
    pool.close()
    ```
    """

    def __init__(
        self,
        source: Any = None,
        options: Optional[PoolOptions] = None,
        *,
        name: Optional[str] = None,
        waits: Any = None,
        counts: Optional[RetryCounts] = None,
    ):
        if options is None:
            options = PoolOptions()
        elif not isinstance(options, PoolOptions):
            raise TypeError(f"`options` must be a PoolOptions or None. Received: options={options!r}")
        self.options = options.resolved()
        self.name = name or (type(source).__name__ if source is not None else "pool")
        payload = dumps_for_workers(source, self.options.worker_init)
        # What the workers' copy is: later passes send what changed since.
        self._state = StateTracker(source) if source is not None else None
        self._dispatcher = Dispatcher(payload, self.options, self.name, waits, counts)
        # Runs on close(), on garbage collection and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._dispatcher.close)

    @property
    def waits(self) -> Any:
        """The pool's ``WaitScope`` (``execution/waits.py``): deleting the last
        iterator over it ends the waits in progress."""
        return self._dispatcher.waits

    @property
    def counts(self) -> RetryCounts:
        """Retries and replaced workers (``execution/retries.py``)."""
        return self._dispatcher.counts

    @property
    def failure(self) -> Any:
        """The ``WorkerError`` that closed the pool (a worker's death, a
        timeout, a start-up failure), or None."""
        return self._dispatcher.failure

    @property
    def failed(self) -> bool:
        return self._dispatcher.failure is not None

    def unfinished(self) -> Any:
        """``(epoch, indices, next_pass)``: the rest of the pass the pool was
        reading when it closed (``PassPlans.unfinished``), or None."""
        return self._dispatcher.unfinished

    @property
    def num_workers(self) -> int:
        return self.options.workers

    @property
    def in_flight_limit(self) -> int:
        """The most items that can be in flight (and in shared memory) at once."""
        return self.options.workers * self.options.in_flight_per_worker

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, in worker id order."""
        return [lane.process.pid for lane in self._dispatcher.lanes]

    def request_counts(self) -> RequestCounts:
        """Requests over all workers: ``pending`` (sent, not answered),
        ``unreleased`` (not released by their load yet), ``waiting`` (answered
        plan requests no load has taken yet) and ``streams`` running."""
        return self._dispatcher.request_counts()

    def plan_status(self) -> PlanStatus:
        """The pass being loaded ahead and the next pass started after it (snapshots)."""
        return self._dispatcher.plan_status()

    def idle(self) -> bool:
        """True when no request is in flight or waiting to be taken and no stream runs."""
        return self._dispatcher.idle()

    def slots_in_use(self) -> int:
        """Shared-memory slots in flight, lent to the consumer or streaming, over all workers."""
        with self._dispatcher.lock:
            return self._dispatcher.slots.in_use()

    def free_slots(self, worker_id: int) -> list[int]:
        """Worker ``worker_id``'s free slots, sorted."""
        with self._dispatcher.lock:
            return self._dispatcher.slots.free_slots(worker_id)

    def load(self, index: int, epoch: int = 0) -> Any:
        """Returns ``source[index]`` made by a worker that saw ``set_epoch(epoch)``.

        Thread-safe and blocking; the GIL is released while waiting.

        Raises:
            kerasfeed.ItemError: ``source[index]`` raised in the worker.
            kerasfeed.WorkerError: a worker died, failed to start or timed out.
        """
        return self._dispatcher.load(index, epoch)

    def ready(self, index: int, epoch: int) -> bool:
        """Whether ``load(index, epoch)`` would return (or raise) without waiting."""
        return self._dispatcher.ready(index, epoch)

    def activity(self) -> tuple[int, int]:
        """``(loads started, loads in progress)``, for parking."""
        d = self._dispatcher
        return d.loads, d.loading

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        """Closes the pool unless a load started or ran since ``activity``; see ``Dispatcher.park``."""
        return self._dispatcher.park(activity)

    @property
    def parked(self) -> bool:
        """Closed by ``park`` (not by a failure or ``close``)."""
        return self._dispatcher.parked

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
        # ``indices`` may be a lazy IndexView: the plan reads it a window at a time.
        if next_pass is not None:
            next_pass = (int(next_pass[0]), next_pass[1])
        # A pass boundary: whatever changed in the source since the workers'
        # copy reaches them before any item of this pass (TypeError if it
        # cannot be pickled); items made ahead from the old copy are dropped.
        state = None
        if self._state is not None:
            self._dispatcher.check_usable()
            state, _ = self._state.check()
        self._dispatcher.start_plan(int(epoch), indices, next_pass, state=state)
        replacements = self._dispatcher.replacements
        if state is not None and replacements.wants_rebase():
            # Here the source is what the workers hold: a successor's new start
            # (NOTE [ Replacing a worker ]).
            replacements.rebase(dumps_for_workers(self._state.source, self.options.worker_init), int(epoch))

    def before_hook(self, name: str) -> None:
        """The consumer is about to run the source's pass hook ``name`` (see
        ``Executor.before_hook``); what it changes reaches the workers at the
        next ``plan``."""
        if self._state is not None:
            self._state.before_hook(name)

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
        label = name or f"{getattr(fn, '__qualname__', type(fn).__name__)}({short_repr(arg)})"
        payload = dumps_task(fn, arg, label)
        lane, session = self._dispatcher.streams.start(payload, label)
        return StreamIterator(self, self._dispatcher.streams, lane, session)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Blocks until every worker has started (source unpickled, ``worker_init`` run)."""
        self._dispatcher.wait_ready(timeout)

    def stats(self) -> dict:
        """Start-up time, memory, transport and consumer-side cost of the pool.

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
        out = _stats(self._dispatcher)
        out.update(self.counts.as_dict(_POOL_COUNTS))
        if self._state is not None:
            out["state"] = {"mode": self._state.mode, "syncs": self._state.syncs, "sent_bytes": self._state.sent_bytes}
        return out

    def observe(self, collector: Any) -> None:
        """Sends each item's make time, as the worker timed it, to
        ``collector`` (a ``kerasfeed.observe.stats.StatsCollector``)."""
        self._dispatcher.stats = collector

    def gauges(self) -> dict:
        """Figures of this instant, cheap enough to poll: ``ahead`` (items made
        for the plan and not taken yet), ``in_flight`` (requested, not
        answered), ``shm_bytes``, per worker ``id``, ``pid``, ``alive``,
        ``rss_mb``, and the counts of ``RetryCounts``."""
        return dict(_gauges(self._dispatcher), **self.counts.as_dict(_POOL_COUNTS))

    def close(self) -> None:
        """Stops the workers and frees the shared memory. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._dispatcher.closed

    def __reduce__(self):
        raise TypeError("kerasfeed: a WorkerPool cannot be pickled (it owns processes).")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<WorkerPool {self.name!r} workers={self.num_workers} {state}>"


# What a pool counts (threads count ``abandoned_threads`` instead).
_POOL_COUNTS = ("retried_items", "requeued_items", "failed_items", "replaced_workers", "recycled_workers")


def _gauges(d: Dispatcher) -> dict:
    # See WorkerPool.gauges. RSS from /proc/<pid>/statm (memory_info), not the
    # slower smaps walk stats() does for USS.
    import psutil

    workers = []
    for lane in d.lanes:
        w = lane.process
        alive = w.proc.poll() is None
        rss = None
        if alive:
            try:
                rss = psutil.Process(w.pid).memory_info().rss / 2**20
            except (psutil.Error, OSError):
                pass
        workers.append({"id": w.id, "pid": w.pid, "alive": alive, "rss_mb": rss})
    counts = d.request_counts()
    with d.lock:
        d.slots.collect_returned()
        shm_bytes = d.slots.shm_bytes()
    return {"ahead": counts.waiting, "in_flight": counts.pending, "shm_bytes": shm_bytes, "workers": workers}


def _stats(d: Dispatcher) -> dict:
    # See WorkerPool.stats.
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        psutil = None
    workers = []
    for lane in d.lanes:
        w = lane.process
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
    with d.lock:
        d.slots.collect_returned()
        shm_bytes = d.slots.shm_bytes()
        lent_bytes = d.slots.lent_bytes
        lent_items = d.slots.lent_items
    items = d.items
    return {
        "workers": len(d.lanes),
        "start_method": "spawn (fresh interpreter via subprocess)",
        "in_flight_limit": len(d.lanes) * d.in_flight_per_worker,
        "startup_s": max(startups) if len(startups) == len(workers) else None,
        "rss_mb_per_worker": sum(rss) / len(rss) if rss else None,
        "uss_mb_per_worker": sum(uss) / len(uss) if uss else None,
        "items": items,
        "consumer_us_per_item": (d.consumer_cpu_s + sum(lane.process.reader_cpu_s for lane in d.lanes)) / items * 1e6
        if items
        else None,
        "shm_bytes": shm_bytes,
        "lent_bytes": lent_bytes,
        "lent_items": lent_items,
        "per_worker": workers,
    }
