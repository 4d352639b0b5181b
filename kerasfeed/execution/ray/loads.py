"""One item's load on Ray: waiting for its call in slices, a lost actor, a timeout, retries.

``LoadsMixin`` is the part of ``RayExecutor`` that ``load`` runs (the rest is in
``executor.py``). It uses the executor's ``_lock`` (around every touch of the
pool and the window), ``_ray``, ``_lost`` (the pool's ``lost_errors``),
``_name``, ``_options``, ``counts``, ``waits``, ``_collector``, ``_window``,
``_loads``/``_loading``/``_items``/``_consumer_cpu_s`` and ``_live_pool()``.

NOTE [ Items from the object store are read-only ]
==================================================

An item comes back as its actor call's return value. ``ray.get`` maps the
arrays out of the node's shared-memory object store without a copy (items
from other nodes are pulled into it first), and numpy marks them read-only
(the object may be shared). kerasfeed hands them on as they are, like the
worker processes' lent shared memory: ``to_dataset`` wraps them in tensors,
``to_loader`` with ``batch_size=n`` copies the samples into its batch
anyway, and with ``batch_size=None`` (items are batches) the batch's arrays
are the read-only views (but a pass's last item, which the pass pipeline
copies before ``on_epoch_end`` runs); ``to_loader(copy=True)`` hands over
writable copies. Ray keeps the object pinned while a view lives.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from kerasfeed.errors import ItemError, WorkerError
from kerasfeed.execution.base import item_position
from kerasfeed.execution.ray.actor import Failed
from kerasfeed.execution.ray.options import MAX_LOSSES_PER_ITEM
from kerasfeed.execution.ray.pool import ActorPool, Call
from kerasfeed.execution.retries import Attempts

# A wait for an item looks at Ctrl-C, the consumer, timeouts and lost workers this often.
_SLICE_S = 0.1


class _Closed(Exception):
    """The pool a load waits on was closed (parked, or the executor closed)."""


def _nbytes(item: Any) -> int:
    nbytes = getattr(item, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(x) for x in item)
    if isinstance(item, dict):
        return sum(_nbytes(x) for x in item.values())
    return 0


class LoadsMixin:
    """``load`` and the waits under it (see the module docstring)."""

    def _check_ray(self) -> None:
        # Ray's API calls ray.init() itself when Ray is not running: a load after ray.shutdown() would start one.
        if not self._ray.is_initialized():
            raise WorkerError(
                f"kerasfeed: Ray was shut down (ray.shutdown()) while the Ray executor of {self._name} was in use; "
                f"create the dataset again. Received: ray.is_initialized()=False"
            )

    def load(self, index: int, epoch: int) -> Any:
        index, epoch = item_position("RayExecutor", "index", index), item_position("RayExecutor", "epoch", epoch)
        t0 = time.thread_time()
        with self._lock:
            pool = self._live_pool()
            self._loads += 1
            self._loading += 1
        try:
            for _ in range(3):  # a pool parked under this load: once more on the new one
                try:
                    return self._load(pool, index, epoch, t0)
                except _Closed:
                    with self._lock:
                        pool = self._live_pool()  # raises if the executor itself was closed
            raise WorkerError(f"kerasfeed: the Ray workers of {self._name} kept closing. Received: index={index}")
        finally:
            with self._lock:
                self._loading -= 1

    def _load(self, pool: ActorPool, index: int, epoch: int, t0: float) -> Any:
        with self._lock:
            call = self._window.take(index, epoch)
            if call is None:
                call = Call(index, epoch)
                pool.send(call)
            self._window.fill(pool)
        attempts: Optional[Attempts] = None
        while True:
            try:
                return self._result(pool, call, t0)
            except (ItemError, WorkerError) as err:
                attempts = attempts or Attempts(index, self._options.retries)
                if not attempts.again(err):
                    self.counts.add("failed_items")
                    raise attempts.final(err) from None
                # As the processes executor counts (dispatcher.py): a call's own errors name its index here,
                # so this is an attempt; an error naming another item would be a requeue.
                self.counts.add("retried_items" if attempts.counts(err) else "requeued_items")
                with self._lock:
                    call = Call(index, epoch)
                    pool.send(call)
            except BaseException:  # Ctrl-C, the iterator deleted, the pool closed: the call is nobody's now
                with self._lock:
                    pool.done(call)
                raise

    def _result(self, pool: ActorPool, call: Call, t0: float) -> Any:
        """Waits for ``call`` (in slices) and returns its item."""
        ray, wait, first = self._ray, None, True
        since = time.monotonic()
        while True:
            with self._lock:
                if pool.closed:
                    raise _Closed()
                self._check_ray()
                if call.ref is None:  # no lane was up when it was sent
                    pool.poll()
                    pool.send(call)
                ref, lane, generation = call.ref, call.lane, call.generation
            if ref is not None:
                done, _ = ray.wait([ref], timeout=0 if first else _SLICE_S)
                if done:
                    try:
                        value = ray.get(ref)
                    except self._lost as e:
                        self._moved(pool, call, lane, generation, e)
                        continue
                    except ray.exceptions.RayError as e:
                        with self._lock:
                            pool.done(call)
                        raise WorkerError(
                            f"kerasfeed: Ray could not return {self._name}[{call.index}] from worker "
                            f"{lane.id if lane else '?'}: {type(e).__name__}: {e}",
                            worker_id=lane.id if lane else None,
                            index=call.index,
                        ) from e
                    with self._lock:
                        pool.done(call)
                    del ref
                    return self._unpack(value, lane, t0)
            first = False
            if wait is None:
                wait = self.waits.begin()
            wait.check(lambda: f"{self._name}[{call.index}] (Ray worker {lane.id if lane else '?'})")
            with self._lock:
                if pool.closed:
                    raise _Closed()
                pool.poll()
            self._check_timeout(pool, call, ref, lane, generation, since)

    def _moved(self, pool: ActorPool, call: Call, lane: Any, generation: int, err: BaseException) -> None:
        """``call``'s actor (or its result) was lost: the lane's calls go elsewhere."""
        why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        with self._lock:
            if pool.closed:
                raise _Closed()
            if call.lane is lane and call.generation == generation:
                if lane is not None and lane.generation == generation and lane.calls.get(call, 1) is None:
                    pool.lost(lane, generation, why)  # moves this call too
                else:  # the actor lives on, only the result is gone (its node's store): this call again
                    pool.done(call)
                    call.losses += 1
                    self.counts.add("requeued_items")
                    pool.send(call)
            if call.losses >= MAX_LOSSES_PER_ITEM:
                pool.done(call)
                raise WorkerError(
                    f"kerasfeed: {self._name}[{call.index}] lost its Ray worker {call.losses} times ({why}); a source "
                    "that kills its process on this item would kill every worker in turn, so the item fails. "
                    f"Received: index={call.index}",
                    worker_id=lane.id if lane is not None else None,
                    index=call.index,
                )

    def _check_timeout(self, pool: ActorPool, call: Call, ref: Any, lane: Any, generation: int, since: float) -> None:
        timeout = self._options.timeout
        if timeout is None or ref is None:
            return
        with self._lock:
            if call.ref is not ref:  # moved meanwhile: its clock starts again
                return
            # From when its actor is ready to run it, as the processes executor counts.
            running = pool.running_since(call)
            if running is None:
                self._stop_stuck_ahead(pool, call, lane, generation, timeout)
                return
            if time.monotonic() - max(since, running) <= timeout:
                return
            pid = lane.info.get("pid") if lane is not None else None
            if lane is not None:
                pool.lost(lane, generation, f"{self._name}[{call.index}] ran past timeout={timeout:g} s", keep=call)
            pool.done(call)
        raise WorkerError(
            f"kerasfeed: Ray worker {lane.id if lane else '?'} (pid {pid}) did not return {self._name}[{call.index}] "
            f"within timeout={timeout:g} s; the actor was killed and is replaced. Received: index={call.index}, "
            f"timeout={timeout}",
            worker_id=lane.id if lane is not None else None,
            pid=pid,
            index=call.index,
        )

    def _stop_stuck_ahead(self, pool: ActorPool, call: Call, lane: Any, generation: int, timeout: float) -> None:
        # With the lock held. ``call`` waits behind an item made ahead on its actor (a retry sent after it)
        # that nobody waits for yet: past the timeout that actor is stuck; replaced, ``call`` moves on.
        ahead = pool.running_ahead(call)
        started = pool.running_since(ahead) if ahead is not None else None
        if started is not None and time.monotonic() - started > timeout and lane is not None:
            pool.lost(lane, generation, f"{self._name}[{ahead.index}], made ahead, ran past timeout={timeout:g} s")

    def _unpack(self, value: Any, lane: Any, t0: float) -> Any:
        if isinstance(value, Failed):
            raise value.error
        item, make_s = value
        nbytes = _nbytes(item)
        stats = self._collector
        if stats is not None:
            stats.made(make_s, lane.id if lane is not None else None, time.perf_counter())
        with self._lock:
            self._window.saw(nbytes)
            self._items += 1
            self._consumer_cpu_s += time.thread_time() - t0
        return item


__all__ = ["LoadsMixin"]
