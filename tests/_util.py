"""Helpers shared by the test modules."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The oldest Keras setup.cfg accepts (the first whose fit takes a data adapter: to_loader).
OLDEST_KERAS = "3.7.0"


def oldest_keras_path() -> str:
    """Keras OLDEST_KERAS installed beside the environment's (first call only), for PYTHONPATH."""
    target = pathlib.Path(sys.prefix) / f"keras-{OLDEST_KERAS}"
    if not (target / "keras").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--target", str(target), f"keras=={OLDEST_KERAS}"], check=True, timeout=300)
    return str(target)


def notf_python(what: str) -> str:
    """The Python of the environment without TensorFlow (``$KERASFEED_NOTF_PYTHON``, else ``.venv-notf``,
    which ``make test`` builds); fails the test ``what`` names, saying how to build it, when it is missing."""
    path = os.environ.get("KERASFEED_NOTF_PYTHON") or str(ROOT / ".venv-notf" / "bin" / "python")
    if not pathlib.Path(path).exists():
        import pytest

        pytest.fail(f"{what} runs in a virtualenv without TensorFlow: build it with `make .venv-notf/"
                    f".kerasfeed-installed` (or point KERASFEED_NOTF_PYTHON at one). Received: {path} does not exist")
    return os.path.abspath(path)  # make test gives it relative to the repository: a test may run it elsewhere


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Polls ``predicate`` until it holds or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def fit_step_counter():
    """A Keras callback and the list it fills: the training steps of each epoch."""
    import keras

    steps: list[int] = []

    class CountSteps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] += 1

    return CountSteps(), steps


def keras_reset(data) -> None:
    """What Keras' ``EpochIterator.reset`` does to its data adapter after a model build: calls its
    ``on_epoch_end`` from ``reset`` itself (a loader tells a build's reset from an epoch's end by that)."""
    import types

    from keras.src.trainers.epoch_iterator import EpochIterator

    EpochIterator.reset(types.SimpleNamespace(data_adapter=data))


def index_recorder(seen: list, width: int):
    """A TensorFlow-backend model (run eagerly) that appends each training batch's first feature column,
    as ints, to ``seen``: which items a ``fit`` step was given, in order."""
    import keras
    import tensorflow as tf

    class Record(keras.layers.Layer):
        def call(self, x):
            if tf.executing_eagerly():  # not while Keras builds the model symbolically
                seen.append(x.numpy()[:, 0].astype(int).tolist())
            return x

        def compute_output_shape(self, shape):
            return shape

    model = keras.Sequential([keras.Input((width,)), Record(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    return model
