"""Index spaces of any size: per-position orders, their quality, lazy pass views, windowed plans,
compatibility with states saved by the whole-pass orders, and billion-item sources end to end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution.plan import LOOKAHEAD, PassPlan
from kerasfeed.sampling.bijection import SMALL_N, derive_key, permute
from kerasfeed.sampling.views import CHUNK, ArrayView, OrderView, RangeView, as_view, pass_view

ROOT = Path(__file__).resolve().parents[1]

# Every size class a Feistel domain can trip on: tiny, primes, powers of two and their neighbours.
SIZES = sorted(
    {1, 2, 3, 5, 7, 11, 13, 97, 251, 1009}
    | {2**k for k in range(1, 13)}
    | {2**k + d for k in range(2, 13) for d in (-1, 1)}
)


def _shuffle(n, seed, epoch=0):
    return kerasfeed.IndexOrder(n, shuffle=True, seed=seed).indices(epoch)


# ---- every index exactly once ------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES + [SMALL_N - 1, SMALL_N, SMALL_N + 1])
def test_every_index_exactly_once_per_pass(n):
    for seed in (0, 1, 2**40 + 3):
        for epoch in (0, 7):
            idx = _shuffle(n, seed, epoch)
            assert idx.dtype == np.int64 and len(idx) == n
            assert np.array_equal(np.sort(idx), np.arange(n)), (n, seed, epoch)
            # The Feistel network itself (IndexOrder's passes past SMALL_N items, a balanced order's cycles).
            feistel = permute(np.arange(n), n, derive_key(seed, 16, epoch))
            assert np.array_equal(np.sort(feistel), np.arange(n)), (n, seed, epoch)


@pytest.mark.parametrize("n, shards", [(10, 3), (97, 4), (1025, 2), (4099, 7)])
def test_shards_split_one_pass_into_equal_disjoint_parts(n, shards):
    full = _shuffle(n, 5, 2)
    parts = [kerasfeed.IndexOrder(n, True, 5, shards, k).indices(2) for k in range(shards)]
    assert {len(p) for p in parts} == {n // shards}
    joined = np.empty(n // shards * shards, dtype=np.int64)
    for k, part in enumerate(parts):
        joined[k::shards] = part
    np.testing.assert_array_equal(joined, full[: len(joined)])  # shard k: positions k, k + shards, ...


@pytest.mark.parametrize("n", [10**9 + 7, 2**62])
def test_huge_spaces_are_computed_by_position(n):
    order = kerasfeed.IndexOrder(n, shuffle=True, seed=3)
    positions = np.concatenate([np.arange(50_000), n - 1 - np.arange(50_000)])
    idx = order.at(4, positions)
    assert len(np.unique(idx)) == len(idx) and idx.min() >= 0 and idx.max() < n
    assert idx.max() > n // 2 > idx.min()  # spread over the whole space, not a corner of it
    np.testing.assert_array_equal(order.at(4, positions[::-1]), idx[::-1])  # a pure function of the position
    with pytest.raises(IndexError, match=rf"IndexOrder.at: positions must be in \[0, {n}\) .*Received: position -1"):
        order.at(0, [5, -1])  # out of range: refused (a walk outside the domain need not end)
    with pytest.raises(IndexError, match=r"BalancedOrder.at: positions must be in \[0, 75\) .*Received: position 75"):
        kerasfeed.BalancedOrder(LABELS, seed=0).at(0, [75])
    with pytest.raises(ValueError, match=r"IndexOrder: `length` must be at most 2\^62. Received: length=4611686018427387905"):
        kerasfeed.IndexOrder(2**62 + 1)


# ---- quality: simple statistics of a uniform permutation -----------------------------------


def _feistel(n, seed, epoch=0):
    # What IndexOrder computes past SMALL_N items (and did for every size in order version per-position-1).
    return permute(np.arange(n), n, derive_key(seed, 16, epoch))


@pytest.mark.parametrize("shuffle", [_shuffle, _feistel], ids=["IndexOrder", "feistel"])
def test_passes_and_seeds_look_like_independent_uniform_permutations(shuffle):
    n, runs = 10_007, 300  # a prime: the Feistel domain is not a power of two
    positions = np.arange(n)
    passes = np.stack([shuffle(n, s, 0) for s in range(runs)])
    fixed = (passes == positions).sum(axis=1)
    # Fixed points of a uniform permutation: Poisson(1) (mean 1, variance 1).
    assert abs(fixed.mean() - 1) < 0.25 and 0.6 < fixed.var() < 1.45, (fixed.mean(), fixed.var())
    # Correlations: pass to pass (same seed), seed to seed (adjacent seeds, same pass),
    # position to index, neighbouring positions. Each ~N(0, 1/n) if independent.
    later = np.stack([shuffle(n, s, 1) for s in range(runs)])
    limit = 5 / np.sqrt(n)
    for name, a, b in [
        ("pass to pass", passes, later),
        ("seed to seed", passes[:-1], passes[1:]),
        ("position to index", passes, np.broadcast_to(positions, passes.shape)),
        ("neighbouring positions", passes[:, :-1], passes[:, 1:]),
    ]:
        a = (a - a.mean(axis=1, keepdims=True)) / a.std(axis=1, keepdims=True)
        b = (b - b.mean(axis=1, keepdims=True)) / b.std(axis=1, keepdims=True)
        r = (a * b).mean(axis=1)
        assert np.abs(r).max() < limit and abs(r.mean()) < 4 / np.sqrt(n * len(r)), (name, r.max(), r.mean())
    # Displacements |index - position| / n: density 2 (1 - x) for a uniform permutation.
    d = (np.abs(passes[:50] - positions) / n).ravel()
    edges = np.linspace(0, 1, 11)
    expected = ((1 - edges[:-1]) ** 2 - (1 - edges[1:]) ** 2) * len(d)
    chi2 = (((np.histogram(d, edges)[0] - expected) ** 2) / expected).sum()
    assert chi2 < 40, chi2  # 9 degrees of freedom: 40 is p < 1e-5
    # The first item of a pass over the seeds: uniform over the space.
    counts = np.histogram(passes[:, 0], np.linspace(0, n, 6))[0]
    assert counts.min() > runs / 5 - 4 * np.sqrt(runs / 5), counts


# ---- small index spaces: exactly uniform (a Feistel network over a few items is not) ---------

PERMS_OF_5 = {p: i for i, p in enumerate(itertools.permutations(range(5)))}


def _chi2(counts):
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def test_small_passes_are_uniform_over_all_permutations():
    # Before: the 6-round Feistel network made some of the 120 permutations of 5 items 1.65x as
    # frequent as they should be and others 0.46x (chi2 ~1100 here).
    counts = np.zeros(120)
    for seed in range(4):
        order = kerasfeed.IndexOrder(5, shuffle=True, seed=seed)
        for epoch in range(1500):
            counts[PERMS_OF_5[tuple(order.indices(epoch).tolist())]] += 1
    assert _chi2(counts) < 185, _chi2(counts)  # 119 degrees of freedom: 185 is p < 1e-4
    assert counts.min() > 0


def test_neighbouring_items_are_not_adjacent_more_often_than_uniform():
    # Before: items i and i + 1 landed at neighbouring positions ~3 % too often for n up to ~100 (z ~ 7.5).
    n, hits, total = 16, 0, 0
    for seed in range(2):
        order = kerasfeed.IndexOrder(n, shuffle=True, seed=seed)
        for epoch in range(10_000):
            hits += int(np.sum(np.abs(np.diff(order.indices(epoch))) == 1))
            total += n - 1
    p = 2 / n
    z = (hits / total - p) / np.sqrt(p * (1 - p) / total)
    assert abs(z) < 4.5, z


def test_small_balanced_passes_are_uniform_too():
    # One class of 5 items, num_samples=5: a pass is a permutation of them (the interleaving).
    labels = np.array([0] * 5 + [1] * 3)
    counts = np.zeros(120)
    for seed in range(2):
        order = kerasfeed.BalancedOrder(labels, class_weights=[1, 0], num_samples=5, seed=seed)
        for epoch in range(1200):
            counts[PERMS_OF_5[tuple(order.indices(epoch).tolist())]] += 1
    assert _chi2(counts) < 185, _chi2(counts)
    # 2000 classes of 5 items, 2 of each per pass: which 2 is the class's own permutation's choice.
    # Before: the Feistel network over 5 items chose some pairs 1.085x as often as others 0.94x (chi2 ~63).
    pairs = {p: i for i, p in enumerate(itertools.combinations(range(5), 2))}
    order = kerasfeed.BalancedOrder(np.repeat(np.arange(2000), 5), num_samples=4000, seed=0)
    counts = np.zeros(10)
    for epoch in range(30):
        for a, b in (np.sort(order.indices(epoch)) % 5).reshape(2000, 2).tolist():
            counts[pairs[(a, b)]] += 1
    assert _chi2(counts) < 30, _chi2(counts)  # 9 degrees of freedom: 30 is p < 5e-4


def test_small_tables_are_cached_in_bounded_memory(monkeypatch):
    from kerasfeed.sampling import bijection

    monkeypatch.setattr(bijection, "TABLE_BUDGET", 100)
    first = bijection.table(60, 1, 16, 0)
    assert bijection.table(60, 1, 16, 0) is first and not first.flags.writeable
    for epoch in range(1, 6):
        bijection.table(60, 1, 16, epoch)
    assert bijection._tables_size <= 100 and (60, 1, 16, 0) not in bijection._tables
    np.testing.assert_array_equal(bijection.table(60, 1, 16, 0), first)  # drawn again: the same table
    np.testing.assert_array_equal(first, np.random.default_rng([1, 16, 0]).permutation(60))


def test_class_permutations_keyed_per_element_are_bijections_too():
    # BalancedOrder permutes each class with its own size and key, one call for the window.
    sizes = np.array([1, 2, 3, 64, 65, 1000])
    n = np.repeat(sizes, sizes)
    ranks = np.concatenate([np.arange(k) for k in sizes])
    keys = np.repeat(np.arange(len(sizes)), sizes).astype(np.uint64) * np.uint64(7919) + np.uint64(11)
    out = permute(ranks, n, keys)
    start = 0
    for k in sizes:
        assert sorted(out[start : start + k].tolist()) == list(range(k))
        start += k
    assert not np.array_equal(out[-1000:], np.arange(1000))


# ---- lazy views ----------------------------------------------------------------------------


def test_views_read_windows_items_slices_and_iterate():
    order = kerasfeed.IndexOrder(3 * CHUNK + 17, shuffle=True, seed=9, num_shards=2, shard_index=1)
    whole = order.indices(3)
    view = pass_view(order, 3)
    assert isinstance(view, OrderView) and len(view) == len(whole) == order.shard_length
    for start, stop in [(0, 5), (CHUNK - 3, CHUNK + 4), (10, 2 * CHUNK + 50), (len(whole) - 2, len(whole) + 9)]:
        np.testing.assert_array_equal(view.window(start, stop), whole[start:stop])
    assert view[0] == whole[0] and view[-1] == whole[-1] and type(view[5]) is int
    part = view[100:CHUNK + 300]
    assert len(part) == CHUNK + 200 and part[0] == whole[100] and part[-1] == whole[CHUNK + 299]
    assert list(part[7:12]) == whole[107:112].tolist() and view[0:] is view
    assert list(view) == whole.tolist() and np.array_equal(np.asarray(view), whole)
    assert view.same_pass(pass_view(order, 3)) and not view.same_pass(pass_view(order, 4))
    assert view.same_pass(whole) and part.same_pass(whole[100:CHUNK + 300])
    with pytest.raises(IndexError, match="position 999999 is out of range for a pass of"):
        view[999999]
    unshuffled = pass_view(kerasfeed.IndexOrder(10, num_shards=3, shard_index=2), 0)
    assert list(unshuffled) == [2, 5, 8]  # an arithmetic range
    assert isinstance(as_view(range(4, 10, 2)), RangeView) and list(as_view(range(4, 10, 2))) == [4, 6, 8]
    assert isinstance(as_view([3, 1]), ArrayView) and as_view(view) is view


def test_a_plan_over_a_huge_pass_holds_a_window_of_it():
    order = kerasfeed.IndexOrder(10**15, shuffle=True, seed=1)
    view = pass_view(order, 0)
    plan = PassPlan(0, view, window=4)
    started = []
    while plan.can_start():
        i = plan.next_index()
        plan.started(i, f"h{i}")
        started.append(i)
    assert started == view.window(0, 4).tolist() and plan.outstanding == 4
    ahead = view[10]
    assert plan.take(ahead, 0) == (True, None)  # made by the caller; the plan will skip it
    assert plan.take(started[0], 0) == (True, f"h{started[0]}")
    assert plan.take(view[LOOKAHEAD + 100], 0) == (False, None)  # too far ahead to be the plan's
    rest = [plan.next_index() for _ in range(7)]  # position 10 was claimed: skipped
    assert rest == [view[p] for p in (4, 5, 6, 7, 8, 9, 11)] and plan.taken == 2 and not plan.finished
    assert plan.is_pass(0, pass_view(order, 0)) and not plan.is_pass(1, pass_view(order, 0))


def test_orders_without_at_are_wrapped_and_checked_per_pass():
    class Reversed:  # a user's order: whole arrays only
        shard_length = 6

        def indices(self, epoch):
            return np.arange(6)[::-1] + epoch

    source = np.arange(7, dtype=np.int64)
    loader = kerasfeed.to_loader(source, batch_size=4, order=Reversed(), executor="threads")
    assert [b.tolist() for b in loader] == [[5, 4, 3, 2], [1, 0]]
    assert [b.tolist() for b in loader] == [[6, 5, 4, 3], [2, 1]]
    with pytest.raises(ValueError, match=r"Reversed.indices\(2\) returned index 7, outside the source's items \[0, 7\)"):
        list(loader)


# ---- compatibility with states saved by kerasfeed 0.1's whole-pass orders -------------------

LABELS = np.repeat(np.array([0, 1, 2]), [50, 20, 5])


def test_golden_passes_and_fingerprints_pin_the_algorithm():
    # Changing how (seed, pass, position) maps to an index must change ORDER_VERSION.
    order = kerasfeed.IndexOrder(10, shuffle=True, seed=1)
    assert order.indices(0).tolist() == [2, 6, 5, 0, 3, 7, 8, 4, 9, 1]
    assert order.indices(0).tolist() == np.random.default_rng([1, 16, 0]).permutation(10).tolist()
    assert order.fingerprint == "8dc6e84e90a4613b"
    assert kerasfeed.IndexOrder(10).fingerprint == "d78b6470a908c806"  # unshuffled: the same as 0.1's
    balanced = kerasfeed.BalancedOrder(LABELS, seed=1)
    assert balanced.indices(0)[:10].tolist() == [15, 28, 40, 52, 74, 73, 59, 73, 36, 66]
    assert balanced.fingerprint == "bcc943b1e391ceee"
    # Passes that did not change with order version per-position-2 keep their fingerprints (and states).
    big = kerasfeed.IndexOrder(SMALL_N + 1, shuffle=True, seed=1)
    assert big.at(0, np.arange(8)).tolist() == [58406, 59244, 18895, 32708, 43809, 21337, 18675, 159]
    assert big.fingerprint == "5cb53fd3c0b3db03"
    weighted = kerasfeed.WeightedOrder(np.arange(1, 11.0), seed=1)
    assert weighted.indices(0).tolist() == [5, 9, 6, 7, 5, 1, 4, 2, 5, 8]
    assert weighted.fingerprint == "ea1d73b7d2693af7"
    drawn = kerasfeed.WeightedOrder(np.arange(1, 11.0), num_samples=5, replacement=False, seed=1)
    assert drawn.indices(0).tolist() == [7, 8, 3, 9, 6] and drawn.fingerprint == "65749930d2f6a7ef"


def _saved_order(kind):
    """The source and the to_loader arguments of the orders whose old states the tests below resume."""
    if kind == "shuffle":
        return np.arange(10, dtype=np.int64), dict(shuffle=True, seed=1)
    return np.arange(len(LABELS), dtype=np.int64), dict(order=kerasfeed.BalancedOrder(LABELS, seed=1))


@pytest.mark.parametrize("saved, kind", [
    ("b31fcfd4447980b9", "shuffle"),  # what order version per-position-1 saved for IndexOrder(10, shuffle=True, seed=1)
    ("531cca3f406f4355", "balanced"),  # ... and for BalancedOrder(LABELS, seed=1)
])
def test_states_saved_by_the_feistel_only_orders_are_refused_with_a_way_on(saved, kind):
    source, kwargs = _saved_order(kind)
    state = {"epoch": 3, "batches": 1, "order": saved}
    with pytest.raises(ValueError, match=(
        r"`initial_state` was saved by an earlier kerasfeed whose shuffled and balanced orders permuted small index "
        r"spaces .*order version 'per-position-1', fingerprint '" + saved + r"'.*exactly uniformly .*"
        r"initial_state=\{'epoch': 4, 'batches': 0\} with fit\(..., initial_epoch=4\)\. "
        r"Received: initial_state=\{'epoch': 3, 'batches': 1, 'order': '" + saved + "'}"
    )):
        kerasfeed.to_loader(source, batch_size=2, initial_state=state, executor="threads", **kwargs)
    # A state of a large shuffled order (passes unchanged) still resumes.
    big = {"epoch": 0, "batches": 1, "order": "5cb53fd3c0b3db03"}
    loader = kerasfeed.to_loader(np.arange(SMALL_N + 1, dtype=np.int64), batch_size=SMALL_N // 2, shuffle=True,
                                 seed=1, initial_state=big, executor="threads")
    batches = list(loader)
    assert [len(b) for b in batches] == [SMALL_N // 2, 1]
    expected = kerasfeed.IndexOrder(SMALL_N + 1, shuffle=True, seed=1).at(0, np.arange(SMALL_N // 2, SMALL_N + 1))
    np.testing.assert_array_equal(np.concatenate(batches), expected)


def test_numpy_integer_arguments_become_plain_ints_and_errors_name_the_order():
    order = kerasfeed.IndexOrder(np.int64(10), shuffle=True, seed=np.uint64(1), num_shards=np.int32(2))
    assert repr(order) == "IndexOrder(length=10, shuffle=True, seed=1, num_shards=2, shard_index=0)"
    assert order.fingerprint == kerasfeed.IndexOrder(10, shuffle=True, seed=1, num_shards=2).fingerprint
    for kwargs in ({"seed": "a"}, {"shuffle": 1}, {"num_shards": 2.0}, {"num_shards": 11}, {"shard_index": 3}):
        with pytest.raises((TypeError, ValueError), match=r"^IndexOrder: .*Received: "):
            kerasfeed.IndexOrder(10, **kwargs)


@pytest.mark.parametrize("saved, kind", [
    ("f826f13da8cfb429", "shuffle"),  # what kerasfeed 0.1 saved for IndexOrder(10, shuffle=True, seed=1)
    ("ff35dcc72199f523", "balanced"),  # ... and for BalancedOrder(LABELS, seed=1)
])
def test_states_saved_by_the_whole_pass_orders_are_refused_with_a_way_on(saved, kind):
    source, kwargs = _saved_order(kind)
    state = {"epoch": 3, "batches": 1, "order": saved}
    with pytest.raises(ValueError, match=(
        r"`initial_state` was saved by kerasfeed 0.1, whose shuffled and sampled orders drew every pass whole "
        r".*initial_state=\{'epoch': 4, 'batches': 0\} with fit\(..., initial_epoch=4\)\. "
        r"Received: initial_state=\{'epoch': 3, 'batches': 1, 'order': '" + saved + "'}"
    )):
        kerasfeed.to_loader(source, batch_size=2, initial_state=state, executor="threads", **kwargs)
    # The way on: the next pass, without the fingerprint.
    loader = kerasfeed.to_loader(source, batch_size=2, initial_state={"epoch": 4, "batches": 0}, executor="threads",
                                 **kwargs)
    assert len(list(loader)) == len(loader)
    # An unshuffled order's passes did not change: its states resume as they are.
    plain = kerasfeed.to_loader(np.arange(10, dtype=np.int64), batch_size=2, executor="threads",
                                initial_state={"epoch": 0, "batches": 1, "order": "d78b6470a908c806"})
    assert [b.tolist() for b in plain] == [[2, 3], [4, 5], [6, 7], [8, 9]]


# ---- billion-item sources end to end (a subprocess: its RSS is measured alone) ----------------


def test_a_billion_items_shuffled_or_mixed_and_ten_million_labels_balanced_start_at_once():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = ROOT / "tests" / "reliability_scripts" / "index_space_memory.py"
    items, labels = 10**9, 10**7
    proc = subprocess.run([sys.executable, str(script), str(items), str(labels)], capture_output=True, text=True,
                          timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 7
    for r in results:
        idx = np.asarray(r["indices"])
        where = (r["kind"], r["front_end"], r["executor"], round(r["seconds"], 2), round(r["growth_mb"], 1))
        print(where)  # first 10 batches: seconds, peak RSS growth
        assert len(idx) == 2560 and idx.min() >= 0, where
        if r["kind"] == "shuffled":
            # A materialized pass of 10^9 would take 8 GB (a Python list: 36 GB).
            assert r["growth_mb"] < 300 and len(np.unique(idx)) == len(idx), where
            assert np.histogram(idx, np.linspace(0, items, 17))[0].min() > 80, where  # over the whole space
            np.testing.assert_array_equal(idx, results[0]["indices"])  # the same order on every path
        elif r["kind"] == "mixed":  # mix of two sources of 10^9 items, 3:1, then shuffled
            assert r["growth_mb"] < 300 and len(np.unique(idx)) == len(idx) and idx.max() < 2 * items, where
            share = np.mean(idx >= items)  # part 1's items
            assert abs(share - 0.25) < 4 * np.sqrt(0.25 * 0.75 / len(idx)), where
        else:
            assert r["growth_mb"] < 600 and idx.max() < labels, where
            share = np.mean(r["labels"])  # 1:49 labels, balanced to 1:1
            assert abs(share - 0.5) < 4 * np.sqrt(0.25 / len(idx)), where
            assert np.histogram(idx, np.linspace(0, labels, 17))[0].min() > 40, where
            np.testing.assert_array_equal(idx, results[5]["indices"])


def test_the_index_space_benchmark_runs_and_reports():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import index_space
    finally:
        sys.path.remove(str(ROOT))
    results = index_space.main(["--sizes", "3000", "--methods", "numpy-permutation"])
    (row,) = results["first_batch"]
    assert row["method"] == "numpy-permutation" and row["items"] == 3000 and row["distinct"] == 256, row
    costs = results["per_index_ns"]
    assert costs["IndexOrder.at (window of 4096)"] > 0 and "BalancedOrder.at (3000 labels)" in costs
    assert "| numpy-permutation | 3e+03 |" in index_space.to_markdown(results)
    with pytest.raises(SystemExit):
        index_space.main(["--methods", "shuffle-everything"])
