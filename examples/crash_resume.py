"""A training run killed with SIGKILL mid-epoch, started again, ends on the weights of one never killed.

    python examples/crash_resume.py --kill-at 1 5   # dies of SIGKILL after batch 5 of epoch 1
    python examples/crash_resume.py                 # resumes at epoch 1, batch 4 (the last backup), to the end
    python examples/crash_resume.py --check         # trains once without a kill, compares bit for bit

Any Keras backend (``KERAS_BACKEND=jax``, ``tensorflow``, ``torch``); the
runs to compare must use the same one. ``fit`` reads a shuffled
``to_loader`` on 2 worker processes (they die with the trainer) and keeps a
``kerasfeed.BackupAndRestore`` every 4 batches: model, optimizer and data
position in one atomic commit under ``DIR/backup`` (deleted when ``fit``
finishes). The finished run's weights go to ``DIR/final.npz``; ``--check``
trains a reference under ``DIR/reference`` and compares. ``--dir DIR``
defaults to ``kerasfeed_crash_resume`` in the temporary directory.
How it works: ``docs/resume.md``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile

import keras
import numpy as np

import kerasfeed

ITEMS, BATCH, EPOCHS, SAVE_FREQ = 96, 8, 3, 4  # 12 batches a pass


class Samples:
    """Sample ``i`` is ``(x, y)``, ``y`` a fixed function of ``x``; the worker processes run ``[i]``."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        x = np.array([np.sin(i), np.cos(3 * i), i / ITEMS], np.float32)
        return x, np.array([x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3], np.float32)


def train(directory: str, kill_at=None) -> list:
    """One ``fit`` of ``EPOCHS`` epochs, backed up under ``directory``; returns the final weights."""
    keras.utils.set_random_seed(0)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()  # bit-equal weights need deterministic ops
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    loader = kerasfeed.to_loader(Samples(), batch_size=BATCH, shuffle=True, seed=0, executor="processes", workers=2)
    backup = os.path.join(directory, "backup")
    latest = os.path.join(backup, "latest.json")
    if os.path.exists(latest):
        with open(latest) as f:
            saved = json.load(f)
        print(f"backup found: resuming at epoch {saved['epoch']}, batch {saved['batch']}", flush=True)
    callbacks = [kerasfeed.BackupAndRestore(backup, save_freq=SAVE_FREQ), FirstBatch()]
    if kill_at is not None:
        callbacks.append(KillAt(*kill_at))  # after the backup's own on_train_batch_end
    model.fit(loader, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    return model.get_weights()


class FirstBatch(keras.callbacks.Callback):
    """Prints the first batch this run trains (Keras numbers a resumed epoch's batches on)."""

    def __init__(self):
        super().__init__()
        self.epoch, self.said = None, False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self.said:
            self.said = True
            print(f"first batch trained: epoch {self.epoch}, batch {batch}", flush=True)


class KillAt(keras.callbacks.Callback):
    """SIGKILLs this process (and so its worker processes) after batch ``batch`` of epoch ``epoch``."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            print(f"killing this process after epoch {self.epoch}, batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def save(path: str, weights: list) -> None:
    np.savez(path, backend=keras.backend.backend(), **{f"w{k}": w for k, w in enumerate(weights)})


def load(path: str) -> tuple[str, list]:
    with np.load(path) as f:
        return str(f["backend"]), [f[f"w{k}"] for k in range(len(f.files) - 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "kerasfeed_crash_resume"),
                   help="where the backup, the final weights and the reference go (default: %(default)s)")
    p.add_argument("--kill-at", nargs=2, type=int, metavar=("EPOCH", "BATCH"),
                   help="SIGKILL this process after that batch (both count from 0)")
    p.add_argument("--check", action="store_true",
                   help="train once without a kill under DIR/reference and compare with DIR/final.npz")
    args = p.parse_args(argv)
    final = os.path.join(args.dir, "final.npz")
    if not args.check:
        weights = train(args.dir, args.kill_at)
        save(final, weights)
        print(f"finished: weights in {final}")
        return 0
    if not os.path.exists(final):
        print(f"no {final}: run this script without --check to the end first", file=sys.stderr)
        return 2
    shutil.rmtree(os.path.join(args.dir, "reference"), ignore_errors=True)  # no backup to resume from: whole
    reference = train(os.path.join(args.dir, "reference"))
    backend, weights = load(final)
    if backend != keras.backend.backend():
        print(f"{final} was trained under {backend}, this check under {keras.backend.backend()}: "
              "run both with the same KERAS_BACKEND", file=sys.stderr)
        return 2
    same = len(weights) == len(reference) and all(
        a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(weights, reference))
    print(f"final weights {'equal' if same else 'DIFFER from'} an uninterrupted run's, bit for bit")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
