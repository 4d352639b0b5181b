"""What ``executor="auto"`` probes for a source read with ``cache=`` (light: numpy and the standard library).

NOTE [ Auto with cache= ]
With ``cache=`` the executor does not run ``source[i]`` every pass
(``execution/cache_front.py``, ``cached_items.py``):

- **No ``augment``.** The executor makes only the items not stored yet: pass
  0, or the part of a pass past a budget. Later passes run nothing on it:
  the consumer serves the stored items itself, whichever executor made them.
  So auto decides for what pass 0 makes (the stored stage), as it would
  without a cache; pass 0 then runs as fast as an uncached pass. When every
  item is stored already (a kept directory reused), or every item of the
  first pass (a host's kept shard), nothing will be made at all: threads,
  without a probe (it would make items for nothing) and without worker
  processes to start.
- **With ``augment``.** Every pass runs ``augment`` on the executor, over the
  stored item (read in place, no copy); pass 0 also runs the stored stage,
  once per item. From the second pass on, the executor's work per item is
  ``augment`` alone, so auto probes that (on items it loads, or reads from
  the store) and decides for it: a training run's passes are mostly
  passes after the first. A cheap ``augment`` (numpy on a few hundred KB)
  usually stays on threads, where a worker process would add a copy of the
  result and the consumer's pick-up; a costly, GIL-bound one goes to
  processes (docs/performance.md, *auto with cache=*).

What the probe loads (the stored stage's items) goes into the store, so pass 0 does not load those
items again. With a shard's store (``ItemCache.whole_source`` False) it probes that shard's first items
(``ItemCache.probe_at``), not items 0, 1, 2..., which may be other shards'.
"""

from __future__ import annotations

from typing import Any, Optional

from kerasfeed.execution.cached_items import ItemCache, read_only, run_augment, run_stage
from kerasfeed.sources.base import source_length
from kerasfeed.sources.item_random import item_scope


class _Stored:
    """``[i]``: what the executor runs for item ``i`` once it is stored: ``augment`` of
    the stored item (read from the store, or loaded here before any is timed)."""

    def __init__(self, source: Any, cache: ItemCache, probed: int):
        self._source, self._cache = source, cache
        n, at = source_length(source), cache.probe_at
        picks = [at[j % len(at)] for j in range(probed)] if at else [j % n for j in range(probed)]
        self._stored = {i: self._stored_item(i) for i in picks}

    def _stored_item(self, i: int) -> Any:
        store = self._cache.store
        item = store.get(i) if store is not None else None
        if item is None:
            with item_scope(i):  # as the executor's call: item_rng() refused in the stage by name
                item = read_only(run_stage(self._source, self._cache.stage_name, i))
            self._cache.keep(i, item)  # loaded once: pass 0 serves it
        return item

    def __len__(self) -> int:
        return source_length(self._source)

    def __getitem__(self, i: int) -> Any:
        item = self._stored.get(i)
        return run_augment(self._source, self._stored_item(i) if item is None else item)


class _Made:
    """``[i]``: what the executor runs for item ``i`` not stored yet: the stored stage (its
    ``load``, or ``__getitem__``), then ``augment`` if the source has one."""

    def __init__(self, source: Any, cache: ItemCache, probed: int):
        self._source, self._cache = source, cache
        self._made: set = set()  # the indices stored

    def __len__(self) -> int:
        return source_length(self._source)

    def __getitem__(self, i: int) -> Any:
        item = run_stage(self._source, self._cache.stage_name, i)
        if i not in self._made:
            # Stored at once (the first call of an index is the probe's warm-up, not timed): a source that reuses
            # its buffers overwrote the items kept for later, and items 0-2 were stored holding item 3's data.
            self._made.add(i)
            self._cache.keep(i, item)
        return run_augment(self._source, read_only(item)) if self._cache.augment else item

    def keep_made(self) -> None:
        """The probe is done: what it made is stored, so pass 0 does not make it again."""
        self._made = set()


def _named(kind: type, source: Any, cache: ItemCache, probed: int) -> Any:
    # Named as the source's class: a probed item that raises is named so (``ItemError``: ``Scenes[3] raised ...``).
    return type(type(source).__name__, (kind,), {"__module__": kind.__module__})(source, cache, probed)


def cached_work(source: Any, cache: ItemCache, probed: int) -> tuple[Optional[Any], str]:
    """``(what to probe, what the reason adds)`` for ``source`` read through ``cache``
    (NOTE [ Auto with cache= ]); what to probe is None when the executor will run
    nothing: every item stored and no ``augment``. ``probed``: the probe reads
    that many items (``auto.probe_source``): ``cache.probe_at``'s, or ``0 .. probed - 1``."""
    store = cache.store
    figures = store.figures() if store is not None else {"items": 0, "n": 1}
    every = figures["n"] > 0 and figures["items"] >= figures["n"]
    if not cache.augment:
        if every or cache.first_pass_stored:
            which = "every item" if every else "every item of the first pass (this shard's)"
            return None, (
                f"with cache= {which} is stored already ({figures['items']:,}) and nothing runs per pass (no "
                "augment): the consumer serves them itself, so no probe and no worker processes"
            )
        return _named(_Made, source, cache, probed), (
            "with cache= and no augment the executor makes only the items not stored yet (pass 0); later passes "
            "are served from the store in this process, whichever executor made them"
        )
    return _named(_Stored, source, cache, probed), (
        "with cache= every pass runs augment on the executor, over the stored item: decided for augment alone "
        "(what every pass after the first runs; pass 0 also loads each item once)"
    )


__all__ = ["cached_work"]
