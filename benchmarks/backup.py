"""What ``kerasfeed.BackupAndRestore`` costs against Keras' own callback at the same ``save_freq``.

Three measurements, under the backend ``KERAS_BACKEND`` names:

1. **One save** (``_save_model`` of each callback, timed alone, many times,
   alternating): Keras' writes the weights and a JSON file; kerasfeed's also
   records the data position, writes into a new folder, fsyncs and commits
   with a rename (docs/resume.md).
2. **A step without a save**: ``on_train_batch_end`` of each callback when it
   does not save (µs per call).
3. **``model.fit``** of a small model on a shuffled ``to_loader``: no
   callback, Keras' and kerasfeed's, in alternating rounds; wall seconds per
   fit and the difference per save.

Run: ``KERAS_BACKEND=jax python benchmarks/backup.py [--rounds 5] [--width 256]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras

import kerasfeed
from benchmarks.machine import cpu_model

BATCH, BATCHES, EPOCHS = 32, 60, 3


class Rows(kerasfeed.SceneSequence):
    def __init__(self, width):
        super().__init__()
        self.width = width

    def __len__(self):
        return BATCHES

    def __getitem__(self, i):
        x = np.random.default_rng(i).normal(size=(BATCH, self.width)).astype("float32")
        return x, x[:, :1]


def _model(width):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((width,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    return model


def _callback(kind, directory, save_freq):
    if kind == "none":
        return []
    cls = keras.callbacks.BackupAndRestore if kind == "keras" else kerasfeed.BackupAndRestore
    return [cls(directory, save_freq=save_freq)]


def _spread(values, scale=1.0):
    med = statistics.median(values) * scale
    return f"{med:.3g} ({min(values) * scale:.3g}..{max(values) * scale:.3g})"


def one_save(width, repeats, workdir):
    """Median ms of one save, each callback inside a running fit's view (its data found)."""
    times = {"keras": [], "kerasfeed": []}
    model = _model(width)
    loader = kerasfeed.to_loader(Rows(width), shuffle=True, seed=0)
    for kind in times:
        cb = _callback(kind, os.path.join(workdir, f"save-{kind}"), "epoch")[0]

        class Timed(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None, cb=cb, kind=kind):
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    cb._save_model()
                    times[kind].append(time.perf_counter() - t0)

        model.fit(loader, epochs=1, verbose=0, shuffle=False, callbacks=[cb, Timed()])
    return times


def no_save_step(width, workdir, calls=20000):
    out = {}
    model = _model(width)
    for kind in ("keras", "kerasfeed"):
        cb = _callback(kind, os.path.join(workdir, f"step-{kind}"), 10**9)[0]
        cb.set_model(model)
        cb.set_params({"steps": BATCHES, "epochs": 1})
        t0 = time.perf_counter()
        for i in range(calls):
            cb.on_train_batch_end(i % BATCHES, {})
        out[kind] = (time.perf_counter() - t0) / calls
    return out


def fits(width, rounds, save_freq, workdir):
    times = {"none": [], "keras": [], "kerasfeed": []}
    for r in range(rounds):
        kinds = list(times) if r % 2 == 0 else list(times)[::-1]
        for kind in kinds:
            model = _model(width)
            loader = kerasfeed.to_loader(Rows(width), shuffle=True, seed=0)
            directory = os.path.join(workdir, f"fit-{kind}-{r}")
            t0 = time.perf_counter()
            model.fit(loader, epochs=EPOCHS, verbose=0, shuffle=False,
                      callbacks=_callback(kind, directory, save_freq))
            times[kind].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--save-freq", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        saves = one_save(args.width, 30, workdir)
        steps = no_save_step(args.width, workdir)
        fit = fits(args.width, args.rounds, args.save_freq, workdir)
    weights = sum(int(np.prod(w.shape)) for w in _model(args.width).weights) * 4
    n_saves = EPOCHS * BATCHES // args.save_freq
    machine = f"{cpu_model()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
    print(f"# BackupAndRestore cost, backend {keras.backend.backend()}; {machine}")
    print(f"model: {weights / 1e6:.2f} MB of float32 weights (+ the optimizer's momentum)")
    print("| what | Keras' BackupAndRestore | kerasfeed.BackupAndRestore |")
    print("| --- | --- | --- |")
    keras_save, kf_save = _spread(saves["keras"], 1e3), _spread(saves["kerasfeed"], 1e3)
    print(f"| one save, ms: median (min..max) of 30 | {keras_save} | {kf_save} |")
    print(f"| a step without a save, µs | {steps['keras'] * 1e6:.2f} | {steps['kerasfeed'] * 1e6:.2f} |")
    none = statistics.median(fit["none"])
    per = {k: (statistics.median(fit[k]) - none) / n_saves * 1e3 for k in ("keras", "kerasfeed")}
    print(f"| fit of {EPOCHS}x{BATCHES} batches, save_freq={args.save_freq}, s (no callback: {_spread(fit['none'])}) "
          f"| {_spread(fit['keras'])} | {_spread(fit['kerasfeed'])} |")
    print(f"| added per save within fit, ms (median difference) | {per['keras']:.3g} | {per['kerasfeed']:.3g} |")


if __name__ == "__main__":
    main()
