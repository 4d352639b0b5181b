"""The data position in the same Orbax checkpoint as the model: ``kerasfeed.orbax`` and ``kerasfeed.OrbaxCheckpoint``.

Real checkpoints on disk: a custom loop saves its loader's position with its
state in one ``CheckpointManager`` step and resumes on exactly the batches an
uninterrupted loop reads; states of another order or batch size are refused;
a ``model.fit`` under JAX killed with SIGKILL mid-epoch (this file run as a
script in a fresh process: the backend is fixed at Keras' import) resumes from
``kerasfeed.OrbaxCheckpoint(restore=True)`` to an uninterrupted run's weights.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import kerasfeed

ROOT = pathlib.Path(__file__).resolve().parents[1]
ITEMS, BATCH = 48, 4  # 12 batches a pass


class Points(kerasfeed.SceneSequence):
    """Samples ``(x, y)`` of a linear target."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        x = np.array([np.sin(i), np.cos(3 * i), i / ITEMS], "float32")
        return x, np.array([x @ np.array([1.0, -2.0, 0.5], "float32") + 0.3], "float32")


def _loader(**kwargs):
    return kerasfeed.to_loader(Points(), **{"batch_size": BATCH, "shuffle": True, "seed": 3, **kwargs})


def _step(state, batch):
    """A training step of a custom loop: what it saw, in order (any change shows)."""
    x, _ = batch
    return {"w": state["w"] * 0.5 + x.sum(axis=0), "n": state["n"] + 1}


def _manager(path):
    return ocp.CheckpointManager(str(path), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def _composite(state, data):
    return ocp.args.Composite(state=ocp.args.StandardSave(state), data=data)


# -- custom loops: kerasfeed.orbax ----------------------------------------------------------------------------------
def _run(path, passes, stop_after=None):
    """A custom loop over ``passes`` passes, checkpointing every 7 steps and at every pass's end;
    restores the latest step first, if any. Stops (as if killed) after ``stop_after`` steps of this run."""
    mngr = _manager(path)
    state, start, seen = {"w": np.zeros(3, "float32"), "n": np.zeros((), "int64")}, {"epoch": 0, "batches": 0}, []
    if mngr.latest_step() is not None:
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state), data=kerasfeed.orbax.DataRestore()))
        state, start = restored.state, restored.data
    step = int(state["n"])
    with _loader(initial_state=start) as loader:
        first = start["batches"]
        for epoch in range(start["epoch"], passes):
            for batches, batch in enumerate(loader, start=first):
                state = _step(state, batch)
                step += 1
                seen.append(batch[0].copy())
                if step % 7 == 0 or batches + 1 == len(loader):
                    mngr.save(step, args=_composite(state, kerasfeed.orbax.DataSave(loader, epoch, batches + 1)))
                if stop_after is not None and len(seen) == stop_after:
                    mngr.wait_until_finished()
                    mngr.close()
                    return state, seen
            first = 0
    mngr.wait_until_finished()
    mngr.close()
    return state, seen


def test_custom_loop_resumes_from_the_step_it_saved_the_loader_with(tmp_path):
    reference, every = _run(tmp_path / "reference", passes=3)
    assert len(every) == 36
    # Killed after 17 steps (the latest checkpoint: step 14, batch 2 of pass 1), then after 12 more
    # (the latest: step 24, the end of pass 1, saved as the start of pass 2).
    _, first = _run(tmp_path / "ckpt", passes=3, stop_after=17)
    mngr = _manager(tmp_path / "ckpt")
    restored = mngr.restore(14, args=ocp.args.Composite(data=kerasfeed.orbax.DataRestore()))
    mngr.close()
    with _loader() as loader:
        assert restored.data == kerasfeed.orbax.position(loader, 1, 2) == {
            "epoch": 1, "batches": 2, "order": restored.data["order"], "items": 8}
    _, second = _run(tmp_path / "ckpt", passes=3, stop_after=12)
    assert json.loads((tmp_path / "ckpt" / "24" / "data" / "metadata").read_text())["epoch"] == 2  # plain JSON
    state, last = _run(tmp_path / "ckpt", passes=3)
    assert int(state["n"]) == 36 and len(last) == 12
    np.testing.assert_array_equal(state["w"], reference["w"])
    trained = first[:14] + second[:10] + last  # steps 15-17 and 25-26 were lost with the kills: trained again
    np.testing.assert_array_equal(np.concatenate(trained), np.concatenate(every))


def test_the_position_is_a_checkpointable_of_the_orbax_v1_api_too(tmp_path):
    v1 = ocp.v1
    loader = _loader()
    it = iter(loader)
    [next(it) for _ in range(5)]
    v1.save_checkpointables(tmp_path / "5", {"pytree": {"w": np.ones(3, "float32")},
                                             "data": kerasfeed.orbax.position(loader, 0, 5)})
    state = v1.load_checkpointables(tmp_path / "5", {"data": None})["data"]
    with _loader(initial_state=state) as resumed:
        np.testing.assert_array_equal(np.concatenate([x for x, _ in resumed]),
                                      np.concatenate([x for x, _ in it]))
    loader.close()


def test_a_state_for_another_order_or_batch_size_is_refused(tmp_path):
    mngr = _manager(tmp_path)
    with _loader() as loader:
        mngr.save(7, args=_composite({"w": np.zeros(3)}, kerasfeed.orbax.DataSave(loader, 0, 7)))
    mngr.wait_until_finished()
    state = mngr.restore(7, args=ocp.args.Composite(data=kerasfeed.orbax.DataRestore())).data
    mngr.close()
    with pytest.raises(ValueError, match="different order .*Received: initial_state="):
        _loader(seed=4, initial_state=state)
    with pytest.raises(ValueError, match="batches hold 2: .*Received: initial_state=.*batch_size=2"):
        _loader(batch_size=2, initial_state=state)
    with _loader(initial_state=state) as same:  # the same data resumes
        assert len(list(same)) == 12 - 7


def test_position_and_data_save_name_what_is_wrong():
    with _loader() as loader:
        assert kerasfeed.orbax.position(loader, 2, 12)["epoch"] == 3  # a whole pass: the next one's start
        with pytest.raises(ValueError, match="has 12 batches.*Received: batches=13"):
            kerasfeed.orbax.position(loader, 0, 13)
        with pytest.raises(ValueError, match="Received: epoch=-1"):
            kerasfeed.orbax.position(loader, -1, 0)
        with pytest.raises(ValueError, match="cannot tell what your loop consumed.*Received: epoch=None"):
            kerasfeed.orbax.DataSave(loader)
        progress = kerasfeed.TrainingProgress({"epoch": 1, "batches": 2}, order=loader)
        assert kerasfeed.orbax.DataSave(progress.state()).item == kerasfeed.orbax.position(loader, 1, 2)
    with pytest.raises(ValueError, match="saved as it is.*Received: a state"):
        kerasfeed.orbax.DataSave({"epoch": 1, "batches": 2}, epoch=1)
    with pytest.raises(ValueError, match="exactly the keys 'epoch' and 'batches'"):
        kerasfeed.orbax.DataSave({"epoch": 1})
    with pytest.raises(TypeError, match="must be the kerasfeed.to_loader loader.*Received: data=\\[1, 2\\]"):
        kerasfeed.orbax.position([1, 2], 0, 0)


# -- model.fit: kerasfeed.OrbaxCheckpoint ----------------------------------------------------------------------------
def _model(name="net"):
    """Named: Keras restores Orbax checkpoints by variable path (unnamed layers are numbered per process)."""
    import keras

    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh", name="hidden"), keras.layers.Dense(1, name="out")]
    model = keras.Sequential(layers, name=name)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9, name="sgd"), "mse")
    return model


def test_fit_restores_model_epoch_and_data_and_refuses_other_data(tmp_path):
    import keras

    keras.utils.set_random_seed(0)
    directory = tmp_path / "ckpt"
    model = _model()
    with _loader() as loader:
        model.fit(loader, epochs=1, verbose=0, callbacks=[
            kerasfeed.OrbaxCheckpoint(directory, save_on_background=False, restore=True)])
    record = json.loads(ocp.v1.load_checkpointables(directory / "0", {"kerasfeed": None})["kerasfeed"]["json"])
    assert (record["epoch"], record["batch"], record["data"]["pass"], record["data"]["batches"]) == (1, 0, 1, 0)
    weights = model.get_weights()
    keras_reads_it = _model()
    keras_reads_it.load_weights(str(directory))  # Keras' own loading reads the checkpoint, item and all
    for a, b in zip(keras_reads_it.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    counter, steps = _steps()
    resumed = _model()
    with _loader() as loader:  # restored: epoch 1 only
        resumed.fit(loader, epochs=2, verbose=0, callbacks=[
            kerasfeed.OrbaxCheckpoint(directory, save_on_background=False, restore=True), counter])
    assert steps == [12]
    finished = _model()
    with _loader() as loader:  # the run is over: nothing left to train, the weights are the last checkpoint's
        history = finished.fit(loader, epochs=2, verbose=0, callbacks=[kerasfeed.OrbaxCheckpoint(directory, restore=True)])
    assert history.epoch == [] and sorted(os.listdir(directory)) == ["1"]
    for a, b in zip(finished.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    with _loader(seed=4) as other, pytest.raises(ValueError, match="OrbaxCheckpoint: the backup in .*order of the items"):
        _model().fit(other, epochs=3, verbose=0, callbacks=[kerasfeed.OrbaxCheckpoint(directory, restore=True)])
    with _loader() as loader:
        _model().fit(loader, epochs=1, verbose=0, callbacks=[keras.callbacks.OrbaxCheckpoint(
            tmp_path / "keras", save_on_background=False)])
        with pytest.raises(ValueError, match="has no 'kerasfeed' record.*Received: the checkpointables"):
            _model().fit(loader, epochs=2, verbose=0, callbacks=[
                kerasfeed.OrbaxCheckpoint(tmp_path / "keras", restore=True)])
    with _loader() as loader, pytest.raises(ValueError, match="are not this model's.*Received: only in the checkpoint"):
        _model("other").fit(loader, epochs=2, verbose=0, callbacks=[kerasfeed.OrbaxCheckpoint(directory, restore=True)])
    with pytest.raises(ValueError, match="needs the optimizer's variables.*Received: restore=True"):
        kerasfeed.OrbaxCheckpoint(directory, save_weights_only=True, restore=True)
    with pytest.raises(ValueError, match="Received: save_freq=0"):
        kerasfeed.OrbaxCheckpoint(directory, save_freq=0)


def test_a_keras_whose_orbax_callback_moved_its_checkpointer_or_counters_is_refused_by_name(tmp_path, monkeypatch):
    """A Keras OrbaxCheckpoint that keeps its Checkpointer under another name failed with a bare AttributeError;
    one that saves through another Checkpointer method wrote steps without the data position, silently (the
    restore then blamed the directory); renamed step counters after a restore renumbered the steps and discarded
    the saves, silently (helper, 3 of 3, 2 of 2, 1 of 1). Each is refused naming what moved."""
    import keras

    from kerasfeed.errors import KerasStructureError

    callback = kerasfeed.OrbaxCheckpoint(tmp_path / "a", save_on_background=False)
    with pytest.raises(KerasStructureError, match=r"saves through `checkpointer.save_pytree`, not"):
        callback.checkpointer.save_pytree
    assert callback.checkpointer.latest is None  # other names pass through (no step saved yet)
    keras_init = keras.callbacks.OrbaxCheckpoint.__init__

    def renamed(self, *args, **kwargs):
        keras_init(self, *args, **kwargs)
        self._checkpointer = vars(self).pop("checkpointer")

    monkeypatch.setattr(keras.callbacks.OrbaxCheckpoint, "__init__", renamed)
    with pytest.raises(KerasStructureError, match=r"its OrbaxCheckpoint keeps no `checkpointer` with"):
        kerasfeed.OrbaxCheckpoint(tmp_path / "b")
    monkeypatch.setattr(keras.callbacks.OrbaxCheckpoint, "__init__", keras_init)
    with _loader() as loader:
        _model().fit(loader, epochs=1, verbose=0, callbacks=[
            kerasfeed.OrbaxCheckpoint(tmp_path / "c", save_on_background=False, restore=True)])

    keras_begin = keras.callbacks.OrbaxCheckpoint.on_train_begin

    def counters_renamed(self, logs=None):
        keras_begin(self, logs)
        self._global_batch_count = vars(self).pop("_total_batches_seen")

    monkeypatch.setattr(keras.callbacks.OrbaxCheckpoint, "on_train_begin", counters_renamed)
    with _loader() as loader, pytest.raises(KerasStructureError, match=r"has no `_total_batches_seen`.*numbered"):
        _model().fit(loader, epochs=2, verbose=0, callbacks=[
            kerasfeed.OrbaxCheckpoint(tmp_path / "c", save_on_background=False, restore=True)])


def _steps():
    import keras

    steps: list = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] += 1

    return Steps(), steps


def _script(tmp_path, name, **config):
    """This file as a script (``main``) under JAX, in a fresh process."""
    config = {"ckpt": str(tmp_path / "ckpt"), "out": str(tmp_path / f"{name}.npz"), **config}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen([sys.executable, __file__, str(path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc):
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out[-3000:]


def test_a_restore_logs_no_orbax_metadata_error_and_reads_the_earlier_record_layout(tmp_path, caplog, monkeypatch):
    # The record was a pytree holding a bool (the order's shuffle): every restore logged "Failed to get metadata
    # for checkpointable: kerasfeed ... Unsupported dtype: bool" (helper, 2 of 2). It is one JSON text now;
    # a checkpoint of the earlier layout (the record as a pytree) still restores.
    import logging

    from kerasfeed.integrations import orbax_callback

    for layout in ("json", "pytree"):
        if layout == "pytree":
            monkeypatch.setattr(orbax_callback._WithRecord, "_with", lambda self, c: {**c, "kerasfeed": self._add()})
        directory = tmp_path / layout
        with _loader() as loader:
            _model().fit(loader, epochs=1, verbose=0, callbacks=[
                kerasfeed.OrbaxCheckpoint(directory, save_on_background=False)])
        monkeypatch.undo()
        counter, steps = _steps()
        caplog.clear()
        with caplog.at_level(logging.WARNING), _loader() as loader:
            _model().fit(loader, epochs=2, verbose=0, callbacks=[
                kerasfeed.OrbaxCheckpoint(directory, save_on_background=False, restore=True), counter])
        assert steps == [12], layout  # epoch 1 only: the record was read
        if layout == "json":
            assert not [r for r in caplog.records if "Failed to get metadata" in r.getMessage()], caplog.text


def test_jax_fit_killed_mid_epoch_resumes_from_the_orbax_checkpoint(tmp_path):
    (tmp_path / "ref").mkdir()
    reference = _script(tmp_path / "ref", "ref")
    rc, out = _finish(_script(tmp_path, "killed", kill_at=[1, 9]))  # 22 batches trained; the latest step: 20
    assert rc == -signal.SIGKILL, out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["20"]
    rc, out = _finish(_script(tmp_path, "resumed"))
    assert rc == 0, out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["35"]  # the steps go on from the restored one's
    assert "ran out of data" not in out, out
    rc, out = _finish(reference)
    assert rc == 0, out
    with np.load(tmp_path / "resumed.npz") as resumed, np.load(tmp_path / "ref" / "ref.npz") as ref:
        assert resumed["batches"].tolist() == [16] and resumed["first"].tolist() == [1, 8]
        assert ref["batches"].tolist() == [36]
        for k in ref.files:
            if k.startswith("arr_"):
                np.testing.assert_array_equal(resumed[k], ref[k])


def main(config_path: str) -> None:
    """One ``fit`` of 3 epochs, saved every 5 batches; killed with SIGKILL after ``kill_at`` (epoch, batch)."""
    import keras

    config = json.loads(pathlib.Path(config_path).read_text())
    keras.utils.set_random_seed(0)
    checkpoint = kerasfeed.OrbaxCheckpoint(config["ckpt"], save_freq=5, restore=True)
    trained: dict = {"batches": 0, "first": None, "epoch": 0}

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            trained["epoch"] = epoch

        def on_train_batch_end(self, batch, logs=None):
            trained["batches"] += 1
            trained["first"] = trained["first"] or [trained["epoch"], batch]
            if [trained["epoch"], batch] == config.get("kill_at"):
                checkpoint.wait_until_finished()  # the machine dies after the save was on disk
                os.kill(os.getpid(), signal.SIGKILL)

    with _loader() as loader:
        model = _model()
        model.fit(loader, epochs=3, verbose=0, shuffle=False, callbacks=[checkpoint, Watch()])
    np.savez(config["out"], *[np.asarray(w) for w in model.get_weights()],
             batches=np.array([trained["batches"]]), first=np.array(trained["first"]))


if __name__ == "__main__":
    main(sys.argv[1])
