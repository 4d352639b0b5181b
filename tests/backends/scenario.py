"""Everything one Keras backend must do with kerasfeed.to_loader, in one process.

Run as ``KERAS_BACKEND=<name> python scenario.py REFERENCE.npz RESULT.json``
(the backend is fixed when Keras is imported, so each backend gets its own
process). ``REFERENCE.npz`` holds the batches ``to_dataset`` yielded with the
same arguments (written by ``write_reference`` under TensorFlow). The script
asserts as it goes and writes what it observed to ``RESULT.json``.

Training checks are exact: a linear model trained with plain SGD on mse ends
at weights that depend on every batch and on their order, so they are
compared with the same updates replayed in numpy on the reference batches.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import kerasfeed

BATCHES, ROWS, EPOCHS, SEED, LR = 8, 4, 2, 7, 0.05
W0, B0 = np.array([[0.1], [-0.2], [0.3]], "float32"), np.array([0.05], "float32")


class Rows(kerasfeed.SceneSequence):
    """Batch ``i`` of pass ``e``: rows that carry ``i`` and ``e`` (so a batch
    read in the wrong pass or order changes training), and ``(x, y)``."""

    def __init__(self, bad_index=None, **kwargs):
        super().__init__(**kwargs)
        self.bad_index = bad_index
        self.passes_begun = []

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        if i == self.bad_index:
            raise ValueError(f"cannot read batch {i}")
        r = np.arange(ROWS, dtype="float32")
        x = np.stack([np.full(ROWS, i / BATCHES), np.full(ROWS, self.epoch / 2), np.sin(r + 3 * i)], 1)
        y = (x @ np.array([[1.0], [-0.5], [0.25]]) + 0.1 * np.cos(r + i)[:, None]).astype("float32")
        return x.astype("float32"), y

    def on_epoch_begin(self):
        self.passes_begun.append(self.epoch)


class Samples(kerasfeed.SceneSequence):
    """Samples of varying length (padded when batched) and a string field."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"v": np.arange(i % 3 + 1, dtype="float32") + i, "name": f"s{i}"}, np.int64(i)


def sgd(w, b, batches):
    """Keras' SGD steps on mse for a Dense(1) model, in float64."""
    w, b = w.astype("float64"), b.astype("float64")
    for x, y in batches:
        err = x @ w + b - y
        w = w - LR * 2 * x.T @ err / err.size
        b = b - LR * 2 * err.sum(0) / err.size
    return w, b


def write_reference(path):
    """The to_dataset batches (TensorFlow) the backends must reproduce."""
    arrays = {}
    ds = kerasfeed.to_dataset(Rows(), shuffle=True, seed=SEED)
    for e in range(EPOCHS):
        for k, (x, y) in enumerate(ds):
            arrays[f"rows/{e}/{k}/x"], arrays[f"rows/{e}/{k}/y"] = x.numpy(), y.numpy()
    ds = kerasfeed.to_dataset(Samples(), batch_size=3, shuffle=True, seed=SEED)
    for e in range(EPOCHS):
        for k, (x, y) in enumerate(ds):
            for name, a in (("v", x["v"]), ("name", x["name"]), ("y", y)):
                arrays[f"samples/{e}/{k}/{name}"] = a.numpy()
    np.savez(path, **arrays)


def _reference_rows(ref, epoch):
    return [(ref[f"rows/{epoch}/{k}/x"], ref[f"rows/{epoch}/{k}/y"]) for k in range(BATCHES)]


def _model(keras):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([W0, B0])
    model.compile(keras.optimizers.SGD(LR), "mse", metrics=["mae"])
    return model


def _close(a, b, what):
    assert np.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what}: {a.ravel()} != {b.ravel()}"


def main(reference_path, result_path):
    import keras

    backend = keras.backend.backend()
    ref = np.load(reference_path, allow_pickle=True)  # our own file: the string field is an object array
    out = {"backend": backend}
    rows = [_reference_rows(ref, e) for e in range(EPOCHS)]
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(rows[0], rows[1])), "passes should differ"

    # Batch parity, samples batched and padded in numpy, strings included.
    with kerasfeed.to_loader(Samples(), batch_size=3, shuffle=True, seed=SEED) as loader:
        for e in range(EPOCHS):
            got = list(loader)
            assert len(got) == 4, len(got)
            for k, (x, y) in enumerate(got):
                for name, a in (("v", x["v"]), ("name", x["name"]), ("y", y)):
                    want = ref[f"samples/{e}/{k}/{name}"]
                    assert a.dtype == want.dtype and np.array_equal(a, want), (e, k, name, a, want)

    # fit on worker processes: epoch k reads pass k (weights prove which
    # batches, in which order), the build batch consumes no pass.
    seq = Rows()
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=SEED, executor="processes", workers=2)
    from keras.src.trainers.data_adapters import get_data_adapter

    assert get_data_adapter(loader) is loader
    model = _model(keras)
    val_seq = Rows()
    # TensorBoard scalars on every backend, without TensorFlow where it is not the backend.
    log_dir = os.path.join(os.path.dirname(os.path.abspath(result_path)), f"logs_{backend}")
    callbacks = [kerasfeed.InputStats(log_dir, every_n_steps=2), kerasfeed.WorkerSummaries(log_dir, update_freq=2)]
    with kerasfeed.to_loader(val_seq, shuffle=True, seed=SEED + 1) as val:
        history = model.fit(loader, epochs=EPOCHS, verbose=0, validation_data=val, callbacks=callbacks)
    out["scalars"] = {"log_dir": log_dir, "loss": [float(v) for v in history.history["loss"]],
                      "input_wait_ms": [float(v) for v in history.history["input_wait_ms"]]}
    w, b = sgd(W0, B0, rows[0] + rows[1])
    _close(model.get_weights()[0], w, "fit weights")
    _close(model.get_weights()[1], b, "fit bias")
    assert seq.passes_begun == [0, 1], seq.passes_begun
    assert val_seq.passes_begun == [0, 1], val_seq.passes_begun  # one validation pass per epoch
    # evaluate / predict read the next pass (pass 2: a third permutation).
    pass2 = list(kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state={"epoch": 2, "batches": 0}))
    x2 = np.concatenate([x for x, _ in pass2])
    pred = model.predict(loader, verbose=0)
    _close(pred, x2 @ w + b, "predict")
    loss = model.evaluate(loader, verbose=0)[0]
    x3, y3 = map(np.concatenate, zip(*kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state={"epoch": 3, "batches": 0})))
    _close(np.float64(loss), np.mean((x3 @ w + b - y3) ** 2), "evaluate loss")
    assert seq.passes_begun == [0, 1, 2, 3], seq.passes_begun
    out["passes_begun"] = list(seq.passes_begun)
    # Calls of one step read a pass each, as under TensorFlow: not taken for a model build's batch.
    for e in (4, 5):
        with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state={"epoch": e, "batches": 0}) as ref_e:
            first = next(iter(ref_e))[0]
        _close(model.predict(loader, steps=1, verbose=0), first @ w + b, f"predict(steps=1) on pass {e}")
    assert seq.passes_begun == [0, 1, 2, 3, 4, 5], seq.passes_begun
    loader.close()

    # Exact resume: epoch 1 from its batch 3, on a fresh (unbuilt) model.
    w1, b1 = sgd(W0, B0, rows[0] + rows[1][:3])
    model = _model(keras)
    model.set_weights([w1.astype("float32"), b1.astype("float32")])
    state = {"epoch": 1, "batches": 3}
    progress = kerasfeed.TrainingProgress(state)
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state=state) as resumed:
        assert resumed.num_batches == BATCHES - 3
        model.fit(resumed, initial_epoch=1, epochs=2, verbose=0, callbacks=[progress])
    _close(model.get_weights()[0], w, "resumed weights")
    assert progress.state() == {"epoch": 2, "batches": 0}, progress.state()

    # The same resume in one fit call going on past the resumed epoch: Keras would keep its 5 batches for
    # every epoch (the later passes cut short); the second epoch is refused, after the resumed one trained.
    model = _model(keras)
    model.set_weights([w1.astype("float32"), b1.astype("float32")])
    progress = kerasfeed.TrainingProgress(state)
    with kerasfeed.to_loader(Rows(), shuffle=True, seed=SEED, initial_state=state) as resumed:
        try:
            model.fit(resumed, initial_epoch=1, epochs=4, verbose=0, callbacks=[progress])
        except ValueError as e:
            assert f"cut from {BATCHES} batches to {BATCHES - 3}" in str(e) and "initial_epoch=1, epochs=2" in str(e), e
        else:
            raise AssertionError("a one-call fit past a resumed epoch was not refused")
    _close(model.get_weights()[0], w, "weights after the refused call (the resumed epoch trained)")
    assert progress.state() == {"epoch": 2, "batches": 0}, progress.state()

    # Arguments Keras never hands a data adapter are refused, not ignored (NOTE [ fit arguments a data
    # adapter never sees ]); the loader reads nothing for the refused call and trains afterwards.
    refused = []
    with kerasfeed.to_loader(Rows()) as plain:
        model = _model(keras)
        for call, kwargs in (("fit", {"y": np.zeros(ROWS * BATCHES)}), ("fit", {"sample_weight": np.ones(ROWS * BATCHES)}),
                             ("fit", {"class_weight": {0: 1.0, 1: 5.0}}), ("evaluate", {"y": np.zeros(ROWS * BATCHES)})):
            name = next(iter(kwargs))
            try:
                getattr(model, call)(plain, verbose=0, **kwargs)
            except ValueError as e:
                assert f"does not pass `{name}` on to a data adapter" in str(e) and f"Received: {name}=" in str(e), e
                refused.append(f"{call}:{name}")
            else:
                raise AssertionError(f"{call}(loader, {name}=...) was not refused")
        assert kerasfeed.stats(plain)["items"] == 0
        model.fit(plain, epochs=1, verbose=0)
        assert not np.allclose(model.get_weights()[0], W0)
    out["refused"] = refused

    # The HDF5 readers: one pass of a gzip-chunked scene file on worker processes.
    path = kerasfeed.datasets.make_synthetic_scenes(
        os.path.join(os.path.dirname(result_path), f"scenes-{backend}.h5"), num_scenes=12, points_per_scene=16
    )
    with kerasfeed.to_loader(kerasfeed.H5SliceSequence(path, ("points", "labels"), 4), executor="processes", workers=2) as h5:
        shapes = [(p.shape, labels.shape) for p, labels in h5]
    assert shapes == [((4, 16, 6), (4,))] * 3, shapes

    # An error in __getitem__ names the index.
    with kerasfeed.to_loader(Rows(bad_index=5), executor="processes", workers=2) as bad:
        try:
            _model(keras).fit(bad, epochs=1, verbose=0)
        except Exception as e:  # noqa: BLE001 - TensorFlow re-raises it as its own type
            out["error_type"] = type(e).__name__
            assert "Rows[5] raised ValueError" in str(e) and "cannot read batch 5" in str(e), str(e)[:500]
            if backend != "tensorflow":
                assert isinstance(e, kerasfeed.ItemError) and e.index == 5, repr(e)
        else:
            raise AssertionError("fit over a failing item did not raise")

    # Keras' own path still trains: model.fit(seq), numbering passes as to_loader does (under JAX and
    # PyTorch the batch Keras reads to build the model made the first epoch read pass 1).
    model = _model(keras)
    own = Rows()
    history = model.fit(own, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"][0]) and not np.allclose(model.get_weights()[0], W0)
    assert own.epoch == 2 and own.passes_begun[-2:] == [0, 1], (own.epoch, own.passes_begun)

    # Conversions for custom loops: every iterator reads the next pass.
    with kerasfeed.to_loader(Rows()) as plain:
        x, y = next(iter(plain))
        assert isinstance(x, np.ndarray) and x.shape == (ROWS, 3) and np.all(x[:, 1] == 0)
        if backend == "torch":
            import torch

            tx, _ = next(iter(plain.torch()))
            assert isinstance(tx, torch.Tensor) and tx.shape == (ROWS, 3) and bool(torch.all(tx[:, 1] == 0.5)), tx
        if backend == "jax":
            import jax

            jx, _ = next(plain.jax())
            assert isinstance(jx, jax.Array) and jx.shape == (ROWS, 3) and bool((jx[:, 1] == 0.5).all()), jx
    try:
        import tensorflow  # noqa: F401
    except ModuleNotFoundError:  # not installed (JAX run) or blocked (PyTorch run)
        try:
            kerasfeed.to_dataset  # the lazy attribute import is what is tested
        except ModuleNotFoundError as e:
            assert "pip install 'kerasfeed[tensorflow]'" in str(e) and "to_loader" in str(e), str(e)
            out["to_dataset_error"] = "names the extra"
        else:
            raise AssertionError("kerasfeed.to_dataset imported without TensorFlow")
    with kerasfeed.to_loader(Rows(), executor="processes", workers=2) as observed:
        list(observed)
        assert kerasfeed.stats(observed)["items"] == BATCHES
    out["tensorflow_imported"] = "tensorflow" in sys.modules
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if os.environ.get("KERASFEED_BLOCK_TENSORFLOW") == "1":
        # Fails any import of TensorFlow: proves this backend's path never needs it.
        import importlib.abc

        class _Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ModuleNotFoundError(f"TensorFlow is blocked in this test process. Received: import {name}", name=name)

        sys.meta_path.insert(0, _Block())
    main(sys.argv[1], sys.argv[2])
