"""``max_skipped=``: items that keep failing are left out, up to a budget per pass, with real faults.

A source whose items in ``bad`` always raise (corrupt), read through both front
ends on threads and worker processes: every pass completes in order, exactly
those items are left out (their batch one sample shorter), nothing else is
lost or repeated, ``fit`` never runs out of data; past the budget the error
names every item skipped; the resume state keeps them (TrainingProgress,
BackupAndRestore), so a resumed run is the same run.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.integrations.backup_files import LATEST

N, B = 40, 4


class Corrupt(kerasfeed.SceneSequence):
    """Sample ``i`` is ``(x_i, y_i)``; the items in ``bad`` raise every time they are read."""

    def __init__(self, bad=(3, 17), n=N, marker_dir=None, **kwargs):
        super().__init__(**kwargs)
        self.bad, self.n, self.marker_dir = frozenset(bad), n, marker_dir

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"corrupt chunk in item {i}")
        if self.marker_dir is not None and i == 5:  # fails on its first attempt only
            marker = os.path.join(self.marker_dir, "item-5-tried")
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise OSError("NFS hiccup")
        x = np.array([np.sin(i), np.cos(i), i / N], "float32")
        return x, np.array([i], "int64")


class Dies(Corrupt):
    """Item 6 kills the worker process that makes it, every time (a crash in native code)."""

    def __getitem__(self, i):
        if i == 6:
            os._exit(3)
        return super().__getitem__(i)


def _labels(batch):
    y = batch[1]
    return (y.numpy() if hasattr(y, "numpy") else y)[:, 0].tolist()


def _make(front, source, **kwargs):
    return (kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader)(source, **kwargs)


def _close(data):
    kerasfeed.executor_of(data).close()


def _expected(order, bad, batch_size=B):
    """The batches of a pass: batch k holds positions [k*B, (k+1)*B) less the items left out."""
    return [[int(i) for i in order[k : k + batch_size] if i not in bad] for k in range(0, len(order), batch_size)]


@pytest.mark.parametrize("executor", ["threads", "processes"])
@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_corrupt_items_are_left_out_of_their_batch_every_pass_in_order(front, executor, caplog):
    workers = {"workers": 2} if executor == "processes" else {}
    data = _make(front, Corrupt(), batch_size=B, shuffle=True, seed=3, max_skipped=2, executor=executor, **workers)
    try:
        with caplog.at_level(logging.WARNING, logger="kerasfeed"):
            for epoch in range(2):
                batches = [_labels(b) for b in data]
                order = kerasfeed.IndexOrder(N, shuffle=True, seed=3).indices(epoch)
                assert batches == _expected(order, {3, 17}), epoch  # 10 batches, two of 3 samples
        stats = kerasfeed.stats(data)
        assert stats["skipped"] == 4 and [p["skipped"] for p in stats["passes"]] == [2, 2]
    finally:
        _close(data)
    logged = [r.getMessage() for r in caplog.records if "skipped item" in r.getMessage()]
    assert len(logged) == 4  # once per skip
    assert re.search(r"skipped item 3 of pass 0 \(position \d+\) after 1 attempt: OSError: corrupt chunk in item 3",
                     logged[0] + logged[1])
    if executor == "processes":
        assert all("pid" in m for m in logged)


@pytest.mark.parametrize("executor", ["threads", "processes"])
@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_fit_over_two_epochs_completes_without_running_out_of_data(front, executor, tmp_path):
    workers = {"workers": 2} if executor == "processes" else {}
    data = _make(front, Corrupt(), batch_size=B, shuffle=True, seed=0, max_skipped=2, executor=executor, **workers)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    stats = kerasfeed.InputStats(str(tmp_path), every_n_steps=5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")
        history = model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[stats])
    assert history.history["input_skipped"] == [2, 2]
    assert kerasfeed.stats(data)["skipped"] == 4
    _close(data)
    from tbparse import SummaryReader

    frame = SummaryReader(str(tmp_path), pivot=False).tensors
    skipped = frame[frame["tag"] == "input/skipped"]
    assert skipped["value"].iloc[-1] == 4 and skipped["step"].iloc[-1] == 20  # cumulative, at the last step


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_past_the_budget_the_error_names_every_item_skipped(front):
    data = _make(front, Corrupt(bad=(3, 17, 25)), batch_size=B, max_skipped=2)
    error = tf.errors.OpError if front == "dataset" else kerasfeed.ItemError
    with pytest.raises(error) as info:
        list(data)
    message = str(info.value)
    assert "Corrupt[25] raised OSError: corrupt chunk in item 25" in message
    assert ("[not left out: pass 0 already left out 2 items, its budget (max_skipped=2: 2 per pass). Items left out "
            "so far: item 3 of pass 0, item 17 of pass 0; this one: item 25 of pass 0 (position 25). "
            "Received: max_skipped=2, batch_size=4]") in message
    if front == "loader":
        assert info.value.index == 25 and info.value.skipped == [(0, 3), (0, 17)]
    assert kerasfeed.stats(data)["skipped"] == 2


def test_a_fraction_budget_is_a_share_of_each_pass():
    # 0.05 of 40 items: 2 per pass.
    with kerasfeed.to_loader(Corrupt(), batch_size=B, max_skipped=0.05) as loader:
        assert [len(b[1]) for b in loader] == [3] + [4] * 3 + [3] + [4] * 5
        assert [len(b[1]) for b in loader] == [3] + [4] * 3 + [3] + [4] * 5  # the budget is per pass
    with pytest.raises(kerasfeed.ItemError, match=r"its budget \(max_skipped=0.03 of 40 items: 1 per pass\)"):
        list(kerasfeed.to_loader(Corrupt(), batch_size=B, max_skipped=0.03))


def test_a_batch_whose_items_all_failed_raises_naming_it():
    with pytest.raises(kerasfeed.ItemError, match=r"every item of batch 1 of pass 0 \(positions 4 to 7\) failed, and "
                       r"a batch of no samples cannot be trained on \(use a larger batch_size\). Items left out so "
                       r"far: item 4 of pass 0, item 5 of pass 0, item 6 of pass 0; this one: item 7 of pass 0"):
        list(kerasfeed.to_loader(Corrupt(bad=(4, 5, 6, 7)), batch_size=B, max_skipped=10))
    # The dropped remainder is no batch: its items may all fail.
    with kerasfeed.to_loader(Corrupt(bad=(38, 39), n=N), batch_size=3, drop_remainder=True, max_skipped=2) as loader:
        assert len(list(loader)) == 13


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_items_that_are_batches_leave_the_pass_one_batch_shorter(front):
    data = _make(front, Corrupt(), max_skipped=2)
    try:
        for _ in range(2):
            assert [_labels((b[0], b[1][None]))[0] for b in data] == [i for i in range(N) if i not in (3, 17)]
    finally:
        _close(data)
    assert len(data) == N  # Keras is told a whole pass (its epoch then ends early, with its warning)


def test_bad_values_are_refused_up_front_naming_the_argument():
    for bad, error, text in [
        (-1, ValueError, "must be a non-negative int"), (1.5, ValueError, "must be in (0, 1)"),
        (0.0, ValueError, "must be in (0, 1)"), ("2", TypeError, "must be an int"), (True, TypeError, "must be an int"),
    ]:
        for front in ("dataset", "loader"):
            with pytest.raises(error) as info:
                _make(front, Corrupt(), batch_size=B, max_skipped=bad)
            assert text in str(info.value) and str(info.value).endswith(f"Received: max_skipped={bad!r}")
    with pytest.raises(ValueError, match=r"`max_skipped` with `batch_size=1` would leave every skipped item's batch "
                       r"empty.*Received: max_skipped=2, batch_size=1"):
        kerasfeed.to_loader(Corrupt(), batch_size=1, max_skipped=2)


def _loop(loader, progress, epochs, stop=None):
    """A custom loop over ``loader``; returns the batches' labels, cut after ``stop`` = (epoch, step)."""
    seen = []
    for epoch in range(progress.state()["epoch"], epochs):
        progress.on_epoch_begin(epoch)
        for step, batch in enumerate(loader):
            seen.append((epoch, _labels(batch)))
            progress.on_train_batch_end(step)
            if (epoch, step) == stop:
                return seen
    return seen


def test_a_resumed_loader_continues_the_run_and_its_budget():
    order = kerasfeed.IndexOrder(N, shuffle=True, seed=1).indices(0).tolist()
    first_bad = min(order.index(3), order.index(17))
    cut = (0, first_bad // B + 1)  # after the batch holding the first item left out
    kwargs = dict(batch_size=B, shuffle=True, seed=1, max_skipped=2)
    with kerasfeed.to_loader(Corrupt(), **kwargs) as loader:
        whole = _loop(loader, kerasfeed.TrainingProgress(order=loader), 2)
    with kerasfeed.to_loader(Corrupt(), **kwargs) as loader:
        progress = kerasfeed.TrainingProgress(order=loader)
        head = _loop(loader, progress, 2, stop=cut)
        state = progress.state()
    assert state["batches"] == cut[1] + 1 and state["skipped"] == [[0, order[first_bad]]]
    with kerasfeed.to_loader(Corrupt(), initial_state=state, **kwargs) as loader:
        first = _loop(loader, kerasfeed.TrainingProgress(state, order=loader), 1)
    with kerasfeed.to_loader(Corrupt(), initial_state={"epoch": 1, "batches": 0}, **kwargs) as loader:
        rest = _loop(loader, kerasfeed.TrainingProgress({"epoch": 1, "batches": 0}, order=loader), 2)
    assert head + first + rest == whole
    # The count goes on from the state: a third bad item is past the budget in the resumed run too,
    # and the error names the item the saved run left out.
    third = order[-1]
    with kerasfeed.to_loader(Corrupt(bad=(3, 17, third)), initial_state=state, **kwargs) as loader:
        with pytest.raises(kerasfeed.ItemError, match=rf"left out so far: item {order[first_bad]} of pass 0, .*this one: "
                           rf"item {third} of pass 0"):
            list(loader)
    with kerasfeed.to_loader(Corrupt(bad=(3, 17, third)), initial_state={**state, "skipped": []}, **kwargs) as loader:
        assert len(list(loader)) == 10 - cut[1] - 1  # without the record the budget would start again


def test_a_resumed_pass_of_whole_batches_counts_the_items_left_out_before_it():
    progress_state = {"epoch": 0, "batches": 5, "skipped": [[0, 3]]}  # 5 batches delivered, item 3 left out
    with kerasfeed.to_loader(Corrupt(), initial_state=progress_state, max_skipped=2) as loader:
        assert [int(b[1][0]) for b in loader] == [i for i in range(6, N) if i != 17]
    with pytest.raises(ValueError, match=r"`skipped` must be a list of \[pass, index\] pairs"):
        kerasfeed.to_loader(Corrupt(), initial_state={"epoch": 0, "batches": 1, "skipped": [3]})


def _cut(epoch, batch):
    """A callback raising after batch ``batch`` of epoch ``epoch``. Made here, not at module level: worker
    processes import this module for ``Corrupt`` and must not import Keras."""

    class Cut(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, b, logs=None):
            if (self.epoch, b) == (epoch, batch):
                raise KeyboardInterrupt("cut")

    return Cut()


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    return model


class Batches(kerasfeed.SceneSequence):
    """Item ``k`` is a whole batch (batch_size=None); the batches in ``bad`` raise every time."""

    def __init__(self, bad=(1, 6), **kwargs):
        super().__init__(**kwargs)
        self.bad = frozenset(bad)

    def __len__(self):
        return N // B

    def __getitem__(self, k):
        if k in self.bad:
            raise OSError(f"corrupt batch {k}")
        x = np.stack([np.array([np.sin(i), np.cos(i), i / N], "float32") for i in range(k * B, (k + 1) * B)])
        return x, x[:, :1] * 2


def _steps_per_epoch():
    """A callback counting the batches of each epoch. Made on call: worker processes import this
    module to unpickle its sources, and a Keras class at module level would import Keras and
    TensorFlow in every one of them (4-5 s per start)."""

    class StepsPerEpoch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = []

        def on_epoch_begin(self, epoch, logs=None):
            self.steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.steps[-1] += 1

    return StepsPerEpoch()


@pytest.mark.parametrize("front, executor", [("dataset", "processes"), ("loader", "threads")])
def test_batches_left_out_end_their_epochs_early_without_keras_warning(front, executor, caplog):
    """batch_size=None: items are batches. Seed 0 puts bad batch 1 first in pass 0 and last in pass 1 (6 in
    the middle of both): each epoch trains on exactly the other 8 batches in pass order, once each (the weights
    of train_on_batch over them), and kerasfeed explains the short epoch where Keras would warn that the
    input ran out."""
    workers = {"workers": 2} if executor == "processes" else {}
    kwargs = dict(batch_size=None, shuffle=True, seed=0, max_skipped=2, executor=executor, **workers)
    twin = _make(front, Batches(), **kwargs)
    passes = [[tuple(np.asarray(t) for t in b) for b in twin] for _ in range(2)]
    _close(twin)
    orders = [[int(k) for k in kerasfeed.IndexOrder(N // B, shuffle=True, seed=0).indices(e)] for e in range(2)]
    assert orders[0][0] == 1 and orders[1][-1] == 1
    got = [[round(float(x[0, 2]) * N / B) for x, _ in p] for p in passes]
    assert got == [[k for k in order if k not in (1, 6)] for order in orders]
    data = _make(front, Batches(), **kwargs)
    steps = _steps_per_epoch()
    fitted = _model()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="kerasfeed"):
        warnings.filterwarnings("error", message=".*ran out of data")
        history = fitted.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=[steps])
    _close(data)
    assert steps.steps == [8, 8] and len(history.history["loss"]) == 2
    explained = [r.getMessage() for r in caplog.records if "ended 2 batches early" in r.getMessage()]
    assert [m.split(" ended")[0] for m in explained] == ["kerasfeed: pass 0", "kerasfeed: pass 1"], explained
    by_hand = _model()
    for x, y in passes[0] + passes[1]:
        by_hand.train_on_batch(x, y)
    for a, b in zip(fitted.get_weights(), by_hand.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("source, batch_size", [(Corrupt, B), (Batches, None)])
def test_backup_and_restore_with_items_left_out_resumes_to_the_same_weights(tmp_path, source, batch_size):
    # Seed 2, pass 1: samples 3 and 17 at positions 14 and 33 (batches 3 and 8); batches 1 and 6 at 3 and 9.
    # The backup after 4 batches of epoch 1 holds the first one left out.
    kwargs = dict(batch_size=batch_size, shuffle=True, seed=2, max_skipped=2)
    bad, cut = {"bad": (3, 17)} if source is Corrupt else {"bad": (1, 6)}, (1, 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")  # batch_size=None too: explained instead
        reference = _model()
        reference.fit(kerasfeed.to_loader(source(**bad), **kwargs), epochs=3, verbose=0, shuffle=False)
        backup = str(tmp_path / "backup")
        with pytest.raises(KeyboardInterrupt):
            _model().fit(kerasfeed.to_loader(source(**bad), **kwargs), epochs=3, verbose=0, shuffle=False,
                         callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), _cut(*cut)])
        data = json.loads((tmp_path / "backup" / LATEST).read_text())["data"]
        assert (data["pass"], data["batches"], len(data["skipped"])) == (1, 4, 1)
        second = _model(seed=5)
        second.fit(kerasfeed.to_loader(source(**bad), **kwargs), epochs=3, verbose=0, shuffle=False,
                   callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    for x, y in zip(second.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_an_item_failing_once_is_retried_not_skipped(tmp_path, executor):
    workers = {"workers": 2} if executor == "processes" else {}
    source = Corrupt(bad=(), marker_dir=str(tmp_path))
    with kerasfeed.to_loader(source, batch_size=B, retries=1, max_skipped=2, executor=executor, **workers) as loader:
        labels = [i for b in loader for i in _labels(b)]
        assert labels == list(range(N)) and kerasfeed.stats(loader)["skipped"] == 0
        x = [b[0] for b in loader][1][1]
    np.testing.assert_array_equal(x, Corrupt(bad=())[5][0])


@pytest.mark.parametrize("retries", [0, 1])
def test_an_item_that_kills_its_worker_every_time_is_left_out_alone(caplog, retries):
    # With retries the dead worker is replaced and its other items made again; without, the pool starts
    # again without item 6 and the items that failed with it are loaded again: only item 6 is lost.
    with kerasfeed.to_loader(Dies(bad=()), batch_size=B, retries=retries, max_skipped=1, executor="processes",
                             workers=2) as loader, caplog.at_level(logging.WARNING, logger="kerasfeed"):
        for epoch in range(2):
            assert [_labels(b) for b in loader] == _expected(list(range(N)), {6}), epoch
    logged = [r.getMessage() for r in caplog.records if "skipped item 6" in r.getMessage()]
    attempts = f"after {retries + 1} attempt{'s' if retries else ''}: WorkerError"
    assert len(logged) == 2 and all(attempts in m and "exit code 3" in m for m in logged), logged


class DiesFirst(Corrupt):
    """Item 1 kills its worker every time: the workers reach it while they make the next pass ahead."""

    def __getitem__(self, i):
        if i == 1:
            os._exit(3)
        return super().__getitem__(i)


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_an_item_that_kills_its_worker_while_the_next_pass_is_made_ahead_is_left_out_there_too(front):
    """Without retries, the pool that made the rest of pass 0 died making pass 1's first items ahead.
    Pass 1 failed as it began, with that death outside any budget (every time under to_dataset). It now
    begins on a new pool, and item 1 is left out of every pass."""
    data = _make(front, DiesFirst(bad=()), batch_size=B, max_skipped=1, executor="processes", workers=2)
    try:
        for epoch in range(3):
            assert [_labels(b) for b in data] == _expected(list(range(N)), {1}), epoch
    finally:
        kerasfeed.executor_of(data).close()


class SlowOnce(Corrupt):
    """Item 0 runs past the timeout the first time it is made (the probe's call), then is quick."""

    def __init__(self, slow_marker):
        super().__init__(bad=())
        self.slow_marker = slow_marker

    def __getitem__(self, i):
        if i == 0:
            try:
                os.close(os.open(self.slow_marker, os.O_CREAT | os.O_EXCL))
                time.sleep(3.0)
            except FileExistsError:
                pass
        return super().__getitem__(i)


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_a_probe_that_timed_out_does_not_leave_its_item_out_of_the_first_pass(tmp_path, front):
    """The probe's call of item 0 ran past timeout= and killed its worker; the probe went on with item 1,
    and pass 0 then left item 0 out with the probe's error, using the budget, though item 0 was fine by
    then. The probe's failure only starts the pool again now: every pass has item 0."""
    source = SlowOnce(str(tmp_path / "slow"))
    data = _make(front, source, batch_size=B, timeout=1.0, max_skipped=1, executor="processes", workers=2)
    try:
        for epoch in range(2):
            assert [_labels(b) for b in data] == _expected(list(range(N)), set()), epoch
    finally:
        kerasfeed.executor_of(data).close()


def test_export_retries_a_failing_item_and_writes_every_item(tmp_path):
    source = Corrupt(bad=(), marker_dir=str(tmp_path))
    kerasfeed.export(source, tmp_path / "e", num_shards=2, executor="threads", retries=1, progress=False)
    assert sorted(int(y[0]) for _, y in kerasfeed.load_export(tmp_path / "e").as_numpy_iterator()) == list(range(N))



@pytest.mark.parametrize("front", ["to_loader", "to_dataset"])
def test_a_pass_that_left_an_item_out_frees_its_pipeline_by_reference_counting(front):
    """The error left out kept the consumer's frames in its traceback (and a thread task kept the error):
    the pipeline, its executor and threads lived until the garbage collector ran."""
    import gc
    import weakref

    class OneBad:
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if i == 11:
                raise ValueError("corrupt")
            return np.full(2, i, np.float32)

    make = getattr(kerasfeed, front)
    data = make(OneBad(), batch_size=4, executor="threads", max_skipped=2)
    gc.collect()
    gc.disable()
    try:
        assert sum(len(b) for b in data) == 19
        executor = weakref.ref(kerasfeed.executor_of(data))
        del data
        assert executor() is None
    finally:
        gc.enable()


class _SlowItem:
    """Item ``slow`` runs past the timeout (None: none does); every call is counted per index."""

    def __init__(self, slow=None):
        self.slow = slow
        self.calls = collections.Counter()
        self.lock = threading.Lock()

    def __len__(self):
        return 40

    def __getitem__(self, i):
        with self.lock:
            self.calls[i] += 1
        time.sleep(2.0 if i == self.slow else 0.02)
        return np.full((2,), i, np.float32)


def _read_counting(src, **kwargs):
    loader = kerasfeed.to_loader(src, batch_size=4, executor="threads", **kwargs)
    try:
        return [int(v) for batch in loader for v in np.asarray(batch)[:, 0]]
    finally:
        kerasfeed.executor_of(loader).close()


def test_a_timed_out_item_skipped_on_threads_keeps_the_items_made_ahead():
    """timeout= and max_skipped= without retries on threads: the timeout closes the pool and the skip
    opens it again for the rest of the pass. The items the closed pool had made (or was making) ahead
    were dropped and made a second time; they are taken over: each is made as often as in a run
    without the slow item (the probe's calls aside, once)."""
    plain, slow = _SlowItem(), _SlowItem(slow=5)
    assert _read_counting(plain) == list(range(40))
    got = _read_counting(slow, timeout=0.5, max_skipped=1)
    assert got == [i for i in range(40) if i != 5], got
    again = sorted(i for i in range(40) if i != 5 and slow.calls[i] != plain.calls[i])
    assert not again, (again, slow.calls, plain.calls)
