"""A resume inside an epoch under Keras' JAX trainer off the CPU, which reads one batch ahead
(``_one_batch_ahead_iterator``): past the end of a resumed ``to_dataset`` pass, where tf.data's check of a whole
pass's length fails (NOTE [ A resumed pass read past its end ]). Simulated on this CPU machine by making
``jax.default_backend()`` say "gpu" in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = r'''
import shutil, sys
import jax
jax.default_backend = lambda: "gpu"  # Keras' JAX trainer then reads one batch ahead, as on a GPU
import keras, numpy as np, kerasfeed

class Seq(kerasfeed.SceneSequence):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        x = np.full((4, 2), i, "float32") + np.arange(2, dtype="float32")
        return x, x[:, :1] * 0.1

class Cut(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.epoch, self.batch = 0, batch
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, self.batch):
            raise KeyboardInterrupt("cut")

def fit(make, callbacks):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(make(Seq()), epochs=3, verbose=0, shuffle=False, callbacks=callbacks)
    return model

out = {}
def derived(seq):
    return kerasfeed.to_dataset(seq).map(lambda x, y: (x, y))

# "last": one batch left, which the model build (from the resumed pass) and its read-ahead read past.
for name in ("to_dataset", "last", "to_loader", "derived", "distributed"):
    if name == "distributed":  # Keras' JAX trainer then reads one batch at a time (no read-ahead)
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    make = derived if name == "derived" else getattr(kerasfeed, name if name == "to_loader" else "to_dataset")
    backup = sys.argv[1] + "/" + name
    reference = fit(make, [])
    try:
        fit(make, [kerasfeed.BackupAndRestore(backup, save_freq=1), Cut(6 if name == "last" else 3)])
    except KeyboardInterrupt:
        pass
    try:
        resumed = fit(make, [kerasfeed.BackupAndRestore(backup, save_freq=1)])
        same = all(np.allclose(a, b) for a, b in zip(reference.get_weights(), resumed.get_weights()))
        print(name, "resumed", "same" if same else "DIFFERENT")
    except Exception as e:
        print(name, "raised", type(e).__name__, str(e).replace("\n", " "))
'''


def _failed(proc: subprocess.CompletedProcess) -> str:
    """The child's rc, stdout, the head of its stderr from the fatal error on (else from the start), the
    aborting thread's stack (faulthandler's "Current thread", which may come after a hundred others) and the
    end of its stderr."""
    err = proc.stderr
    marks = [k for k in (err.find("terminate called"), err.find("Fatal Python error")) if k >= 0]
    start = min(marks) if marks else 0
    current = err.find("Current thread ")
    return (f"rc={proc.returncode}; stdout: {proc.stdout[-1500:]}\n--- stderr from {start} of {len(err)} ---\n"
            f"{err[start:start + 5000]}\n--- the current thread ---\n{err[current:current + 2500] if current >= 0 else '-'}"
            f"\n--- stderr, its end ---\n{err[-2000:]}")


def test_jax_reading_one_batch_ahead_resumes_exactly_and_a_derived_dataset_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    # faulthandler: an abort (rc -6 at exit once, under load: "terminate called ... FATAL: exception not
    # rethrown") names its thread and every other thread's stack (NOTE [ Pool threads at exit ]).
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, _failed(proc)
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines() if line.startswith(("to_", "d", "last"))}
    # A bare FailedPreconditionError ("expected to contain 8 elements but contained only 4"), then a refusal, before.
    assert lines["to_dataset"] == "to_dataset resumed same", lines  # read without the length check for that epoch
    # One batch left: the model build read the resumed pass (its first batch, and one ahead) through the check and
    # failed with a bare FailedPreconditionError (a review's report); the build now reads a whole pass there.
    assert lines["last"] == "last resumed same", lines
    assert lines["to_loader"] == "to_loader resumed same", lines  # its passes end without tf.data's check
    assert lines["distributed"] == "distributed resumed same", lines  # refused wrongly before (a review's report)
    # Through a dataset derived from kerasfeed's, the check stays: refused by name before any batch.
    assert lines["derived"].startswith("derived raised ValueError kerasfeed.BackupAndRestore: the interrupted "
                                       "epoch resumes after batch 4 of 8, and Keras' JAX trainer on gpu reads one "
                                       "batch ahead"), lines
    assert "derived, zipped or distributed" in lines["derived"], lines
    assert "read the data through kerasfeed.to_loader under the JAX or torch backend" in lines["derived"], lines
