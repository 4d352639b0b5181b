"""Balanced and weighted per-pass orders, the order protocol of to_dataset, and order-aware resume."""

from __future__ import annotations

import gc
import json
import sys
import warnings

import cloudpickle
import keras
import numpy as np
import pytest

import kerasfeed
from kerasfeed.sampling.protocol import order_fingerprint, resolve_order

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# 1:50 imbalance, three classes: 1000 / 100 / 20 items.
LABELS = np.repeat(np.array([0, 1, 2], dtype=np.int64), [1000, 100, 20])


class Items(kerasfeed.SceneSequence):
    """Item i: (i as a 2-vector, label of i): the stream says which items came."""

    def __init__(self, labels=LABELS):
        super().__init__()
        self.labels = np.asarray(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return np.array([i, i], dtype=np.int64), np.int64(self.labels[i])


def _stream(ds):
    return [int(i) for x, _ in ds.as_numpy_iterator() for i in np.atleast_2d(x)[:, 0]]


# ---- proportions ----------------------------------------------------------------


def test_exact_balanced_passes_are_within_one_item_per_class():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=1000, seed=0)
    for epoch in range(6):
        counts = np.bincount(LABELS[order.indices(epoch)], minlength=3)
        assert counts.sum() == 1000
        assert np.all(np.abs(counts - 1000 / 3) <= 1), counts


def test_class_weights_set_the_proportions():
    order = kerasfeed.BalancedOrder(LABELS, class_weights={0: 2, 1: 1, 2: 1}, num_samples=999, seed=1)
    counts = np.bincount(LABELS[order.indices(0)], minlength=3)
    assert np.all(np.abs(counts - np.array([499.5, 249.75, 249.75])) <= 1), counts
    left_out = kerasfeed.BalancedOrder(LABELS, class_weights=[1, 0, 1], seed=1)
    assert set(LABELS[left_out.indices(0)].tolist()) == {0, 2}


def test_independent_draws_stay_within_statistical_bounds():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=3000, exact=False, seed=2)
    passes = [np.bincount(LABELS[order.indices(e)], minlength=3) for e in range(8)]
    sigma = np.sqrt(3000 * (1 / 3) * (2 / 3))
    for counts in passes:
        assert np.all(np.abs(counts - 1000) < 5 * sigma), counts
    assert len({tuple(c) for c in passes}) > 1  # counts really vary: independent draws


def test_weighted_order_frequencies_follow_the_weights():
    weights = np.array([1.0, 2.0, 0.0, 5.0, 2.0])
    order = kerasfeed.WeightedOrder(weights, num_samples=20000, seed=3)
    freq = sum(np.bincount(order.indices(e), minlength=5) for e in range(4)) / 80000
    p = weights / weights.sum()
    sigma = np.sqrt(p * (1 - p) / 80000)
    assert freq[2] == 0
    assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-12), (freq, p)


def test_rare_class_items_repeat_only_after_the_whole_class_came():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=3000, seed=4)  # class 2: 1000 draws of 20 items
    for epoch in range(3):
        idx = order.indices(epoch)
        for c in range(3):
            per_item = np.bincount(idx[LABELS[idx] == c], minlength=len(LABELS))[LABELS == c]
            k = (LABELS[idx] == c).sum()
            n = (LABELS == c).sum()
            # every item k // n or k // n + 1 times: none twice before all came once
            assert per_item.min() >= k // n and per_item.max() <= -(-k // n), (c, per_item.min(), per_item.max())


def test_without_replacement_every_item_at_most_once_per_pass():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=60, replacement=False, seed=5)
    idx = order.indices(0)
    assert len(set(idx.tolist())) == 60 and np.all(np.bincount(LABELS[idx]) == 20)
    draws = kerasfeed.BalancedOrder(LABELS, num_samples=500, replacement=False, exact=False, seed=5)
    assert len(set(draws.indices(1).tolist())) == 500
    weighted = kerasfeed.WeightedOrder(np.ones(50), num_samples=50, replacement=False, seed=5)
    assert sorted(weighted.indices(0).tolist()) == list(range(50))


# ---- determinism and shards -----------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda seed: kerasfeed.BalancedOrder(LABELS, num_samples=500, seed=seed),
    lambda seed: kerasfeed.BalancedOrder(LABELS, num_samples=500, exact=False, replacement=False, seed=seed),
    lambda seed: kerasfeed.WeightedOrder(np.arange(1, 101.0), num_samples=300, seed=seed),
    lambda seed: kerasfeed.WeightedOrder(np.arange(1, 101.0), num_samples=60, replacement=False, seed=seed),
])
def test_same_seed_same_passes_and_passes_differ(make):
    a, b, other = make(7), make(7), make(8)
    for epoch in (0, 1, 5):
        np.testing.assert_array_equal(a.indices(epoch), b.indices(epoch))
    assert not np.array_equal(a.indices(0), a.indices(1))
    assert not np.array_equal(a.indices(0), other.indices(0))
    assert a.indices(0).dtype == np.int64
    assert a.fingerprint == b.fingerprint != other.fingerprint


def test_shards_are_disjoint_equal_and_cover_the_pass():
    full = kerasfeed.BalancedOrder(LABELS, num_samples=1001, seed=9)
    shards = [kerasfeed.BalancedOrder(LABELS, num_samples=1001, seed=9, num_shards=3, shard_index=k) for k in range(3)]
    for epoch in (0, 3):
        parts = [s.indices(epoch) for s in shards]
        assert [len(p) for p in parts] == [333, 333, 333] == [s.shard_length for s in shards]
        # each position of the pass goes to exactly one shard
        joined = np.empty(999, dtype=np.int64)
        for k, p in enumerate(parts):
            joined[k::3] = p
        np.testing.assert_array_equal(joined, full.indices(epoch)[:999])
    # without replacement, the shards' items are disjoint
    unique = [kerasfeed.WeightedOrder(np.ones(100), num_samples=90, replacement=False, seed=1, num_shards=3, shard_index=k)
              for k in range(3)]
    sets = [set(o.indices(2).tolist()) for o in unique]
    assert all(len(s) == 30 for s in sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert shards[0].fingerprint == shards[2].fingerprint  # one run, every shard resumes from one state


@pytest.mark.parametrize("length", [103, 200_000])  # an exact permutation table, and the Feistel network
def test_fixed_shards_keep_their_items_every_pass_in_a_new_order(length):
    """IndexOrder(fixed_shards=True), the order for cache= on several hosts: each shard
    reads the same items every pass (disjoint, equal in number, the same remainder left
    out), each pass in another order; ``at`` agrees with ``indices`` (a resume)."""
    shards = [kerasfeed.IndexOrder(length, shuffle=True, seed=7, num_shards=4, shard_index=k, fixed_shards=True)
              for k in range(4)]
    passes = [[s.indices(epoch) for s in shards] for epoch in (0, 1, 5)]
    per_shard = length // 4
    for parts in passes:
        assert [len(p) for p in parts] == [per_shard] * 4 == [s.shard_length for s in shards]
        assert all(len(np.unique(p)) == per_shard for p in parts)  # a permutation of its items
        assert len(np.unique(np.concatenate(parts))) == 4 * per_shard  # disjoint
        assert all(p.min() >= 0 and p.max() < length for p in parts)
    for k in range(4):
        items = [set(parts[k].tolist()) for parts in passes]
        assert items[0] == items[1] == items[2], k  # the same items every pass
        assert not np.array_equal(passes[0][k], passes[1][k]), k  # in a new order
    positions = np.array([0, 3, per_shard - 1])
    np.testing.assert_array_equal(shards[2].at(5, positions), passes[2][2][positions])
    free = kerasfeed.IndexOrder(length, shuffle=True, seed=7, num_shards=4, shard_index=0)
    free_items = [set(free.indices(epoch).tolist()) for epoch in (0, 1)]
    assert free_items[0] != free_items[1]  # without fixed_shards a shard's items change every pass
    assert shards[0].fingerprint == shards[3].fingerprint == shards[0].pass_fingerprint != free.fingerprint
    assert "fixed_shards=True" in repr(shards[0]) and "fixed_shards" not in repr(free)


def test_more_than_two_to_the_24_items():
    n = 2**24 + 1_000_000
    labels = np.zeros(n, dtype=np.int8)
    labels[::51] = 1  # 1:50
    labels[-5:] = 2  # a tiny class at the very end
    order = kerasfeed.BalancedOrder(labels, num_samples=300_000, seed=0, num_shards=2, shard_index=1)
    idx = order.indices(0)
    assert idx.dtype == np.int64 and len(idx) == 150_000
    assert idx.max() >= 2**24 and idx.max() < n
    counts = np.bincount(labels[order.indices(0)], minlength=3)
    assert np.all(np.abs(counts - 50_000) <= 200), counts  # one shard of an exact pass
    assert set(np.flatnonzero(labels == 2).tolist()) <= set(order.indices(1).tolist()) | set(idx.tolist())
    weighted = kerasfeed.WeightedOrder(labels.astype(np.float64), num_samples=1000, seed=0)
    w_idx = weighted.indices(0)
    assert np.all(labels[w_idx] > 0) and w_idx.max() >= 2**24


# ---- to_dataset: the order protocol ------------------------------------------------


def test_to_dataset_reads_the_order_and_batches_it():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=300, seed=11)
    ds = kerasfeed.to_dataset(Items(), batch_size=32, order=order)
    assert int(ds.cardinality()) == 10
    for epoch in range(2):
        assert _stream(ds) == order.indices(epoch).tolist()


def test_a_custom_order_object_works_and_is_checked():
    class EveryOther:
        shard_length = 560

        def indices(self, epoch):
            return np.arange(epoch % 2, 1120, 2)

    ds = kerasfeed.to_dataset(Items(), order=EveryOther())
    assert _stream(ds) == list(range(0, 1120, 2)) and _stream(ds) == list(range(1, 1120, 2))

    class OutOfRange(EveryOther):
        def indices(self, epoch):
            return np.arange(560) * 3

    with pytest.raises(Exception, match=r"OutOfRange.indices\(0\) returned index 1677, outside the source's items \[0, 1120\)"):
        list(kerasfeed.to_dataset(Items(), order=OutOfRange()))
    with pytest.raises(TypeError, match="`order` must be an order object.*Received: order=5"):
        kerasfeed.to_dataset(Items(), order=5)


def test_order_and_order_arguments_together_is_an_error():
    order = kerasfeed.BalancedOrder(LABELS, seed=0)
    with pytest.raises(ValueError, match="Pass either `order` or `shuffle`.*not both.*Received: order=BalancedOrder.*shuffle=True, seed=3"):
        kerasfeed.to_dataset(Items(), order=order, shuffle=True, seed=3)
    with pytest.raises(ValueError, match="num_shards=2, shard_index=1"):
        kerasfeed.to_dataset(Items(), order=order, num_shards=2, shard_index=1)
    # without `order` the old arguments still work as before
    assert _stream(kerasfeed.to_dataset(Items(), shuffle=True, seed=3)) == kerasfeed.IndexOrder(1120, True, 3).indices(0).tolist()


def test_labels_whose_length_differs_from_the_source():
    order = kerasfeed.BalancedOrder(LABELS[:-1], seed=0)
    with pytest.raises(ValueError, match=r"`order` picks from 1119 items .* but the source has 1120 items.*Received: order=BalancedOrder\(<1119 labels"):
        kerasfeed.to_dataset(Items(), order=order)


def test_threads_and_processes_give_the_same_stream():
    order = kerasfeed.BalancedOrder(LABELS, num_samples=200, seed=12)
    threads = _stream(kerasfeed.to_dataset(Items(), batch_size=16, order=order))
    ds = kerasfeed.to_dataset(Items(), batch_size=16, order=order, executor="processes", workers=2)
    try:
        assert _stream(ds) == threads == order.indices(0).tolist()
        assert _stream(ds) == order.indices(1).tolist()
    finally:
        kerasfeed.executor_of(ds).close()
        del ds
        gc.collect()


# ---- resume -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: kerasfeed.BalancedOrder(LABELS, num_samples=200, seed=13),
    lambda: kerasfeed.WeightedOrder(np.linspace(0, 1, 1120), num_samples=200, seed=13),
])
def test_resume_exactly_mid_pass(make):
    ref = kerasfeed.to_dataset(Items(), batch_size=16, order=make())
    passes = [_stream(ref) for _ in range(3)]
    progress = kerasfeed.TrainingProgress({"epoch": 1, "batches": 5}, order=ref)
    state = progress.state()
    assert state["order"] == make().fingerprint and json.loads(json.dumps(state)) == state
    resumed = kerasfeed.to_dataset(Items(), batch_size=16, order=make(), initial_state=state)
    assert _stream(resumed) == passes[1][5 * 16:]
    assert _stream(resumed) == passes[2]


def test_balanced_orders_of_the_same_labels_in_another_dtype_resume_each_other():
    """int32 labels (an HDF5 label dataset) and int64 ones (a list), or strings of two widths, give the
    same passes: a state saved with one resumes with the other. Before, their fingerprints differed and the
    resume was refused. A state an earlier kerasfeed saved (its fingerprint hashed the dtype) resumes with
    labels of that dtype."""
    labels = np.asarray(LABELS)
    for a, b in [(labels.astype(np.int32), labels.astype(np.int64)),
                 (np.array([f"c{v}" for v in labels]), np.array([f"c{v}" for v in labels], dtype="<U12"))]:
        saved_order, order = kerasfeed.BalancedOrder(a, num_samples=64, seed=3), kerasfeed.BalancedOrder(b, seed=3,
                                                                                                            num_samples=64)
        assert np.array_equal(saved_order.indices(1), order.indices(1))
        ref = kerasfeed.to_dataset(Items(), batch_size=16, order=saved_order)
        passes = [_stream(ref) for _ in range(2)]
        state = kerasfeed.TrainingProgress({"epoch": 1, "batches": 2}, order=ref).state()
        resumed = kerasfeed.to_dataset(Items(), batch_size=16, order=order, initial_state=state)
        assert _stream(resumed) == passes[1][2 * 16:]
        assert saved_order.fingerprint_aliases  # int32, and strings: the dtype was hashed before
        for same in (saved_order, order):
            for earlier in same.fingerprint_aliases:
                kerasfeed.TrainingProgress({**state, "order": earlier}, order=same)
    with pytest.raises(ValueError, match="saved with a different order"):  # other values: other passes
        kerasfeed.TrainingProgress(state, order=kerasfeed.BalancedOrder(np.array([f"d{v}" for v in labels]), seed=3,
                                                                        num_samples=64))


def test_resume_with_a_different_order_is_refused_and_old_states_still_load():
    saved = kerasfeed.TrainingProgress({"epoch": 0, "batches": 2}, order=kerasfeed.BalancedOrder(LABELS, seed=1)).state()
    with pytest.raises(ValueError, match=r"`initial_state` was saved with a different order .*Received: initial_state=\{'epoch': 0, 'batches': 2, 'order': "):
        kerasfeed.to_dataset(Items(), order=kerasfeed.BalancedOrder(LABELS, seed=2), initial_state=saved)
    with pytest.raises(ValueError, match="saved with a different order"):
        kerasfeed.to_dataset(Items(), shuffle=True, seed=1, initial_state=saved)
    with pytest.raises(ValueError, match="saved with a different order"):
        kerasfeed.TrainingProgress(saved, order=kerasfeed.BalancedOrder(LABELS, class_weights=[1, 1, 2], seed=1))
    # a state without a fingerprint (saved before orders had one) resumes with any order
    old = {"epoch": 0, "batches": 2}
    ds = kerasfeed.to_dataset(Items(), batch_size=16, order=kerasfeed.BalancedOrder(LABELS, num_samples=64, seed=2), initial_state=old)
    assert len(_stream(ds)) == 32
    assert kerasfeed.TrainingProgress(old).state() == old
    # IndexOrder fingerprints: shuffle and seed matter, the shard index does not
    a = resolve_order(10, None, shuffle=True, seed=1, num_shards=2, shard_index=0)
    b = resolve_order(10, None, shuffle=True, seed=1, num_shards=2, shard_index=1)
    assert order_fingerprint(a) == order_fingerprint(b) != order_fingerprint(resolve_order(10, None, shuffle=True, seed=2))


def test_fit_records_the_order_and_learns_from_a_balanced_stream(tmp_path):
    order = kerasfeed.BalancedOrder(LABELS, num_samples=256, seed=14)
    ds = kerasfeed.to_dataset(Items(), batch_size=32, order=order).map(lambda x, y: (keras.ops.cast(x, "float32") / 1000.0, y))
    progress = kerasfeed.TrainingProgress(path=tmp_path / "state.json", order=ds)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=2, verbose=0, shuffle=False, callbacks=[progress])
    saved = kerasfeed.TrainingProgress.load(tmp_path / "state.json")
    assert saved == {"epoch": 2, "batches": 0, "order": order.fingerprint, "items": 0}


# ---- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(class_weights={0: 1, 1: 1, 2: 1, 7: 1}), r"`class_weights` has a weight for class 7, which no label has; the labels' classes are \[0, 1, 2\]"),
    (dict(class_weights={0: 1, 1: 1}), r"`class_weights` must give a weight for every class .*class 2 has none"),
    (dict(class_weights=[0, 0, 0]), r"`class_weights` are all zero.*Received: class_weights=\[0, 0, 0\]"),
    (dict(class_weights={0: 1, 1: -2, 2: 1}), r"`class_weights` must be finite and non-negative; class 1 has -2"),
    (dict(class_weights=[1, float("nan"), 1]), r"class_weights\[1\] is nan"),
    (dict(class_weights=[1, 1]), r"one weight per class.*3 classes.*Received: class_weights=\[1, 1\]"),
    (dict(num_samples=0), r"BalancedOrder: `num_samples` must be a positive int. Received: num_samples=0"),
    (dict(replacement=False, num_samples=100), r"replacement=False .* needs up to 34 items of class 2, which has only 20.*Received: num_samples=100, replacement=False"),
    (dict(replacement=False, exact=False, num_samples=2000), r"num_samples=2000 is more than the 1120 items.*Received: num_samples=2000, replacement=False"),
    (dict(num_shards=2), r"several shards need an explicit `seed`.*Received: seed=None, num_shards=2"),
])
def test_balanced_order_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kerasfeed.BalancedOrder(LABELS, **kwargs)


@pytest.mark.parametrize("weights, kwargs, message", [
    ([0.0, 0.0], {}, r"WeightedOrder: `weights` are all zero: nothing could ever be drawn. Received: weights=\[0.0, 0.0\]"),
    ([1.0, -1.0], {}, r"`weights` must be finite and non-negative; weights\[1\] is -1.0"),
    ([1.0, float("nan")], {}, r"weights\[1\] is nan"),
    ([1.0, 1.0], dict(num_samples=0), r"`num_samples` must be a positive int. Received: num_samples=0"),
    ([1.0, 0.0, 1.0], dict(replacement=False, num_samples=3), r"num_samples=3 is more than the 2 items of non-zero weight.*Received: num_samples=3, replacement=False"),
    ([[1.0, 2.0]], {}, r"`weights` must be a non-empty 1-D sequence"),
    (["1", "2"], {}, r"WeightedOrder: `weights` must be numbers. Received: weights=\['1', '2'\]"),  # not read as 1, 2
    (np.array([1 + 1j, 1.0]), {}, r"WeightedOrder: `weights` must be numbers. Received: weights="),  # not 1, 1
])
def test_weighted_order_bad_input(weights, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kerasfeed.WeightedOrder(weights, **kwargs)


def test_labels_must_be_one_per_item():
    with pytest.raises(ValueError, match=r"`labels` must be a non-empty 1-D array.*Received: labels of shape \(2, 3\)"):
        kerasfeed.BalancedOrder(np.zeros((2, 3)))


@pytest.mark.parametrize("labels, error, message", [
    # A missing label was a class of its own (NaN) or a bare '<' not supported ... (None).
    (np.array([0.0, 1.0, np.nan, 1.0, np.nan]), ValueError,
     r"2 of 5 labels are missing \(NaN or None\), the first at item 2;.*Received: labels\[2\]=nan$"),
    (["cat", None, "dog"], ValueError, r"1 of 3 labels are missing.*first at item 1;.*Received: labels\[1\]=None$"),
    (np.array(["cat", float("nan")], dtype=object), ValueError, r"first at item 1;.*Received: labels\[1\]=nan$"),
    (np.array([1, "a", 1], dtype=object), TypeError,
     r"labels must be of one comparable kind.*Received: labels of types \['int', 'str'\]$"),
])
def test_labels_that_name_no_class_are_refused_with_the_item(labels, error, message):
    with pytest.raises(error, match=message):
        kerasfeed.BalancedOrder(labels, seed=0)


def test_missing_labels_are_found_across_chunks(monkeypatch):
    from kerasfeed.sampling import labels as lab

    monkeypatch.setattr(lab, "CHUNK", 3)
    values = np.arange(10, dtype=np.float32)
    values[[4, 9]] = np.nan
    assert lab.missing_labels(values).tolist() == [4, 9]
    assert lab.missing_labels(np.array([1, None, 2, 3, None], dtype=object)).tolist() == [1, 4]
    assert lab.missing_labels(np.arange(7)).size == 0


def test_orders_and_mix_stay_free_of_tensorflow_and_keras():
    import subprocess

    code = (
        "import sys, numpy as np, kerasfeed\n"
        "from kerasfeed.sampling.protocol import resolve_order, order_fingerprint\n"
        "o = kerasfeed.BalancedOrder(np.array([0, 0, 0, 1]), seed=0); o.indices(0)\n"
        "w = kerasfeed.WeightedOrder([1.0, 2.0], seed=0); w.indices(0)\n"
        "m = kerasfeed.mix([np.arange(4), np.arange(4)]); m[3]\n"
        "order_fingerprint(resolve_order(4, o))\n"
        "assert not {'tensorflow', 'keras', 'h5py'} & set(sys.modules), sorted({'tensorflow', 'keras', 'h5py'} & set(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_weights_whose_sum_overflows_keep_their_proportions():
    # Each finite, the sum inf: item 0 was never drawn and weight-0 items were (the clamp at the
    # end of the cumulative sum); BalancedOrder failed with a bare IndexError.
    counts = np.bincount(kerasfeed.WeightedOrder([1e308, 1e308, 0.0], num_samples=2000, seed=0).indices(0), minlength=3)
    assert counts[2] == 0 and 900 < counts[0] < 1100, counts
    labels = np.array([0, 0, 1, 1])
    balanced = kerasfeed.BalancedOrder(labels, class_weights=[1e308, 1e308], num_samples=2000, seed=0)
    counts = np.bincount(labels[balanced.indices(0)], minlength=2)
    assert 900 < counts[0] < 1100, counts


def test_a_tiny_weight_beside_weights_whose_sum_overflows_stays_positive():
    """The overflowing sum was rescaled by the largest weight, under which 1e-300 became 0: a pass without
    replacement of every item was refused ("more than the 2 items of non-zero weight")."""
    order = kerasfeed.WeightedOrder([1e308, 1e308, 1e-300], num_samples=3, replacement=False, seed=0)
    assert sorted(order.indices(0).tolist()) == [0, 1, 2]


def test_subnormal_weights_never_draw_items_of_weight_zero():
    # Before: u * total rounded to the total's few subnormal steps and the clamp took the last item
    # (weight 0) half the time; without replacement E / w overflowed to inf, tied with zero weights.
    counts = np.bincount(kerasfeed.WeightedOrder([5e-324, 0.0, 0.0], num_samples=1000, seed=0).indices(0), minlength=3)
    assert counts.tolist() == [1000, 0, 0]
    counts = np.bincount(kerasfeed.WeightedOrder([1e-320, 0.0, 3e-320], num_samples=4000, seed=0).indices(0), minlength=3)
    assert counts[1] == 0 and 850 < counts[0] < 1150, counts
    # Proportions 1:2 of a total of 3 subnormal steps (u * total rounded to them gave item 0 only 1/6).
    counts = np.bincount(kerasfeed.WeightedOrder([5e-324, 1e-323], num_samples=3000, seed=0).indices(0), minlength=2)
    assert 900 < counts[0] < 1100, counts
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was: RuntimeWarning: overflow encountered in divide
        for seed in range(20):
            order = kerasfeed.WeightedOrder([1e-320, 0.0, 1e-320], num_samples=2, replacement=False, seed=seed)
            assert sorted(order.indices(0).tolist()) == [0, 2]


def test_weights_far_below_the_largest_are_drawn_before_weight_zero():
    # Normal weights, but E / 1e-320 overflows even next to 1.0: item 2 tied with the zero weights.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(20):
            order = kerasfeed.WeightedOrder([1.0, 0.0, 1e-320, 0.0], num_samples=2, replacement=False, seed=seed)
            assert order.indices(0).tolist() == [0, 2]
            order = kerasfeed.WeightedOrder([1.0, 0.0, 1e-320, 2.0, 1e-310], num_samples=4, replacement=False, seed=seed)
            assert order.indices(0).tolist()[2:] == [4, 2]


def test_weighted_passes_of_ordinary_weights_are_unchanged():
    # Pinned: the fixes for extreme weights must not move the draws of seeded orders.
    w = [0.3, 1.0, 2.5, 0.0, 4.0, 0.7, 1.5, 3.0]
    assert kerasfeed.WeightedOrder(w, num_samples=12, seed=0).indices(1).tolist() == [7, 7, 7, 2, 6, 6, 2, 4, 7, 2, 4, 7]
    assert kerasfeed.WeightedOrder(w, num_samples=6, replacement=False, seed=0).indices(1).tolist() == [4, 1, 6, 0, 7, 2]


def test_index_order_refuses_an_epoch_that_is_not_a_non_negative_int():
    order = kerasfeed.IndexOrder(10, shuffle=True, seed=0)
    for epoch in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^IndexOrder: `epoch` must be a non-negative int. Received: epoch={epoch!r}"):
            order.at(epoch, [0, 1])
        with pytest.raises(ValueError, match=r"^IndexOrder: `epoch`"):
            order.indices(epoch)
    np.testing.assert_array_equal(order.at(np.int64(2), [0, 1]), order.indices(2)[:2])


# ---- fixes: aliasing, huge passes, wide labels, bad positions ------------------------------


def test_weighted_orders_keep_their_own_copy_of_the_weights():
    # Before: replacement=False kept the caller's float64 array; editing it changed later passes
    # while the fingerprint (and so a saved state) still matched.
    for replacement in (True, False):
        w = np.ones(1000)
        order = kerasfeed.WeightedOrder(w, num_samples=10, replacement=replacement, seed=0)
        reference = kerasfeed.WeightedOrder(w.copy(), num_samples=10, replacement=replacement, seed=0)
        fingerprint = order.fingerprint
        w[:] = 0.0
        w[-10:] = 1.0  # the caller reuses its array
        np.testing.assert_array_equal(order.indices(7), reference.indices(7))
        assert order.fingerprint == fingerprint
    from kerasfeed import _validation

    given = np.array([1.0, 2.0])
    checked = _validation.weights("weights", given)
    assert not np.shares_memory(checked, given) and not checked.flags.writeable


def test_exact_class_counts_are_right_up_to_two_to_the_62_samples():
    # Before: float quotas past 2^53: negative counts, divide warnings, a bare IndexError from at().
    import warnings
    from fractions import Fraction

    labels = np.repeat(np.arange(3), 5)
    for s in (2**53 + 1, 10**16 + 1, 2**62):
        for weights in ([1, 1, 1], [0.1, 0.2, 0.7], [1, 2, 4]):
            order = kerasfeed.BalancedOrder(labels, class_weights=weights, num_samples=s, seed=0)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for epoch in range(3):
                    counts = order.class_targets(epoch)
                    exact = [Fraction(s) * Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
                    assert int(counts.sum()) == s and counts.dtype == np.int64, counts
                    assert all(abs(int(c) - q) < 1 for c, q in zip(counts.tolist(), exact)), (s, weights, counts)
                idx = order.at(0, np.arange(50))
            assert idx.min() >= 0 and idx.max() < 15


def test_exact_class_counts_match_the_float_computation_where_it_was_exact():
    # The integer computation gives today's counts wherever float64 carried the quotas exactly enough.
    from kerasfeed.sampling.weighted import STREAM_COUNTS

    rng = np.random.default_rng(123)
    for trial in range(300):
        k = int(rng.integers(1, 12))
        weights = [rng.integers(0, 10, k).astype(float), rng.random(k), np.round(rng.random(k), 1)][trial % 3]
        weights[0] += 1
        s = int(rng.integers(1, 2 ** int(rng.integers(1, 40))))
        order = kerasfeed.BalancedOrder(np.arange(k), class_weights=weights.tolist(), num_samples=s, seed=trial)
        for epoch in range(3):
            quota = s * order.proportions
            base = np.floor(quota).astype(np.int64)
            extra = s - int(base.sum())
            expected = base
            if extra:
                edges = np.concatenate([[0.0], np.cumsum(quota - base)])
                edges *= extra / edges[-1]
                u = order._rng(STREAM_COUNTS, epoch).random()
                expected = base + np.diff(np.floor(edges + u)).astype(np.int64)
            np.testing.assert_array_equal(order.class_targets(epoch), expected, err_msg=str((trial, s, weights)))


@pytest.mark.parametrize("labels", [
    np.array([2**63 + 1, 2**63 + 5, 2**63 + 1, 2**63 + 1], dtype=np.uint64),  # before: a bare OverflowError
    np.array([2**64 - 1, 2**64 - 3, 2**64 - 1], dtype=np.uint64),
    np.array([-128, 127, 0, -128], dtype=np.int8),
    np.array([-(2**63), -(2**63) + 7, -(2**63)], dtype=np.int64),
    np.array([2**63 - 1, 2**63 - 300, 2**63 - 1], dtype=np.int64),
])
def test_integer_labels_of_any_width_are_counted_exactly(labels):
    order = kerasfeed.BalancedOrder(labels, seed=0)
    classes, counts = np.unique(labels, return_counts=True)
    assert order.classes.dtype == labels.dtype and order.classes.tolist() == classes.tolist()
    assert order.class_counts.tolist() == counts.tolist()
    for c in classes.tolist():
        assert sorted(np.flatnonzero(labels == c).tolist()) == sorted(
            order._members[order._offsets[classes.tolist().index(c)] : order._offsets[classes.tolist().index(c) + 1]]
            .tolist()
        )


def test_mixed_int_and_str_labels_in_a_list_are_refused():
    # Before: numpy turned [0, 1, 'a'] into the strings '0', '1', 'a' without a word.
    with pytest.raises(TypeError, match=r"^BalancedOrder: the labels must be of one comparable kind.*"
                                        r"Received: labels of types \['int', 'str'\]$"):
        kerasfeed.BalancedOrder([0, 1, "a"])
    assert kerasfeed.BalancedOrder(["a", np.str_("b"), "a"], seed=0).classes.tolist() == ["a", "b"]


def _orders():
    return [
        kerasfeed.IndexOrder(10, shuffle=True, seed=0),
        kerasfeed.IndexOrder(10),
        kerasfeed.BalancedOrder(LABELS, seed=0),
        kerasfeed.WeightedOrder([1.0, 2.0, 3.0], seed=0),
    ]


@pytest.mark.parametrize("positions, error, message", [
    ([0.9], TypeError, r"`positions` must be integers .*Received: positions=\[0.9\]"),  # before: read as 0
    (["3"], TypeError, r"`positions` must be integers .*Received: positions=\['3'\]"),  # before: read as 3
    ([True], TypeError, r"Received: positions=\[True\]"),
    (np.arange(20.0), TypeError, r"Received: positions=ndarray of 20: \[0.0, 1.0, "),
    ([2**64], IndexError, r"positions must be in \[0, \d+\) .*Received: position 18446744073709551616"),  # before: OverflowError
    (np.array([2**63], dtype=np.uint64), IndexError, r"Received: position 9223372036854775808"),
])
def test_positions_that_are_not_integers_in_range_are_refused(positions, error, message):
    for order in _orders():
        with pytest.raises(error, match=rf"^{type(order).__name__}\.at: .*{message}"):
            order.at(0, positions)
        assert order.at(0, []).tolist() == [] and order.at(0, np.uint8([1])).tolist() == order.at(0, [1]).tolist()


def test_sampled_orders_name_themselves_in_epoch_errors():
    for order in _orders()[2:]:
        name = type(order).__name__
        for epoch in (-1, 1.5):
            with pytest.raises(ValueError, match=rf"^{name}: `epoch` must be a non-negative int. Received: epoch={epoch}"):
                order.at(epoch, [0])
            with pytest.raises(ValueError, match=rf"^{name}: `epoch`"):
                order.indices(epoch)


def test_class_tables_past_the_budget_give_the_same_passes(monkeypatch):
    from kerasfeed.sampling import balanced

    labels = np.repeat(np.arange(5), [3, 70_000, 10, 1, 500])  # one class past SMALL_N items
    order = kerasfeed.BalancedOrder(labels, num_samples=80_000, seed=3)
    passes = [order.indices(e) for e in range(2)]
    monkeypatch.setattr(balanced, "TABLE_BUDGET", 0)  # class by class, through the LRU of tables
    again = kerasfeed.BalancedOrder(labels, num_samples=80_000, seed=3)
    for e in range(2):
        np.testing.assert_array_equal(again.indices(e), passes[e])
    assert np.bincount(labels[passes[0]]).tolist() == [16_000] * 5


_HELD_BY_A_SWMR_WRITER = """
import sys, h5py, numpy as np
f = h5py.File(sys.argv[1], "w", libver="latest")
f.create_dataset("labels", data=np.arange(40) % 2, maxshape=(None,), chunks=(16,))
f.swmr_mode = True
f.flush()
print("ok", flush=True)
sys.stdin.readline()
f.close()
"""


def test_balanced_order_from_hdf5_reads_a_file_a_swmr_writer_holds_with_swmr(tmp_path):
    # Without swmr its open failed with h5py's bare error, naming neither the file nor the remedy.
    import subprocess

    path = str(tmp_path / "live.h5")
    writer = subprocess.Popen([sys.executable, "-c", _HELD_BY_A_SWMR_WRITER, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ok"
        with pytest.raises(OSError, match=rf"from_hdf5: file '{path}' could not be opened .*pass swmr=True"):
            kerasfeed.BalancedOrder.from_hdf5(path, "labels", seed=0)
        order = kerasfeed.BalancedOrder.from_hdf5(path, "labels", seed=0, swmr=True)
        assert len(order.indices(0)) == 40
    finally:
        writer.communicate("\n", timeout=60)


def test_a_state_of_another_shard_count_is_refused_naming_the_counts():
    # Saved by 2 JAX processes (each cutting the order), resumed on 1 (or 4): the refusal named only two
    # fingerprints of "a different order" the user had built the same way (helper).
    from kerasfeed.loading.hosts import _ProcessShardOrder
    from kerasfeed.sampling.protocol import check_resume_order
    from kerasfeed.sampling.state import ResumeState

    labels = np.array([0] * 50 + [1] * 10 + [2] * 4)
    balanced = kerasfeed.BalancedOrder(labels, seed=0)
    index = kerasfeed.IndexOrder(64, shuffle=True, seed=0)
    cases = [
        (_ProcessShardOrder(balanced, 2, 0), balanced, 2, 1),
        (balanced, _ProcessShardOrder(balanced, 2, 1), 1, 2),
        (_ProcessShardOrder(balanced, 2, 0), _ProcessShardOrder(balanced, 4, 3), 2, 4),
        (kerasfeed.IndexOrder(64, shuffle=True, seed=0, num_shards=2, shard_index=1), index, 2, 1),
        (index, kerasfeed.IndexOrder(64, shuffle=True, seed=0, num_shards=4, shard_index=0), 1, 4),
    ]
    for saved_on, now, then, count in cases:
        state = ResumeState(1, 3, order_fingerprint(saved_on))
        with pytest.raises(ValueError, match=rf"saved by a run reading this order in {then} shard\(s\) .*this run "
                                             rf"reads it in {count}: .*Resume with {then} shard\(s\), or from a "
                                             r"pass boundary: initial_state=\{'epoch': 2, 'batches': 0\}"):
            check_resume_order(state, now)
        # At a pass boundary (what TrainingProgress writes at every epoch's end) the position is the same
        # whatever the shards: resumed, not refused (its suggestion skipped a whole pass).
        check_resume_order(ResumeState(1, 0, order_fingerprint(saved_on)), now)
    # Another seed is another order, whatever the shards.
    with pytest.raises(ValueError, match=r"saved with a different order \(fingerprint"):
        check_resume_order(ResumeState(1, 3, order_fingerprint(kerasfeed.BalancedOrder(labels, seed=1))), balanced)
