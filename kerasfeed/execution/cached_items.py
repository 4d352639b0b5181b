"""One item through the item cache: ``augment(stored or load(i))`` (light: numpy and the standard library).

NOTE [ An item with cache= ]
A source may split an item in two: ``load(i)``, made once and stored, and
``augment(item)``, run on every pass after the store (fresh random
augmentation, drawing from ``kerasfeed.item_rng()``). Without ``load`` the
whole ``__getitem__`` is the stored stage and nothing runs per pass.
``ItemCache.make`` is what every executor's item call runs with ``cache=``
(pool threads: ``thread_tasks.Runner``; worker processes and Ray actors:
``source_calls.call_source``):

1. the stored item when the store holds it (read-only views, no copy);
2. else the stage, under ``sources/stage.enter_cached`` (``item_rng()`` and
   ``epoch`` refuse to run there: NOTE [ What a cached stage may not read ])
   and with the global generators watched (a draw from them is warned about
   once: its numbers would be frozen; not in a call that imported a module,
   which may draw at import), then stored (unless the store is full:
   NOTE [ A budget keeps a fixed subset ] in ``cache_front.py``);
3. ``augment`` on it, when the source has one. ``augment`` always gets
   read-only arrays (stored or not), so one that writes in place fails on the
   first item rather than on the first hit. A stored item is handed on as the
   store's views from the pass that stores it: a source that reuses its
   buffers overwrites its own arrays, not what the pass reads.

A worker process sends an item without ``augment`` that the store holds as
``IN_STORE`` (``handed_over_stored``): nothing is written to its slot and the
consumer reads the store, so a first pass with cache= writes each item once,
as one without it does (into the store instead of a slot).

A Ray actor has no store (it may run on another host): it runs the stage
only, and the consumer stores the item and augments it (``cache_front.py``).
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from kerasfeed.cache.keys import stage_of
from kerasfeed.cache.store import ItemStore
from kerasfeed.execution import worker_info
from kerasfeed.execution.augment_place import AugmentCost
from kerasfeed.sources import stage

logger = logging.getLogger("kerasfeed")
_warned = [False]


def _global_states() -> tuple:
    # Python's generator: its whole state; numpy's legacy one: position and the key's first word.
    state = np.random.get_state()
    return random.getstate(), state[2], int(state[1][0]), state[3]


def _warn_global_draw(name: str, index: int) -> None:
    info = worker_info.get_worker_info()
    if _warned[0] or (info is not None and info.id != 0):  # once, in the consumer or worker 0
        return
    _warned[0] = True
    logger.warning(
        "kerasfeed: `%s` (item %d) drew from the global `random` or `numpy.random` generator; with cache= its "
        "result is made once and stored, so those draws are frozen and repeat every pass. Move random work into "
        "`augment(item)` and draw from kerasfeed.item_rng() there.", name, index,
    )


class _Calls:
    """The source's calls (stored stages, augments) running in this process now, and how many have begun.

    The global generators are the process's: a change seen across a stage is the stage's own draw only
    when no other call ran beside it (an ``augment`` on another pool thread may draw from them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._begun = 0

    def enter(self) -> int:
        """A token for ``leave``: the count of calls begun, or -1 when another call is running."""
        with self._lock:
            self._running += 1
            self._begun += 1
            return self._begun if self._running == 1 else -1

    def leave(self, token: int) -> bool:
        """Whether the call ran alone: nothing running when it began, nothing begun since."""
        with self._lock:
            self._running -= 1
            return token == self._begun


_CALLS = _Calls()


def run_stage(source: Any, name: str, index: int) -> Any:
    """The cached stage ``name`` of item ``index``, refusing what depends on the pass."""
    token = _CALLS.enter()
    before, modules = _global_states(), len(sys.modules)
    previous = stage.enter_cached(name)
    try:
        item = getattr(source, name)(index) if name == "load" else source[index]
    finally:
        stage.leave(previous)
        changed = _global_states() != before
        alone = _CALLS.leave(token)
    # A module imported in the call may draw at import (``import jax`` does): a later call decides.
    if changed and alone and len(sys.modules) == modules:
        _warn_global_draw(name, index)
    return item


def run_augment(source: Any, item: Any) -> Any:
    """The source's ``augment`` of a stored (or just made) item, counted among the running calls."""
    _CALLS.enter()
    try:
        return source.augment(item)
    except ValueError as e:
        if "read-only" not in str(e):
            raise
        # numpy's "assignment destination is read-only" alone did not say why the arrays were.
        raise ValueError(f"{e} (with cache=, `augment` gets the stored item's arrays, read-only views of the "
                         "store: write into a copy, `x = x.copy()`, or return new arrays)") from e
    finally:
        _CALLS.leave(-1)


def read_only(item: Any) -> Any:
    if isinstance(item, np.ndarray):
        item.flags.writeable = False
    elif isinstance(item, (tuple, list)):
        for x in item:
            read_only(x)
    elif isinstance(item, dict):
        for x in item.values():
            read_only(x)
    return item


def timed_augment(source: Any, item: Any, cost: AugmentCost) -> Any:
    """``run_augment``, its thread CPU time added to ``cost``."""
    began = time.thread_time()
    try:
        return run_augment(source, item)
    finally:
        cost.add(time.thread_time() - began)


class ItemCache:
    """What an executor's item calls go through with ``cache=``.

    Args:
        store: the store (None: the stage only, for an executor away from
            the store's host; the consumer stores and augments).
        stage_name: ``"load"`` or ``"__getitem__"`` (``keys.stage_of``).
        augment: whether the source's ``augment`` runs after the store.
    """

    def __init__(self, store: Optional[ItemStore], stage_name: str, augment: bool):
        self.store = store
        self.stage_name = stage_name
        self.augment = augment
        # Every item of the pipeline's first pass was stored when it was opened (a kept directory reused; a
        # shard's holds only the shard's): set by the pipeline, for executor="auto" (``auto_cached.py``).
        self.first_pass_stored = False
        self.whole_source = True  # the store is for every item, not a shard's (set by the pipeline)
        # A shard's store: the first items of its first pass, which the checks and auto's probe make (not items
        # 0, 1, 2..., which may be other shards'), and which may be kept in it. None: items 0, 1, 2...
        self.probe_at: Optional[list] = None
        self.augment_cost = AugmentCost()  # for the cache front's choice of where augment runs (threads)

    @classmethod
    def for_source(cls, source: Any, store: Optional[ItemStore]) -> "ItemCache":
        name = stage_of(source)
        return cls(store, name, name == "load" and callable(getattr(source, "augment", None)))

    def keep(self, index: int, item: Any) -> None:
        """Stores item ``index`` that a check or a probe made outside the executor (its stored stage's
        result), so that no pass makes it again; in a shard's store only its own (``probe_at``)."""
        if self.store is not None and (self.whole_source or index in (self.probe_at or ())):
            self.store.put(index, item)

    def make(self, source: Any, index: int) -> Any:
        """Item ``index`` (see NOTE [ An item with cache= ])."""
        store = self.store
        item = store.get(index) if store is not None else None
        if item is None:
            item = run_stage(source, self.stage_name, index)
            if store is None:
                return item  # the consumer stores and augments it
            # The stored copy from here on, as every later pass gets: not the source's arrays, which a source
            # that reuses its buffers would overwrite before they are read.
            stored = store.get(index) if store.put(index, item) else None
            if stored is not None:
                item = stored
            elif self.augment:
                item = read_only(item)
        return timed_augment(source, item, self.augment_cost) if self.augment else item

    def handed_over_stored(self, index: int) -> bool:
        """Whether a worker process answers item ``index`` as stored (nothing in its slot: the consumer
        reads the store): the item is the stored one (no ``augment``) and the store holds it, its
        record intact (one that fails its check, e.g. pages a crash lost, is answered in the slot)."""
        return not self.augment and self.store is not None and self.store.get(index) is not None

    # ------------------------------------------------------------ worker processes
    def described(self) -> dict:
        """What a worker process needs (with ``fds()``) to make items the same way."""
        return {"store": None if self.store is None else self.store.described(), "stage": self.stage_name,
                "augment": self.augment}

    def fds(self) -> tuple:
        return () if self.store is None else self.store.fds()

    @classmethod
    def in_worker(cls, described: Optional[dict], fds: list) -> Optional["ItemCache"]:
        """The worker's ``ItemCache`` from its first message (None without cache=)."""
        if described is None:
            return None
        store = None if described["store"] is None else ItemStore.attach(described["store"], fds)
        return cls(store, described["stage"], described["augment"])

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


__all__ = ["ItemCache", "read_only", "run_augment", "run_stage", "timed_augment"]
