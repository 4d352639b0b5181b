"""Grouped hand-over: small fixed-shape items reach tf.data several per Python call."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.loading.groups import (
    GROUP_BYTES,
    GROUP_ITEM_BYTES,
    MAX_GROUP,
    GroupLoader,
    RunLoader,
    auto_group_size,
)


class Small(kerasfeed.SceneSequence):
    """Item i: x = [i, i, i] (float32), y = i (int64); ``bad`` indices raise."""

    def __init__(self, n=40, bad=(), shape=(3,)):
        super().__init__()
        self.n, self.bad, self.shape = n, set(bad), shape
        self.events = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"scene {i} is unreadable")
        return np.full(self.shape, i, np.float32), np.int64(i)

    def on_epoch_begin(self):
        self.events.append("begin")

    def on_epoch_end(self):
        super().on_epoch_end()
        self.events.append("end")


class Ragged(Small):
    """Batches of 1-3 rows: the leading (batch) dimension varies."""

    def __getitem__(self, i):
        return np.full((1 + i % 3, 2), i, np.float32), np.full((1 + i % 3,), i, np.int64)


class Wide(Small):
    """An inner dimension varies: such items cannot be grouped."""

    def __getitem__(self, i):
        return np.full((2, 1 + i % 3), i, np.float32), np.int64(i)


def _ys(ds):
    return [int(y) for _, y in ds.as_numpy_iterator()]


def test_small_items_are_grouped_and_arrive_in_order_every_pass():
    seq = Small(n=37)
    grouped = kerasfeed.to_dataset(seq, shuffle=True, seed=3)
    single = kerasfeed.to_dataset(Small(n=37), shuffle=True, seed=3, group_items=1)
    assert grouped._kerasfeed_group_items == MAX_GROUP
    assert single._kerasfeed_group_items == 1
    assert int(grouped.cardinality()) == 37
    assert grouped.element_spec == single.element_spec  # the groups do not show
    for _ in range(2):
        got, want = list(grouped.as_numpy_iterator()), list(single.as_numpy_iterator())
        assert [int(y) for _, y in got] == [int(y) for _, y in want]
        assert sorted(int(y) for _, y in got) == list(range(37))
        for x, y in got:
            np.testing.assert_array_equal(x, np.full((3,), y, np.float32))
    assert seq.events == ["begin", "end", "begin", "end"]


def test_grouping_applies_to_processes_and_to_batched_samples():
    seq = Small(n=21)
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=1, batch_size=4, group_items=5)
    try:
        assert ds._kerasfeed_group_items == 5
        batches = list(ds.as_numpy_iterator())
        assert [b[1].tolist() for b in batches] == [list(range(k, min(k + 4, 21))) for k in range(0, 21, 4)]
    finally:
        ds._kerasfeed_executor.close()


def test_batches_of_varying_size_are_grouped_and_split_back_exactly():
    ds = kerasfeed.to_dataset(Ragged(n=20))
    assert ds._kerasfeed_group_items == MAX_GROUP
    assert ds.element_spec == (tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None], tf.int64))
    for i, (x, y) in enumerate(ds.as_numpy_iterator()):
        np.testing.assert_array_equal(x, np.full((1 + i % 3, 2), i, np.float32))
        np.testing.assert_array_equal(y, np.full((1 + i % 3,), i, np.int64))
    assert i == 19


def test_group_size_follows_the_item_size():
    assert auto_group_size(12, True) == MAX_GROUP  # a few bytes: the most per call
    assert auto_group_size(32 * 2**10, True) == GROUP_BYTES // (32 * 2**10)  # at most GROUP_BYTES per call
    assert auto_group_size(GROUP_ITEM_BYTES, True) >= 2
    assert auto_group_size(GROUP_ITEM_BYTES + 1, True) == 1 and auto_group_size(12, False) == 1


def test_large_variable_or_parallel_items_are_not_grouped():
    assert kerasfeed.to_dataset(Small(n=4, shape=(128, 128)))._kerasfeed_group_items == 1  # 64 KB + 8 B
    assert kerasfeed.to_dataset(Wide(n=6))._kerasfeed_group_items == 1
    assert kerasfeed.to_dataset(Small(n=4), num_parallel_calls=2)._kerasfeed_group_items == 1
    assert _ys(kerasfeed.to_dataset(Wide(n=6))) == list(range(6))


def test_group_items_argument_errors():
    with pytest.raises(ValueError, match=r"`group_items` must be a positive int. Received: group_items=0"):
        kerasfeed.to_dataset(Small(), group_items=0)
    with pytest.raises(ValueError, match=r"fixed shape \(but for a leading batch dimension\) and a numeric dtype.*Received: group_items=4"):
        kerasfeed.to_dataset(Wide(), group_items=4)
    with pytest.raises(ValueError, match=r"num_parallel_calls=None.*Received: group_items=4"):
        kerasfeed.to_dataset(Small(), group_items=4, num_parallel_calls=2)


def test_item_error_inside_a_group_surfaces_at_its_own_position():
    ds = kerasfeed.to_dataset(Small(n=40, bad=(21,)))  # groups [0, 16), [16, 32), [32, 40)
    got = []
    with pytest.raises(tf.errors.OpError, match=r"Small\[21\] raised ValueError: scene 21 is unreadable"):
        for _, y in ds:
            got.append(int(y))
    assert got == list(range(21))  # 16..20 came before the error, from the same call


def test_item_error_in_the_last_group_is_raised_at_its_own_position():
    ds = kerasfeed.to_dataset(Small(n=40, bad=(38,)))  # batches of one size: dense runs
    assert isinstance(ds._kerasfeed_groups, RunLoader)
    got = []
    with pytest.raises(tf.errors.OpError, match=r"Small\[38\] raised ValueError"):
        for _, y in ds:
            got.append(int(y))
    assert got == list(range(38))


def test_item_error_in_the_last_group_of_varying_batches_is_raised():
    n = MAX_GROUP + 8  # sizes vary: ragged groups of fixed indices, [0, MAX_GROUP) then the rest
    ds = kerasfeed.to_dataset(Bad(Ragged(n=n, bad=(n - 2,))))
    assert isinstance(ds._kerasfeed_groups, GroupLoader)
    got = []
    with pytest.raises(tf.errors.OpError, match=rf"\[{n - 2}\] raised ValueError"):
        for _, y in ds:
            got.append(int(y[0]))
    assert got == list(range(MAX_GROUP))  # that path's last call raises at once


class Bad(kerasfeed.SceneSequence):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if i in self.inner.bad:
            raise ValueError(f"scene {i} is unreadable")
        return self.inner[i]


class Batches(kerasfeed.SceneSequence):
    """Batches of 4 rows but where ``short`` says otherwise (the last one, a mid-pass one)."""

    def __init__(self, n, short):
        super().__init__()
        self.n, self.short, self.calls = n, dict(short), []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls.append(i)
        rows = self.short.get(i, 4)
        return np.full((rows, 2), i, np.float32), np.full((rows,), i, np.int64)


def test_batches_of_one_size_go_through_dense_runs_and_short_ones_arrive_exactly():
    seq = Batches(40, {17: 1, 18: 3, 39: 2})  # two short batches mid-pass, a short last one
    ds = kerasfeed.to_dataset(seq)
    assert isinstance(ds._kerasfeed_groups, RunLoader)
    assert ds.element_spec[0].shape.as_list() == [None, 2]
    for _ in range(2):
        seq.calls.clear()
        got = [(x.shape[0], int(y[0])) for x, y in ds.as_numpy_iterator()]
        assert got == [(seq.short.get(i, 4), i) for i in range(40)]
        assert sorted(seq.calls) == list(range(40))  # each item made once, none reloaded at a run's end
    assert ds.cardinality().numpy() == 40


def test_run_loader_splits_runs_at_a_length_change_and_raises_errors_in_place():
    calls = []

    def load_one(index, epoch):
        calls.append(index)
        if index == 5:
            raise KeyError(index)
        rows = 2 if index in (3, 4) else 1
        return [np.full((rows,), index), np.array(epoch)]

    empty = [np.zeros((0, 0)), np.zeros((0,))]
    loader = RunLoader(lambda: (np.arange(8), np.int64(7)), load_one, [True, False], 4, empty)
    assert loader.begin() == 7
    x, e = loader.load(7)
    assert x.tolist() == [[0], [1], [2]] and e.tolist() == [7, 7, 7]  # 3 has two rows: the next run
    x, _ = loader.load(7)
    assert x.tolist() == [[3, 3], [4, 4]]  # 5 raises: the run ends before it
    with pytest.raises(KeyError):
        loader.load(7)  # at its own position
    x, _ = loader.load(7)
    assert x.tolist() == [[6], [7]]  # the pass goes on after it
    assert [a.shape for a in loader.load(7)] == [(0, 0), (0,)]  # the end: zero items
    assert calls == list(range(8))  # every item loaded once
    assert [a.shape for a in loader.load(7)] == [(0, 0), (0,)]  # an unknown or finished pass: zero items


def test_grouped_dataset_trains_with_fit_and_resumes():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    seq = Small(n=40)
    ds = kerasfeed.to_dataset(seq, batch_size=8)
    history = model.fit(ds, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    assert seq.events == ["begin", "end", "begin", "end"]
    resumed = kerasfeed.to_dataset(Small(n=40), batch_size=8, initial_state={"epoch": 1, "batches": 2})
    assert [b[1].tolist()[0] for b in resumed.as_numpy_iterator()] == [16, 24, 32]
    assert [b[1].tolist()[0] for b in resumed.as_numpy_iterator()] == [0, 8, 16, 24, 32]


def test_group_loader_carries_a_failure_to_the_next_call():
    calls = []

    def load_one(index, epoch):
        calls.append(index)
        if index == 2:
            raise KeyError(index)
        return [np.array([index]), np.array(epoch)]

    loader = GroupLoader(load_one)
    x, e = loader.load([0, 1, 2, 3], 5)
    assert x.tolist() == [[0], [1]] and e.tolist() == [5, 5]
    with pytest.raises(KeyError):
        loader.load([4, 5], 5)  # the carried failure comes first
    x, _ = loader.load([6], 5, True)
    assert x.ravel().tolist() == [3, 4, 5, 6]
    assert calls == [0, 1, 2, 3, 4, 5, 6]  # index 2 ran once
    with pytest.raises(KeyError):
        loader.load([1, 2, 3], 6, True)  # the last call raises at once


def test_dense_runs_resume_mid_pass_and_fire_the_epoch_hooks():
    seq = Batches(40, {39: 2})
    ds = kerasfeed.to_dataset(seq, initial_state={"epoch": 1, "batches": 5})
    assert isinstance(ds._kerasfeed_groups, RunLoader)
    assert [int(y[0]) for _, y in ds.as_numpy_iterator()] == list(range(5, 40))
    assert [int(y[0]) for _, y in ds.as_numpy_iterator()] == list(range(40))
