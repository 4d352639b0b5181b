"""Grouped hand-over: small fixed-shape items reach tf.data several per Python call."""

import os
import sys
import time

import cloudpickle
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

# The sources below reach worker processes by value: the workers do not import this module
# (nor TensorFlow with it).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
    n = MAX_GROUP + 8  # sizes vary: ragged groups
    ds = kerasfeed.to_dataset(Bad(Ragged(n=n, bad=(n - 2,))))
    assert isinstance(ds._kerasfeed_groups, GroupLoader)
    got = []
    with pytest.raises(tf.errors.OpError, match=rf"\[{n - 2}\] raised ValueError"):
        for _, y in ds:
            got.append(int(y[0]))
    assert got == list(range(n - 2))  # every item before it, from the same group too


class Faults(kerasfeed.SceneSequence):
    """16 items. Pass 1, 2, 3 fails at item 0, 7, 15 (the first, a middle and the last of a
    group of 16). In pass 4, item SLOW comes only once the consumer has the item before it (a
    file it writes in ``flags``), or after 30 s; its y says which (1: released by the consumer)."""

    AT = {1: 0, 2: 7, 3: 15}
    SLOW = 5

    def __init__(self, flags):
        super().__init__()
        self.flags = str(flags)

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == self.AT.get(self.epoch):
            raise ValueError(f"scene {i} is unreadable")
        released = 0
        if i == self.SLOW and self.epoch == 4:
            flag = os.path.join(self.flags, f"got{i - 1}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not os.path.exists(flag):
                time.sleep(0.01)
            released = int(os.path.exists(flag))
        return np.full((3,), i, np.float32), np.int64(released)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_no_item_waits_for_a_later_one_in_its_group(executor, tmp_path):
    """An error at the first, middle or last position of a group comes after every item before
    it; a slow item holds back no item before it (it is released by the consumer receiving the
    item before it: were the group waiting for it, that would never happen)."""
    kw = {"workers": 2} if executor == "processes" else {}
    ds = kerasfeed.to_dataset(Faults(tmp_path), executor=executor, group_items=16, **kw)
    try:
        assert ds._kerasfeed_group_items == 16 and isinstance(ds._kerasfeed_groups, RunLoader)
        assert len(list(ds)) == 16  # pass 0
        for at in Faults.AT.values():  # passes 1, 2, 3
            got = []
            with pytest.raises(tf.errors.OpError, match=rf"Faults\[{at}\] raised ValueError.*scene {at} is unreadable"):
                for x, _ in ds:
                    got.append(int(x[0]))
            assert got == list(range(at))
        got = []
        for x, released in ds.as_numpy_iterator():  # pass 4
            got.append(int(x[0]))
            (tmp_path / f"got{got[-1]}").touch()
            if got[-1] == Faults.SLOW:
                assert released == 1  # made after the consumer had every item before it
        assert got == list(range(16))
    finally:
        kerasfeed.executor_of(ds).close()


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
        return [np.full((rows,), index), np.array(epoch)], index == 7

    empty = [np.zeros((0, 0)), np.zeros((0,))]
    loader = RunLoader(lambda: (np.arange(8), np.int64(7)), load_one, lambda i, e: True, [True, False], 4, empty)
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


def test_the_pass_ends_only_once_the_group_holding_its_last_item_is_stacked():
    """``end_pass`` (the source's ``on_epoch_end``) may overwrite what items view: it runs after
    the stack copied them, also when the last item is held over to the next call."""
    table = np.arange(8.0)
    ended = []

    def take(index, epoch):  # views of the table, as PassPipeline.take hands them
        rows = 2 if index == 7 else 1
        view = table[index : index + 1]
        return [np.repeat(view, rows), np.array(epoch)], index == 7

    def end_pass(epoch):
        ended.append(True)
        table[:] = -1

    empty = [np.zeros((0, 0)), np.zeros((0,))]
    loader = RunLoader(lambda: (np.arange(8), np.int64(0)), take, lambda i, e: True, [True, False], 8, empty,
                       end_pass=end_pass)
    loader.begin()
    x, _ = loader.load(0)
    assert x.tolist() == [[i] for i in range(7)] and not ended  # 7 (two rows) is held for the next run
    x, _ = loader.load(0)
    assert x.tolist() == [[7, 7]] and ended == [True]  # stacked before the hook overwrote the table
    assert [a.shape for a in loader.load(0)] == [(0, 0), (0,)] and ended == [True]


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


def test_groups_take_only_ready_items_and_raise_errors_in_place():
    """A group waits for its first item only: it ends at the first item that is not ready
    (taken first by the next call) and before an item whose load raised (raised by the next call)."""
    calls, ready = [], {0, 1, 3, 4, 5, 6}  # 2 is not made yet when the first call asks

    def load_one(index, epoch):
        calls.append(index)
        if index == 5:
            raise KeyError(index)
        return [np.full((1 + index % 2,), index), np.array(epoch)], index == 7

    empty = [np.zeros((0,)), np.zeros((0,), np.int64), np.zeros((0, 1), np.int64)]
    loader = GroupLoader(lambda: (np.arange(8), np.int64(3)), load_one, lambda i, e: i in ready, [True, False], 64, empty)
    assert loader.begin() == 3
    x, e, lengths = loader.load(3)
    assert x.tolist() == [0, 1, 1] and lengths.ravel().tolist() == [1, 2] and e.tolist() == [3, 3]
    assert calls == [0, 1]  # 2 was not asked for: nothing waits for it with 0 and 1 in hand
    x, _, lengths = loader.load(3)
    assert x.tolist() == [2, 3, 3, 4] and lengths.ravel().tolist() == [1, 2, 1]  # a call waits for its first item
    with pytest.raises(KeyError):
        loader.load(3)  # 5 raised after 2-4 were in hand: at its own position
    x, _, lengths = loader.load(3)
    assert x.tolist() == [6] and lengths.ravel().tolist() == [1]  # 7 is not ready
    x, _, _ = loader.load(3)
    assert x.tolist() == [7, 7]
    assert [a.shape for a in loader.load(3)] == [(0,), (0,), (0, 1)]  # the end: zero items
    assert calls == list(range(8))  # every item loaded once


def test_dense_runs_resume_mid_pass_and_fire_the_epoch_hooks():
    seq = Batches(40, {39: 2})
    ds = kerasfeed.to_dataset(seq, initial_state={"epoch": 1, "batches": 5})
    assert isinstance(ds._kerasfeed_groups, RunLoader)
    assert [int(y[0]) for _, y in ds.as_numpy_iterator()] == list(range(5, 40))
    assert [int(y[0]) for _, y in ds.as_numpy_iterator()] == list(range(40))


def test_a_group_leaf_that_may_hold_no_values_is_split_without_unbatch():
    from kerasfeed.tfdata.unbatching import may_hold_no_values

    assert may_hold_no_values(tf.TensorSpec([None, None, 3], tf.float32))  # items that are batches
    assert may_hold_no_values(tf.TensorSpec([None, 4, 0], tf.float32))
    assert not may_hold_no_values(tf.TensorSpec([None, 4, 3], tf.float32))
    assert not may_hold_no_values(tf.TensorSpec([None, None], tf.string))
    assert not may_hold_no_values(tf.RaggedTensorSpec([None, None, 3], tf.float32))


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_items_holding_no_values_pass_through_grouping_and_streams(executor):
    """An empty batch or a zero-size leaf crashed the process (SIGSEGV in tf.data's unbatch, TF 2.21)."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "reliability_scripts", "empty_elements.py")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, script, executor], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batches"] == [[[0 if i == 5 else 4, 3]] for i in range(12)]
    assert out["zero_width"] == [[[4, 0]]] * 6
    assert out["no_points"] == [[[2], [2, 0, 3]]] * 2  # dict leaves in key order: id, points
    assert sorted(out["stream"]) == sorted([[[2, 3]], [[0, 3]], [[2, 3]]] * 2)


class OneField(kerasfeed.SceneSequence):
    """Items that are 1-tuples ``(x,)``; ``vary``: x's length varies (ragged groups)."""

    def __init__(self, vary):
        super().__init__()
        self.vary = vary

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return (np.arange(i % 3 + 1 if self.vary else 3, dtype=np.float32) + i,)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_one_field_tuple_item_stays_a_tuple_through_ragged_groups(batch_size):
    """A group whose leading lengths vary is unbatched then mapped again for its element spec; that
    map kept ``(x,)`` as a bare ``x`` where to_loader and ungrouped items give ``(x,)``."""
    source = OneField(vary=True)
    ds = kerasfeed.to_dataset(source, batch_size=batch_size, **({"padding_values": 0.0} if batch_size else {}))
    assert isinstance(ds.element_spec, tuple) and len(ds.element_spec) == 1, ds.element_spec
    with kerasfeed.to_loader(source, batch_size=batch_size) as loader:
        want = [b[0].tolist() for b in loader]
    assert [b[0].numpy().tolist() for b in ds] == want
