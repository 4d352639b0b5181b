"""The documented `model.fit` paths: no Keras warning, and readable item errors."""

import gc
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed


def make_rows_class():
    # Defined in a function: cloudpickle sends it by value, so worker
    # processes do not import this (TensorFlow-importing) test module.
    class Rows(kerasfeed.SceneSequence):
        def __init__(self, fail_at=None, **kwargs):
            super().__init__(**kwargs)
            self.fail_at = fail_at

        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i == self.fail_at:
                raise ValueError(f"row block {i} is corrupt")
            x = np.random.default_rng(i).random((4, 3), dtype=np.float32)
            return x, x.sum(axis=1, keepdims=True)

    return Rows


Rows = make_rows_class()


def small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def keras_warnings(record):
    return [str(w.message) for w in record if "keras" in w.filename]


def test_fit_on_to_dataset_with_shuffle_false_is_warning_free():
    model = small_model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(kerasfeed.to_dataset(Rows(), shuffle=True, seed=0), epochs=2, verbose=0, shuffle=False)
        model.fit(Rows(), epochs=1, verbose=0)  # Keras' own path
    assert keras_warnings(record) == []
    # fit's default shuffle=True is what makes Keras warn (the documented argument is needed)
    with pytest.warns(UserWarning, match=r"`shuffle=True` was passed, but will be ignored"):
        model.fit(kerasfeed.to_dataset(Rows()), epochs=1, verbose=0)


def test_the_documented_resume_path_is_warning_free_and_reads_every_batch_once(tmp_path):
    path = tmp_path / "run" / "state.json"
    state = kerasfeed.TrainingProgress.load(path)  # a first run: no file yet
    assert state == {"epoch": 0, "batches": 0}
    with pytest.raises(FileNotFoundError):
        kerasfeed.TrainingProgress.load(path, missing_ok=False)
    state = {"epoch": 1, "batches": 4}  # as an interrupted run leaves it
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    model, seq = small_model(), Rows()
    progress = kerasfeed.TrainingProgress(state, path=path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        epoch = state["epoch"]
        model.fit(kerasfeed.to_dataset(seq, shuffle=True, seed=0, initial_state=state),
                  initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=len(seq) - state["batches"],
                  shuffle=False, callbacks=[progress, Seen()], verbose=0)
        assert kerasfeed.TrainingProgress.load(path) == {"epoch": 2, "batches": 0}
        model.fit(kerasfeed.to_dataset(seq, shuffle=True, seed=0, initial_state={"epoch": 2, "batches": 0}),
                  initial_epoch=2, epochs=4, shuffle=False, callbacks=[progress, Seen()], verbose=0)
    assert keras_warnings(record) == []
    assert seen == [0, 1] + list(range(6)) * 2  # the 2 batches left of epoch 1, then whole epochs
    assert kerasfeed.TrainingProgress.load(path) == {"epoch": 4, "batches": 0}


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_an_item_error_in_fit_shows_index_and_the_original_traceback_once(executor):
    extra = {"workers": 1} if executor == "processes" else {}
    ds = kerasfeed.to_dataset(make_rows_class()(fail_at=3), executor=executor, **extra)
    with pytest.raises(tf.errors.OpError) as info:
        small_model().fit(ds, epochs=1, verbose=0, shuffle=False)
    text = str(info.value)
    del ds, info  # the traceback holds the dataset (and its workers)
    gc.collect()
    # the original exception and its source line, once
    assert text.count('raise ValueError(f"row block {i} is corrupt")') == 1, text
    assert len(re.findall(r"^ValueError: row block 3 is corrupt$", text, re.M)) == 1, text
    assert text.count("Original traceback") == 1, text
    # the kerasfeed line first (index, type, message), then the original traceback right after it
    first = text.index("kerasfeed: Rows[3] raised ValueError")
    assert "row block 3 is corrupt" in text[first:].splitlines()[0]
    tb = text.index("Original traceback")
    assert first < tb and text[first:tb].count("\n") <= 2
    # kerasfeed's executor internals are not in the text
    assert not re.search(r"threads\.py.*in (load|_thread_loop)|dispatcher\.py", text), text
    # the Python exception itself: one-line message, traceback in full_message
    with pytest.raises(kerasfeed.ItemError) as direct:
        kerasfeed.to_dataset(Rows(fail_at=5))  # probing the last item
    err = direct.value
    assert "\n" not in str(err) and err.index == 5 and err.exc_type == "ValueError"
    assert 'raise ValueError(f"row block {i} is corrupt")' in err.full_message
