"""kerasfeed.mix: several sources as one indexable source in given proportions; and H5RowSequence."""

from __future__ import annotations

import gc
import pickle
import sys
import warnings

import cloudpickle
import h5py
import keras
import numpy as np
import pytest

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Part(kerasfeed.SceneSequence):
    """Batch i of part `tag`: x = [tag, i, epoch], y = tag; records its epoch hooks."""

    def __init__(self, tag, n):
        super().__init__()
        self.tag, self.n, self.hooks = tag, n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.array([[self.tag, i, self.epoch]], dtype=np.float32), np.array([self.tag], dtype=np.int64)

    def on_epoch_begin(self):
        self.hooks.append(("begin", self.epoch))

    def on_epoch_end(self):
        self.hooks.append(("end", self.epoch))


def _pairs(mixed):
    return [mixed.locate(i) for i in range(len(mixed))]


def test_proportions_by_arithmetic_each_item_once():
    a, b, c = np.arange(1000), np.arange(1000, 1300), np.arange(5000, 5050)
    mixed = kerasfeed.mix([a, b, c], [6, 3, 1])
    assert mixed.slots.tolist() == [6, 3, 1] and mixed.period == 10
    pairs = _pairs(mixed)
    assert len(set(pairs)) == len(pairs)  # each element from exactly one part, no item twice
    # 50 whole blocks, then the block's first slots (a, b, a, a, b, a) until c runs out
    assert len(mixed) == 506
    counts = np.bincount([p for p, _ in pairs], minlength=3)
    assert counts.tolist() == [304, 152, 50]
    parts = np.array([p for p, _ in pairs])
    for k in range(1, len(mixed) + 1):  # every prefix within one item per part of the proportions
        assert np.all(np.abs(np.bincount(parts[:k], minlength=3) - k * np.array([0.6, 0.3, 0.1])) < 1)
    assert [mixed[i] for i in (0, 1, 2, -1)] == [a[pairs[0][1]], [a, b, c][pairs[1][0]][pairs[1][1]], [a, b, c][pairs[2][0]][pairs[2][1]], [a, b, c][pairs[-1][0]][pairs[-1][1]]]
    with pytest.raises(IndexError, match="index 506 is out of range for 506 elements"):
        mixed[506]


def test_every_prefix_holds_each_share_within_less_than_one_item():
    """Tijdeman's bound, 1 - 1/(2n - 2) for n parts, on every prefix of a block (blocks repeat whole,
    so of the mix); a window is the difference of two prefixes: within less than two."""
    rng = np.random.default_rng(0)
    cases = [[7, 1, 1, 1], [1, 1, 1, 1, 5], [6, 3, 1], [1, 0, 2]]
    cases += [rng.integers(1, 40, rng.integers(2, 9)).tolist() for _ in range(150)]
    for w in cases:
        mixed = kerasfeed.mix([np.arange(100)] * len(w), w, check=False)
        block = np.array([mixed.locate(i)[0] for i in range(mixed.period)])
        n = sum(1 for x in w if x > 0)
        counts = np.cumsum(np.eye(len(w), dtype=int)[block], axis=0)
        drift = counts - np.arange(1, mixed.period + 1)[:, None] * mixed.proportions
        assert np.abs(drift).max() <= 1 - 1 / (2 * n - 2) + 1e-9, (w, block.tolist())
        assert np.bincount(block, minlength=len(w)).tolist() == mixed.slots.tolist()


def test_rounded_weights_that_move_a_share_are_warned_about():
    with pytest.warns(UserWarning, match=r"gives part 1 a share of 9.999e-05 where the weights ask for 4.99975e-05"):
        huge = kerasfeed.mix([np.arange(10)] * 2, [20000, 1], check=False)
    assert huge.slots.tolist() == [10000, 1]
    with pytest.warns(UserWarning, match=r"part 0 a share .* Received: weights=\[1e-06, 1.0\]"):
        kerasfeed.mix([np.arange(10)] * 2, [1e-6, 1], check=False)
    # A positive weight whose share float64 cannot hold (it said "ask for 0"; 1e-308 also gave numpy's
    # "divide by zero" RuntimeWarning).
    for tiny in (1e-300, 1e-308):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert kerasfeed.mix([np.arange(10)] * 2, [1e308, tiny], check=False).slots.tolist() == [10000, 1]
        assert [str(w.message).split(". Whole")[0] for w in seen] == [
            "mix: the weights are rounded to whole slots of a block of 10000, which gives part 1 a share of "
            "9.999e-05 where the weights ask for a share under float64's smallest number"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kerasfeed.mix([np.arange(10)] * 2, [6000, 4000], check=False).slots.tolist() == [3, 2]
        assert kerasfeed.mix([np.arange(10)] * 2, [1 / 3, 2 / 3], check=False).period == 10_000


def test_float_weights_and_the_partial_last_block():
    mixed = kerasfeed.mix([np.arange(100), np.arange(7)], [0.75, 0.25])
    assert mixed.slots.tolist() == [3, 1]
    assert len(mixed) == 7 * 4 + 2  # 7 whole blocks (slots a, a, b, a), then a, a before b runs out
    counts = np.bincount([p for p, _ in _pairs(mixed)])
    assert counts.tolist() == [23, 7]
    odd = kerasfeed.mix([np.arange(1000), np.arange(1000)], [1 / 3, 2 / 3])
    assert np.allclose(odd.proportions, [1 / 3, 2 / 3], atol=1e-4)


def test_seed_shuffles_every_block_the_same_way_every_time():
    parts = [np.arange(400), np.arange(400, 600)]
    plain = kerasfeed.mix(parts, [2, 1])
    seeded, again, other = (kerasfeed.mix(parts, [2, 1], seed=s) for s in (3, 3, 4))
    assert _pairs(seeded) == _pairs(again) != _pairs(other)
    assert _pairs(seeded) != _pairs(plain) and sorted(_pairs(seeded)) == sorted(_pairs(plain))
    for start in range(0, len(seeded) - 2, 3):  # whole blocks keep the proportions exactly
        assert sorted(p for p, _ in _pairs(seeded)[start:start + 3]) == [0, 0, 1]
    assert _pairs(pickle.loads(pickle.dumps(seeded))) == _pairs(seeded)


def test_mismatched_items_are_named():
    with pytest.raises(ValueError, match=r"field x of part 1 differs from part 0: part 0 has float32 with 2 dims, part 1 has float64 with 2 dims"):
        kerasfeed.mix([[(np.zeros((2, 3), "float32"), 1)], [(np.zeros((2, 3)), 1)]], [1, 1])
    with pytest.raises(ValueError, match=r"items of part 2 have a different structure.*part 0 gives \(\{'a': an array\}, an array\), part 2 gives \(\{'b': an array\}, an array\)"):
        kerasfeed.mix([[({"a": 1}, 2)], [({"a": 1}, 2)], [({"b": 1}, 2)]])
    with pytest.raises(ValueError, match=r"field y\['m'\] of part 1"):
        kerasfeed.mix([[(1, {"m": np.zeros(3)})], [(1, {"m": np.zeros((3, 1))})]])


@pytest.mark.parametrize("sources, weights, error, message", [
    ([np.arange(3)], None, ValueError, r"`sources` must be a list or tuple of two or more"),
    ([np.arange(3), np.arange(3)], [1, -1], ValueError, r"mix: `weights` must be finite and non-negative; weights\[1\] is -1.0"),
    ([np.arange(3), np.arange(3)], [0, 0], ValueError, r"mix: `weights` are all zero.*Received: weights=\[0, 0\]"),
    ([np.arange(3), np.arange(3)], [1, float("nan")], ValueError, r"weights\[1\] is nan"),
    ([np.arange(3), np.arange(3)], [1, 2, 3], ValueError, r"one weight per part \(2 parts\). Received: weights=\[1, 2, 3\]"),
    ([np.arange(3), 5], None, TypeError, r"mix: part 1: kerasfeed needs an indexable source"),
])
def test_bad_mix_arguments(sources, weights, error, message):
    with pytest.raises(error, match=message):
        kerasfeed.mix(sources, weights)


def test_scene_sequences_mix_into_a_scene_sequence_for_fit():
    parts = [Part(0, 30), Part(1, 10)]
    mixed = kerasfeed.mix(parts, [1, 1], seed=0)
    assert isinstance(mixed, kerasfeed.SceneSequence) and isinstance(mixed, keras.utils.PyDataset) and len(mixed) == 21
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(mixed, epochs=2, verbose=0)
    # Keras' epoch hooks reached every part: each part's epoch advanced with the mix's
    assert mixed.epoch == 2 and [p.epoch for p in parts] == [2, 2]
    assert [h for h in parts[1].hooks if h[0] == "begin"] == [("begin", 0), ("begin", 1)]


def test_mix_through_to_dataset_threads_and_processes_resume():
    mixed = kerasfeed.mix([Part(0, 40), Part(1, 20)], [2, 1], seed=1)

    def stream(ds):
        return [tuple(int(v) for v in x[0]) for x, _ in ds.as_numpy_iterator()]

    ref = kerasfeed.to_dataset(mixed, shuffle=True, seed=5)
    passes = [stream(ref) for _ in range(2)]
    # set_epoch reached the parts: items of pass 1 carry epoch 1
    assert {e for _, _, e in passes[1]} == {1} and {e for _, _, e in passes[0]} == {0}
    assert sorted((t, i) for t, i, _ in passes[0]) == sorted(mixed.locate(k) for k in range(len(mixed)))
    ds = kerasfeed.to_dataset(mixed, shuffle=True, seed=5, executor="processes", workers=2)
    try:
        assert [stream(ds) for _ in range(2)] == passes
    finally:
        kerasfeed.executor_of(ds).close()
        del ds
        gc.collect()
    resumed = kerasfeed.to_dataset(mixed, shuffle=True, seed=5, initial_state={"epoch": 1, "batches": 7})
    assert stream(resumed) == passes[1][7:]


# ---- H5RowSequence: batches of the rows an order picks ----------------------------


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    a = make_synthetic_scenes(d / "a.h5", num_scenes=96, points_per_scene=16, chunk_scenes=4, seed=1)
    b = make_synthetic_scenes(d / "b.h5", num_scenes=64, points_per_scene=16, chunk_scenes=4, seed=2)
    # 1:20 imbalance in the labels of the two files together
    for path, n in ((a, 96), (b, 64)):
        with h5py.File(path, "a") as f:
            f["labels"][...] = np.where(np.arange(n) % 21 == 0, 1, 0)
    return [str(a), str(b)]


def test_h5_rows_balanced_batches_read_the_right_rows(scenes):
    order = kerasfeed.BalancedOrder.from_hdf5(scenes, "labels", seed=0, num_samples=100)
    seq = kerasfeed.H5RowSequence(scenes, ("points", "labels"), 20, order=order)
    assert len(seq) == 5
    points = np.concatenate([h5py.File(p, "r")["points"][()] for p in scenes])
    labels = np.concatenate([h5py.File(p, "r")["labels"][()] for p in scenes])
    for epoch in range(2):
        seq.set_epoch(epoch)
        got = [seq[i] for i in range(len(seq))]
        rows = np.concatenate([seq.batch_rows(i) for i in range(len(seq))])
        np.testing.assert_array_equal(rows, order.indices(epoch))
        np.testing.assert_array_equal(np.concatenate([x for x, _ in got]), points[rows])
        np.testing.assert_array_equal(np.concatenate([y for _, y in got]), labels[rows])
        assert np.bincount(labels[rows]).tolist() == [50, 50]  # 8 rare rows, each read ~6 times
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=2)
    try:
        ys = [y for _, y in ds.as_numpy_iterator()]
        np.testing.assert_array_equal(np.concatenate(ys), labels[order.indices(0)])
    finally:
        kerasfeed.executor_of(ds).close()
        del ds
        gc.collect()
    seq.close()


def test_h5_rows_bad_input(scenes):
    short = kerasfeed.BalancedOrder(np.zeros(100, np.int64), seed=0)
    with pytest.raises(ValueError, match=r"H5RowSequence: `order` picks from 100 items .* but the source has 160 items.*\(the files hold 160 rows\)"):
        kerasfeed.H5RowSequence(scenes, "points", 8, order=short)
    with pytest.raises(TypeError, match="`order` is required"):
        kerasfeed.H5RowSequence(scenes, "points", 8, order=None)
    with pytest.raises(ValueError, match=r"from_hdf5: file '.*a.h5' has no dataset 'nope'"):
        kerasfeed.BalancedOrder.from_hdf5(scenes, "nope")
    with pytest.raises(ValueError, match=r"must hold one label per row, shape \(N,\) or \(N, 1\). Received: shape=\(96, 16\)"):
        kerasfeed.BalancedOrder.from_hdf5(scenes, "point_labels")
    # Named, not numpy's "need at least one array to concatenate" or an open file read as a list of names.
    with pytest.raises(ValueError, match=r"from_hdf5: `paths` is empty: no file to read labels from. Received: paths=\[\]"):
        kerasfeed.BalancedOrder.from_hdf5([], "labels")
    with h5py.File(scenes[0], "r") as f, pytest.raises(TypeError, match=r"`paths` must be .* Received: an open h5py file"):
        kerasfeed.BalancedOrder.from_hdf5(f, "labels")


def test_balanced_order_from_hdf5_reads_string_labels_as_str(tmp_path):
    """HDF5 strings read back as bytes: class_weights={"cat": ...} was refused, and the fingerprint differed
    from the same labels held in memory (a resume between the two was refused)."""
    names = np.array(["cat", "dog", "dog", "cat", "bird", "dog"] * 10)
    path = str(tmp_path / "labels.h5")
    with h5py.File(path, "w") as f:
        f["vlen"] = names.astype(h5py.string_dtype())
        f["fixed"] = names.astype("S4")
    in_memory = kerasfeed.BalancedOrder(names, seed=0, class_weights={"cat": 1, "dog": 1, "bird": 2})
    for key in ("vlen", "fixed"):
        read = kerasfeed.BalancedOrder.from_hdf5(path, key, seed=0, class_weights={"cat": 1, "dog": 1, "bird": 2})
        assert read.classes.tolist() == ["bird", "cat", "dog"] and read.fingerprint == in_memory.fingerprint
        assert np.array_equal(read.indices(1), in_memory.indices(1))


def test_balanced_order_from_hdf5_reads_a_url_s_labels_as_the_local_file_s(tmp_path):
    from remote_servers import http_server

    path = make_synthetic_scenes(tmp_path / "b.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4, seed=1)
    local = kerasfeed.BalancedOrder.from_hdf5(str(path), "labels", seed=0)
    with http_server({"b.h5": str(path)}) as srv:
        remote = kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/b.h5", "labels", seed=0)
        per_scheme = kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/b.h5", "labels", seed=0,
                                                       storage_options={"http": {}})
        with pytest.raises(FileNotFoundError, match="missing.h5"):
            kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/missing.h5", "labels", seed=0)
    with http_server({"b.h5": str(path)}, token="t0k") as locked:  # keyed as the readers take it, s3a too
        keyed = kerasfeed.BalancedOrder.from_hdf5(
            f"{locked.url}/b.h5", "labels", seed=0,
            storage_options={"s3a": {"anon": True}, "http": {"headers": {"Authorization": "Bearer t0k"}}})
    for order in (remote, per_scheme, keyed):
        np.testing.assert_array_equal(order.proportions, local.proportions)
        np.testing.assert_array_equal(order.indices(0), local.indices(0))
