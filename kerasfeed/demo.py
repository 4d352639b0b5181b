"""The demo: train a point-cloud classifier from an HDF5 scene file three ways.

Run it with ``python -m kerasfeed demo`` (or ``make demo``). It writes a
synthetic scene file, wraps it in a ``SceneSequence`` subclass, and trains
the same small PointNet-style model through ``model.fit(seq)`` (Keras' own
machinery) and through ``model.fit(kerasfeed.to_dataset(seq))`` with each
executor (``run_demo``).
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any, Optional

import numpy as np

import kerasfeed
from kerasfeed._demo_args import check_demo_arguments


class SceneFile(kerasfeed.SceneSequence):
    """Batches of whole scenes ``(points, label)`` from a scene file.

    The pattern for any HDF5 reader: keep only the path in ``__init__``, open
    the file lazily in the process that reads, drop the handle when pickled.
    """

    def __init__(self, path, rows: range, batch_size: int = 16, num_points: int = 512, **kwargs):
        super().__init__(**kwargs)
        self.path, self.rows, self.batch_size, self.num_points = str(path), rows, batch_size, num_points
        self._file = None

    def __len__(self) -> int:
        return math.ceil(len(self.rows) / self.batch_size)

    def __getitem__(self, i: int):
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r")
        lo = self.rows.start + i * self.batch_size
        hi = min(lo + self.batch_size, self.rows.stop)
        points = self._file["points"][lo:hi, : self.num_points, :]
        labels = self._file["labels"][lo:hi]
        return points, labels

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"] = None
        return state


def build_model(num_points: int, num_features: int, num_classes: int, seed: int = 0):
    """A small PointNet: shared per-point layers, a global max pool, a head."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((num_points, num_features))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.Dense(64, activation="relu")(h)
    h = keras.layers.GlobalMaxPooling1D()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _rate():
    """A Keras callback measuring training batches per second per epoch."""
    import keras

    class Rate(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.batches = time.perf_counter(), 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.rate = self.batches / (time.perf_counter() - self.start)

    return Rate()


def _describe_executor(ds, asked: str) -> str:
    """``"processes (2 workers): auto chose processes: ..."`` for the table."""
    ex = kerasfeed.executor_of(ds)
    workers = getattr(getattr(ex, "pool", None), "num_workers", None)
    name = f"{ex.name} ({workers} workers)" if ex.name == "processes" and workers else ex.name
    reason = getattr(ex, "reason", None)
    if asked != "auto" or not reason:
        return f"{name}: asked for with executor={asked!r}"
    return f"{name}: {reason}"


def run_demo(workdir: Optional[str] = None, *, num_scenes: int = 640, num_points: int = 512, epochs: int = 6,
             batch_size: int = 16, executor: str = "auto", verbose: bool = True) -> dict[str, Any]:
    """Runs the demo and returns its results per way of feeding.

    Three training runs of the same model: ``model.fit(seq)`` (Keras' own
    workers), ``model.fit(to_dataset(seq, executor=executor))``, and
    ``to_dataset`` with the other executor (worker processes if the first
    ran on threads, threads otherwise), so both paths run every time.

    Args:
        workdir: where the scene file goes; a cache directory by default.
        num_scenes: scenes in the file (the last fifth is held out).
        num_points: points per scene read by the model.
        epochs: epochs of each training run.
        batch_size: scenes per batch.
        executor: the first ``to_dataset`` run's executor: ``"auto"``
            (measures the source and picks), ``"threads"`` or ``"processes"``.
        verbose: print progress and the results table.

    Returns:
        ``{label: {...}}`` per run, with ``loss``, ``accuracy`` (training,
        last epoch), ``val_accuracy`` (held out), ``batches_per_s`` (last
        epoch), ``seconds``, ``ran_on`` (``"keras"``, ``"threads"`` or
        ``"processes"``) and ``executor`` (what ran and why).
    """
    from kerasfeed.datasets import make_synthetic_scenes

    workdir = check_demo_arguments(workdir, epochs=epochs, executor=executor, num_scenes=num_scenes,
                                   num_points=num_points, batch_size=batch_size)
    say = print if verbose else (lambda *a, **k: None)
    path = pathlib.Path(workdir) / f"scenes-{num_scenes}x{num_points}.h5"
    if not path.exists():
        t = time.perf_counter()
        make_synthetic_scenes(path, num_scenes=num_scenes, points_per_scene=num_points, num_classes=4, seed=0)
        say(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.1f} s")
    split = num_scenes * 4 // 5
    train = SceneFile(path, range(0, split), batch_size, num_points, workers=2)
    held_out = SceneFile(path, range(split, num_scenes), batch_size, num_points)
    val_x = np.concatenate([held_out[i][0] for i in range(len(held_out))])
    val_y = np.concatenate([held_out[i][1] for i in range(len(held_out))])
    say(f"{len(train)} training batches of {batch_size} scenes x {num_points} points, "
        f"{len(val_y)} held-out scenes, 4 classes")

    results: dict[str, Any] = {}
    runs = [("fit(seq)", None), (f"fit(to_dataset(seq, executor='{executor}'))", executor)]
    for label, asked in runs:
        model = build_model(num_points, 6, 4)
        rate = _rate()
        if asked is None:
            data, fit_kwargs, ran_on = train, {}, "keras"
            how = "Keras' own loader (a PyDataset with workers=2 threads)"
        else:
            extra = {} if asked == "threads" else {"workers": 2}
            data = kerasfeed.to_dataset(train, shuffle=True, seed=0, executor=asked, **extra)
            fit_kwargs = {"shuffle": False}  # the dataset shuffles itself; Keras would only warn
            how, ran_on = _describe_executor(data, asked), kerasfeed.executor_of(data).name
            if len(runs) == 2:  # then the other executor, so that both paths run
                other = "threads" if kerasfeed.executor_of(data).name == "processes" else "processes"
                runs.append((f"fit(to_dataset(seq, executor='{other}'))", other))
        say(f"training with {label}: {how}")
        t = time.perf_counter()
        hist = model.fit(data, epochs=epochs, verbose=0, callbacks=[rate], **fit_kwargs)
        seconds = time.perf_counter() - t
        _, val_acc = model.evaluate(val_x, val_y, verbose=0)
        results[label] = {
            "loss": float(hist.history["loss"][-1]),
            "accuracy": float(hist.history["accuracy"][-1]),
            "val_accuracy": float(val_acc),
            "batches_per_s": float(rate.rate),
            "seconds": seconds,
            "ran_on": ran_on,
            "executor": how,
        }
        del data  # stops this run's worker processes
        say(f"  done in {seconds:.1f} s")
    width = max(len(label) for label in results) + 2
    say("")
    say(f"{'way of feeding':{width}} {'ran on':>9} {'loss':>7} {'acc':>6} {'val acc':>8} {'batches/s':>10}")
    for label, r in results.items():
        say(f"{label:{width}} {r['ran_on']:>9} {r['loss']:7.3f} {r['accuracy']:6.3f} {r['val_accuracy']:8.3f} "
            f"{r['batches_per_s']:10.1f}")
    say(f"(chance accuracy is 0.25; {epochs} epochs each; batches/s on a busy machine are not a benchmark: "
        "see `make bench`)")
    return results
