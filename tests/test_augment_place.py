"""Where a cached source's ``augment`` runs on the threads executor: the pool or the asking thread
(NOTE [ A cheap augment runs where its item is asked for ], ``kerasfeed/execution/augment_place.py``).

The choice itself is tested with a fake clock; the pipelines check that whichever way a pass takes,
its batches are the bits an uncached run makes (``item_rng()``, subnormal floats under ``to_dataset``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution import augment_place
from kerasfeed.execution.augment_place import LEAST_LOADS, AugmentCost, AugmentPlace

N = 24
PASSES = 4


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_pass(place, cost, clock, epoch, *, interval, augment_s, stored=True, loads=N):
    inline = place.choose(epoch, stored)
    for _ in range(loads):
        clock.now += interval
        place.loaded(epoch)
        cost.add(augment_s)
    return inline


def test_a_pass_tries_the_asking_thread_when_one_thread_keeps_the_pools_pace_then_keeps_the_faster_way(
        monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(augment_place.time, "perf_counter", clock)
    cost = AugmentCost()
    place = AugmentPlace(cost)
    # Pass 0 makes its items (not a measure), pass 1 is the pool's first measure: no trial before it.
    assert not _run_pass(place, cost, clock, 0, interval=0.010, augment_s=0.001, stored=False)
    assert not _run_pass(place, cost, clock, 1, interval=0.004, augment_s=0.001)
    # The augment (1 ms) takes less than the pool's interval between loads (4 ms): pass 2 tries.
    assert _run_pass(place, cost, clock, 2, interval=0.002, augment_s=0.001)
    assert place.figures() == {"augment_s": pytest.approx(0.001), "pace_pool_s": pytest.approx(0.004),
                               "pace_inline_s": None}
    # The trial kept a shorter interval (2 ms): the asking thread from now on, while it stays faster.
    assert _run_pass(place, cost, clock, 3, interval=0.005, augment_s=0.001)
    # Pass 3 ran at 5 ms, slower than the pool's last 4 ms: the pool again, measured anew.
    assert not _run_pass(place, cost, clock, 4, interval=0.006, augment_s=0.001)
    assert place.figures()["pace_inline_s"] == pytest.approx(0.005)
    # The pool's pass 4 took 6 ms: the asking thread's last 5 ms is shorter again.
    assert _run_pass(place, cost, clock, 5, interval=0.003, augment_s=0.001)
    assert place.figures()["pace_pool_s"] == pytest.approx(0.006)
    assert _run_pass(place, cost, clock, 6, interval=0.003, augment_s=0.001)


def test_a_costly_augment_and_passes_that_measure_nothing_stay_on_the_pool(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(augment_place.time, "perf_counter", clock)
    cost = AugmentCost()
    place = AugmentPlace(cost)
    _run_pass(place, cost, clock, 0, interval=0.010, augment_s=0.004, stored=False)
    _run_pass(place, cost, clock, 1, interval=0.002, augment_s=0.004)
    # 4 ms of CPU a call against 2 ms between loads: the pool runs calls side by side; one thread could not.
    assert not _run_pass(place, cost, clock, 2, interval=0.002, augment_s=0.004)
    # Cheap again, but the passes measure nothing: too few loads, or a tenth of the items made (a budget).
    fresh = AugmentPlace(cost)
    assert not _run_pass(fresh, cost, clock, 0, interval=0.004, augment_s=0.0001, loads=LEAST_LOADS - 1)
    assert not _run_pass(fresh, cost, clock, 1, interval=0.004, augment_s=0.0001, stored=False)
    assert not _run_pass(fresh, cost, clock, 2, interval=0.004, augment_s=0.0001)
    assert fresh.figures()["pace_pool_s"] is None


class _Augmented(kerasfeed.SceneSequence):
    """``load`` cached; ``augment`` draws from ``item_rng()`` and records which thread ran it."""

    cache_ignores = ("threads",)  # the record grows every pass; load does not read it

    def __init__(self, threads=None):
        super().__init__()
        self.threads = threads

    def __len__(self):
        return N

    def load(self, i):
        return np.full((4,), i, np.float32), np.int64(i)

    def augment(self, item):
        x, label = item
        if self.threads is not None:
            self.threads.append(threading.current_thread().name)
        return x + kerasfeed.item_rng().normal(size=x.shape).astype(np.float32), label


def _uncached(front):
    seq = _Augmented()
    return _passes(front, seq, executor="threads", seed=7)


def _passes(front, seq, slow=0.0, **kwargs):
    if front == "to_loader":
        feed = kerasfeed.to_loader(seq, shuffle=True, **kwargs)
    else:
        # prefetch=1: tf.data's read-ahead would hold a whole short pass, the loads then paced by the pool, not
        # by the consumer's sleep below.
        feed = kerasfeed.to_dataset(seq, shuffle=True, prefetch=1, group_items=1, **kwargs)
    out = []
    try:
        for _ in range(PASSES):
            batches = []
            for x, label in feed:
                batches.append((np.asarray(x).copy(), int(label)))
                time.sleep(slow)  # a consumer slower than the pool: a cheap augment is tried in the asking thread
            out.append(batches)
    finally:
        if hasattr(feed, "close"):
            feed.close()
    return out


@pytest.mark.parametrize("front", ["to_loader", "to_dataset"])
def test_a_cheap_augment_run_by_the_asking_thread_gives_the_uncached_runs_bits(front):
    names: list = []
    cached = _passes(front, _Augmented(names), slow=0.003, executor="threads", seed=7, cache="memory")
    expected = _uncached(front)
    for got, want in zip(cached, expected):
        assert [label for _, label in got] == [label for _, label in want]
        for (x, _), (y, _) in zip(got, want):
            np.testing.assert_array_equal(x, y)
    # Pass 1 ran augment on the pool; pass 2 (the trial: 3 ms between loads) in the asking thread. (The
    # passes' calls are the last ones; the first few are the front's probes of the source.)
    per_pass = [names[len(names) - (PASSES - k) * N:][:N] for k in range(PASSES)]
    assert all(name.startswith("kerasfeed-thread") for name in per_pass[1]), per_pass[1]
    assert not any(name.startswith("kerasfeed-thread") for name in per_pass[2]), per_pass[2]


def test_a_subnormal_made_by_augment_in_a_tensorflow_thread_is_kept():
    """The trial pass runs augment in to_dataset's TensorFlow thread (flush-to-zero): the default
    floating-point environment is set around it, as on the pool's threads."""

    class _Subnormal(_Augmented):
        def augment(self, item):
            x, label = item
            return x * np.float32(1e-39), label  # i * 1e-39: subnormal for every i >= 1

    got = _passes("to_dataset", _Subnormal(), slow=0.003, executor="threads", seed=1, cache="memory")
    for batches in got:
        values = sorted(float(x[0]) for x, _ in batches)
        assert values[1:] == sorted(float(np.float32(i) * np.float32(1e-39)) for i in range(1, N)), values[:4]


def test_with_a_timeout_augment_stays_on_the_pool():
    names: list = []
    _passes("to_loader", _Augmented(names), slow=0.003, executor="threads", seed=7, cache="memory", timeout=30)
    passes = names[-PASSES * N:]  # the first few: the front's probes of the source
    assert all(name.startswith("kerasfeed-thread") for name in passes), sorted(set(passes))


class _Exits(_Augmented):
    """Item 5's ``augment`` calls ``sys.exit()``, as a library may on a bad record."""

    def augment(self, item):
        if int(item[1]) == 5:
            raise SystemExit(3)
        return super().augment(item)


def test_sys_exit_in_augment_run_by_the_asking_thread_is_that_item_s_error():
    """A pool thread makes a ``SystemExit`` in ``augment`` the item's ``ItemError`` (skipped within
    ``max_skipped``); the asking thread did not: the trial pass raised a bare SystemExit out of the loop."""
    names: list = []
    source = _Exits(names)
    feed = kerasfeed.to_loader(source, shuffle=True, executor="threads", seed=3, cache="memory", max_skipped=0.5)
    try:
        for _ in range(PASSES):
            labels = []
            for _, label in feed:
                labels.append(int(label))
                time.sleep(0.003)
            assert sorted(labels) == [i for i in range(N) if i != 5]
        stats = kerasfeed.stats(feed)
    finally:
        feed.close()
    trial = names[-(PASSES - 2) * (N - 1):][:N - 1]  # pass 2's calls (item 5 records none)
    assert not any(name.startswith("kerasfeed-thread") for name in trial), trial
    assert stats["skipped"] == PASSES, stats


def test_items_augmented_by_the_asking_thread_count_as_made_in_stats():
    """``items_made`` and ``make_ms`` count every item's ``augment``, wherever it ran (they stopped at the pool's)."""
    made = {}
    for cache in (None, "memory"):
        feed = kerasfeed.to_loader(_Augmented([]), shuffle=True, executor="threads", seed=3, cache=cache)
        try:
            for _ in range(PASSES):
                for _ in feed:
                    time.sleep(0.003)
            made[cache] = kerasfeed.stats(feed)["items_made"]
        finally:
            feed.close()
    assert made["memory"] == made[None] >= PASSES * N, made
