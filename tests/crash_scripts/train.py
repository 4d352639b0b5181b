"""One training run for the crash-resume tests: killed with SIGKILL where told, resumed by running it again.

Run as ``KERAS_BACKEND=<name> python train.py CONFIG.json``. The config says
the front end (``loader``/``dataset``), the executor and worker count, the
callback (``kerasfeed`` or ``keras``), ``save_freq``, and ``kill_at``:
``[epoch, batch]`` after whose ``on_train_batch_end`` (every callback's,
the backup's included) the process kills itself with SIGKILL, or null.
``crash_save``: ``{"at": n, "where": "weights" | "commit"}`` kills it during
its n-th backup instead: half-way through writing the weights, or with the
weights written and the commit not made. ``augment``: the source adds noise
drawn from ``np.random`` (worker processes reseed it per item). ``cache``:
passed as ``cache=`` (a directory outlives a killed run). ``calls_to``: a
file where every item made appends ``pass index`` (any process). The final
weights go to ``CONFIG.json``'s ``out`` (an ``.npz``), written only when
``fit`` returns, with the backup directory's existence after it.
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

    def __init__(self, augment=False, calls_to=None, **kwargs):
        super().__init__(**kwargs)
        self.augment = augment
        self.calls_to = calls_to

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        if self.calls_to:
            with open(self.calls_to, "a") as f:  # one short append per line: whole lines from any process
                f.write(f"{self.epoch} {i}\n")
        x = np.array([np.sin(i), np.cos(3 * i), i / ITEMS], "float32")
        if self.augment:
            x = x + np.random.normal(0, 0.1, 3).astype("float32")
        y = np.array([x @ np.array([1.0, -2.0, 0.5], "float32") + 0.3], "float32")
        return x, y


class KillAt(keras.callbacks.Callback):
    def __init__(self, at, children_to=None):
        super().__init__()
        self.at = at
        self.epoch = 0
        self.children_to = children_to  # where to write [pid, start time] of every descendant before dying

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if [self.epoch, batch] == self.at:
            if self.children_to:
                import psutil

                kids = [[p.pid, p.create_time()] for p in psutil.Process().children(recursive=True)]
                with open(self.children_to, "w") as f:
                    json.dump(kids, f)
            os.kill(os.getpid(), signal.SIGKILL)


def crash_during_save(at: int, where: str) -> None:
    """SIGKILL inside the ``at``-th backup: mid-weights, or between the weights and the commit."""
    from kerasfeed.integrations import backup_files

    saves = {"n": 0}
    commit = backup_files.BackupFiles.commit

    def crashing_commit(self, record, write_weights):
        saves["n"] += 1
        if saves["n"] != at:
            return commit(self, record, write_weights)

        def write(path):
            if where == "weights":
                write_weights(path)
                with open(path, "r+b") as f:  # as if the machine died half-way through the file
                    f.truncate(os.path.getsize(path) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            write_weights(path)

        real_replace = os.replace

        def replace(src, dst):
            if where == "commit" and dst.endswith(backup_files.LATEST):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)

        backup_files.os.replace = replace
        try:
            return commit(self, record, write)
        finally:
            backup_files.os.replace = real_replace

    backup_files.BackupFiles.commit = crashing_commit


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    keras.utils.set_random_seed(0)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    source = Noisy(augment=config.get("augment", False), calls_to=config.get("calls_to"))
    common = dict(batch_size=BATCH, shuffle=True, seed=3, executor=config["executor"])
    if config["executor"] != "threads":
        common["workers"] = config.get("workers", 2)
    if config.get("cache"):  # cache=: "memory" or a kept directory (it outlives the killed run)
        common["cache"] = config["cache"]
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
        callbacks.append(KillAt(config["kill_at"], config.get("children_to")))
    if config.get("crash_save"):
        crash_during_save(**config["crash_save"])
    model.fit(data, epochs=config.get("epochs", 3), callbacks=callbacks, verbose=0, shuffle=False)
    weights = [np.asarray(w) for w in model.get_weights()]
    np.savez(config["out"], *weights, backup_left=np.array(os.path.exists(backup)), keras=np.array(keras.version()))


if __name__ == "__main__":
    main(sys.argv[1])
