"""kerasfeed against a Keras whose private structure differs from what it reads (TensorFlow backend).

NOTE [ Keras' private structure ] in kerasfeed/_keras_fit.py: where Keras has no public route,
kerasfeed reads its ``fit``'s locals and patches its epoch iterator. Here Keras is changed the way a
release could change it — its own ``fit`` source recompiled with other local names, an epoch
iterator without the method kerasfeed replaces, a fit that no longer starts at the restored epoch —
and every case either trains the right passes with one ``KerasStructureWarning``, or raises a
``KerasStructureError`` before any batch of another pass: which passes began is asserted each time.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import textwrap
import types
import warnings

import keras
import numpy as np
import pytest
from test_backup import BATCHES, Cut, Seq, Steps, _model  # its batches record the passes begun

import kerasfeed
from kerasfeed import _keras_epoch_iterator, _keras_fit
from kerasfeed.errors import KerasStructureError, KerasStructureWarning


@pytest.fixture(autouse=True)
def _each_mismatch_reported_anew():
    _keras_fit._REPORTED.clear()
    yield
    _keras_fit._REPORTED.clear()


def _weights(model):
    return [w.copy() for w in model.get_weights()]


def keras_fit_changed(monkeypatch, renames=(), edits=(), module=None):
    """Keras' own TensorFlow ``fit``, recompiled with locals renamed (``(old, new)`` pairs) and
    source ``edits`` (``(regex, replacement)``), in its module (or ``module``), in place of Keras'."""
    from keras.src.backend.tensorflow import trainer

    source = textwrap.dedent(inspect.getsource(trainer.TensorFlowTrainer.fit))
    for old, new in renames:
        source = re.sub(rf"\b{old}\b", new, source)
    for pattern, replacement in edits:
        source, n = re.subn(pattern, replacement, source)
        assert n, pattern
    namespace = dict(vars(trainer), __name__=module or trainer.__name__)
    exec(compile(source, trainer.__file__, "exec"), namespace)
    fit = namespace[re.search(r"def (\w+)\(", source).group(1)]
    monkeypatch.setattr(trainer.TensorFlowTrainer, "fit", fit)
    return fit


RENAMED = (("epoch_iterator", "batches"), ("epoch", "epoch_number"))  # a Keras whose fit names them otherwise


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_renamed_locals_from_epoch_0_train_passes_0_and_1_with_one_warning(monkeypatch, front):
    keras_fit_changed(monkeypatch, RENAMED)
    seq = Seq()
    data = (kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader)(seq, shuffle=True, seed=1)
    with pytest.warns(KerasStructureWarning) as caught:
        _model().fit(data, epochs=2, verbose=0, shuffle=False)
    ours = [str(w.message) for w in caught if issubclass(w.category, KerasStructureWarning)]
    assert len(ours) == 1, ours  # once, though two passes began
    assert re.search(r"its `fit` has no `epoch`, `epoch_iterator`.*counted by the dataset or loader itself.*"
                     rf"Received: keras {re.escape(keras.version())}$", ours[0]), ours[0]
    assert seq.passes == [0, 1]


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_renamed_locals_refuse_a_fit_from_a_later_epoch_before_any_batch(monkeypatch, front):
    keras_fit_changed(monkeypatch, RENAMED)
    seq, model = Seq(), _model()
    before = _weights(model)
    data = (kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader)(seq, shuffle=True, seed=1)
    with pytest.raises(Exception, match=r"KerasStructureError|has no `epoch`") as caught:
        model.fit(data, epochs=4, initial_epoch=2, verbose=0, shuffle=False)
    assert "a fit that starts at epoch 2 would train other passes" in str(caught.value)
    assert seq.passes == []  # not pass 0 read as epoch 2
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


X_LET_GO = (r"\n(\s+)callbacks\.on_train_begin\(\)", r"\n\1x = None\n\1callbacks.on_train_begin()")


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_a_fit_that_lets_go_of_x_is_reported_and_refused_from_a_later_epoch(monkeypatch, front):
    """A Keras whose fit drops ``x`` once its epoch iterator holds the data: the fit was not taken for the
    pipeline's (``x`` did not hold it), so passes were counted silently, epoch 2 reading pass 0."""
    keras_fit_changed(monkeypatch, edits=[X_LET_GO])
    make = kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader
    seq = Seq()
    with pytest.raises(Exception, match=r"KerasStructureError|has no") as caught:
        _model().fit(make(seq, shuffle=True, seed=1), epochs=4, initial_epoch=2, verbose=0, shuffle=False)
    assert "`x` (None)" in str(caught.value) and "a fit that starts at epoch 2 would train other passes" in str(
        caught.value)
    assert seq.passes == []
    seq = Seq()
    with pytest.warns(KerasStructureWarning, match=r"its `fit` has no `x` \(None\).*counted by the dataset"):
        _model().fit(make(seq, shuffle=True, seed=1), epochs=2, verbose=0, shuffle=False)
    assert seq.passes == [0, 1]


X_REBOUND = (r"\n(\s+)callbacks\.on_train_begin\(\)", r"\n\1x = epoch_iterator.data_adapter\n\1callbacks.on_train_begin()")


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_a_fit_that_rebinds_x_still_reads_the_pass_of_its_epoch(monkeypatch, front):
    """A Keras whose fit rebinds ``x`` to another object (its data adapter): the fit was not taken for the
    pipeline's, and ``fit(initial_epoch=2)`` of to_dataset trained pass 0, silently (helper, 3 of 3). The epoch
    iterator's data tells it; reported once."""
    keras_fit_changed(monkeypatch, edits=[X_REBOUND])
    make = kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader
    seq = Seq()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(make(seq, shuffle=True, seed=1), epochs=3, initial_epoch=2, verbose=0, shuffle=False)
    assert seq.passes == [2]
    ours = [str(w.message) for w in caught if issubclass(w.category, KerasStructureWarning)]
    assert front == "loader" or any("holds a TFDatasetAdapter as `x`" in m for m in ours), ours


class _MadeIn(kerasfeed.SceneSequence):
    """Records the pass each batch was made in."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __len__(self):
        return 3

    def __getitem__(self, i):
        self.made.append(self.epoch)
        return np.full((2, 3), i, "float32"), np.zeros((2, 1), "float32")


def test_fit_of_a_scene_sequence_through_a_rebound_x_reads_the_pass_of_its_epoch(monkeypatch):
    """model.fit(seq, initial_epoch=2) under a fit that rebinds x trained passes 0 and 1, silently (helper, 3 of 3
    on three backends): Keras' PyDataset adapter holds the sequence as ``py_dataset``."""
    keras_fit_changed(monkeypatch, edits=[X_REBOUND])
    seq = _MadeIn()
    with pytest.warns(KerasStructureWarning, match=r"holds a PyDatasetAdapter as `x`"):
        _model().fit(seq, epochs=4, initial_epoch=2, verbose=0)
    assert seq.made[-6:] == [2] * 3 + [3] * 3 and 1 not in seq.made, seq.made  # (pass 0's: the model build's)


def test_a_keras_that_ends_a_sequences_epochs_without_beginning_them_is_reported(monkeypatch):
    """A Keras whose PyDataset adapter no longer calls the dataset's on_epoch_begin: every epoch of fit(seq) read
    pass 0, silently (helper, 3 of 3). The ended epoch now sets the next pass, with a warning."""
    from keras.src.trainers.data_adapters import py_dataset_adapter

    def on_epoch_begin(self):  # Keras' own, without `self.py_dataset.on_epoch_begin()`
        self._within_epoch = True
        if self.enqueuer:
            self.enqueuer.start()

    monkeypatch.setattr(py_dataset_adapter.PyDatasetAdapter, "on_epoch_begin", on_epoch_begin)
    seq = _MadeIn()
    with pytest.warns(KerasStructureWarning, match=r"ended an epoch of a PyDataset it did not begin"):
        _model().fit(seq, epochs=3, verbose=0)
    assert seq.made[-9:] == [0] * 3 + [1] * 3 + [2] * 3, seq.made  # (before them: the model build's)


def test_renamed_locals_refuse_what_keras_own_backup_restored(monkeypatch, tmp_path):
    """keras.callbacks.BackupAndRestore sets model._initial_epoch; the data cannot follow it: refused."""
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_dataset(Seq(), shuffle=True, seed=1), epochs=4, verbose=0, shuffle=False,
                     callbacks=[keras.callbacks.BackupAndRestore(backup), Cut(2, 1)])
    keras_fit_changed(monkeypatch, RENAMED)
    seq = Seq()
    with pytest.raises(Exception, match="a fit that starts at epoch 2 would train other passes"):
        _model().fit(kerasfeed.to_dataset(seq, shuffle=True, seed=1), epochs=4, verbose=0, shuffle=False,
                     callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert seq.passes == []


def test_a_scene_sequence_under_renamed_locals_is_refused_from_a_later_epoch(monkeypatch):
    keras_fit_changed(monkeypatch, RENAMED)
    seq = Seq()
    with pytest.warns(KerasStructureWarning, match="has no `epoch`"):
        _model().fit(seq, epochs=2, verbose=0, shuffle=False)
    assert seq.passes == [0, 1]
    later = Seq()
    with pytest.raises(KerasStructureError, match="a fit that starts at epoch 1"):
        _model().fit(later, epochs=3, initial_epoch=1, verbose=0, shuffle=False)
    assert later.passes == []


def _cut_backup(tmp_path, front="loader"):
    """A kerasfeed backup after batch 4 of epoch 1 (Keras unchanged), and the reference weights."""
    make = kerasfeed.to_loader if front == "loader" else kerasfeed.to_dataset
    reference = _model()
    reference.fit(make(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False)
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(make(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), Cut(1, 4)])
    record = json.loads((tmp_path / "backup" / "latest.json").read_text())
    assert (record["epoch"], record["batch"]) == (1, 4)
    return backup, reference


@pytest.mark.parametrize("front", ["loader", "dataset"])
def test_without_the_epoch_local_kerasfeeds_callback_says_the_epoch_and_the_resume_is_exact(monkeypatch, tmp_path,
                                                                                              front):
    """Keras' public route: kerasfeed.BackupAndRestore's on_epoch_begin(epoch) tells the data its epoch."""
    backup, reference = _cut_backup(tmp_path, front)
    keras_fit_changed(monkeypatch, [("epoch", "epoch_number")])
    seq, steps, model = Seq(), Steps(), _model(seed=5)
    make = kerasfeed.to_loader if front == "loader" else kerasfeed.to_dataset
    with pytest.warns(KerasStructureWarning, match=r"has no `epoch`.*on_epoch_begin says the epoch"):
        model.fit(make(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                  callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), steps])
    assert seq.passes == [1, 2]
    assert [s[:2] for s in steps.seen] == [(1, 4), (1, 5)] + [(2, b) for b in range(BATCHES)]
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_without_the_epoch_iterator_a_resume_inside_an_epoch_is_refused(monkeypatch, tmp_path):
    backup, _ = _cut_backup(tmp_path)
    keras_fit_changed(monkeypatch, RENAMED)
    seq, model = Seq(), _model(seed=5)
    with pytest.raises(KerasStructureError, match=r"has no `epoch`, `epoch_iterator`.*cannot resume inside an epoch"
                                                  r".*Received: keras "):
        model.fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                  callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    assert seq.passes == []


def test_an_epoch_iterator_without_enumerate_iterator_refuses_the_resume(monkeypatch, tmp_path):
    backup, _ = _cut_backup(tmp_path)
    from keras.src.trainers import epoch_iterator

    cls = epoch_iterator.EpochIterator
    monkeypatch.setattr(cls, "_steps_of_epoch", cls._enumerate_iterator, raising=False)
    monkeypatch.delattr(cls, "_enumerate_iterator")

    def __iter__(self):
        self._epoch_iterator = self._steps_of_epoch()
        return self

    monkeypatch.setattr(cls, "__iter__", __iter__)
    seq = Seq()
    with pytest.raises(KerasStructureError, match=r"EpochIterator \(TFEpochIterator\) has no `_enumerate_iterator`"):
        _model(seed=5).fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                           callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    assert seq.passes == []


def test_an_enumerate_iterator_given_an_argument_resumes_exactly(monkeypatch, tmp_path):
    """A Keras whose ``__iter__`` calls ``self._enumerate_iterator(self.steps_per_execution)``: the resume raised a
    bare TypeError from kerasfeed's replacement (it took no argument), before any batch (a helper's report)."""
    backup, reference = _cut_backup(tmp_path)
    from keras.src.trainers import epoch_iterator

    cls = epoch_iterator.EpochIterator
    own = cls._enumerate_iterator

    def _enumerate_iterator(self, per_execution=None):
        assert per_execution == self.steps_per_execution
        yield from own(self)

    def __iter__(self):
        self._epoch_iterator = self._enumerate_iterator(self.steps_per_execution)
        return self

    monkeypatch.setattr(cls, "_enumerate_iterator", _enumerate_iterator)
    monkeypatch.setattr(cls, "__iter__", __iter__)
    model = _model(seed=5)
    model.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
              callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_run_out_warning_given_arguments_gets_them(monkeypatch):
    """A Keras that calls ``self._interrupted_warning(steps)``: kerasfeed's replacement took none, and a fit with
    an item left out died of a bare TypeError (a helper's report)."""
    monkeypatch.setattr(_keras_fit, "keras_version", lambda: "3.15.1")

    class Iterator:
        def _interrupted_warning(self, steps=None):
            return f"keras after {steps}"

    it = Iterator()
    _keras_epoch_iterator.explain_short_epochs(_keras_fit.FitView(0, 0, None, None, it), lambda: None)
    assert it._interrupted_warning(7) == "keras after 7"  # not explained: Keras' own, with its argument


def test_an_epoch_iterator_that_enumerates_by_another_method_refuses_to_back_up_behind_the_training(
        monkeypatch, tmp_path):
    """A Keras whose EpochIterator keeps ``_enumerate_iterator`` (an alias) but enumerates through another method:
    the resumed epoch's steps counted from 0 again, the backup's count went back (4 trained, then batch 0), and a
    third run trained batches twice (helper, 2 of 2 under JAX). The first such step is refused."""
    backup, _ = _cut_backup(tmp_path)
    from keras.src.trainers import epoch_iterator

    cls = epoch_iterator.EpochIterator
    monkeypatch.setattr(cls, "_steps_of_epoch", cls._enumerate_iterator, raising=False)

    def __iter__(self):
        self._epoch_iterator = self._steps_of_epoch()
        return self

    monkeypatch.setattr(cls, "__iter__", __iter__)
    with pytest.raises(KerasStructureError, match=r"numbered a step of the resumed epoch 1 as batch 0, after 4 "):
        _model(seed=5).fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                           callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=1)])
    record = json.loads((tmp_path / "backup" / "latest.json").read_text())
    assert (record["epoch"], record["batch"]) == (1, 4)  # no backup behind what was trained


def test_steps_of_another_shape_stop_the_resumed_epoch_before_its_first_batch():
    class Iterator:
        _current_iterator, _steps_seen, data_adapter, num_batches = None, 0, None, 6

        def _enumerate_iterator(self):
            yield {"step": 0}, iter(())  # not (step, ..., iterator)

    it = Iterator()
    view = _keras_fit.FitView(0, 0, None, None, it)
    _keras_epoch_iterator.start_epoch_at(view, 2, owner="kerasfeed.BackupAndRestore")
    with pytest.raises(KerasStructureError, match=r"_enumerate_iterator yields \(\{'step': 0\}, .*not \(step, ..., "
                                                  r"iterator\)"):
        next(it._enumerate_iterator())
    for steps, message in ((None, "counts None steps"), (2, "counts 2 steps an epoch, and the epoch resumes after 2")):
        it.num_batches = steps
        with pytest.raises(KerasStructureError, match=message):
            _keras_epoch_iterator.start_epoch_at(view, 2, owner="kerasfeed.BackupAndRestore")


def test_a_fit_that_does_not_start_at_the_restored_epoch_is_refused(monkeypatch, tmp_path):
    """A Keras whose trainer no longer reads model._initial_epoch: the callback sees on_epoch_begin(0)."""
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(backup), Cut(1, 0)])
    keras_fit_changed(monkeypatch, edits=[(r"self\._initial_epoch or initial_epoch", "initial_epoch")])
    seq = Seq()
    with pytest.raises(KerasStructureError, match=r"started at epoch 0 after kerasfeed.BackupAndRestore set "
                                                  r"model._initial_epoch=1"):
        _model().fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(backup)])
    assert seq.passes == []


def test_a_model_without_initial_epoch_is_not_restored(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(backup), Cut(1, 0)])
    model, seq = _model(), Seq()
    del model._initial_epoch
    with pytest.raises(KerasStructureError, match=r"its model has no `_initial_epoch`.*cannot make this fit start at "
                                                  r"the backup's epoch 1"):
        model.fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                  callbacks=[kerasfeed.BackupAndRestore(backup)])
    assert seq.passes == []


def test_a_frame_epoch_of_another_meaning_is_refused_where_a_callback_says_the_epoch(monkeypatch, tmp_path):
    """A Keras whose `epoch` local counts from 1: kerasfeed's callback says 0 for the first epoch."""
    keras_fit_changed(monkeypatch, [("epoch", "keras_epoch")], edits=[
        (r"\n(\s+)callbacks\.on_epoch_begin\(keras_epoch\)",
         r"\n\1epoch = keras_epoch + 1\n\1callbacks.on_epoch_begin(keras_epoch)"),
    ])
    seq = Seq()
    with pytest.raises(Exception, match=r"frame says epoch 1 where a kerasfeed callback's on_epoch_begin said 0"):
        _model().fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=2, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(str(tmp_path / "backup"))])
    assert seq.passes == []


def test_a_fit_that_wraps_a_loop_of_another_name_is_read_through_its_kwargs(monkeypatch):
    """Keras' loop moved to `_fit_loop`, `fit` a wrapper taking **kwargs: initial_epoch is read there."""
    from keras.src.backend.tensorflow import trainer

    loop = keras_fit_changed(monkeypatch, edits=[(r"def fit\(", "def _fit_loop(")])
    namespace = dict(vars(trainer), _fit_loop=loop)
    exec("def fit(self, x=None, **kwargs):\n    return _fit_loop(self, x, **kwargs)", namespace)
    monkeypatch.setattr(trainer.TensorFlowTrainer, "fit", namespace["fit"])
    seq = Seq()
    with pytest.raises(Exception, match="a fit that starts at epoch 1 would train other passes"):
        _model().fit(kerasfeed.to_dataset(seq, shuffle=True, seed=1), epochs=3, initial_epoch=1, verbose=0)
    assert seq.passes == []
    with pytest.warns(KerasStructureWarning, match=r"has no `initial_epoch`, `steps_per_epoch`, `epoch`"):
        _model().fit(kerasfeed.to_dataset(seq, shuffle=True, seed=1), epochs=2, verbose=0)
    assert seq.passes == [0, 1]


def test_a_fit_in_another_module_without_the_names_is_named(monkeypatch):
    keras_fit_changed(monkeypatch, RENAMED, module="keras.src.trainers.fit_loop")
    seq = Seq()
    with pytest.warns(KerasStructureWarning, match=r"in keras.src.trainers.fit_loop, not keras.src.backend.<backend>"):
        _model().fit(kerasfeed.to_dataset(seq), epochs=1, verbose=0)
    assert seq.passes == [0]


def test_a_keras_that_does_not_take_a_resumed_datasets_length_is_refused_before_it_cuts_a_pass(monkeypatch):
    """Keras reads a resumed dataset's length from its cardinality() method (tfdata/adapter.py); a
    Keras that asks tf.data instead learns 5 steps from the resumed pass and would cut the next."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    def num_batches(self):
        n = int(tf.data.experimental.cardinality(self._dataset))
        return None if n < 0 else n

    monkeypatch.setattr(tf_dataset_adapter.TFDatasetAdapter, "num_batches", property(num_batches))
    seq = Seq()
    resumed = kerasfeed.to_dataset(seq, shuffle=True, seed=1, initial_state={"epoch": 0, "batches": 2})
    with pytest.raises(Exception, match=r"counts 5 steps an epoch where a pass has 6 batches.*would read 5 of a pass's "
                                        r"6 batches"):
        _model().fit(resumed, epochs=3, verbose=0, shuffle=False)
    assert seq.passes == [0]  # the resumed pass, whole; not pass 1 cut short


@pytest.mark.parametrize("version,steps,patched", [
    ("3.15.1", None, True), ("3.16.0", None, False), ("3.16.0", BATCHES, True), ("4.0.0", BATCHES, True),
])
def test_the_run_out_warning_is_explained_only_where_keras_gives_it(monkeypatch, version, steps, patched):
    """Keras 3.16 (keras#23360) warns "ran out of data" only with steps_per_epoch."""
    monkeypatch.setattr(_keras_fit, "keras_version", lambda: version)

    class Iterator:
        def _interrupted_warning(self):
            return "keras"

    it = Iterator()
    _keras_epoch_iterator.explain_short_epochs(_keras_fit.FitView(0, 0, steps, None, it), lambda: "kerasfeed explains")
    assert ("_interrupted_warning" in vars(it)) is patched
    if patched:
        assert it._interrupted_warning() is None  # logged instead


@pytest.mark.parametrize("version,offset", [("3.10.0", 4), ("3.11.0", 1), ("3.15.1", 1)])
def test_callbacks_batch_is_an_executions_first_step_before_keras_3_11(monkeypatch, version, offset):
    """keras#21422: on_train_batch_end(batch) gets the execution's last step from 3.11, its first before."""
    monkeypatch.setattr(_keras_fit, "keras_version", lambda: version)
    model = _model()
    model.compile("sgd", "mse", steps_per_execution=4)
    assert _keras_fit.batch_end_offset(model) == offset


def test_a_fit_giving_the_other_step_of_an_execution_than_its_version_says_is_counted_by_what_it_gives(
        monkeypatch, tmp_path):
    """batch_end_offset decides from the Keras version alone which step of an execution on_train_batch_end gets
    (keras#21422); a Keras giving the other one had backups saved a batch off, silently, and the resume trained
    a batch twice (a helper's report, with Keras' fit edited back to 3.10's call). The epoch's first call says
    which: here this Keras (the last step) read as 3.10 (the first)."""
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", steps_per_execution=2)
    reference.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False)
    monkeypatch.setattr(_keras_fit, "keras_version", lambda: "3.10.0")
    backup = str(tmp_path / "backup")
    model = _model()
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", steps_per_execution=2)
    with pytest.warns(KerasStructureWarning, match=r"gives on_train_batch_end an execution's last step \(batch 1 "
                                                   r"after 0 with steps_per_execution=2\), not its first"):
        with pytest.raises(KeyboardInterrupt):
            model.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                      callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), Cut(1, 3)])
    record = json.loads((tmp_path / "backup" / "latest.json").read_text())
    assert (record["epoch"], record["batch"]) == (1, 4)  # 4 trained (steps 0-3); read as first steps: (1, 5)
    monkeypatch.undo()
    resumed = _model(seed=5)
    resumed.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", steps_per_execution=2)
    resumed.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("version,first_step", [("3.10.0", True), ("3.15.1", False)])
def test_training_progress_counts_an_executions_batches_before_keras_3_11(monkeypatch, version, first_step):
    """Keras 3.7-3.10 give on_train_batch_end an execution's first step (keras#21422): TrainingProgress saved a
    position one batch short (2 trained, 1 saved; a resume trained a batch twice), as BackupAndRestore does not."""
    import kerasfeed

    monkeypatch.setattr(_keras_fit, "keras_version", lambda: version)
    model = _model()
    model.compile("sgd", "mse", steps_per_execution=2)
    progress = kerasfeed.TrainingProgress()
    progress.set_model(model)
    progress.set_params({"epochs": 2, "steps": 6})
    progress.on_train_begin()
    namespace = {"__name__": "keras.src.backend.tensorflow.trainer", "progress": progress}
    exec("def fit():\n    progress.on_epoch_begin(0)", namespace)
    namespace["fit"]()  # called by a fit, as Keras' are
    saved = []
    for last in (1, 3, 5):  # the execution's last step; Keras before 3.11 passes its first (last - 1)
        progress.on_train_batch_end(last - 1 if first_step else last)
        saved.append((progress.state()["epoch"], progress.state()["batches"]))
    assert saved == [(0, 2), (0, 4), (1, 0)]
    progress.on_epoch_begin(1)  # a custom loop (no fit frame; a CallbackList's too): the step it trained
    progress.on_train_batch_end(0)
    assert progress.state()["batches"] == 1


def test_an_epoch_iterator_without_the_warning_method_is_reported_once(monkeypatch):
    monkeypatch.setattr(_keras_fit, "keras_version", lambda: "3.15.1")
    view = _keras_fit.FitView(0, 0, None, None, types.SimpleNamespace())
    with pytest.warns(KerasStructureWarning, match=r"has no `_interrupted_warning`.*the data trained is the same.*"
                                                   r"Received: keras 3\.15\.1"):
        _keras_epoch_iterator.explain_short_epochs(view, lambda: "text")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _keras_epoch_iterator.explain_short_epochs(view, lambda: "text")  # once


def test_an_epoch_iterator_init_without_the_dropped_arguments_is_reported():
    namespace = {"__name__": "keras.src.trainers.epoch_iterator", "sys": sys}
    exec("def __init__(self, x, y=None, weights=None):\n    return sys._getframe()", namespace)
    frame = namespace["__init__"](None, 1, y=np.ones(3))
    with pytest.warns(KerasStructureWarning, match=r"EpochIterator.__init__ has no sample_weight, class_weight.*may "
                                                   r"be ignored by Keras"):
        given = _keras_epoch_iterator.epoch_iterator_arguments(frame)
    assert given["y"] is not None and given["sample_weight"] is None


def test_keras_modules_read_where_keras_has_no_public_route_are_checked_too(monkeypatch):
    """The data adapter class to_loader extends (refused by name), Keras' torch device and its Orbax
    shardings helper (reported once; the data trained is the same)."""
    from kerasfeed.integrations import orbax_callback
    from kerasfeed.loader import device, keras_adapter

    keras_adapter.loader_class.cache_clear()
    monkeypatch.setitem(sys.modules, "keras.src.trainers.data_adapters.data_adapter", None)
    try:
        with pytest.raises(KerasStructureError, match=r"no keras.src.trainers.data_adapters.data_adapter.DataAdapter.*"
                                                      r"use kerasfeed.to_dataset.*Received: keras "):
            keras_adapter.loader_class()
    finally:
        keras_adapter.loader_class.cache_clear()
    monkeypatch.setitem(sys.modules, "keras.src.backend.torch.core", None)
    with pytest.warns(KerasStructureWarning, match="no keras.src.backend.torch.core.get_device"):
        assert str(device.torch_device(keras_backend=True)) == "cpu"
    monkeypatch.setitem(sys.modules, "keras.src.saving.orbax_util", None)
    with pytest.warns(KerasStructureWarning, match="no keras.src.saving.orbax_util.build_orbax_abstract_pytree"):
        assert orbax_callback._abstract("unused", None) is None


def test_an_epoch_iterator_without_reset_is_reported(monkeypatch):
    from keras.src.trainers import epoch_iterator

    monkeypatch.delattr(epoch_iterator.EpochIterator, "reset")
    with pytest.warns(KerasStructureWarning, match=r"its EpochIterator has no `reset`.*SceneSequence"):
        assert not _keras_epoch_iterator.called_by_epoch_iterator_reset(sys._getframe())


def test_a_fit_that_begins_no_batch_or_epoch_itself_is_reported_once_for_ctrl_c():
    """NOTE [ Keras' private structure ], item 5: a Ctrl-C taken inside ``fit`` is raised
    again when that fit calls ``on_train_batch_begin``/``on_epoch_begin`` itself; a
    trainer whose fit names neither is reported once (and not watched)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    real = types.SimpleNamespace(f_code=inspect.unwrap(TensorFlowTrainer.fit).__code__,
                                 f_globals={"__name__": "keras.src.backend.tensorflow.trainer"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _keras_fit.fit_calls(real) == _keras_fit.FIT_CALLS

    moved = {"__name__": "keras.src.backend.future.trainer"}
    exec("def fit(self, callbacks):\n    callbacks.on_epoch_begin(0)\n    callbacks.begin_step(0)\n", moved)
    frame = types.SimpleNamespace(f_code=moved["fit"].__code__, f_globals=moved)
    with pytest.warns(KerasStructureWarning, match=r"future\.trainer\.fit calls no on_train_batch_begin .*Ctrl-C"):
        assert _keras_fit.fit_calls(frame) == ("on_epoch_begin",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert _keras_fit.fit_calls(frame) == ("on_epoch_begin",)


def test_an_epoch_iterator_module_that_moved_is_read_where_it_is_and_reported(monkeypatch):
    """Keras' EpochIterator was recognised by its module's name only: moved, ``fit(loader, y=...)`` trained
    without ``y`` and without kerasfeed's refusal, silently."""
    import keras.src.trainers.epoch_iterator as module

    old, new = module.__name__, "keras.src.trainers.epoch_iterators"
    monkeypatch.setattr(module, "__name__", new)
    monkeypatch.setitem(sys.modules, new, module)
    monkeypatch.delitem(sys.modules, old)
    rows = np.zeros((8, 3), "float32")
    with pytest.warns(KerasStructureWarning, match=rf"its EpochIterator is in {re.escape(new)}, not {re.escape(old)}"):
        with pytest.raises(ValueError, match=r"Keras does not pass `y` on to a data adapter"):
            _model().fit(kerasfeed.to_loader(rows, batch_size=4), y=np.zeros((8, 1), "float32"), epochs=1, verbose=0)


def _trainer_frames():
    """``_symbolic_build`` in Keras' trainer module, called by functions of the JAX and TF trainers' modules."""
    trainer = {"__name__": "keras.src.trainers.trainer"}
    exec("def _symbolic_build(look):\n    return look()", trainer)
    callers = {}
    for module in ("keras.src.backend.jax.trainer", "keras.src.backend.tensorflow.trainer"):
        namespace = {"__name__": module, "_symbolic_build": trainer["_symbolic_build"]}
        for name in ("evaluate", "fit", "run_evaluation"):
            exec(f"def {name}(look):\n    return _symbolic_build(look)", namespace)
        callers[module.split(".")[3]] = namespace
    return callers


def test_an_evaluations_model_build_is_told_apart_by_its_frames():
    """NOTE [ An evaluation's model build ] (kerasfeed/_keras_build.py): the JAX trainer's ``evaluate`` under
    ``_symbolic_build`` is one; its ``fit`` (FitView.builds) and TensorFlow's trainer are not, silently; a JAX
    trainer's build from a function of another name is reported once, as the pass it reads may be the next."""
    from kerasfeed._keras_build import evaluation_builds

    callers = _trainer_frames()
    look = lambda: evaluation_builds(sys._getframe(1))  # noqa: E731 - the frame of _symbolic_build's callee
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callers["jax"]["evaluate"](look) is True
        assert callers["jax"]["fit"](look) is False
        assert callers["tensorflow"]["evaluate"](look) is False
        assert look() is False  # no build on the stack
    with pytest.warns(KerasStructureWarning, match=r"keras\.src\.backend\.jax\.trainer\.run_evaluation builds"):
        assert callers["jax"]["run_evaluation"](look) is False
    # TensorFlow's trainer peeks under a strategy in ``_maybe_symbolic_build``, in fit and evaluate alike
    tf_trainer = {"__name__": "keras.src.backend.tensorflow.trainer"}
    exec("def _maybe_symbolic_build(look):\n    return look()", tf_trainer)
    for name in ("evaluate", "fit", "predict"):
        exec(f"def {name}(look):\n    return _maybe_symbolic_build(look)", tf_trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tf_trainer["evaluate"](look) is True and tf_trainer["fit"](look) is True
        assert tf_trainer["predict"](look) is False


def test_a_trainer_without_symbolic_build_is_reported(monkeypatch):
    from keras.src.trainers import trainer

    from kerasfeed._keras_build import evaluation_builds

    monkeypatch.delattr(trainer.Trainer, "_symbolic_build")
    with pytest.warns(KerasStructureWarning, match="its Trainer has no `_symbolic_build`.*the next one"):
        assert evaluation_builds(sys._getframe()) is False


def test_a_build_behind_keras_own_decorator_is_still_told_apart():
    """A Keras that wraps ``_symbolic_build`` in its ``filter_traceback``: the frame above the build was the
    decorator's, and a JAX or torch ``evaluate`` (or an initial_state ``fit``) read the pass after the resumed
    one, silently (helper, 4 of 4)."""
    from kerasfeed._keras_build import evaluation_builds

    trainer = {"__name__": "keras.src.trainers.trainer"}
    exec("def _symbolic_build(look):\n    return look()", trainer)
    decorator = {"__name__": "keras.src.utils.traceback_utils", "inner": trainer["_symbolic_build"]}
    exec("def error_handler(look):\n    return inner(look)", decorator)
    jax = {"__name__": "keras.src.backend.jax.trainer", "_symbolic_build": decorator["error_handler"]}
    exec("def evaluate(look):\n    return _symbolic_build(look)", jax)
    look = lambda: evaluation_builds(sys._getframe(1))  # noqa: E731 - the frame of _symbolic_build's callee
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jax["evaluate"](look) is True


def test_a_build_method_holding_other_code_is_reported(monkeypatch):
    from keras.src.trainers import trainer

    from kerasfeed._keras_build import evaluation_builds

    def _build_from_batch(self, iterator=None, data_batch=None):  # the build moved; the old name kept as an alias
        return None

    monkeypatch.setattr(trainer.Trainer, "_symbolic_build", _build_from_batch)
    with pytest.warns(KerasStructureWarning, match="its Trainer._symbolic_build runs `_build_from_batch` of"):
        assert evaluation_builds(sys._getframe()) is False


def test_kerasfeed_callbacks_under_a_keras_callback_without_its_private_attributes(monkeypatch, tmp_path):
    """A Keras whose Callback keeps its model under another name, and whose BackupAndRestore names its files
    otherwise: kerasfeed's callbacks failed with a bare AttributeError ('_model', '_weights_path'; helper, 2 of 2
    each). They are reported, and the backup and the position are kept as before."""
    from keras.src.callbacks import backup_and_restore, callback

    def set_model(self, model):
        vars(self).pop("_model", None)
        self._keras_model = model

    monkeypatch.setattr(callback.Callback, "set_model", set_model)
    monkeypatch.setattr(callback.Callback, "model", property(lambda self: self._keras_model))
    keras_init = backup_and_restore.BackupAndRestore.__init__

    def renamed(self, *args, **kwargs):
        keras_init(self, *args, **kwargs)
        self._paths = {"weights": vars(self).pop("_weights_path")}

    monkeypatch.setattr(backup_and_restore.BackupAndRestore, "__init__", renamed)
    loader = kerasfeed.to_loader(Seq(), shuffle=True, seed=1)
    progress = kerasfeed.TrainingProgress(order=loader)
    with pytest.warns(KerasStructureWarning, match=r"its BackupAndRestore has no `_weights_path`"):
        backup = kerasfeed.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.warns(KerasStructureWarning, match=r"its Callback keeps no `_model`"):
        _model().fit(loader, epochs=2, verbose=0, shuffle=False, callbacks=[progress, backup])
    assert progress.state()["epoch"] == 2 and progress.state()["batches"] == 0
    assert backup._weights_path is not None  # kept under Keras' name, pointing at the last backup's weights


def test_a_tensorflow_trainer_without_maybe_symbolic_build_is_reported(monkeypatch):
    from keras.src.backend.tensorflow import trainer

    from kerasfeed._keras_build import evaluation_builds

    monkeypatch.delattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    with pytest.warns(KerasStructureWarning, match="its TensorFlowTrainer has no `_maybe_symbolic_build`.*strategy"):
        assert evaluation_builds(sys._getframe()) is False


def test_step_offset_reads_which_step_of_an_execution_a_first_call_gives(monkeypatch):
    from kerasfeed.integrations.steps import step_offset

    _keras_fit._REPORTED.clear()
    model = types.SimpleNamespace(steps_per_execution=4)
    assert step_offset(model, 0, 3, 10, 1) == 1  # the last step, as guessed
    assert step_offset(model, 8, 9, 10, 1) == 1  # a resumed epoch's short first execution: its last step
    assert step_offset(model, 0, 0, 1, 4) == 4  # one step: both say the same, the guess stands
    assert step_offset(model, 4, 5, 12, 1) == 1  # neither (checked elsewhere): the guess stands
    assert step_offset(types.SimpleNamespace(steps_per_execution=1), 0, 0, 10, 1) == 1
    with pytest.warns(KerasStructureWarning, match=r"an execution's first step \(batch 4 after 4 with "
                                                   r"steps_per_execution=4\), not its last"):
        assert step_offset(model, 4, 4, 12, 1) == 4  # the first step where the last was guessed


def test_a_trainer_moved_to_another_module_is_reported_and_told_by_the_backend(monkeypatch):
    """Keras' JAX or torch fit in another module (a renamed trainer) was taken for one that does not build the
    model from a throwaway iterator: under fit(to_dataset(seq)) the source's epoch hooks ran twice for pass 0 and
    every epoch trained the next pass's order, silently (a helper's report, JAX and torch)."""
    _keras_fit._REPORTED.clear()
    assert _keras_fit._builds("keras.src.backend.jax.trainer") and _keras_fit._builds("keras.src.backend.torch.trainer")
    assert not _keras_fit._builds("keras.src.backend.tensorflow.trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _keras_fit._builds("my_trainers")  # not Keras' (the backend says; nothing to report)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.warns(KerasStructureWarning, match=r"its `fit` is in keras\.src\.backend\.jax\.trainers, not "
                                                   r"keras\.src\.backend\.jax\.trainer.*JAX's and torch's build"):
        assert _keras_fit._builds("keras.src.backend.jax.trainers")


def test_a_tensorflow_without_the_iterator_hook_kerasfeed_wraps_is_warned_about_not_a_bare_error(monkeypatch):
    """``tfdata/consumers.install`` read ``OwnedIterator._create_iterator`` without a check (a helper's reading)."""
    from tensorflow.python.data.ops import iterator_ops

    from kerasfeed.tfdata import consumers

    monkeypatch.setattr(consumers, "_installed", False)
    monkeypatch.delattr(iterator_ops.OwnedIterator, "_create_iterator")
    with pytest.warns(RuntimeWarning, match=r"no tensorflow\.python\.data\.ops\.iterator_ops\.OwnedIterator\."
                                            r"_create_iterator.*The batches are the same.*Received: tensorflow "):
        consumers.install()
