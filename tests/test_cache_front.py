"""CacheFront: Ray's side of ``cache=`` (``remote=True``: misses made elsewhere, stored and augmented
here), emulated over a threads executor that runs the stored stage only, and ``cache_fill`` on a shard."""

from __future__ import annotations

import random

import numpy as np

import kerasfeed
from kerasfeed.cache.store import ItemStore
from kerasfeed.execution.cache_front import CacheFront
from kerasfeed.execution.cached_items import ItemCache
from kerasfeed.execution.threads import ThreadExecutor
from kerasfeed.sources.item_random import ItemSeeds

N = 8


class _Drawing(kerasfeed.SceneSequence):
    """``augment`` draws from the global generators (what a Ray actor reseeds per item)."""

    def __len__(self):
        return N

    def load(self, i):
        return np.full((2,), i, "float64")

    def augment(self, x):
        return x + np.random.randint(1000) + random.random()


class _Stage:
    """What a Ray actor runs for a miss of a source with ``augment``: the stored stage alone."""

    def __init__(self, source):
        self.source = source

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.source.load(i)


def _remote_front(source, seed=0):
    store = ItemStore.memory(N, 1 << 20)
    inner = ThreadExecutor(_Stage(source), parallelism=1)
    return CacheFront(inner, ItemCache.for_source(source, store), source, remote=True, seeds=ItemSeeds(seed),
                      on_close=store.close)


def _pass(front, epoch):
    order = np.random.default_rng(epoch).permutation(N)
    front.plan(epoch, order)
    return {int(i): front.load(int(i), epoch)[0] for i in order}


def test_remote_augment_reseeds_the_globals_per_item_and_restores_them():
    """Ray + cache: ``augment`` run in the consumer draws from the globals seeded as a worker's (the
    numbers an uncached Ray or processes run draws), in every pass, hit or miss; the consumer's own
    global streams go on untouched."""
    seeds = ItemSeeds(0)

    def expected(epoch, i):
        seeds.seed_globals(epoch, i)
        return i + np.random.randint(1000) + random.random()

    want = [{i: expected(e, i) for i in range(N)} for e in range(2)]
    runs = []
    for _ in range(2):
        np.random.seed(123)
        random.seed(123)
        front = _remote_front(_Drawing())
        try:
            runs.append([_pass(front, e) for e in range(2)])  # pass 0 misses, pass 1 hits
            assert front.hits == N and front.misses == N
        finally:
            front.close()
        after = (np.random.randint(10**9), random.random())
        np.random.seed(123)
        random.seed(123)
        assert after == (np.random.randint(10**9), random.random())
    assert runs[0] == runs[1] == want


def test_remote_augment_hits_are_ready():
    """A stored item of a later pass is served (and augmented) by the front: ready at once, though the
    executor never had it planned (to_dataset would otherwise load such a pass one item at a time)."""
    front = _remote_front(_Drawing())
    try:
        _pass(front, 0)
        front.plan(1, np.arange(N))
        assert all(front.ready(i, 1) for i in range(N))
    finally:
        front.close()


def test_cache_fill_counts_the_shard_read():
    """A host reading a fixed shard of the order stores its shard: cache_fill reaches 1 after one pass."""
    order = kerasfeed.IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=0, fixed_shards=True)

    class Plain(kerasfeed.SceneSequence):
        def __len__(self):
            return 16

        def load(self, i):
            return np.full((3,), i, "float32")

    loader = kerasfeed.to_loader(Plain(), batch_size=4, order=order, cache="memory", executor="threads")
    try:
        assert sum(len(np.asarray(b)) for b in loader) == 8
        assert kerasfeed.stats(loader)["cache_fill"] == 1.0
    finally:
        loader.close()
    assert kerasfeed.stats(loader)["cache_fill"] == 1.0  # as it was when it closed
