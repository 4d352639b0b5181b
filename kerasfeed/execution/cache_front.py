"""The consumer's side of ``cache=``: items the store holds are served here, the rest are made by the executor.

NOTE [ Serving hits in the consumer ]
When a pass starts (``plan``, after the source's epoch hooks), the front
takes a cut of the store (``ItemStore.new_cut``): the items stored before it
are *hits* of this pass, the others *misses*, and both sides keep to that
split however the workers race. Without ``augment`` nothing runs per pass
for a hit, so the front serves it itself from the store (read-only views of
its pages, no copy, no round trip to a worker) and plans only the misses
on the executor; a pass whose items are all stored plans nothing. With
``augment`` every item goes to the executor, whose threads or workers read
the stored item and augment it (NOTE [ An item with cache= ]). Ray actors
may be on other hosts: they run the stored stage for the misses only, and
the front stores each and runs ``augment`` itself, with the item's seeds.

NOTE [ A budget keeps a fixed subset ]
Past ``max_bytes`` nothing more is stored: the items stored first stay, the
rest are made every pass. Under a fresh permutation every pass, any eviction
policy would only trade one stored item for another at the cost of a write:
the hit rate of a budgeted cache is the share of items that fit, whichever
they are, so a fixed subset costs nothing against LRU and writes nothing
after the store is full.

NOTE [ A cheap augment runs where its item is asked for ]: ``augment_place.py``.

NOTE [ A source that changes between passes ]: ``source_changes.py``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.cache.key_sources import ignored
from kerasfeed.cache.store import EVER, FIRST_OFFSET, index_chunks
from kerasfeed.errors import ItemError
from kerasfeed.execution.augment_place import AugmentPlace
from kerasfeed.execution.base import Executor
from kerasfeed.execution.cached_items import ItemCache, timed_augment
from kerasfeed.execution.fpenv import default_fp_env
from kerasfeed.execution.retries import Attempts
from kerasfeed.execution.source_changes import SourceChanges
from kerasfeed.execution.state_sync import fingerprints_once
from kerasfeed.execution.thread_tasks import item_failure
from kerasfeed.sources import item_random
from kerasfeed.sources.base import source_name

# Passes whose cut stays known (loads of older passes go to the executor).
_KEPT_CUTS = 8


def _read_through(name: str) -> property:
    return property(lambda self: getattr(self.inner, name))


class CacheFront(Executor):
    """An executor whose items go through an item store (see the NOTEs).

    Args:
        inner: the executor that makes items (its item calls run ``cache``).
        cache: the consumer's ``ItemCache`` (its store is the one the
            executor's threads or workers use).
        source: the source (its ``augment`` and its state, checked per pass).
        remote: the executor runs away from the store (Ray): it makes
            misses only, stored and augmented here.
        seeds: the items' seeds, for ``augment`` run here.
        retries: the pipeline's ``retries=``, for ``augment`` run here.
        first_pass: the first pass's indices (a callable): ``cache_fill`` before any pass is planned.
        on_close: releases the store (and a kept directory's lock).
    """

    def __init__(self, inner: Executor, cache: ItemCache, source: Any, *, remote: bool = False,
                 seeds: Optional[item_random.ItemSeeds] = None, on_close: Optional[Callable[[], None]] = None,
                 retries: int = 0, first_pass: Optional[Callable[[], Any]] = None):
        self.inner = inner
        self.cache = cache
        self.store = cache.store
        self._source = source
        self._remote = remote
        self._serve = remote or not cache.augment  # hits served here, misses only planned
        self._augment_here = remote and cache.augment
        self._seeds = seeds if seeds is not None else item_random.ItemSeeds(None)
        # NOTE [ A cheap augment runs where its item is asked for ]: the pool's seeds, when it may.
        caller_seeds = None if remote or not cache.augment else inner.caller_augment_seeds()
        if caller_seeds is not None:
            self._seeds = caller_seeds
        self._place = None if caller_seeds is None else AugmentPlace(cache.augment_cost)
        self._inline: set[int] = set()  # the passes whose hits are augmented here
        self._stats: Any = None  # a StatsCollector, once attached
        self._retries = retries  # for ``augment`` run here (``_augmented``)
        self._name = source_name(source)
        self._on_close = on_close
        self._cuts: dict[int, int] = {}
        self._whole: dict[int, int] = {}  # pass -> its cut, for a pass whose items were all stored before it
        self._lock = threading.Lock()
        self._globals_lock = threading.Lock()
        self.hits = self.misses = 0
        self._changes = SourceChanges(source, ignored(source))  # NOTE [ A source that changes between passes ]
        self._closed = False
        self._read: Optional[np.ndarray] = None  # the indices the passes planned so far (cache_fill's whole)
        self._reads = 0
        self._first_pass = first_pass
        self._closed_fill = 1.0

    # The executor's own attributes (name, reason, probe, counts...) read through; those the
    # Executor base class defines need a property each (a class attribute hides __getattr__).
    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    name = _read_through("name")  # type: ignore[assignment]
    reason = _read_through("reason")  # type: ignore[assignment]
    prefetches = _read_through("prefetches")  # type: ignore[assignment]
    lends_source_arrays = _read_through("lends_source_arrays")  # type: ignore[assignment]
    waits = _read_through("waits")  # type: ignore[assignment]

    @property
    def source(self) -> Any:
        return self._source

    # ------------------------------------------------------------ passes
    def plan(self, epoch: int, indices: Any, next_pass: Optional[tuple[int, Any]] = None) -> None:
        with fingerprints_once():  # the inner executor's state tracker reads the same fingerprints
            self._plan(epoch, indices)

    def _plan(self, epoch: int, indices: Any) -> None:
        self._changes.check()
        self._mark_read(indices)
        cut = self.store.new_cut()
        missing = self.store.missing(indices, cut) if self._serve or self._place is not None else indices
        # A pass a tenth or more of whose items are made (the first, one past a budget) measures no augment pace.
        inline = self._place is not None and self._place.choose(epoch, len(missing) * 10 <= len(indices))
        with self._lock:
            self._cuts[epoch] = cut
            self._whole.pop(epoch, None)
            if self.whole_passes and len(missing) == 0:
                self._whole[epoch] = cut
            (self._inline.add if inline else self._inline.discard)(epoch)
            for old in [e for e in self._cuts if e <= epoch - _KEPT_CUTS]:
                del self._cuts[old]
                self._whole.pop(old, None)
                self._inline.discard(old)
        # The next pass is not planned ahead: its misses are known only at its own cut.
        self.inner.plan(epoch, missing if self._serve or inline else indices)

    def _mark_read(self, indices: Any) -> None:
        # A host reading a shard reads only its share: cache_fill is the share of what it reads, not of the
        # source. One vectorized write per pass, none once every index has been read.
        n = self.store.n
        if self._reads >= n:
            return
        if self._read is None:
            self._read = np.zeros(n, np.bool_)
        for chunk in index_chunks(indices):
            self._read[chunk] = True
        self._reads = int(np.count_nonzero(self._read))

    @property
    def whole_passes(self) -> bool:
        """Whether a pass whose items are all stored needs nothing per item but the stored
        bytes (no ``augment``): the consumer may read it without calling ``load`` (to_dataset
        reads such passes in the graph: NOTE [ A stored pass runs in the graph ])."""
        return self._serve and not self._augment_here

    def all_stored(self, epoch: int) -> Optional[int]:
        """The cut of pass ``epoch`` when every one of its items was stored before it began
        (``whole_passes`` only), else None."""
        with self._lock:
            return self._whole.get(epoch)

    def served(self, count: int) -> None:
        """``count`` items of a stored pass read without ``load`` (counted as hits)."""
        with self._lock:
            self.hits += int(count)

    # ------------------------------------------------------------ items
    def _served_here(self, epoch: int) -> bool:
        """Whether pass ``epoch``'s hits are read from the store here, not asked of the executor (which
        never had them planned): without ``augment`` or on Ray (``_serve``), or augmented in the asking thread."""
        return self._serve or epoch in self._inline

    def load(self, index: int, epoch: int) -> Any:
        if self._place is not None:
            self._place.loaded(epoch)
        cut = self._cuts.get(epoch)
        if cut is not None:
            if self._served_here(epoch):  # stored before this pass: served here, no executor involved
                item = self.store.get(index, cut)
                if item is not None:
                    self.hits += 1
                    return self._augmented(item, index, epoch) if self.cache.augment else item
            elif self.store.has(index, cut):  # the executor reads it from the store and augments it
                self.hits += 1
                return self.inner.load(index, epoch)
            self.misses += 1
        elif self._serve:  # the probe, before any pass: a stored item needs no executor (Ray's actors read
            item = self.store.get(index)  # the object store, not this one)
            if item is not None:
                return self._augmented(item, index, epoch) if self._augment_here else item
        item = self.inner.load(index, epoch)
        if self._remote:
            stored = self.store.get(index) if self.store.put(index, item) else None
            item = stored if stored is not None else item
            if self._augment_here:
                item = self._augmented(item, index, epoch)
        return item

    def _augmented(self, item: Any, index: int, epoch: int) -> Any:
        """``augment`` run here (Ray: the actors make ``load`` only), as an executor runs an item: its error an
        ``ItemError`` naming the index, made again while ``retries=`` allow, counted in ``stats()``."""
        attempts = Attempts(index, self._retries)
        while True:
            try:
                return self._augmented_once(item, index, epoch)
            except BaseException as e:  # named, as the executors name an item's error
                if not item_failure(e):  # as on a pool thread
                    raise
                error = e if isinstance(e, ItemError) else ItemError.from_exception(index, e, source_name=self._name)
                counts = getattr(self.inner, "counts", None)
                if not attempts.again(error):
                    if counts is not None:
                        counts.add("failed_items")
                    raise attempts.final(error) from e
                if counts is not None:
                    counts.add("retried_items")

    def _augmented_once(self, item: Any, index: int, epoch: int) -> Any:
        if not self._seeds.given or not self._remote:  # pool threads share the globals: none reseeded
            return self._augment(item, index, epoch)
        # As an actor would (NOTE [ Random augmentation is a function of (seed, pass, index) ]): a seeded
        # pipeline's globals are reseeded for the item, then put back (the consumer's own draws go on). The
        # globals are the process's: one item at a time (to_dataset loads on several threads).
        with self._globals_lock:
            saved = random.getstate(), np.random.get_state()
            self._seeds.seed_globals(epoch, index)
            try:
                return self._augment(item, index, epoch)
            finally:
                random.setstate(saved[0])
                np.random.set_state(saved[1])

    def _augment(self, item: Any, index: int, epoch: int) -> Any:
        previous = item_random.enter(self._seeds, epoch, index)
        stats = self._stats if self._place is not None else None  # in the asking thread: made as on the pool
        started = time.perf_counter()
        try:
            with default_fp_env():  # the asking thread may be TensorFlow's (execution/fpenv.py)
                item = timed_augment(self._source, item, self.cache.augment_cost)
        finally:
            item_random.leave(previous)
        if stats is not None:
            end = time.perf_counter()
            lane = threading.current_thread().name if stats.timeline is not None else None
            stats.made(end - started, None, end, lane)
        return item

    def ready(self, index: int, epoch: int) -> bool:
        cut = self._cuts.get(epoch)
        if self._served_here(epoch) and cut is not None and self.store.has(index, cut):
            return True  # served here (augment too, when remote): the executor never had it planned
        return self.inner.ready(index, epoch)

    # ------------------------------------------------------------ the rest reads through
    def attach_stats(self, collector: Any) -> None:
        self._stats = collector
        self.inner.attach_stats(collector)
        collector.add_gauges(self.cache_gauges)
        collector.add_cache_counts(self.cache_counts)

    def cache_counts(self) -> tuple:
        return self.hits, self.misses

    def cache_gauges(self) -> dict:
        figures = self.store.figures()
        return {
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "cache_items": figures["items"],
            "cache_bytes": figures["bytes"],
            "cache_capacity": figures["capacity"] - FIRST_OFFSET,  # the budget: the file's first 64 bytes hold none
            "cache_full": figures["full"],
            "cache_fill": self._fill(figures),
        }

    def _fill(self, figures: dict) -> float:
        # The share of the items the passes read that are stored: a host reading a shard counts its shard's
        # (the stored items it does not read, e.g. executor="auto"'s probe's, do not count). One O(n) mask
        # per call, only then: gauges are read per stats() call, not per item.
        if self._closed:
            return self._closed_fill
        if not self._reads and self._first_pass is not None:  # before any pass: the first one's items (a
            self._mark_read(self._first_pass())  # shard's, not the source's: a warm kept shard read 0.49)
        whole = self._reads or figures["n"]
        if not whole:
            return 1.0
        held = figures["items"]
        if 0 < self._reads < figures["n"] and self._read is not None:
            held = int(np.count_nonzero(self.store.cached_mask(EVER) & self._read))
        return min(1.0, held / whole)

    def gauges(self) -> dict:
        return {**self.inner.gauges(), **self.cache_gauges()}

    def before_hook(self, name: str) -> None:
        self._changes.before_hooks()
        self.inner.before_hook(name)

    def after_hook(self, name: str) -> None:
        self.inner.after_hook(name)

    def pass_failed(self, epoch: int) -> None:
        self.inner.pass_failed(epoch)

    def item_skipped(self, index: int, epoch: int) -> None:
        self.inner.item_skipped(index, epoch)

    def activity(self) -> tuple[int, int]:
        return self.inner.activity()

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        return self.inner.park(activity)

    def parallel_calls(self) -> int:
        return self.inner.parallel_calls()

    def close(self) -> None:
        if self._closed:
            return
        self._closed_fill = self._fill(self.store.figures())  # as it was when the store closed
        self._closed = True
        try:
            self.inner.close()
        finally:
            if self._on_close is not None:
                self._on_close()

    def __repr__(self) -> str:
        return f"<CacheFront over {self.inner!r}>"


__all__ = ["CacheFront"]
