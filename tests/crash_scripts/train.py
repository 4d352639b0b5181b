"""One training run for the crash-resume tests: killed with SIGKILL where told, resumed by running it again.

Run as ``KERAS_BACKEND=<name> python train.py CONFIG.json``. The config says
the front end (``loader``/``dataset``), the executor and worker count, the
callback (``kerasfeed`` or ``keras``), ``save_freq``, and ``kill_at``:
``[epoch, batch]`` after whose ``on_train_batch_end`` (every callback's,
the backup's included) the process kills itself with SIGKILL, or null. The
final weights go to ``CONFIG.json``'s ``out`` (an ``.npz``), written only
when ``fit`` returns.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import keras
import numpy as np

import kerasfeed

BATCH, ITEMS = 4, 48


class Noisy(kerasfeed.SceneSequence):
    """Samples ``(x, y)``; with ``augment``, x gets noise drawn from ``np.random``."""

    def __init__(self, augment=False, **kwargs):
        super().__init__(**kwargs)
        self.augment = augment

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        x = np.array([np.sin(i), np.cos(3 * i), i / ITEMS], "float32")
        if self.augment:
            x = x + np.random.normal(0, 0.1, 3).astype("float32")
        y = np.array([x @ np.array([1.0, -2.0, 0.5], "float32") + 0.3], "float32")
        return x, y


class KillAt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if [self.epoch, batch] == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    keras.utils.set_random_seed(0)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    source = Noisy(augment=config.get("augment", False))
    common = dict(batch_size=BATCH, shuffle=True, seed=3, executor=config["executor"])
    if config["executor"] == "processes":
        common["workers"] = config.get("workers", 2)
    if config["front"] == "loader":
        data = kerasfeed.to_loader(source, **common)
    else:
        data = kerasfeed.to_dataset(source, **common)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    backup = config["backup"]
    if config.get("callback", "kerasfeed") == "kerasfeed":
        callbacks = [kerasfeed.BackupAndRestore(backup, save_freq=config.get("save_freq", "epoch"))]
    else:
        callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=config.get("save_freq", "epoch"))]
    if config.get("kill_at"):
        callbacks.append(KillAt(config["kill_at"]))
    model.fit(data, epochs=config.get("epochs", 3), callbacks=callbacks, verbose=0)
    np.savez(config["out"], *[np.asarray(w) for w in model.get_weights()])


if __name__ == "__main__":
    main(sys.argv[1])
