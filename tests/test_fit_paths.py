"""The documented `model.fit` paths: no Keras warning, and readable item errors."""

import gc
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _util import index_recorder

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


# --- streams and resumed datasets: what fit trains on, and no "ran out of data" ---------------------

class Recorder(keras.layers.Layer):
    """Records the first feature of every sample the model trains on (eager steps only)."""

    def __init__(self, record, **kwargs):
        super().__init__(**kwargs)
        self.record = record  # a function: Keras would copy a list into a tracked one

    def call(self, x):
        if not isinstance(x, keras.KerasTensor):
            self.record(np.asarray(x)[:, 0].astype(int).tolist())
        return x


def recording_model(features):
    keras.utils.set_random_seed(0)
    seen = []
    model = keras.Sequential([keras.Input((features,)), Recorder(seen.append), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    return model, seen


def fit_quietly(model, ds, capfd, **kwargs):
    """`model.fit` with Keras warnings as errors; asserts no "ran out of data" on stderr either."""
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module=r"keras(\.|$)")
        model.fit(ds, shuffle=False, verbose=0, **kwargs)
    assert "ran out of data" not in capfd.readouterr().err


def numbered(value):
    return np.full(6, value, np.float32), np.float32(value % 3)


def count_producer(put):
    for epoch in range(2):
        for j in range(10):
            put(numbered(100 * epoch + j))
        put(kerasfeed.END_OF_EPOCH)


def shard_items(k):
    for j in range(5):
        yield numbered(10 * k + j)


def read_numbers(path):
    with open(path) as f:
        return [numbered(int(line)) for line in f]


def make_stream(kind, tmp_path, **kwargs):
    if kind == "from_queue":
        return kerasfeed.from_queue(count_producer, batch_size=4, **kwargs)
    if kind == "from_generators":
        return kerasfeed.from_generators(shard_items, 2, batch_size=4, **kwargs)
    paths = []
    for k in range(2):
        paths.append(tmp_path / f"part{k}.txt")
        paths[-1].write_text("".join(f"{10 * k + j}\n" for j in range(5)))
    return kerasfeed.from_files(paths, read_numbers, batch_size=4, **kwargs)


# Every pass, in the stream's deterministic order (queue: the producer's epochs).
STREAM_EPOCHS = {
    "from_queue": [list(range(10)), list(range(100, 110))],
    "from_generators": [[0, 10, 1, 11, 2, 12, 3, 13, 4, 14]] * 2,
    "from_files": [[0, 10, 1, 11, 2, 12, 3, 13, 4, 14]] * 2,
}


@pytest.mark.parametrize("kind", sorted(STREAM_EPOCHS))
def test_a_stream_with_items_per_epoch_fits_two_epochs_warning_free_on_every_item(kind, tmp_path, capfd):
    ds = make_stream(kind, tmp_path, items_per_epoch=10)
    assert int(ds.cardinality()) == 3  # ceil(10 / 4) batches: Keras knows the steps
    model, seen = recording_model(6)
    fit_quietly(model, ds, capfd, epochs=2)
    expected = [e[i : i + 4] for e in STREAM_EPOCHS[kind] for i in range(0, 10, 4)]
    assert seen == expected


def test_without_a_declared_length_keras_warns_ran_out_of_data_every_epoch(tmp_path):
    # What items_per_epoch avoids (Keras 3 learns one step too many from the first epoch).
    model, _ = recording_model(6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(make_stream("from_generators", tmp_path), epochs=2, shuffle=False, verbose=0)
    assert sum("ran out of data" in m for m in keras_warnings(record)) == 2


@pytest.mark.parametrize("declared, how", [(9, "more than 9"), (11, "fewer than 11")])
def test_a_pass_that_differs_from_items_per_epoch_fails_naming_both_counts(declared, how, tmp_path):
    ds = make_stream("from_generators", tmp_path, items_per_epoch=declared)
    model, _ = recording_model(6)
    with pytest.raises(tf.errors.OpError, match=rf"from_generators \(pass 0\) had {how} items.*"
                       rf"Received: items_per_epoch={declared}"):
        model.fit(ds, epochs=1, shuffle=False, verbose=0)
    # outside fit too, whatever the batching
    with pytest.raises(tf.errors.OpError, match=f"had {how} items"):
        list(make_stream("from_queue", tmp_path, items_per_epoch=declared))


@pytest.mark.parametrize("declared", [8, 9])
def test_a_longer_pass_with_drop_remainder_fails_rather_than_being_cut(declared, tmp_path):
    """With drop_remainder, fit stops after the whole batches: 10 items declared as 8 or 9 trained 8 items an
    epoch, silently, where the last declared item was held back for the check (helper, 4 of 4)."""
    ds = make_stream("from_generators", tmp_path, items_per_epoch=declared, drop_remainder=True)
    assert int(ds.cardinality()) == 2
    model, _ = recording_model(6)
    with pytest.raises(tf.errors.OpError, match=rf"had more than {declared} items"):
        model.fit(ds, epochs=1, shuffle=False, verbose=0)


def test_a_pass_of_the_declared_length_with_drop_remainder_gives_every_whole_batch(tmp_path):
    ds = make_stream("from_generators", tmp_path, items_per_epoch=10, drop_remainder=True, shuffle_buffer=4, seed=1)
    passes = [[int(v) for x, _ in ds for v in x.numpy()[:, 0]] for _ in range(2)]
    assert [len(p) for p in passes] == [8, 8] and all(set(p) <= set(STREAM_EPOCHS["from_generators"][0]) for p in passes)
    ds = make_stream("from_generators", tmp_path, items_per_epoch=10, drop_remainder=True)
    assert [int(v) for x, _ in ds for v in x.numpy()[:, 0]] == STREAM_EPOCHS["from_generators"][0][:8]


def test_items_per_epoch_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"`items_per_epoch` must be a positive int. Received: items_per_epoch=0"):
        make_stream("from_generators", tmp_path, items_per_epoch=0)
    with pytest.raises(ValueError, match=r"leaves no batch. Received: items_per_epoch=3"):
        make_stream("from_queue", tmp_path, items_per_epoch=3, drop_remainder=True)


class NumberedBatches(kerasfeed.SceneSequence):
    """Batch ``i`` is two rows of ``i``: a recording model sees which batch it trained on."""

    def __init__(self, length):
        super().__init__()
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return np.full((2, 6), i, np.float32), np.full((2, 1), i, np.float32)


def first_passes(seq, n=4):
    """The batches of passes 0..n-1 of an uninterrupted shuffled run, by number."""
    reference = kerasfeed.to_dataset(seq, shuffle=True, seed=0)
    return [[int(x[0, 0]) for x, _ in reference] for _ in range(n)]


def test_a_resumed_dataset_trains_the_rest_of_its_epoch_then_whole_epochs_warning_free(capfd):
    seq = NumberedBatches(6)
    passes = first_passes(seq)
    state = {"epoch": 1, "batches": 4}  # stopped after 4 batches of epoch 1
    model, seen = recording_model(6)
    progress = kerasfeed.TrainingProgress(state)
    # the documented path: the interrupted epoch on its remaining steps, then whole epochs
    fit_quietly(model, kerasfeed.to_dataset(seq, shuffle=True, seed=0, initial_state=state), capfd,
                initial_epoch=1, epochs=2, steps_per_epoch=len(seq) - state["batches"], callbacks=[progress])
    assert progress.state() == {"epoch": 2, "batches": 0}
    fit_quietly(model, kerasfeed.to_dataset(seq, shuffle=True, seed=0, initial_state=progress.state()), capfd,
                initial_epoch=2, epochs=4, callbacks=[progress])
    assert [batch[0] for batch in seen] == passes[1][4:] + passes[2] + passes[3]
    assert progress.state() == {"epoch": 4, "batches": 0}


def test_one_fit_call_over_a_resumed_dataset_trains_every_later_epoch_whole():
    # Keras reads `ds.cardinality()` once per call; unknown, it took every later epoch's steps
    # from the short resumed pass and cut them (5, 6, 6 of 8 batches). Told the whole pass, the
    # resumed epoch ends early (Keras' warning, once) and every later epoch is whole.
    seq = NumberedBatches(8)
    passes = first_passes(seq)
    resumed = kerasfeed.to_dataset(seq, shuffle=True, seed=0, initial_state={"epoch": 1, "batches": 3})
    assert int(resumed.cardinality()) == len(resumed) == 8  # a whole pass; tf.data's own count stays unknown
    assert int(tf.data.experimental.cardinality(resumed)) == tf.data.UNKNOWN_CARDINALITY
    model, seen = recording_model(6)
    progress = kerasfeed.TrainingProgress({"epoch": 1, "batches": 3})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(resumed, initial_epoch=1, epochs=4, shuffle=False, verbose=0, callbacks=[progress])
    assert [batch[0] for batch in seen] == passes[1][3:] + passes[2] + passes[3]
    assert sum("ran out of data" in m for m in keras_warnings(record)) == 1  # the resumed epoch's end
    assert progress.state() == {"epoch": 4, "batches": 0}


def test_a_resumed_loader_reads_whole_passes_in_the_calls_after_its_resumed_one():
    # Under TensorFlow the loader's dataset reads the passes; the loader's num_batches stayed at the resumed
    # pass's length (2 of 3), so an evaluate and a second fit on the same loader read 2 batches of each pass.
    seq = NumberedBatches(3)
    passes = first_passes(seq)
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=0, initial_state={"epoch": 1, "batches": 1})
    model, seen = recording_model(6)
    model.fit(loader, initial_epoch=1, epochs=2, shuffle=False, verbose=0)
    model.evaluate(loader, verbose=0)
    model.fit(loader, initial_epoch=3, epochs=4, shuffle=False, verbose=0)
    assert [batch[0] for batch in seen] == passes[1][1:] + passes[2] + passes[3]
    loader.close()


def test_every_documented_fit_on_a_dataset_passes_shuffle_false():
    """README.md, docs/, examples/ and the notebooks: `fit(dataset)` always says `shuffle=False`."""
    import ast
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    sources = []
    for md in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        blocks = re.findall(r"^```python\n(.*?)^```", md.read_text(), re.S | re.M)
        sources += [(md.name, b) for b in blocks]
    sources += [(p.name, p.read_text()) for p in sorted((root / "examples").glob("*.py"))]
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for c in cells:  # IPython magics (`%matplotlib inline`) are not Python
            if c["cell_type"] == "code":
                lines = "".join(c["source"]).splitlines()
                sources.append((nb.name, "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))))
    # Keras' own inputs: a PyDataset (`fit` shuffles its batch order) or a kerasfeed Loader (a data adapter)
    keras_own = {"seq", "mixed", "loader"}
    calls, missing = 0, []
    for name, code in sources:
        for node in ast.walk(ast.parse(code)):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "fit" and node.args):
                continue
            calls += 1
            x = node.args[0]
            own = (isinstance(x, ast.Name) and x.id in keras_own) or "to_loader(" in ast.unparse(x)
            shuffle = [k.value for k in node.keywords if k.arg == "shuffle"]
            if not own and not (shuffle and isinstance(shuffle[0], ast.Constant) and shuffle[0].value is False):
                missing.append(f"{name}: fit({ast.unparse(node)[:80]}...)")
    assert calls >= 20, calls  # the scan found the documented calls
    assert missing == []


class Numbered(kerasfeed.SceneSequence):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full(3, i, np.float32), np.float32([i])


def test_a_repeated_dataset_under_fit_reads_a_new_pass_each_repetition():
    """``ds.repeat(2)`` makes epochs of two passes: the pass followed Keras' epoch, so each epoch read
    the same pass twice. Its epochs are now counted on, as under ``steps_per_epoch``; a fit starting at
    a later epoch, which cannot say the pass, is refused naming the repeat."""
    seen: list = []
    ds = kerasfeed.to_dataset(Numbered(), batch_size=4, shuffle=True, seed=0)
    index_recorder(seen, 3).fit(ds.repeat(2), epochs=2, verbose=0)
    with kerasfeed.to_loader(Numbered(), batch_size=4, shuffle=True, seed=0) as loader:
        want = [b[1][:, 0].astype(int).tolist() for _ in range(4) for b in loader]
    assert seen == want, (seen, want)
    with pytest.raises(Exception, match=r"starts at epoch 1 with epochs of 4 steps \(its dataset derived to read more "
                                        r"than a pass an epoch, such as repeat\(\)\)"):
        index_recorder([], 3).fit(kerasfeed.to_dataset(Numbered(), batch_size=4, shuffle=True, seed=0).repeat(2),
                                 epochs=2, initial_epoch=1, verbose=0)


class _Passes(kerasfeed.SceneSequence):
    """Items hold the pass they were made in; the hooks are recorded per source."""

    def __init__(self, name, hooks):
        super().__init__()
        self.name, self.hooks = name, hooks

    def __len__(self):
        return 3

    def on_epoch_begin(self):
        self.hooks.append(f"{self.name}:begin{self.epoch}")

    def __getitem__(self, i):
        return np.full((4, 1), self.epoch, "float32")


def test_a_zip_of_two_kerasfeed_datasets_follows_the_fit_s_epochs_in_both():
    """Only the nearest pipeline of a ``tf.data.Dataset.zip`` followed the fit's epoch (``find_tagged``); the
    other counted its own passes: a second fit read passes 2 and 3 there, 0 and 1 in the first (a helper's
    report). Each epoch's passes, read through an identity model's outputs."""
    hooks = []
    a, b = kerasfeed.to_dataset(_Passes("A", hooks)), kerasfeed.to_dataset(_Passes("B", hooks))
    ds = tf.data.Dataset.zip(a, b).map(lambda p, q: (tf.concat([p, q], 1), tf.zeros((4, 1))))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, kernel_initializer="identity",
                                                                   use_bias=False)])
    model.compile(keras.optimizers.SGD(0.0), "mse", metrics=[
        keras.metrics.MeanMetricWrapper(lambda y, p: p[:, 0], name="passA"),
        keras.metrics.MeanMetricWrapper(lambda y, p: p[:, 1], name="passB")])
    for _ in range(2):
        history = model.fit(ds, epochs=2, verbose=0).history
        assert (history["passA"], history["passB"]) == ([0.0, 1.0], [0.0, 1.0]), history
    assert sorted(hooks) == sorted(f"{s}:begin{k}" for s in "AB" for k in (0, 1) for _ in range(2)), hooks
