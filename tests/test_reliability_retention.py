"""What a closed ``to_dataset`` keeps: TensorFlow may keep a dataset's
function (and so the dataset's Python side) long after it is closed; the
kerasfeed heap kept per dataset must stay small (docs/reliability.md)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

import kerasfeed

CYCLES = 20
# Per closed dataset kept alive. Before: ~90 KB (two 32 KB stats rings and
# the pool's stopped Thread objects); after: ~7 KB (the pipeline's own objects).
BOUND_BYTES = 20_000


class _Small:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return np.full((4,), i, np.float32)


def _cycle():
    ds = kerasfeed.to_dataset(_Small(), executor="threads", batch_size=4)
    for _ in ds.take(2):
        pass
    kerasfeed.executor_of(ds).close()
    return ds


def test_a_closed_dataset_keeps_little_kerasfeed_heap():
    kept = [_cycle() for _ in range(3)]  # warm-up: caches, first traces
    gc.collect()
    tracemalloc.start()
    try:
        only = [tracemalloc.Filter(True, "*/kerasfeed/*")]
        before = tracemalloc.take_snapshot().filter_traces(only)
        kept += [_cycle() for _ in range(CYCLES)]  # kept alive, as TensorFlow may keep them
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(only)
    finally:
        tracemalloc.stop()
    per_cycle = sum(s.size_diff for s in after.compare_to(before, "filename")) / CYCLES
    top = after.compare_to(before, "lineno")[:5]
    assert per_cycle < BOUND_BYTES, (per_cycle, [str(s) for s in top])


def test_stats_stay_the_same_after_close():
    ds = kerasfeed.to_dataset(_Small(), executor="threads", batch_size=4)
    for _ in ds:
        pass
    before = kerasfeed.stats(ds)
    kerasfeed.executor_of(ds).close()
    after = kerasfeed.stats(ds)
    for key in ("wait_ms", "make_ms"):
        assert before.get(key) == after.get(key), (key, before.get(key), after.get(key))


class _Large:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.full((512, 512), i, np.float32)  # 1 MB


def test_a_dropped_dataset_of_large_items_keeps_no_item_sized_array():
    """TensorFlow keeps each ``numpy_function`` of an eagerly built dataset for the life of the process; the
    load's exit fallback (an item-sized placeholder of zeros) was made beside it and kept with it: 1 MB a
    dataset here, for good."""

    def cycle():
        ds = kerasfeed.to_dataset(_Large(), executor="threads", batch_size=2)
        for _ in ds:
            pass
        kerasfeed.executor_of(ds).close()

    cycle()
    gc.collect()
    tracemalloc.start()
    try:
        only = [tracemalloc.Filter(True, "*/kerasfeed/*")]
        before = tracemalloc.take_snapshot().filter_traces(only)
        for _ in range(5):
            cycle()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(only)
    finally:
        tracemalloc.stop()
    per_cycle = sum(s.size_diff for s in after.compare_to(before, "filename")) / 5
    assert per_cycle < BOUND_BYTES, (per_cycle, [str(s) for s in after.compare_to(before, "lineno")[:5]])
