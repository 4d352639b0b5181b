"""Live input statistics for every kerasfeed pipeline (TF-free).

A ``StatsCollector`` sits next to each pipeline: the consumer records how long
every pick-up blocked (``picked``), the producer how long each item took to
make and where (``made``). Percentiles come from the most recent ``window``
samples (a ring); totals count everything since the pipeline was built.

Per-item recording takes no lock and makes no clock read of its own (callers
pass the times they took): ``picked`` and ``made`` are straight-line attribute
and list writes with no call between a read and its write, which CPython's GIL
(Python 3.11, the version kerasfeed runs on) never interrupts, so concurrent
recorders cannot lose an update. A new pass or worker, and ``snapshot``, take
the lock; gauges (``add_gauges``) add what the executor knows right now.
"""

from __future__ import annotations

import array
import collections
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional

import numpy as np

# Stats are on unless KERASFEED_STATS=0, read once: set before kerasfeed.observe.stats is imported (by kerasfeed's
# front ends).
ENABLED = os.environ.get("KERASFEED_STATS", "1") not in ("0", "false", "False", "")
DEFAULT_WINDOW = 4096  # recent samples kept for percentiles
PASSES_KEPT = 32  # per-pass records kept
READY_S = 1e-4  # a pick-up shorter than this found its item ready
_TIMELINE_MAX = 20000

_LIVE: "weakref.WeakSet[StatsCollector]" = weakref.WeakSet()


class _Ring:
    """The last ``size`` float samples, as C doubles: a write keeps no float
    object alive (a list would hold ``size`` of them, and free a cold one on
    every write)."""

    __slots__ = ("values", "count", "size")

    def __init__(self, size: int):
        self.values = array.array("d", bytes(8 * size))
        self.size = size
        self.count = 0

    def recent(self) -> np.ndarray:
        return np.frombuffer(self.values[: min(self.count, self.size)], dtype=np.float64)  # a slice: one atomic copy


def _compact(ring: _Ring) -> _Ring:
    """A ring of just the samples ``ring`` holds (same percentiles), for a collector whose pipeline
    is closed: TensorFlow may keep the dataset's function, and with it the collector, long after."""
    kept = ring.recent()
    out = _Ring(max(1, kept.size))
    out.values[: kept.size] = array.array("d", kept.tobytes())
    out.count = ring.count if kept.size else 0
    return out


def _summary_ms(ring: _Ring) -> Optional[dict]:
    v = ring.recent()
    if not v.size:
        return None
    p50, p95, p99 = np.percentile(v, (50, 95, 99)) * 1e3
    return {"mean": float(v.mean() * 1e3), "p50": float(p50), "p95": float(p95), "p99": float(p99),
            "max": float(v.max() * 1e3), "samples": int(v.size)}


class _Pass:
    __slots__ = ("epoch", "begin", "first", "last", "items", "wait_s", "gap_s", "skipped", "cache_at_begin")

    def __init__(self, epoch: int, begin: float, gap_from: Optional[float], cache_at_begin: Optional[tuple] = None):
        self.epoch, self.begin = epoch, begin
        self.cache_at_begin = cache_at_begin  # the store's (hits, misses) when the pass began (with cache=)
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.items = 0
        self.wait_s = 0.0
        self.skipped = 0  # items left out (max_skipped)
        self.gap_s = gap_from  # the previous pass's last pick-up, until the first one here

    def as_dict(self, per_batch: int) -> dict:
        end = self.last if self.last is not None else self.begin
        seconds = end - self.begin
        rate = self.items / seconds if seconds > 0 and self.items else None
        return {
            "epoch": self.epoch,
            "items": self.items,
            "batches": self.items / per_batch,
            "seconds": seconds,
            "items_per_s": rate,
            "batches_per_s": rate / per_batch if rate else None,
            "wait_s": self.wait_s,
            "first_item_s": None if self.first is None else self.first - self.begin,
            "gap_s": self.gap_s if self.first is not None else None,
            "skipped": self.skipped,
        }


class StatsCollector:
    """Counters, recent samples and per-pass records of one pipeline. Thread-safe; every ``record``
    method is cheap enough to call per item.

    Args:
        kind: what built the pipeline (``"to_dataset"``, ``"from_generators"``...).
        items_per_batch: items in one consumer batch (``batch_size``, or 1
            when items are batches): turns items/s into batches/s.
        window: recent samples kept for percentiles.
    """

    def __init__(self, kind: str, items_per_batch: int = 1, window: int = DEFAULT_WINDOW):
        self.kind = kind
        self.items_per_batch = max(1, int(items_per_batch or 1))
        self.executor: Optional[str] = None
        self.process: Optional[int] = None  # this process's index under a multi-process Keras distribution
        self.may_skip = False  # the pipeline may leave failed items out (max_skipped)
        self._lock = threading.Lock()
        self._created = time.perf_counter()
        self._wait = _Ring(window)
        self._make = _Ring(window)
        self._wait_total = 0.0
        self._errors = 0
        self._skipped = 0
        self._busy: dict[Any, list] = {}  # worker id -> [busy seconds, items]
        self._first_made: Optional[float] = None
        # Every pass begun, in order (a second fit on one dataset begins its passes 0, 1... again: each a record
        # of its own), and the latest record of each pass number (where its items are counted).
        self._passes: "collections.deque[_Pass]" = collections.deque()
        self._by_epoch: dict[int, _Pass] = {}
        self._last_pick: Optional[float] = None
        self._current: Optional[_Pass] = None  # the pass picked from last
        # (items, wait_s, skipped) a pass had when a fit's iterator took it over from a model build (Keras'
        # JAX and torch trainers read a batch before on_train_begin): InputStats counts them in its epoch.
        self._taken_over: Optional[tuple] = None
        self._gauges: list[Callable[[], Optional[Callable[[], dict]]]] = []
        self._cache_counts: Callable[[], Optional[Callable[[], tuple]]] = lambda: None  # add_cache_counts
        self.timeline: Optional[list] = None  # (lane, start, end) per item when enabled
        _LIVE.add(self)

    def compact(self) -> None:
        """Shrinks the sample rings to the samples they hold (the pipeline
        was closed); snapshots stay the same, and recording still works."""
        with self._lock:
            self._wait = _compact(self._wait)
            self._make = _compact(self._make)

    # ------------------------------------------------------------ recording
    def pass_begin(self, epoch: int) -> None:
        """A pass starts (its order was handed to the executor)."""
        now = time.perf_counter()
        counts = self._cache_counts()
        with self._lock:
            record = _Pass(int(epoch), now, self._last_pick, None if counts is None else counts())
            self._taken_over = None  # a take-over is of the pass begun last: no longer counted
            self._passes.append(record)
            self._by_epoch[int(epoch)] = record
            self._current = None
            while len(self._passes) > PASSES_KEPT:
                old = self._passes.popleft()
                if self._by_epoch.get(old.epoch) is old:
                    del self._by_epoch[old.epoch]

    def taken_over(self, epoch: int) -> None:
        """A fit's iterator took over pass ``epoch``, which a model build began and picked from."""
        with self._lock:
            p = self._by_epoch.get(int(epoch))
            self._taken_over = None if p is None else (p.items, p.wait_s, p.skipped, p.cache_at_begin)

    @property
    def taken_over_items(self) -> int:
        """Items of a take-over ``take_taken_over`` has not read yet (0: none)."""
        found = self._taken_over
        return 0 if found is None else found[0]

    def take_taken_over(self) -> Optional[tuple]:
        """What ``taken_over`` recorded, once: ``(items, wait_s, skipped)`` picked before the fit's iterator, and
        the store's ``(hits, misses)`` when the pass began (None without ``cache=``)."""
        with self._lock:
            found, self._taken_over = self._taken_over, None
        return found

    def picked(self, epoch: int, wait_s: float, now: Optional[float] = None) -> None:
        """The consumer got an item of pass ``epoch`` after blocking ``wait_s``
        (``now``: when, as ``time.perf_counter``)."""
        if now is None:
            now = time.perf_counter()
        p = self._current
        if p is None or p.epoch != epoch:
            with self._lock:
                p = self._current = self._by_epoch.get(epoch)
        # From here to the end: no call (see the module docstring).
        ring = self._wait
        n = ring.count
        ring.values[n % ring.size] = wait_s
        ring.count = n + 1
        self._wait_total += wait_s
        self._last_pick = now
        if p is not None:
            if p.first is None:
                p.first = now
                if p.gap_s is not None:
                    p.gap_s = now - p.gap_s
            p.last = now
            p.items += 1
            p.wait_s += wait_s

    def picked_many(self, epoch: int, count: int, first: float, last: float) -> None:
        """The consumer got ``count`` items of pass ``epoch`` between ``first`` and ``last``
        without blocking for any (a pass read from the item store in the graph)."""
        if count <= 0:
            return
        self.picked(epoch, 0.0, first)  # the first: the pass's first pick-up (and the gap before it)
        rest = count - 1
        with self._lock:
            ring = self._wait
            for _ in range(min(rest, ring.size)):
                ring.values[ring.count % ring.size] = 0.0
                ring.count += 1
            ring.count += rest - min(rest, ring.size)
            self._last_pick = last
            p = self._by_epoch.get(int(epoch))
            if p is not None:
                p.last = last
                p.items += rest

    def error(self) -> None:
        with self._lock:
            self._errors += 1

    def skipped(self, epoch: int) -> None:
        """An item of pass ``epoch`` failed and was left out (``max_skipped``; also counted in ``error``)."""
        with self._lock:
            self._skipped += 1
            p = self._by_epoch.get(int(epoch))
            if p is not None:
                p.skipped += 1

    def made(self, make_s: float, worker: Any = None, end: Optional[float] = None, lane: Any = None,
             busy_s: Optional[float] = None) -> None:
        """One item took ``make_s`` seconds to make, on ``worker`` (None: a pool thread). ``end``: when
        it finished (perf_counter); ``lane``: its timeline row (default ``worker``); ``busy_s``: the
        worker's whole time on it (default ``make_s``; a worker process also writes it to shared memory)."""
        busy = make_s if busy_s is None else busy_s
        if self.timeline is not None or self._first_made is None:
            self._made_rarely(busy, worker, end, lane)
        try:
            entry = self._busy[worker]
        except KeyError:
            with self._lock:
                entry = self._busy.setdefault(worker, [0.0, 0])
        # From here to the end: no call (see the module docstring).
        ring = self._make
        n = ring.count
        ring.values[n % ring.size] = make_s
        ring.count = n + 1
        entry[0] += busy
        entry[1] += 1

    def _made_rarely(self, busy: float, worker: Any, end: Optional[float], lane: Any) -> None:
        end = time.perf_counter() if end is None else end
        with self._lock:
            if self._first_made is None:
                self._first_made = end - busy
            if self.timeline is not None and len(self.timeline) < _TIMELINE_MAX:
                self.timeline.append((worker if lane is None else lane, end - busy, end))

    def add_cache_counts(self, fn: Callable[[], tuple]) -> None:
        """Registers a bound method returning the store's ``(hits, misses)`` (held weakly), read as each pass
        begins: what a model build's pick-ups of a pass count there belongs to the epoch that takes it over."""
        self._cache_counts = weakref.WeakMethod(fn)

    def add_gauges(self, fn: Callable[[], dict]) -> None:
        """Registers a bound method returning instant figures (held weakly); once, however often it is given
        (a loader's executor reports to the loader's collector again after its TensorFlow dataset's)."""
        ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        with self._lock:
            if not any(r() == fn for r in self._gauges):
                self._gauges.append(ref)

    # ------------------------------------------------------------ reading
    @property
    def items(self) -> int:
        return self._wait.count

    def snapshot(self) -> dict:
        """Everything as a plain dict (see ``kerasfeed.stats``)."""
        now = time.perf_counter()
        with self._lock:
            wait = _summary_ms(self._wait)
            make = _summary_ms(self._make)
            recent = self._wait.recent()
            ready = float((recent < READY_S).mean()) if recent.size else None
            passes = [p.as_dict(self.items_per_batch) for p in self._passes]
            busy = {k: list(v) for k, v in list(self._busy.items())}
            since = self._first_made
            out = {
                "kind": self.kind,
                "executor": self.executor,
                "process": self.process,
                "items": self._wait.count,
                "batches": self._wait.count / self.items_per_batch,
                "items_per_batch": self.items_per_batch,
                "errors": self._errors,
                "skipped": self._skipped,
                "uptime_s": now - self._created,
                "wait_total_s": self._wait_total,
                "wait_ms": wait,
                "ready_fraction": ready,
                "items_made": self._make.count,
                "make_ms": make,
            }
            gauges = list(self._gauges)
        current = next((p for p in reversed(passes) if p["items_per_s"]), None)
        out["items_per_s"] = current["items_per_s"] if current else None
        out["batches_per_s"] = current["batches_per_s"] if current else None
        out["passes"] = passes
        elapsed = now - since if since is not None else None
        workers = []
        for key in sorted((k for k in busy if k is not None), key=str):
            busy_s, n = busy[key]
            workers.append({"id": key, "items": n, "busy_s": busy_s, "busy": busy_s / elapsed if elapsed else None})
        # Pool threads: how many were making items at once, on average (None
        # where no thread makes items: worker processes, or none made yet).
        out["threads_busy"] = out["threads_busy_s"] = None
        if None in busy:
            busy_s, _ = busy[None]
            out["threads_busy"] = busy_s / elapsed if elapsed else None
            out["threads_busy_s"] = busy_s
        out["workers"] = workers
        out.update({"ahead": None, "in_flight": None, "shm_bytes": None})
        for ref in gauges:
            fn = ref()
            if fn is None:
                continue
            try:
                extra = fn()
            except Exception:  # noqa: BLE001 - a closing executor: report what we have
                continue
            for w in extra.pop("workers", []):
                _merge_worker(out["workers"], w)
            out.update(extra)
        return out


def _merge_worker(workers: list, info: dict) -> None:
    for w in workers:
        if w["id"] == info["id"]:
            w.update(info)
            return
    workers.append({"id": info["id"], "items": 0, "busy_s": 0.0, "busy": 0.0, **info})


def live_collectors() -> list[StatsCollector]:
    """Collectors of pipelines still alive (for callbacks not given a dataset)."""
    return list(_LIVE)


def new_collector(kind: str, items_per_batch: int = 1) -> Optional[StatsCollector]:
    """A collector, or None when stats are switched off (``ENABLED``)."""
    return StatsCollector(kind, items_per_batch) if ENABLED else None


__all__ = ["StatsCollector", "new_collector", "live_collectors", "ENABLED"]
