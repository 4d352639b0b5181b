"""``RayOptions``: the arguments of ``RayExecutor``, checked once, before any cluster is touched (Ray-free)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Callable, Mapping, Optional

from kerasfeed import _validation as _v

OWNER = "RayExecutor"
# Each actor asks for one CPU by default: a cluster holds as many workers as it has CPUs, none sharing a core.
DEFAULT_RESOURCES: Mapping[str, float] = {"CPU": 1.0}
DEFAULT_BYTES_AHEAD = 256 * 2**20  # items made ahead and not taken yet, in the object store (per executor)
# Seconds the actors may take to be placed and to start (source unpickled, ``worker_init`` run).
DEFAULT_START_TIMEOUT_S = 60.0
# An item whose actor (or node) was lost this many times fails: a source killing its worker would kill every actor.
MAX_LOSSES_PER_ITEM = 3
MAX_WORKERS = 4096  # more is a typo, not a cluster (each one is a process)
# Ray's own actor options that kerasfeed sets itself: ``actor_options`` may not.
_OWN_ACTOR_OPTIONS = frozenset(
    {"name", "namespace", "lifetime", "max_restarts", "max_task_retries", "max_concurrency", "num_cpus", "num_gpus",
     "memory", "resources", "get_if_exists"}
)


def _resources(value: Any) -> dict[str, float]:
    if value is None:
        return dict(DEFAULT_RESOURCES)
    if not isinstance(value, Mapping) or not value:
        raise TypeError(
            f"{OWNER}: `resources` must be a non-empty dict of Ray resource names to amounts per worker, e.g. "
            f"{{'CPU': 1}} or {{'CPU': 2, 'memory': 2 * 2**30}}, or None for {dict(DEFAULT_RESOURCES)}. "
            f"Received: resources={value!r}"
        )
    out = {}
    for key, amount in value.items():
        ok = isinstance(amount, numbers.Real) and not isinstance(amount, bool) and math.isfinite(amount)
        if not isinstance(key, str) or not key or not ok or amount < 0:
            raise ValueError(
                f"{OWNER}: `resources` maps Ray resource names (str) to non-negative amounts per worker. "
                f"Received: resources={dict(value)!r}"
            )
        out[key] = float(amount)
    return out


def _actor_options(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{OWNER}: `actor_options` must be a dict of Ray actor options (e.g. runtime_env, "
            f"scheduling_strategy) or None. Received: actor_options={value!r}"
        )
    own = sorted(set(value) & _OWN_ACTOR_OPTIONS)
    if own:
        raise ValueError(
            f"{OWNER}: `actor_options` may not set {own}: kerasfeed sets them itself (the amounts per worker go "
            f"in `resources`). Received: actor_options={dict(value)!r}"
        )
    return dict(value)


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """The checked arguments of ``RayExecutor`` (see there for each).

    Raises:
        TypeError, ValueError: a bad value; the message names the argument and what was received.
    """

    workers: Optional[int] = None
    address: Optional[str] = None
    resources: Optional[Mapping[str, float]] = None
    worker_init: Optional[Callable[[], None]] = None
    seed: Optional[int] = None
    in_flight_per_worker: int = 2
    bytes_ahead: int = DEFAULT_BYTES_AHEAD
    timeout: Optional[float] = None
    retries: int = 0
    start_timeout: float = DEFAULT_START_TIMEOUT_S
    actor_options: Optional[Mapping[str, Any]] = None

    def __post_init__(self):
        put = object.__setattr__
        workers = _v.positive_int("workers", self.workers, allow_none=True, owner=OWNER)
        if workers is not None and workers > MAX_WORKERS:
            raise ValueError(f"{OWNER}: `workers` must be at most {MAX_WORKERS}. Received: workers={workers}")
        put(self, "workers", workers)
        address = self.address
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise TypeError(
                f"{OWNER}: `address` must be the address of a running Ray cluster ('host:port' of its head, "
                f"'auto', or 'ray://host:port') or None. Received: address={address!r}"
            )
        put(self, "address", None if address is None else address.strip())
        put(self, "resources", _resources(self.resources))
        put(self, "worker_init", _v.optional_callable("worker_init", self.worker_init, owner=OWNER))
        put(self, "seed", _v.seed("seed", self.seed, owner=OWNER))
        in_flight = _v.positive_int("in_flight_per_worker", self.in_flight_per_worker, owner=OWNER)
        put(self, "in_flight_per_worker", in_flight)
        put(self, "bytes_ahead", _v.positive_int("bytes_ahead", self.bytes_ahead, owner=OWNER))
        put(self, "timeout", _v.seconds("timeout", self.timeout, owner=OWNER))
        put(self, "retries", _v.non_negative_int("retries", self.retries, owner=OWNER))
        put(self, "start_timeout", _v.seconds("start_timeout", self.start_timeout, allow_none=False, owner=OWNER))
        put(self, "actor_options", _actor_options(self.actor_options))

    def ray_actor_options(self) -> dict:
        """The resource part of ``ActorClass.options(...)`` for one worker."""
        res = dict(self.resources)
        out: dict = {"num_cpus": res.pop("CPU", 0.0)}
        for key, option in (("GPU", "num_gpus"), ("memory", "memory")):
            if key in res:
                out[option] = res.pop(key)
        if res:
            out["resources"] = res
        return out

    def base_seed(self) -> tuple[int, bool]:
        """``(seed, given)``: the user's seed, or one drawn from the OS once."""
        if self.seed is not None:
            return self.seed, True
        return int.from_bytes(os.urandom(7), "little"), False


def workers_for(options: RayOptions, available: Mapping[str, float], items: Optional[int]) -> int:
    """How many actors to start: the ``workers`` given, or as many as the cluster's available resources
    hold (at least 1), never more than the source's items (3 batches need 3 workers at most)."""
    if options.workers is not None:
        n = options.workers
    else:
        fits = [available.get(k, 0.0) / v for k, v in options.resources.items() if v > 0 and k != "memory"]
        n = max(1, min(int(math.floor(min(fits) + 1e-9)) if fits else 1, MAX_WORKERS))
    if items is not None and items > 0:
        n = min(n, items)
    return n


__all__ = ["RayOptions", "workers_for", "DEFAULT_RESOURCES", "MAX_LOSSES_PER_ITEM"]
