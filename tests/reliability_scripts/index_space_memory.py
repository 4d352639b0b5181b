"""First 10 batches of billion-item index spaces: peak RSS growth and the indices; prints JSON.

Usage: ``index_space_memory.py ITEMS LABELS`` (10^9 and 10^7 in the test).

Scenarios (``to_loader`` and ``to_dataset``, threads and worker processes):
a source of ``ITEMS`` items with ``shuffle=True``, a ``mix`` of two such
sources (``to_loader``, threads), and a ``BalancedOrder`` over ``LABELS``
imbalanced labels. Every item is its own index, so the
batches say which items came. Imports and first-use costs are taken out by a
warm-up on a tiny source; the peak RSS of this process (sampled every 5 ms
by a thread) is measured from just before the order or the pipeline is
built to the 10th batch. Worker processes' own memory is not counted (they
hold no order: items are requested one by one).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import kerasfeed
from benchmarks.machine import PeakRss

MB = 2**20
BATCHES, BATCH = 10, 256


class Identity:
    """Item ``i`` is ``offset + i`` (int64): a source of any length that costs nothing."""

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.int64(self.offset + i)


def first_batches(front_end, executor, make_source, **kwargs):
    """Builds the pipeline, takes BATCHES batches; returns (indices, seconds, peak growth in MB)."""
    with PeakRss() as rss:
        t0 = time.perf_counter()
        source, extra = make_source()
        options = dict(batch_size=BATCH, executor=executor, **extra, **kwargs)
        if executor == "processes":
            options["workers"] = 2
        if front_end == "to_loader":
            pipeline = kerasfeed.to_loader(source, **options)
            it = iter(pipeline)
        else:
            pipeline = kerasfeed.to_dataset(source, **options)
            it = pipeline.as_numpy_iterator()
        batches = [np.asarray(next(it)).reshape(-1) for _ in range(BATCHES)]
        seconds = time.perf_counter() - t0
    executor_of = kerasfeed.executor_of(pipeline)
    del it
    if executor_of is not None:
        executor_of.close()
    return np.concatenate(batches), seconds, rss.growth / MB


def main(items, num_labels):
    for front_end in ("to_loader", "to_dataset"):  # warm-up: imports, first traces
        make = kerasfeed.to_loader if front_end == "to_loader" else kerasfeed.to_dataset
        for executor in ("threads", "processes"):
            pipeline = make(Identity(8), batch_size=2, executor=executor, shuffle=True, seed=0)
            next(iter(pipeline))
            kerasfeed.executor_of(pipeline).close()
            del pipeline
    results = []

    def shuffled():
        return Identity(items), {"shuffle": True, "seed": 1}

    state = {}

    def balanced():
        # Built inside the measure: the order's own memory counts (not the labels').
        state["order"] = kerasfeed.BalancedOrder(state["labels"], seed=2)
        return Identity(len(state["labels"])), {"order": state["order"]}

    for front_end in ("to_loader", "to_dataset"):
        for executor in ("threads", "processes"):
            idx, seconds, growth = first_batches(front_end, executor, shuffled)
            results.append(dict(kind="shuffled", front_end=front_end, executor=executor, seconds=seconds,
                                growth_mb=growth, indices=idx.tolist()))
    def mixed():
        # Two parts of ITEMS items, 3:1, the slots of every block shuffled; part 1's items come offset by ITEMS.
        return kerasfeed.mix([Identity(items), Identity(items, offset=items)], [3, 1], seed=3), {"shuffle": True,
                                                                                                 "seed": 4}

    idx, seconds, growth = first_batches("to_loader", "threads", mixed)
    results.append(dict(kind="mixed", front_end="to_loader", executor="threads", seconds=seconds, growth_mb=growth,
                        indices=idx.tolist()))
    rng = np.random.default_rng(0)
    labels = np.zeros(num_labels, dtype=np.int64)  # 1:49 imbalance, class 1 scattered
    labels[rng.choice(num_labels, num_labels // 50, replace=False)] = 1
    state["labels"] = labels
    for front_end, executor in (("to_loader", "threads"), ("to_dataset", "processes")):
        idx, seconds, growth = first_batches(front_end, executor, balanced)
        results.append(dict(kind="balanced", front_end=front_end, executor=executor, seconds=seconds,
                            growth_mb=growth, indices=idx.tolist(), labels=labels[idx].tolist()))
        state.pop("order")
    print(json.dumps(results))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
