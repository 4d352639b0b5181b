"""The actors of one ``RayExecutor``: placing them, starting them, replacing a lost one, killing them all.

Each worker is a *lane* (``Lane``): worker id ``k`` (what ``get_worker_info()``
says), the actor serving it now, and the calls sent to it and not finished
by their load, an ordered queue (a plain actor runs its calls one at a time,
in the order sent).

NOTE [ A lost worker is replaced, and its items are made elsewhere ]
====================================================================

Actors are created with ``max_restarts=0`` and ``max_task_retries=0``: Ray's
own restart would run ``__init__`` again with the first start's arguments
(the source before the epoch hooks changed it), and its task retries wait,
unbounded, for a restart that may never be placed (the node that held the
CPU is gone). Instead:

- **The calls move.** The first load that sees the actor's death (its call
  raises ``RayActorError``, or the item's object is lost with its node)
  marks the lane lost (``lost``): its calls are sent again, in order, to the
  live lanes, and their loads wait for the new calls. The consumer still
  takes the items in the pass's order, so each item reaches it once. A
  result the lost actor made already stays when it can still be had (small
  ones live with the consumer, large ones in the store of a node that is up:
  a stuck actor's); one in the store of a node that went is made again when
  its load finds it gone.
- **The lane gets a new actor** with the same worker id and the source as
  first sent plus every state change since (``states``), so it computes what
  the others compute. It may not be placeable at once (its node's CPU went
  with the node); the pool goes on with the lanes it has. If no lane is up
  and none comes up within ``start_timeout``, loads fail with
  ``WorkerError`` instead of waiting.
- **Bounded.** An item whose call was lost ``MAX_LOSSES_PER_ITEM`` times
  fails with ``WorkerError`` (a source that kills its process on one item
  would otherwise kill every actor in turn); ``retries=`` then applies.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Optional

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import light_modules
from kerasfeed.execution.ray.actor import FeedActor
from kerasfeed.execution.ray.options import RayOptions

STARTING, UP, LOST = "starting", "up", "lost"  # lane states
_ACTOR_CLASSES: dict = {}  # id(ray module) -> ray.remote(FeedActor)
_INLINE_BYTES = 100 * 2**10  # Ray's own limit for arguments sent inline with a call


def actor_class(ray: Any) -> Any:
    cls = _ACTOR_CLASSES.get(id(ray))
    if cls is None:
        cls = _ACTOR_CLASSES[id(ray)] = ray.remote(FeedActor)
    return cls


def lost_errors(ray: Any) -> tuple:
    """Ray's errors that mean the call's actor, node or result is gone (not the item's fault)."""
    ex = ray.exceptions
    names = ("RayActorError", "ObjectLostError", "WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError")
    return tuple(getattr(ex, n) for n in names if hasattr(ex, n))


class Call:
    """One ``source[index]`` request of pass ``epoch`` and where it is now."""

    __slots__ = ("index", "epoch", "ref", "lane", "generation", "losses", "run_from")

    def __init__(self, index: int, epoch: int):
        self.index = index
        self.epoch = epoch
        self.ref: Any = None  # None: waits for a lane that is up
        self.lane: Optional["Lane"] = None
        self.generation = -1
        self.losses = 0
        self.run_from: Optional[float] = None  # when it was seen running (pool.running_since)


class Lane:
    """Worker ``id``: its actor now and the calls on it (in the order sent)."""

    __slots__ = ("id", "actor", "generation", "state", "ready_ref", "info", "since", "calls", "why")

    def __init__(self, wid: int):
        self.id = wid
        self.actor: Any = None
        self.generation = -1
        self.state = STARTING
        self.ready_ref: Any = None
        self.info: dict = {}
        self.since = 0.0
        self.calls: dict[Call, None] = {}  # insertion-ordered set
        self.why = ""  # why the last actor was lost

    @property
    def busy(self) -> int:
        return len(self.calls)


class ActorPool:
    """The lanes of one executor (not thread-safe: the executor holds its lock around every call).

    Args:
        ray: the ``ray`` module.
        payload: ``dumps_for_workers(source, worker_init)``.
        options: the executor's ``RayOptions``.
        workers: how many lanes.
        base_seed, seed_given: the items' seeds (``sources/item_random.py``).
        name: the source's name, for messages.
        counts: the executor's ``RetryCounts``.
        cache: with cache=, what the actors' item calls run (``ItemCache.described()``), else None.
    """

    def __init__(self, ray: Any, payload: bytes, options: RayOptions, workers: int, base_seed: int,
                 seed_given: bool, name: str, counts: Any, cache: Optional[dict] = None):  # fmt: skip
        self.ray = ray
        self.options = options
        self.name = name
        self.counts = counts
        self.tag = uuid.uuid4().hex[:12]
        self.payload_ref = ray.put(payload)  # shipped once; every actor's __init__ reads it
        self.payload_bytes = len(payload)
        self.states: list[bytes] = []  # sent since payload (a replacement applies them)
        self.states_bytes = 0
        self.config = {"num_workers": workers, "base_seed": base_seed, "seed_given": seed_given,
                       "sys_path": list(sys.path), "cache": cache,
                       "light": light_modules.stand_ins_fit()}  # fmt: skip
        self.lanes = [Lane(k) for k in range(workers)]
        self.lost_errors = lost_errors(ray)
        self.closed = False
        self._pid = os.getpid()  # a forked copy never kills the actors (they are the parent's)
        try:
            for lane in self.lanes:
                self._start(lane)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ actors
    def _start(self, lane: Lane) -> None:
        lane.generation += 1
        opts = dict(self.options.ray_actor_options())
        opts.setdefault("scheduling_strategy", "SPREAD")
        opts.update(self.options.actor_options)
        opts.update(name=f"kerasfeed-{self.tag}-w{lane.id}.{lane.generation}", max_restarts=0, max_task_retries=0,
                    max_concurrency=1)  # fmt: skip
        config = dict(self.config, worker_id=lane.id)
        lane.actor = actor_class(self.ray).options(**opts).remote(self.payload_ref, config, list(self.states))
        lane.ready_ref = lane.actor.ready.remote()
        lane.state, lane.info, lane.since = STARTING, {}, time.monotonic()

    def _kill(self, lane: Lane) -> None:
        actor, lane.actor, lane.ready_ref = lane.actor, None, None
        # No Ray call once Ray is shut down (at exit, the user's ray.shutdown()): it would start a new local instance.
        if actor is not None and self.ray.is_initialized():
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - dead already, or Ray shut down
                pass

    def _started(self, lane: Lane, info: dict) -> None:
        error = info.get("error")
        if error is not None:
            exc_type, message, tb = error
            raise WorkerError(
                f"kerasfeed: Ray worker {lane.id} (pid {info.get('pid')}, node {str(info.get('node_id'))[:12]}) could "
                f"not start: {exc_type}: {message}\nOriginal traceback:\n{tb.rstrip()}",
                worker_id=lane.id,
                pid=info.get("pid"),
            )
        lane.state, lane.info, lane.ready_ref = UP, info, None

    def wait_started(self, timeout: float, available: Optional[dict] = None) -> None:
        """Blocks until every lane's actor is up, at most ``timeout`` seconds.

        Raises:
            WorkerError: an actor could not start (the source's unpickling or
                ``worker_init`` raised: its traceback), or not all were up in time.
        """
        pending = {lane.ready_ref: lane for lane in self.lanes if lane.state == STARTING}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=min(left, 0.5))
            for ref in done:
                lane = pending.pop(ref)
                try:
                    info = self.ray.get(ref)
                except self.lost_errors as e:
                    raise WorkerError(
                        f"kerasfeed: Ray worker {lane.id} of {self.name} died while starting: {type(e).__name__}: "
                        f"{_first_line(e)}. Received: worker_id={lane.id}",
                        worker_id=lane.id,
                    ) from e
                self._started(lane, info)
        if pending:
            raise WorkerError(
                f"kerasfeed: only {self.up()} of {len(self.lanes)} Ray workers of {self.name} started within "
                f"start_timeout={timeout:g} s: the cluster cannot place the others (each asks for "
                f"{self.options.resources}; available when they were asked for: {_resources_text(available)}), or "
                f"they start slowly. Use fewer workers, smaller `resources`, add nodes, or raise `start_timeout`. "
                f"Received: workers={len(self.lanes)}, resources={self.options.resources}"
            )

    def poll(self) -> None:
        """``refresh``, and raises ``WorkerError`` when no lane is up and none came up within ``start_timeout``."""
        self.refresh()
        if self.up():
            return
        oldest = min((lane.since for lane in self.lanes), default=time.monotonic())
        if time.monotonic() - oldest > self.options.start_timeout:
            raise WorkerError(
                f"kerasfeed: no Ray worker of {self.name} is running: the lost ones ({self.lanes[0].why or 'lost'}) "
                f"were not replaced within start_timeout={self.options.start_timeout:g} s; the cluster has no room for "
                f"a worker (each asks for {self.options.resources}; available now: "
                f"{_resources_text(self.available())}). Received: workers={len(self.lanes)}"
            )

    def refresh(self) -> None:
        """Lanes whose new actor came up since are used from now on."""
        if self.closed or not self.ray.is_initialized():
            return
        starting = [lane for lane in self.lanes if lane.state == STARTING and lane.ready_ref is not None]
        if starting:
            done, _ = self.ray.wait([lane.ready_ref for lane in starting], num_returns=len(starting), timeout=0)
            done_set = set(done)
            for lane in starting:
                if lane.ready_ref in done_set:
                    try:
                        self._started(lane, self.ray.get(lane.ready_ref))
                    except self.lost_errors as e:  # its node went too: try again
                        self._replace(lane, f"{type(e).__name__} while starting")

    def available(self) -> Optional[dict]:
        try:
            return dict(self.ray.available_resources())
        except Exception:  # noqa: BLE001 - informative only
            return None

    # ------------------------------------------------------------ calls
    def pick(self, cap: Optional[int] = None) -> Optional[Lane]:
        """The up lane with the fewest calls (below ``cap`` if given), or None."""
        best = None
        for lane in self.lanes:
            if lane.state == UP and (cap is None or lane.busy < cap) and (best is None or lane.busy < best.busy):
                best = lane
        return best

    def send(self, call: Call, lane: Optional[Lane] = None) -> bool:
        """Sends ``call`` to ``lane`` (default: the least busy up lane); False when none is up (``call.ref`` None)."""
        lane = lane or self.pick()
        if lane is None:
            call.ref, call.lane = None, None
            return False
        call.ref = lane.actor.load.remote(call.index, call.epoch)
        call.lane, call.generation, call.run_from = lane, lane.generation, None
        lane.calls[call] = None
        return True

    def running_since(self, call: Call) -> Optional[float]:
        """When ``call`` was first seen running on its actor (None: not yet). An actor runs its calls in the
        order sent, so a call runs once every call sent to its lane before it has a result: a call sent
        again (a lost actor's, a retry) waits behind the lane's later items, and its timeout must not."""
        if call.run_from is None and call.lane is not None:
            ahead = []
            for other in call.lane.calls:
                if other is call:
                    break
                if other.ref is not None:
                    ahead.append(other.ref)
            if ahead:
                done, _ = self.ray.wait(ahead, num_returns=len(ahead), timeout=0, fetch_local=False)
            if not ahead or len(done) == len(ahead):
                call.run_from = time.monotonic()
        return call.run_from

    def running_ahead(self, call: Call) -> Optional[Call]:
        """The call ``call``'s actor runs now, sent before it (None: none, or ``call`` runs)."""
        for other in list(call.lane.calls) if call.lane is not None else ():
            if other is call:
                return None
            if other.ref is not None and not self.ray.wait([other.ref], timeout=0, fetch_local=False)[0]:
                return other
        return None

    def done(self, call: Call) -> None:
        """``call`` is finished with (its result taken, or dropped)."""
        lane = call.lane
        if lane is not None:
            lane.calls.pop(call, None)
        call.ref, call.lane = None, None

    def lost(self, lane: Lane, generation: int, why: str, keep: Optional[Call] = None) -> None:
        """The actor of ``lane`` (``generation``; not if replaced already) is
        gone or stuck: it is killed and replaced, and its calls (but ``keep``)
        whose results cannot be had now are sent again elsewhere (each one's
        ``losses`` counted)."""
        if lane.generation != generation or lane.state == LOST or self.closed:
            return
        moved = [c for c in lane.calls if c is not keep and not self._reachable(c)]
        lane.calls.clear()
        if keep is not None:
            keep.ref, keep.lane = None, None
        self._replace(lane, why)
        for call in moved:
            call.losses += 1
            self.send(call)
        self.counts.add("requeued_items", len(moved))

    def _reachable(self, call: Call) -> bool:
        """``call``'s result is made and can be had now (not an error)."""
        if call.ref is None:
            return False
        try:
            done, _ = self.ray.wait([call.ref], timeout=0, fetch_local=False)
            if not done:
                return False
            self.ray.get(call.ref, timeout=0)
            return True
        except Exception:  # noqa: BLE001 - the actor's death, a lost object, not local yet: make it again
            return False

    def _replace(self, lane: Lane, why: str) -> None:
        lane.state, lane.why = LOST, why
        self._kill(lane)
        self.counts.add("replaced_workers")
        self._start(lane)

    # ------------------------------------------------------------ state
    def broadcast(self, epoch: int, payload: bytes) -> None:
        """Every actor applies ``payload`` before its next calls (they run in order)."""
        self.states.append(payload)
        self.states_bytes += len(payload)
        # A large change goes into the object store once, not per actor (a top-level ObjectRef arrives as its value).
        arg = self.ray.put(payload) if len(payload) > _INLINE_BYTES else payload
        for lane in self.lanes:
            if lane.actor is not None:
                lane.actor.set_state.remote(epoch, arg)

    def rebase(self, payload: bytes, outside: bytes) -> None:
        """The source as it is now replaces the first payload and the changes since (for replacements);
        ``outside``: the class attributes and module globals changed since the start, which the source's
        pickle does not carry for a class in a module file (``StateTracker.outside_since_start``)."""
        self.payload_ref = self.ray.put(payload)
        self.payload_bytes = len(payload)
        self.states, self.states_bytes = [outside], 0

    # ------------------------------------------------------------ info
    def up(self) -> int:
        return sum(1 for lane in self.lanes if lane.state == UP)

    def workers_info(self) -> list[dict]:
        out = []
        for lane in self.lanes:
            info = lane.info
            out.append({
                "id": lane.id,
                "alive": lane.state == UP,
                "state": lane.state,
                "pid": info.get("pid"),
                "node_id": info.get("node_id"),
                "host": info.get("host"),
                "startup_s": info.get("startup_s"),
                "ready_rss_mb": info["rss_bytes"] / 2**20 if info.get("rss_bytes") else None,
                "tensorflow_imported": info.get("tensorflow_imported"),
                "keras_imported": info.get("keras_imported"),
                "in_flight": lane.busy,
                "generation": lane.generation,
            })  # fmt: skip
        return out

    def close(self) -> None:
        """Kills every actor (idempotent; only in the process that made them)."""
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self._pid:
            return
        for lane in self.lanes:
            lane.calls.clear()
            self._kill(lane)
        self.payload_ref = None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _resources_text(available: Optional[dict]) -> str:
    if available is None:
        return "unknown"
    keys = [k for k in sorted(available) if not k.startswith("node:") and k != "object_store_memory"]
    shown = {k: (round(available[k] / 2**30, 2) if k == "memory" else available[k]) for k in keys}
    return f"{shown} (memory in GiB)" if "memory" in shown else str(shown)


__all__ = ["ActorPool", "Call", "Lane", "actor_class", "lost_errors", "STARTING", "UP", "LOST"]
