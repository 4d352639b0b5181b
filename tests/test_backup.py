"""kerasfeed.BackupAndRestore and the pass following Keras' epoch, in one process (TensorFlow backend).

The real crashes (SIGKILL, every backend) are in test_crash_resume.py; here a
run is cut by an exception after a backup, and what a resumed ``fit`` sees is
checked: passes, batch numbers, refusals, messages.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import keras
import numpy as np
import pytest

import kerasfeed
from kerasfeed._keras_fit import find_fit
from kerasfeed.integrations.backup_files import LATEST, BackupFiles
from kerasfeed.loading.fit_follow import keras_pass

BATCHES = 6


class Seq(kerasfeed.SceneSequence):
    """Batch ``i`` of pass ``e``; records the passes begun."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.passes = []

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        x = np.full((2, 3), i, "float32") + np.arange(3, dtype="float32")
        return x, x.sum(1, keepdims=True) * 0.1

    def on_epoch_begin(self):
        self.passes.append(self.epoch)


class Samples(kerasfeed.SceneSequence):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        x = np.array([np.sin(i), np.cos(i), i / 24], "float32")
        return x, x[:1] * 2


class Cut(keras.callbacks.Callback):
    """Raises after batch ``batch`` of epoch ``epoch`` (after every other callback's hook)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("cut")


class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch, "loss" in (logs or {})))


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    return model


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_keras_pass_is_the_epoch_when_epochs_are_passes():
    assert keras_pass(3, None, 10, 0) == 3
    assert keras_pass(3, 10, 10, 2) == 3
    assert keras_pass(0, 4, 10, 0) is None  # epochs of another length: counted on from the first pass
    with pytest.raises(ValueError, match=r"steps_per_epoch=4.*does not say which pass.*Received: initial_epoch=2"):
        keras_pass(2, 4, 10, 2)


def test_no_fit_is_found_outside_fit():
    assert find_fit(lambda x: True) is None


@pytest.mark.parametrize("front", ["dataset", "loader"])
def test_a_fit_from_initial_epoch_reads_that_epochs_pass(front):
    seq = Seq()
    make = kerasfeed.to_dataset if front == "dataset" else kerasfeed.to_loader
    data = make(seq, shuffle=True, seed=1)
    _model().fit(data, epochs=4, initial_epoch=2, verbose=0, shuffle=False)
    assert seq.passes == [2, 3]
    # initial_state still numbers the passes itself
    seq2 = Seq()
    resumed = make(seq2, shuffle=True, seed=1, initial_state={"epoch": 5, "batches": 0})
    _model().fit(resumed, epochs=3, initial_epoch=2, verbose=0, shuffle=False)
    assert seq2.passes == [5]


def test_backup_files_commit_is_all_or_nothing(tmp_path):
    files = BackupFiles(str(tmp_path / "b"))
    assert files.latest() is None
    files.commit({"epoch": 0, "batch": 2}, lambda p: open(p, "wb").write(b"first"))
    first = files.latest()
    assert first["batch"] == 2 and open(files.weights_of(first), "rb").read() == b"first"

    def broken(path):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.commit({"epoch": 0, "batch": 4}, broken)
    assert files.latest() == first and open(files.weights_of(first), "rb").read() == b"first"
    files.commit({"epoch": 1, "batch": 0}, lambda p: open(p, "wb").write(b"third"))
    latest = files.latest()
    assert latest["epoch"] == 1 and sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        latest["checkpoint"], LATEST,
    ]  # the broken backup's folder and the first one are gone
    (tmp_path / "b" / LATEST).write_text('{"epoch": 1}')
    with pytest.raises(ValueError, match=r"not a backup record written by kerasfeed.*Received: '\{\"epoch\": 1\}'"):
        files.latest()


def test_a_cut_run_resumes_inside_its_epoch_with_keras_batch_numbers(tmp_path):
    reference = _model()
    reference.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False)

    backup = str(tmp_path / "backup")
    first = _model()
    with pytest.raises(KeyboardInterrupt):
        first.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                  callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), Cut(1, 4)])
    record = json.loads((tmp_path / "backup" / LATEST).read_text())
    assert (record["epoch"], record["batch"], record["data"]["pass"], record["data"]["batches"]) == (1, 4, 1, 4)

    seq, steps, second = Seq(), Steps(), _model(seed=5)  # other initial weights: all restored
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")
        second.fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                   callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), steps])
    assert seq.passes == [1, 2]
    assert [s[:2] for s in steps.seen] == [(1, 4), (1, 5)] + [(2, b) for b in range(BATCHES)]
    assert all(s[2] for s in steps.seen)
    _assert_same_weights(second, reference)
    assert not (tmp_path / "backup").exists()
    assert second._initial_epoch is None  # a later fit starts where it is told


def test_a_backup_at_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_dataset(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=BATCHES), Cut(0, BATCHES - 1)])
    record = json.loads((tmp_path / "backup" / LATEST).read_text())
    assert (record["epoch"], record["batch"]) == (1, 0)


def test_a_backup_of_other_data_restores_the_epoch_and_warns_once(tmp_path):
    x = np.random.default_rng(0).normal(size=(12, 3)).astype("float32")
    y = x[:, :1]
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(x, y, batch_size=4, epochs=3, verbose=0,
                     callbacks=[kerasfeed.BackupAndRestore(backup, save_freq="epoch"), Cut(1, 1)])
    steps = Steps()
    with pytest.warns(UserWarning, match="data without a position to restore") as caught:
        _model().fit(x, y, batch_size=4, epochs=3, verbose=0,
                     callbacks=[kerasfeed.BackupAndRestore(backup, save_freq="epoch"), steps])
    assert sum("without a position to restore" in str(w.message) for w in caught) == 1
    assert steps.seen[0][:2] == (1, 0)  # the epoch again, from its start


def test_what_a_backup_cannot_resume_is_refused(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_loader(Samples(), batch_size=4, shuffle=True, seed=2), epochs=2, verbose=0,
                     shuffle=False, callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2), Cut(0, 3)])
    cases = [
        # which of the order's arguments changed (only two fingerprints were named: a helper's report)
        (dict(batch_size=4, shuffle=True, seed=3), r"the order of the items: seed saved 2, now 3\. Make"),
        (dict(batch_size=4, shuffle=False), r"the order of the items: seed saved 2, now None, shuffle saved True, "
                                            r"now False\. Make"),
        (dict(batch_size=4, order=kerasfeed.WeightedOrder(np.ones(24), seed=2)),
         r"the order of the items: kind saved 'IndexOrder', now 'WeightedOrder', num_samples saved None, now 24, "
         r"replacement saved None, now True, shuffle saved True, now None\. Make"),
        (dict(batch_size=3, shuffle=True, seed=2), r"the items per step \(batch_size x processes .*\): saved 4 \(4 x 1 process\), now 3 \(3 x 1 process\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=r"other data than this run's.*" + message + r".*Received: "):
            _model().fit(kerasfeed.to_loader(Samples(), **kwargs), epochs=2, verbose=0, shuffle=False,
                         callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=2)])
    with pytest.raises(ValueError, match=r"steps_per_epoch=3 steps and a pass has 6 batches.*Received: "):
        _model().fit(kerasfeed.to_loader(Samples(), batch_size=4, shuffle=True, seed=2), epochs=2, verbose=0,
                     shuffle=False, steps_per_epoch=3, callbacks=[kerasfeed.BackupAndRestore(backup)])
    resumed = kerasfeed.to_loader(Samples(), batch_size=4, shuffle=True, seed=2, initial_state={"epoch": 0, "batches": 0})
    with pytest.raises(ValueError, match=r"made with `initial_state=`.*Received: "):
        _model().fit(resumed, epochs=2, verbose=0, shuffle=False, callbacks=[kerasfeed.BackupAndRestore(backup)])


def test_a_backup_of_keras_own_callback_is_refused_not_trained_over_and_deleted(tmp_path):
    # It trained from epoch 0 as if the directory were empty, then deleted Keras' backup at the fit's end.
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(kerasfeed.to_loader(Samples(), batch_size=4, shuffle=True, seed=2), epochs=3, verbose=0,
                     shuffle=False, callbacks=[keras.callbacks.BackupAndRestore(backup), Cut(1, 2)])
    left = sorted(os.listdir(backup))
    assert "training_metadata.json" in left, left
    with pytest.raises(ValueError, match=r"holds a backup of Keras' own BackupAndRestore \(training_metadata.json"):
        _model().fit(kerasfeed.to_loader(Samples(), batch_size=4, shuffle=True, seed=2), epochs=3, verbose=0,
                     shuffle=False, callbacks=[kerasfeed.BackupAndRestore(backup)])
    assert sorted(os.listdir(backup)) == left


@pytest.mark.parametrize("bad", [{"save_freq": 0}, {"save_freq": "batch"}, {"save_freq": True}, {"backup_dir": ""}])
def test_bad_arguments_are_named(bad):
    kwargs = {"backup_dir": "run/backup", **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}="):
        kerasfeed.BackupAndRestore(**kwargs)


def test_a_backup_dir_that_is_a_file_is_refused_when_made(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")  # fit failed later with a bare FileExistsError naming no argument
    with pytest.raises(ValueError, match=rf"`backup_dir` is an existing file, not a directory.*Received: backup_dir='{afile}'"):
        kerasfeed.BackupAndRestore(afile)


def test_it_is_keras_callback():
    assert isinstance(kerasfeed.BackupAndRestore("run/b"), keras.callbacks.BackupAndRestore)


def test_steps_per_execution_counts_batches_between_backups(tmp_path):
    """save_freq counts batches, as Keras' callback does, also when one step runs several."""
    backup = str(tmp_path / "backup")
    model = _model()
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=2)
    saved = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record = json.loads((tmp_path / "backup" / LATEST).read_text()) if (tmp_path / "backup").exists() else None
            saved.append(None if record is None else (record["epoch"], record["batch"]))

    model.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=1, verbose=0, shuffle=False,
              callbacks=[kerasfeed.BackupAndRestore(backup, save_freq=4, delete_checkpoint=False), Spy()])
    assert saved == [None, (0, 4), (0, 4)]  # executions of 2 batches: a backup once 4 are trained, none at 6


def test_a_scene_sequence_fitted_by_keras_follows_the_epoch_it_starts_at():
    """model.fit(seq) (Keras' own PyDataset path): seq.epoch is the fit's epoch from initial_epoch on."""
    class Epochs(Seq):
        def __getitem__(self, i):
            if getattr(self, "_kf_in_epoch", False):  # not Keras' signature probe before the first epoch
                self.seen_epochs = getattr(self, "seen_epochs", set()) | {self.epoch}
            return super().__getitem__(i)

    seq = Epochs()
    _model().fit(seq, epochs=4, initial_epoch=2, verbose=0, shuffle=False)
    assert seq.passes == [2, 3] and seq.seen_epochs == {2, 3}
    seq2 = Epochs()
    _model().fit(seq2, epochs=2, verbose=0, shuffle=False)
    assert seq2.passes == [0, 1]


def test_a_keras_too_old_to_resume_inside_an_epoch_is_refused_by_name():
    from kerasfeed.integrations.backup import _check_keras

    _check_keras("3.7.0")
    _check_keras("3.15.1")
    with pytest.raises(RuntimeError, match=r"needs Keras >= 3\.7.*Received: keras 3\.6\.0"):
        _check_keras("3.6.0")


def test_an_unreadable_latest_backup_falls_back_on_the_previous_one_and_its_position(tmp_path):
    """double_checkpoint=True, the latest weights file overwritten (Keras' own corrupted-backup case):
    the previous backup's weights *and* data position come back, it is made current again, and the
    run trains exactly the batches after it; without its own record (an older backup) it is refused."""
    reference = _model()
    reference.fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False)
    backup = tmp_path / "backup"

    def cut_run():
        cbk = kerasfeed.BackupAndRestore(str(backup), save_freq=2, double_checkpoint=True)
        with pytest.raises(KeyboardInterrupt):
            _model().fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                         callbacks=[cbk, Cut(1, 4)])
        latest = json.loads((backup / LATEST).read_text())
        assert (latest["epoch"], latest["batch"]) == (1, 4) and cbk._current_epoch == 1
        assert cbk._weights_path == str(backup / latest["checkpoint"] / "model.weights.h5")
        assert cbk._prev_training_metadata_path == str(backup / latest["previous"] / "record.json")
        with open(cbk._weights_path, "w") as f:
            f.write("0")
        return latest

    latest = cut_run()
    seq, steps, second = Seq(), Steps(), _model(seed=5)
    with pytest.warns(UserWarning, match=r"latest backup .* could not be read.*previous one \(epoch 1, batch 2\)"):
        second.fit(kerasfeed.to_loader(seq, shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                   callbacks=[kerasfeed.BackupAndRestore(str(backup), save_freq=2, double_checkpoint=True,
                                                         delete_checkpoint=False), steps])
    assert seq.passes == [1, 2]
    assert [s[:2] for s in steps.seen] == [(1, b) for b in range(2, BATCHES)] + [(2, b) for b in range(BATCHES)]
    _assert_same_weights(second, reference)
    assert latest["checkpoint"] not in {p.name for p in backup.iterdir()}  # the unreadable one is gone

    shutil.rmtree(backup)
    latest = cut_run()
    (backup / latest["previous"] / "record.json").unlink()  # as a backup written before records were kept
    with pytest.raises(RuntimeError, match=r"could not be read, and the previous one \(ckpt-\d+\) has no record.*"
                                           r"Received: "):
        _model().fit(kerasfeed.to_loader(Seq(), shuffle=True, seed=2), epochs=3, verbose=0, shuffle=False,
                     callbacks=[kerasfeed.BackupAndRestore(str(backup), save_freq=2, double_checkpoint=True)])


class Nine(Seq):
    def __len__(self):
        return 9


@pytest.mark.parametrize("front", ["to_dataset", "to_loader"])
def test_a_resume_keras_reads_past_the_end_of_is_exact_and_refused_through_a_derived_dataset(tmp_path, front):
    """A pass of 9 batches resumed after 4 with steps_per_execution=2: Keras' last step reads past the 5
    batches left. tf.data's check of a whole pass's length failed there with a bare FailedPreconditionError at
    every rerun (a helper's report), then the resume was refused by name. Now Keras reads that epoch from the same
    pipeline without the check: the same weights and steps as a run never cut, the later epoch a checked whole
    pass. Through a dataset derived from kerasfeed's, the check stays: refused by name before any batch, and
    steps_per_execution=1 resumes the same backup."""
    make = getattr(kerasfeed, front)

    def fit(spe, callbacks, derive=lambda ds: ds):
        model = _model()
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", steps_per_execution=spe)
        steps = Steps()
        model.fit(derive(make(Nine(), shuffle=True, seed=2)), epochs=3, verbose=0, shuffle=False,
                  callbacks=callbacks + [steps])
        return model, steps.seen

    reference, seen = fit(2, [])
    itself, derived = str(tmp_path / "itself"), str(tmp_path / "derived")
    with pytest.raises(KeyboardInterrupt):
        fit(2, [kerasfeed.BackupAndRestore(itself, save_freq=2, delete_checkpoint=False), Cut(1, 3)])
    shutil.copytree(itself, derived)
    resumed, resumed_seen = fit(2, [kerasfeed.BackupAndRestore(itself, save_freq=2)])
    _assert_same_weights(resumed, reference)
    assert resumed_seen == [s for s in seen if s[0] == 2 or (s[0] == 1 and s[1] > 4)], (resumed_seen, seen)
    if front == "to_loader":
        return  # a to_loader is not a tf.data.Dataset to derive from
    with pytest.raises(ValueError, match=r"resumes after batch 4 of 9, and Keras reads steps_per_execution=2 batches "
                                         r"a step, so it would read past the 5 batches left.*derived, zipped or "
                                         r"distributed.*Received: steps_per_execution=2, 5 batches left"):
        fit(2, [kerasfeed.BackupAndRestore(derived, save_freq=2, delete_checkpoint=False)],
            derive=lambda ds: ds.map(lambda x, y: (x, y)))
    _assert_same_weights(fit(1, [kerasfeed.BackupAndRestore(derived, save_freq=2)],
                             derive=lambda ds: ds.map(lambda x, y: (x, y)))[0], reference)
