"""One process of a multi-process JAX ``model.fit`` with ``kerasfeed.BackupAndRestore``.

Run once per process (``tests/multiworker_launch.py`` sets the
``KERAS_DISTRIBUTION_*`` variables), or alone without them. Arguments:
``BACKUP_DIR OUT_NPZ GLOBAL_BATCH [KILL_EPOCH KILL_BATCH]``. Each process
reads its own shard with a per-process batch of ``GLOBAL_BATCH / processes``;
with a kill point, the first process SIGKILLs itself after that batch (its
backup committed) and the launcher ends the others.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

if os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES"):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")

import keras

import kerasfeed

ITEMS = 96


class Samples(kerasfeed.SceneSequence):
    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        x = rng.normal(size=4).astype("float32")
        return x, np.array([x @ np.array([0.5, -1.0, 2.0, 0.25]) + 0.5], "float32")


class KillAt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at, self.epoch = at, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if [self.epoch, batch] == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(backup, out, global_batch, *kill):
    processes = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1"))
    if processes > 1:
        keras.distribution.initialize()
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    keras.utils.set_random_seed(0)
    loader = kerasfeed.to_loader(Samples(), batch_size=int(global_batch) // processes, shuffle=True, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    callbacks = [kerasfeed.BackupAndRestore(backup, save_freq=3)]
    if kill:
        callbacks.append(KillAt([int(kill[0]), int(kill[1])]))
    model.fit(loader, epochs=3, verbose=0, shuffle=False, callbacks=callbacks)
    if int(os.environ.get("KERAS_DISTRIBUTION_PROCESS_ID", "0")) == 0:
        np.savez(out, *[np.asarray(w) for w in model.get_weights()], backup_left=np.array(os.path.exists(backup)))


if __name__ == "__main__":
    main(*sys.argv[1:])
