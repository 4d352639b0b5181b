"""Exact resume: a run stopped mid-epoch continues on exactly the next batches."""

import json

import keras
import numpy as np
import pytest

import kerasfeed


class Seq(kerasfeed.SceneSequence):
    def __len__(self):
        return 7

    def __getitem__(self, i):
        x = np.random.default_rng(i).normal(size=(4, 3)).astype("float32")
        return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + i


def _first_column(ds):
    return [float(x[0, 0]) for x, _ in ds]


def test_resumed_dataset_continues_the_same_order():
    ref = kerasfeed.to_dataset(Seq(), shuffle=True, seed=3)
    passes = [_first_column(ref) for _ in range(3)]
    resumed = kerasfeed.to_dataset(Seq(), shuffle=True, seed=3, initial_state={"epoch": 1, "batches": 2})
    assert _first_column(resumed) == passes[1][2:]
    assert _first_column(resumed) == passes[2]


def test_resume_with_sample_batching():
    class Samples:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.int64(i)

    ref = kerasfeed.to_dataset(Samples(), batch_size=3, shuffle=True, seed=1)
    full = [b.numpy().tolist() for b in ref]
    resumed = kerasfeed.to_dataset(Samples(), batch_size=3, shuffle=True, seed=1, initial_state={"epoch": 0, "batches": 2})
    assert [b.numpy().tolist() for b in resumed] == full[2:]


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, epoch, batches):
        super().__init__()
        self.epoch, self.batches = epoch, batches

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch + 1 == self.batches:
            self.model.stop_training = True


def test_fit_stopped_mid_epoch_resumes_to_identical_weights(tmp_path):
    reference = _model()
    reference.fit(kerasfeed.to_dataset(Seq(), shuffle=True, seed=0), epochs=3, verbose=0, shuffle=False)

    state_path = tmp_path / "data_state.json"
    progress = kerasfeed.TrainingProgress(path=state_path)
    first = _model()
    first.fit(
        kerasfeed.to_dataset(Seq(), shuffle=True, seed=0),
        epochs=3, verbose=0, shuffle=False, callbacks=[progress, _StopAfter(1, 3)],
    )
    assert progress.state() == {"epoch": 1, "batches": 3}
    state = kerasfeed.TrainingProgress.load(state_path)
    assert state == {"epoch": 1, "batches": 3} and json.loads(state_path.read_text()) == state
    first.save(tmp_path / "model.keras")

    second = keras.models.load_model(tmp_path / "model.keras")
    epoch = state["epoch"]
    progress2 = kerasfeed.TrainingProgress(state)
    if state["batches"]:  # finish the interrupted epoch: its pass is shorter
        second.fit(
            kerasfeed.to_dataset(Seq(), shuffle=True, seed=0, initial_state=state),
            epochs=epoch + 1, initial_epoch=epoch, verbose=0, shuffle=False, callbacks=[progress2],
        )
        epoch += 1
    assert progress2.state() == {"epoch": 2, "batches": 0}
    second.fit(
        kerasfeed.to_dataset(Seq(), shuffle=True, seed=0, initial_state={"epoch": epoch, "batches": 0}),
        epochs=3, initial_epoch=epoch, verbose=0, shuffle=False, callbacks=[progress2],
    )
    assert progress2.state() == {"epoch": 3, "batches": 0}
    for a, b in zip(reference.get_weights(), second.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_resume_states():
    with pytest.raises(ValueError, match="exactly the keys 'epoch' and 'batches'.*Received: \\{'epoch': 1\\}"):
        kerasfeed.to_dataset(Seq(), initial_state={"epoch": 1})
    with pytest.raises(ValueError, match="batches=-1"):
        kerasfeed.to_dataset(Seq(), initial_state={"epoch": 0, "batches": -1})
    with pytest.raises(ValueError, match="a pass has only 7"):
        kerasfeed.to_dataset(Seq(), initial_state={"epoch": 0, "batches": 7})
    with pytest.raises(ValueError, match="save_every=0"):
        kerasfeed.TrainingProgress(save_every=0)


def test_training_progress_in_a_custom_loop_without_a_model():
    """A custom loop (JAX, numpy) calls the hooks with no Keras model set: the epoch ends complete
    (an AttributeError on model.stop_training before)."""
    progress = kerasfeed.TrainingProgress()
    progress.on_epoch_begin(0)
    for b in range(3):
        progress.on_train_batch_end(b)
    assert progress.state() == {"epoch": 0, "batches": 3}
    progress.on_epoch_end(0)
    assert progress.state() == {"epoch": 1, "batches": 0}


def test_a_custom_loop_that_breaks_off_a_pass_keeps_its_position_where_the_pass_length_is_known():
    """A loop stopped by a time limit (``break``, no model to set ``stop_training`` on) saved the pass as
    complete: the resumed run began the next pass, and the pass's other batches were never trained."""
    loader = kerasfeed.to_loader(Samples(), batch_size=2, shuffle=True, seed=0)  # 5 batches a pass
    progress = kerasfeed.TrainingProgress(order=loader)
    seen = []
    progress.on_epoch_begin(0)
    for step, batch in enumerate(loader):
        seen += batch.tolist()
        progress.on_train_batch_end(step)
        if step == 2:
            break
    progress.on_epoch_end(0)
    state = progress.state()
    assert (state["epoch"], state["batches"]) == (0, 3), state
    rest = [int(i) for b in kerasfeed.to_loader(Samples(), batch_size=2, shuffle=True, seed=0, initial_state=state)
            for i in b]
    assert sorted(seen + rest) == list(range(10)), (seen, rest)
    progress.on_epoch_begin(1)  # a whole pass moves on at its last batch, as before
    for step, _ in enumerate(loader):
        progress.on_train_batch_end(step)
    progress.on_epoch_end(1)
    assert (progress.state()["epoch"], progress.state()["batches"]) == (2, 0)


class Samples:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.int64(i)


def test_a_state_saved_knowing_the_batching_refuses_another_batch_size():
    # Before: batches x the new batch_size items were skipped: with batch_size=2 items 4 and 8 came twice.
    for make in (kerasfeed.to_dataset, kerasfeed.to_loader):
        run = make(Samples(), batch_size=3, shuffle=True, seed=1)
        state = kerasfeed.TrainingProgress({"epoch": 0, "batches": 2}, order=run).state()
        assert state["items"] == 6 and "order" in state
        with pytest.raises(ValueError, match=r"saved after 2 batches holding 6 items of pass 0 \(batches of 3 items\), "
                           r"but this pipeline's batches hold 2: .*'epoch': 1, 'batches': 0"):
            make(Samples(), batch_size=2, shuffle=True, seed=1, initial_state=state)
        resumed = make(Samples(), batch_size=3, shuffle=True, seed=1, initial_state=state)
        assert sorted(int(v) for b in resumed for v in np.asarray(b)) == sorted(
            int(v) for b in list(run)[2:] for v in np.asarray(b)
        )
        with pytest.raises(ValueError, match=r"^TrainingProgress: `initial_state` was saved after 2 batches"):
            kerasfeed.TrainingProgress(state, order=make(Samples(), batch_size=5, shuffle=True, seed=1))
    assert kerasfeed.TrainingProgress({"epoch": 0, "batches": 2, "items": 6}).state()["items"] == 6
    with pytest.raises(ValueError, match=r"ResumeState: `items` must be a non-negative int"):
        kerasfeed.ResumeState.from_dict({"epoch": 0, "batches": 2, "items": -1})


def test_epochs_that_are_not_whole_passes_are_refused_when_the_order_is_the_dataset():
    # Keras goes on reading a pass across epochs with steps_per_epoch shorter than it: the state said
    # {'epoch': 1, 'batches': 0} while pass 0's second half had trained.
    ds = kerasfeed.to_dataset(Seq(), shuffle=True, seed=0)
    with pytest.raises(ValueError, match=r"epochs have 3 steps and a pass has 7 batches.*steps_per_epoch=3"):
        _model().fit(ds, epochs=2, steps_per_epoch=3, shuffle=False, verbose=0,
                     callbacks=[kerasfeed.TrainingProgress(order=ds)])
    resumed = kerasfeed.to_dataset(Seq(), shuffle=True, seed=0, initial_state={"epoch": 1, "batches": 3})
    progress = kerasfeed.TrainingProgress({"epoch": 1, "batches": 3}, order=resumed)
    _model().fit(resumed, initial_epoch=1, epochs=2, steps_per_epoch=4, shuffle=False, verbose=0,
                 callbacks=[progress])  # the resumed epoch's own call
    assert progress.state() == {"epoch": 2, "batches": 0, "order": kerasfeed.TrainingProgress(order=ds).state()["order"],
                                "items": 0}


class _Pairs:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.full(3, i, np.float32), np.float32([i])


class _CrashInValidation(keras.callbacks.Callback):
    def on_test_begin(self, logs=None):
        raise RuntimeError("preempted during validation")


def test_a_crash_during_the_end_of_epoch_validation_resumes_at_the_next_pass(tmp_path):
    # The state was {'epoch': 0, 'batches': 3} (the pass's end) until on_epoch_end,
    # after validation: the front ends refuse it and the recipe had 0 steps left.
    items = _Pairs()
    ds = kerasfeed.to_dataset(items, batch_size=4, shuffle=True, seed=0)
    path = tmp_path / "state.json"
    model = _model()
    with pytest.raises(RuntimeError, match="preempted during validation"):
        model.fit(ds, epochs=2, validation_data=(np.zeros((4, 3)), np.zeros((4, 1))), shuffle=False, verbose=0,
                  callbacks=[kerasfeed.TrainingProgress(path=path, order=ds), _CrashInValidation()])
    state = kerasfeed.TrainingProgress.load(path)
    assert (state["epoch"], state["batches"], state["items"]) == (1, 0, 0)
    resumed = kerasfeed.to_dataset(items, batch_size=4, shuffle=True, seed=0, initial_state=state)
    again = kerasfeed.to_dataset(items, batch_size=4, shuffle=True, seed=0, initial_state={"epoch": 1, "batches": 0})
    assert [b[1].numpy().tolist() for b in resumed] == [b[1].numpy().tolist() for b in again]
