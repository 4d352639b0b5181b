"""``executor="ray"``: ``source[i]`` runs on Ray actors, anywhere in a Ray cluster.

The ``Executor`` seam (``execution/base.py``) as the worker processes serve it
(``processes/executor.py``), with the parts split by concern:

- ``options.py``  ``RayOptions``: the arguments, checked before Ray is touched
- ``cluster.py``  which cluster, starting Ray on 127.0.0.1, letting go of it
- ``actor.py``    ``FeedActor``: the actor side (source, seeds, epoch state)
- ``pool.py``     the actors: placing, starting, replacing a lost one, killing
- ``window.py``   the pass requested ahead, in order, bounded in count and bytes
- ``loads.py``    one load: waiting in slices, a lost actor, timeouts, retries
- this module     the seam: passes, state, parking, stats, close
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

from kerasfeed.errors import WorkerError
from kerasfeed.execution.base import Executor
from kerasfeed.execution.cached_items import ItemCache
from kerasfeed.execution.parking import ParkWatch
from kerasfeed.execution.pickling import dumps_for_workers
from kerasfeed.execution.ray import cluster
from kerasfeed.execution.ray.loads import LoadsMixin
from kerasfeed.execution.ray.options import (
    DEFAULT_BYTES_AHEAD,
    DEFAULT_START_TIMEOUT_S,
    RayOptions,
    workers_for,
)
from kerasfeed.execution.ray.pool import ActorPool
from kerasfeed.execution.ray.window import Window
from kerasfeed.execution.retries import RetryCounts
from kerasfeed.execution.state_sync import StateTracker
from kerasfeed.execution.waits import WaitScope
from kerasfeed.sources.base import source_length, source_name

# State changes sent since the source was last shipped whole, past which a replacement gets the source as it is now.
_REBASE_BYTES = 2**20
_COUNTS = ("retried_items", "requeued_items", "failed_items", "replaced_workers")


class _Held:
    """What a finalizer must release without the executor: the pool and the lease on the Ray connection."""

    def __init__(self, lease: Any):
        self.lease = lease
        self.pool: Optional[ActorPool] = None

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()
        self.lease.release()


class RayExecutor(LoadsMixin, Executor):
    """Runs ``source[index]`` on Ray actors: on other machines' CPUs too.

    Use it when one host's CPUs cannot make the batches as fast as the model
    takes them (heavy Python decoding, point clouds, simulations); all else is
    as with worker processes (docs/ray.md lists it). Only Ray Core is used.

    Where it runs: the cluster this process is connected to already (your
    ``ray.init(...)``, left as it is), else the one at ``address`` (or
    ``$RAY_ADDRESS``), else a Ray instance started here on 127.0.0.1 and
    stopped when the last ``RayExecutor`` closes. The source is pickled once
    (cloudpickle) into the object store; each actor unpickles it once.
    Items come back through the object store as read-only arrays
    (NOTE [ Items from the object store are read-only ]). A lost actor or
    node is replaced and its items are made elsewhere, each reaching the
    consumer once, in order
    (NOTE [ A lost worker is replaced, and its items are made elsewhere ]).
    The actors are killed on ``close()``, when the executor (or what holds
    it) is garbage collected, after a failed pass is left
    (NOTE [ Parking after a failed pass ]), and at interpreter exit.

    Security: a Ray cluster runs whatever any client that reaches it sends;
    keep it on a private network (docs/ray.md).

    Args:
        source: the indexable source (sent by value, like ``ProcessExecutor``'s).
        workers: how many actors; None = as many as the cluster's available
            resources hold (CPUs / ``resources["CPU"]``), at most the source's
            items. Two executors in one process share the cluster: give the
            second (a validation set) a small ``workers``.
        address: a running cluster to connect this process to (``"host:port"``
            of its head, ``"auto"``); None = the connected one,
            ``$RAY_ADDRESS``, or a local start.
        resources: what each actor asks Ray for, e.g. ``{"CPU": 2}``,
            ``{"CPU": 1, "memory": 4 * 2**30}`` or a custom resource that only
            the data nodes have; None = ``{"CPU": 1}``.
        worker_init: run once in each actor after the source arrives.
        seed: the items' seed (``kerasfeed.item_rng()``; with a seed, the
            globals ``random``/``numpy.random`` are reseeded per item too);
            None draws one.
        in_flight_per_worker: calls queued on each actor beyond the one it makes.
        bytes_ahead: object-store bytes that items made ahead may take.
        timeout: seconds one item may take before its load fails with
            ``WorkerError`` (the stuck actor is replaced); None waits.
        retries: more attempts for an item that raised or timed out.
        start_timeout: seconds the actors may take to be placed and started
            (and a lost one's replacement, when no other is up).
        actor_options: more Ray actor options (``runtime_env``,
            ``scheduling_strategy``, ``label_selector``; default strategy "SPREAD").

    Raises:
        ConnectionError: nothing answers at ``address``.
        kerasfeed.WorkerError: the cluster has no room for the workers, or
            they did not start within ``start_timeout`` (the actor's
            traceback when the source's unpickling or ``worker_init`` raised).
        TypeError: the source or ``worker_init`` cannot be pickled.
        ModuleNotFoundError: Ray is not installed (``pip install 'kerasfeed[ray]'``).

    Example:

    ```python
    ex = kerasfeed.RayExecutor(seq, workers=8, address="10.0.0.1:6379")
    model.fit(kerasfeed.to_dataset(seq, batch_size=32, shuffle=True, seed=0, executor=ex), epochs=10)
    ```
    """

    name = "ray"
    prefetches = True
    # Actors hold their own copy and call set_epoch themselves, as worker processes do.
    plans_next_pass = True

    def __init__(
        self,
        source: Any,
        *,
        workers: Optional[int] = None,
        address: Optional[str] = None,
        resources: Optional[Mapping[str, float]] = None,
        worker_init: Optional[Callable[[], None]] = None,
        seed: Optional[int] = None,
        in_flight_per_worker: int = 2,
        bytes_ahead: int = DEFAULT_BYTES_AHEAD,
        timeout: Optional[float] = None,
        retries: int = 0,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        actor_options: Optional[Mapping[str, Any]] = None,
    ):
        source_length(source, allow_infinite=True, owner="RayExecutor")
        options = RayOptions(workers=workers, address=address, resources=resources, worker_init=worker_init,
                             seed=seed, in_flight_per_worker=in_flight_per_worker, bytes_ahead=bytes_ahead,
                             timeout=timeout, retries=retries, start_timeout=start_timeout,
                             actor_options=actor_options)  # fmt: skip
        self._start(source, options)

    @classmethod
    def from_options(cls, source: Any, pool: Any) -> "RayExecutor":
        """``executor="ray"``: the executor for ``source`` from the front end's ``PoolOptions``."""
        if getattr(pool, "recycles", False):
            raise ValueError(
                "`worker_max_items` and `worker_max_rss` recycle worker processes; executor='ray' does not recycle "
                f"its actors. Received: worker_max_items={pool.worker_max_items!r}, "
                f"worker_max_rss={pool.worker_max_rss!r}"
            )
        options = RayOptions(workers=pool.workers, worker_init=pool.worker_init, seed=pool.seed,
                             in_flight_per_worker=pool.in_flight_per_worker, timeout=pool.timeout,
                             retries=getattr(pool, "retries", 0))  # fmt: skip
        ex = cls.__new__(cls)
        # cache=: the actors run the stored stage only (they may be on other hosts; cache_front.py).
        cache = getattr(pool, "item_cache", None)
        ex._cache = None if cache is None else ItemCache(None, cache.stage_name, cache.augment).described()
        ex._start(source, options)
        return ex

    def _start(self, source: Any, options: RayOptions) -> None:
        self._source = source
        self._options = options
        self._name = source_name(source)
        self._lock = threading.RLock()
        self._closed = False
        self._parked = False
        self._collector: Any = None
        self._watch = ParkWatch(self)
        self.waits = WaitScope(options.timeout)
        self.counts = RetryCounts()
        self._loads = self._loading = 0
        self._items, self._consumer_cpu_s = 0, 0.0
        self._base_seed, self._seed_given = options.base_seed()
        self.item_seed = self._base_seed if self._seed_given else None
        self._ray = cluster.import_ray()
        self._lost = None
        payload = dumps_for_workers(source, options.worker_init, "ray")  # TypeError before any cluster is touched
        self._held = _Held(cluster.acquire(options.address))
        self._finalizer = weakref.finalize(self, self._held.close)
        cluster.register_pool(self._held)
        try:
            self._new_pool(payload)
        except BaseException:
            self._closed = True
            self._finalizer()
            raise

    def _new_pool(self, payload: Optional[bytes] = None) -> ActorPool:
        # With the lock held (or in the constructor). The source as it is now.
        if payload is None:
            payload = dumps_for_workers(self._source, self._options.worker_init, "ray")
        try:
            items = source_length(self._source, allow_infinite=True)
        except (TypeError, ValueError):
            items = None
        items = items if isinstance(items, int) else None
        self._state = StateTracker(self._source, "ray")  # what the actors' copy is (the payload's source)
        available = cluster.room(self._ray, self._options, items, self._held.lease.address, self._name)
        workers = workers_for(self._options, available, items)
        pool = ActorPool(self._ray, payload, self._options, workers, self._base_seed, self._seed_given, self._name,
                         self.counts, getattr(self, "_cache", None))  # fmt: skip
        self._held.pool = pool
        self._lost = pool.lost_errors
        try:
            pool.wait_started(self._options.start_timeout, available)
        except BaseException:
            pool.close()  # a later plan or load tries again
            raise
        self._window = Window(self._options.in_flight_per_worker + 1, self._options.bytes_ahead)
        self._parked = False
        return pool

    @property
    def source(self) -> Any:
        """The source the actors run (each holds its own copy)."""
        return self._source

    def _live_pool(self) -> ActorPool:
        # With the lock held: the pool, started again if it was parked.
        if self._closed:
            raise WorkerError(f"kerasfeed: the Ray executor of {self._name} is closed; create the dataset (or loader) "
                              "again.")
        self._check_ray()
        pool = self._held.pool
        if self._parked or pool is None or pool.closed:
            pool = self._new_pool()
        return pool

    def ready(self, index: int, epoch: int) -> bool:
        with self._lock:
            if self._closed or not self._ray.is_initialized():
                return True  # load raises at once
            window = None if self._parked else self._window
            call = None if window is None else window.peek(int(index), int(epoch))
            ref = None if call is None else call.ref
        if ref is None:
            return False
        done, _ = self._ray.wait([ref], timeout=0)
        return bool(done)

    # ------------------------------------------------------------ passes
    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        epoch = int(epoch)
        self._watch.pass_started(epoch)  # the consumer goes on
        if next_pass is not None:
            next_pass = (int(next_pass[0]), next_pass[1])
        with self._lock:
            pool = self._live_pool()
            # What the hooks changed reaches every actor before any call of this pass (TypeError if it cannot be
            # pickled); calls made ahead from the old state are dropped.
            payload, _ = self._state.check()
            if payload is not None:
                self._window.drop_all(pool)
                pool.broadcast(epoch, payload)
                if pool.states_bytes > max(pool.payload_bytes, _REBASE_BYTES):
                    pool.rebase(dumps_for_workers(self._source, self._options.worker_init, "ray"),
                                self._state.outside_since_start())
            self._window.start(epoch, indices, next_pass, pool)
            self._window.fill(pool)

    def before_hook(self, name: str) -> None:
        with self._lock:
            state = self._state
        state.before_hook(name)

    def after_hook(self, name: str) -> None:
        with self._lock:
            state = self._state
        state.after_hook(name)

    def pass_failed(self, epoch: int) -> None:
        self._watch.arm(int(epoch))

    # item_skipped: Executor's no-op (lost or stuck actors are replaced as the pass goes: nothing to start again).

    def activity(self) -> tuple[int, int]:
        with self._lock:
            return self._loads, self._loading

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        """Kills the actors (their CPUs go back to the cluster) until the next ``plan`` or ``load`` starts new
        ones; only if ``activity`` is still the same."""
        with self._lock:
            if self._closed or self._parked:
                return True
            if activity is not None and tuple(activity) != (self._loads, self._loading):
                return False
            pool = self._held.pool
            self._window.drop_all(pool)
            pool.close()
            self._parked = True
        return True

    def parallel_calls(self) -> int:
        return self.workers * self._options.in_flight_per_worker

    @property
    def workers(self) -> int:
        pool = self._held.pool
        return len(pool.lanes) if pool is not None else 0

    # ------------------------------------------------------------ stats
    def attach_stats(self, collector: Any) -> None:
        super().attach_stats(collector)
        self._collector = collector

    def gauges(self) -> dict:
        """``ahead`` (made, not taken), ``in_flight`` (requested, not made), ``bytes_ahead`` (from the largest
        item), ``workers`` (per actor: ``id``, ``alive``, ``pid``, ``node_id``) and the retry counts."""
        with self._lock:
            pool = self._held.pool
            if self._parked or pool is None or pool.closed or not self._ray.is_initialized():
                return dict(ahead=0, in_flight=0, bytes_ahead=0, workers=[], **self.counts.as_dict(_COUNTS))
            pool.refresh()
            refs = [c.ref for c in self._window.pending() if c.ref is not None]
            workers = [{k: w[k] for k in ("id", "alive", "pid", "node_id")} for w in pool.workers_info()]
            item_bytes = self._window.item_bytes
        done = len(self._ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) if refs else 0
        return dict(ahead=done, in_flight=len(refs) - done, bytes_ahead=done * item_bytes, workers=workers,
                    **self.counts.as_dict(_COUNTS))  # fmt: skip

    def stats(self) -> dict:
        """``workers``, ``startup_s`` (slowest actor), ``items``, ``consumer_us_per_item`` (CPU of this
        process per item: the waits and the mapping out of the object store), ``in_flight_limit``,
        ``per_worker`` (pid, node, host, state, start-up, RSS at start), ``state`` (how the epoch state
        reaches the actors), ``cluster`` (address, and whether kerasfeed started or connected it) and the
        retry counts."""
        with self._lock:
            pool = self._held.pool
            if pool is not None:
                pool.refresh()  # replacements that came up since the last load
            per_worker = pool.workers_info() if pool is not None else []
            state = self._state
            items, cpu = self._items, self._consumer_cpu_s
        startups = [w["startup_s"] for w in per_worker if w["startup_s"] is not None]
        out = {
            "workers": len(per_worker),
            "startup_s": max(startups) if startups and len(startups) == len(per_worker) else None,
            "items": items,
            "consumer_us_per_item": cpu / items * 1e6 if items else None,
            "in_flight_limit": len(per_worker) * (self._options.in_flight_per_worker + 1),
            "per_worker": per_worker,
            "cluster": {"address": self._held.lease.address, "owner": self._held.lease.owner},
            "state": {"mode": state.mode, "syncs": state.syncs, "sent_bytes": state.sent_bytes},
        }
        out.update(self.counts.as_dict(_COUNTS))
        return out

    # ------------------------------------------------------------ close
    def close(self) -> None:
        """Kills the actors, and stops (or disconnects) Ray if kerasfeed started (or connected) it and no
        other executor uses it. Idempotent."""
        with self._lock:
            self._closed = True
            pool, window = self._held.pool, getattr(self, "_window", None)
            if pool is not None and window is not None:
                window.drop_all(pool)  # no ObjectRef outlives the close
        self._watch.disarm()
        self._finalizer()
        if self._collector is not None:  # TensorFlow may keep the closed dataset: see ThreadExecutor.close
            self._collector.compact()

    def __reduce__(self):
        raise TypeError("kerasfeed: a RayExecutor cannot be pickled (it owns Ray actors).")

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<RayExecutor name={self.name!r} workers={self.workers} address={self._held.lease.address!r}{why}>"


__all__ = ["RayExecutor"]
