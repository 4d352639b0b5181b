"""``kerasfeed.stats(ds)``: the live input stats of a kerasfeed dataset (TF-free)."""

from __future__ import annotations

from typing import Any

from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged
from kerasfeed.observe.stats import ENABLED, StatsCollector

# Set by the stream functions (from_generators/from_files/from_queue) on the
# dataset they return; to_dataset's collector lives on its pipeline.
STATS_ATTR = "_kerasfeed_stats"


def collector_of(ds: Any) -> StatsCollector:
    """The ``StatsCollector`` behind ``ds`` (see ``stats``)."""
    found = find_tagged(ds, STATS_ATTR)
    if found is None:
        pipeline = find_tagged(ds, PIPELINE_ATTR)
        found = getattr(pipeline, "stats", None) if pipeline is not None else None
        if pipeline is not None and found is None:
            raise ValueError(
                "kerasfeed stats were switched off when this dataset was built (KERASFEED_STATS=0). "
                f"Received: {type(ds).__name__}"
            )
    if found is None:
        raise ValueError(
            "stats() needs a dataset or loader made by kerasfeed (to_dataset, to_loader, from_generators, from_files, "
            "from_queue) or derived from one with .map/.batch/..."
            f"{'' if ENABLED else ' (stats are switched off: KERASFEED_STATS=0)'}. "
            f"Received: {type(ds).__name__}"
        )
    return found


def stats(ds: Any) -> dict:
    """The input stats of a kerasfeed dataset, as a plain dict.

    Collected all the time at a small cost (a few clock reads per item):
    how long the consumer's pick-up of each item blocked, how long items take
    to make, rates per pass, worker figures. Percentiles cover the most
    recent 4096 items; counts and totals cover the dataset's whole life.

    Keys (``None`` where not known yet or not applicable):

    - ``items``, ``batches``, ``errors``: picked up so far / items that raised. ``batches`` counts
      kerasfeed's own batches (``batch_size=``); a ``.batch()`` applied to the dataset afterwards is
      not seen, so for a stream's single items ``batches`` equals ``items`` (and ``batches_per_s``
      ``items_per_s``).
    - ``skipped``: items that failed and were left out (``max_skipped=``;
      each is counted in ``errors`` too); per pass in ``passes``.
    - ``wait_ms``: ``{mean, p50, p95, p99, max, samples}`` of the pick-up's
      blocking time per item; ``wait_total_s``; ``ready_fraction``: share of
      pick-ups that found the item ready (blocked < 0.1 ms).
    - ``make_ms``: the same summary for the time an item took to make, as
      timed where it was made (``source[i]`` on a pool thread or in the
      worker process itself; a stream's ``next()`` of its generator or
      reader in the producer thread or worker process; a ``from_queue``
      producer's time between ``put`` calls); ``items_made``.
    - ``items_per_s``, ``batches_per_s``: of the latest pass with items.
    - ``passes``: per pass ``{epoch, items, batches, seconds, items_per_s,
      batches_per_s, wait_s, first_item_s, gap_s, skipped}``; ``gap_s`` is the time
      from the previous pass's last pick-up to this pass's first.
    - ``workers``: per worker process ``{id, items, busy_s, busy, pid, rss_mb}``
      (``busy``: share of the time since the first item spent making items);
      ``threads_busy``: pool or producer threads making items at once, on
      average (``threads_busy_s``: their busy seconds in all).
    - ``ahead``, ``in_flight``: items made and not taken yet / being made,
      right now; ``shm_bytes``: shared memory held by worker processes.
    - ``device`` (``to_loader``): the device prefetch: ``{prefetch,
      target, batches, wait_total_s, wait_ms, ready_fraction, place_ms}``;
      ``wait_ms`` is how long the training thread blocked for a placed
      batch (``kerasfeed/loader/device.py``).
    - ``kind``, ``executor``, ``items_per_batch``, ``uptime_s``.
    - ``process``: this process's index when a ``to_loader`` reads its shard
      under a multi-process Keras distribution (JAX); None otherwise.

    Args:
        ds: a dataset from ``kerasfeed.to_dataset`` or a stream function,
            or one derived from it (``ds.map(...).batch(...)``).

    Returns:
        A dict of plain Python values (JSON-able).

    Raises:
        ValueError: ``ds`` is not a kerasfeed dataset, or stats were
            switched off (``KERASFEED_STATS=0``) when it was built.

    Example:

    ```python
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=2).map(lambda x, y: (x / 255, y))
    for _ in ds:
        pass
    s = kerasfeed.stats(ds)
    print(s["wait_ms"]["p95"], s["make_ms"]["p50"], s["batches_per_s"])
    ```
    """
    out = collector_of(ds).snapshot()
    for key in _EVERY_KIND:  # one schema for every kind of dataset: None where a count does not apply
        out.setdefault(key, None)
    return out


# What each executor adds of its own (threads: no workers to replace; processes: no threads to abandon;
# streams: neither), given to every kind so that code reading them works on any dataset.
_EVERY_KIND = ("retried_items", "failed_items", "replaced_workers", "recycled_workers", "requeued_items",
               "abandoned_threads", "abandoned_threads_running", "ahead", "in_flight", "shm_bytes", "process")


__all__ = ["stats", "collector_of", "STATS_ATTR"]
