"""The Ray actor that makes items: ``source[index]`` on any node of the cluster.

The actor side of ``RayExecutor``, written to behave as ``processes/worker.py``
does: it receives the pickled source once, runs ``worker_init`` once, sets up
``get_worker_info()`` and the item seeds, applies what the consumer's epoch
hooks changed (``execution/state_sync.py``), and answers ``load(index,
epoch)`` calls one at a time, in the order sent.

This module never imports Ray: ``pool.py`` makes ``FeedActor`` an actor class
(``ray.remote(FeedActor)``) in the consumer, and nodes unpickle it by
reference, so every node needs the consumer's kerasfeed version installed.
The item goes back as the call's return value through the object store
(arrays out of band, pickle protocol 5; mapped without a copy on the
consumer's node).
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np

from kerasfeed.errors import ItemError
from kerasfeed.execution import worker_info
from kerasfeed.execution.cached_items import ItemCache
from kerasfeed.execution.source_calls import call_source
from kerasfeed.execution.state_sync import apply_state
from kerasfeed.sources import item_random
from kerasfeed.sources.base import source_name


class Failed:
    """What ``FeedActor.load`` returns when ``source[index]`` raised: the ``ItemError`` (with the
    original traceback as text), so that Ray never wraps it in its own task error."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        return (Failed, (self.error,))


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class FeedActor:
    """Makes the items of one source (one ``RayExecutor`` worker).

    Args:
        payload: ``pickling.dumps_for_workers(source, worker_init)``.
        config: ``worker_id``, ``num_workers``, ``base_seed``, ``seed_given``,
            ``sys_path`` (the consumer's import path: its entries that
            exist on this node go first, so a source's modules resolve as in
            the consumer on a single machine) and ``cache`` (with cache=:
            ``ItemCache.described()`` of a cache without a store, else None).
        states: the state changes (``StateTracker.check`` payloads) sent
            since ``payload`` was made, applied in order: a replacement starts
            from the same source as the others.

    An error while starting is reported by ``ready`` (with its traceback),
    not raised: Ray would only say that the actor died.
    """

    def __init__(self, payload: bytes, config: dict, states: list):
        t0 = time.perf_counter()
        self.id = int(config["worker_id"])
        self.pid = os.getpid()
        self.source: Any = None
        self.name = "source"
        self.epoch: Any = None
        self.state_error: Optional[BaseException] = None
        self.init_error: Optional[tuple[str, str, str]] = None
        self.seeds = item_random.ItemSeeds(config["base_seed"], given=config["seed_given"])
        # cache=: the stored stage only (no store here: the consumer stores and augments; cache_front.py).
        self.cache = ItemCache.in_worker(config.get("cache"), [])
        try:
            self._setup(payload, config, states)
        except BaseException as e:  # noqa: BLE001 - reported by ready()
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            self.init_error = (type(e).__name__, str(e), tb)
        self.startup_s = time.perf_counter() - t0

    def _setup(self, payload: bytes, config: dict, states: list) -> None:
        here = [p for p in config.get("sys_path", ()) if isinstance(p, str) and p and os.path.isdir(p)]
        sys.path[:] = here + [p for p in sys.path if p not in here]
        info = worker_info.WorkerInfo(self.id, int(config["num_workers"]), int(config["base_seed"]) + self.id)
        worker_info._set_worker_info(info)
        random.seed(info.seed)
        np.random.seed(info.seed % 2**32)
        # The light Keras/TensorFlow stand-ins while unpickling (NOTE [ Light framework stand-ins in workers ]).
        from kerasfeed.execution.processes import frameworks, light_modules

        source, worker_init = light_modules.loads(payload, config.get("light", True))
        if worker_init is not None:
            with frameworks.starting():
                worker_init()
        for change in states:
            source = apply_state(source, change)
        self.source = source
        if source is not None:
            self.name = source_name(source)

    def ready(self) -> dict:
        """How the start went: ``error`` (None, or ``(type, message, traceback)``), ``pid``, ``node_id``,
        ``host``, ``startup_s``, ``rss_bytes`` and whether TensorFlow/Keras were imported."""
        node_id = None
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - informative only
            pass
        return {
            "error": self.init_error,
            "pid": self.pid,
            "node_id": node_id,
            "host": os.uname().nodename if hasattr(os, "uname") else None,
            "startup_s": self.startup_s,
            "rss_bytes": _rss_bytes(),
            "tensorflow_imported": "tensorflow" in sys.modules,
            "keras_imported": "keras" in sys.modules,
        }

    def set_state(self, epoch: int, payload: bytes) -> None:
        """Applies what the consumer's epoch hooks changed (before any item of pass ``epoch``)."""
        try:
            self.source = apply_state(self.source, payload)
            self.state_error = None
        except BaseException as e:  # noqa: BLE001 - every later item fails with it
            self.state_error = e
        self.epoch = epoch  # the state carries the consumer's set_epoch(epoch)

    def load(self, index: int, epoch: int) -> Any:
        """``(item, seconds source[index] took)`` for item ``index`` of pass ``epoch``; ``Failed`` if it raised."""
        try:
            if self.init_error is not None:
                raise RuntimeError(f"the worker did not start: {self.init_error[0]}: {self.init_error[1]}")
            return call_source(self, index, epoch)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            return Failed(ItemError.from_exception(index, e, worker_id=self.id, pid=self.pid, source_name=self.name))


__all__ = ["FeedActor", "Failed"]
