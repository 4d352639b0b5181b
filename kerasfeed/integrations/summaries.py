"""``WorkerSummaries``: every worker writes its own TensorBoard scalars, under ``worker_run_dir``."""

from __future__ import annotations

import numbers
import os
import time
from typing import Any, Optional, Union

import keras
import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.integrations.scalars import check_log_dir, scalar_writer
from kerasfeed.integrations.steps import StepCount
from kerasfeed.loading import hosts
from kerasfeed.loading.shards import tf_config_worker


def worker_run_dir(log_dir: "str | os.PathLike") -> str:
    """``log_dir/worker_<k>``: this worker's own TensorBoard run directory.

    ``k`` is the worker's index in a multi-worker cluster (the chief, if any,
    is 0), the process index (``jax.process_index()``) under a multi-process
    Keras distribution on JAX, and 0 for a single worker (two summary
    writers must never share a run directory).

    Example:

    ```python
    import kerasfeed
    kerasfeed.worker_run_dir("logs")  # 'logs/worker_0' outside a cluster
    ```
    """
    log_dir = _v.path("log_dir", log_dir, owner="worker_run_dir")
    member = hosts.job_member()  # Keras' distribution API on JAX, else a tf.distribute strategy's workers
    if member is not None:
        return os.path.join(log_dir, f"worker_{member[0]}")
    worker = tf_config_worker()  # TF_CONFIG set, no strategy made yet
    return os.path.join(log_dir, f"worker_{0 if worker is None else worker.worker_id}")


class WorkerSummaries(keras.callbacks.Callback):
    """Writes this worker's scalars to TensorBoard, under its own run directory.

    Under a multi-worker strategy Keras' ``TensorBoard`` callback is meant for
    the chief; this callback runs on every worker and writes to
    ``worker_run_dir(log_dir)`` (``log_dir/worker_<k>``), so two writers never
    share a run directory and TensorBoard shows one run per worker.

    Scalars written (``tag``: value at ``step``):

    - ``epoch/<name>`` for every number in the ``logs`` of ``on_epoch_end``
      (at the epoch number);
    - ``batch/<name>`` for every number in the ``logs`` of
      ``on_train_batch_end``, every ``update_freq`` batches (at the global
      batch count) when ``update_freq`` is an int;
    - ``input/batches_per_s``: the batches this worker's pipeline delivered
      per second of the epoch (its input rate, bounded by the step time), and
      ``input/batches``: how many, at the epoch number.

    In a custom loop, pass each worker's own figures in ``logs`` (for example
    its loss on its shard, the mean of ``strategy.experimental_local_results``
    of the per-replica losses); under ``model.fit`` the logs are what Keras
    reports (global, already reduced across workers).

    Args:
        log_dir: the common TensorBoard directory; each worker writes under
            its ``worker_<k>`` subdirectory (without TensorFlow outside its
            backend: ``integrations/scalars.py``).
        update_freq: ``"epoch"`` (per-epoch scalars only) or an int: also
            write the batch logs every that many batches.

    Example:

    ```python
    import keras
    import kerasfeed

    summaries = kerasfeed.WorkerSummaries("logs", update_freq=10)
    callbacks = keras.callbacks.CallbackList([summaries], model=keras.Sequential())
    callbacks.on_train_begin()
    callbacks.on_epoch_begin(0)
    callbacks.on_train_batch_end(0, {"loss": 0.5})
    callbacks.on_epoch_end(0, {"loss": 0.5})
    callbacks.on_train_end()   # logs/worker_0 holds the events
    ```
    """

    def __init__(self, log_dir: Union[str, os.PathLike], update_freq: Union[str, int] = "epoch"):
        super().__init__()
        self.log_dir = check_log_dir(log_dir, owner="WorkerSummaries")
        ok_int = isinstance(update_freq, int) and not isinstance(update_freq, bool) and update_freq > 0
        if update_freq != "epoch" and not ok_int:
            raise ValueError(f"`update_freq` must be 'epoch' or a positive int. Received: update_freq={update_freq!r}")
        self.update_freq = update_freq
        self.run_dir: Optional[str] = None
        self._writer = None
        self._steps = StepCount()  # batches trained (an execution of steps_per_execution: one call)
        self._epoch_start = 0.0

    def _ensure_writer(self):
        if self._writer is None:
            # Resolved when training starts: the strategy (and so the worker index) is known by then.
            self.run_dir = worker_run_dir(self.log_dir)
            self._writer = scalar_writer(self.run_dir)
        return self._writer

    def _write(self, prefix: str, logs: Any, step: int) -> None:
        numbers = {f"{prefix}/{name}": _number(value) for name, value in (logs or {}).items()}
        self._ensure_writer().scalars({tag: v for tag, v in numbers.items() if v is not None}, step)

    def on_train_begin(self, logs: Any = None) -> None:
        self._ensure_writer()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_start = time.perf_counter()
        self._steps.epoch_begins()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        added = self._steps.batch_ends(self.model, batch, self.params)
        if self.update_freq != "epoch" and self._steps.crossed(added, self.update_freq):
            self._write("batch", logs, self._steps.total)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        elapsed = max(time.perf_counter() - self._epoch_start, 1e-9)
        self._write("epoch", logs, epoch)
        rate = {"batches_per_s": self._steps.epoch / elapsed, "batches": self._steps.epoch}
        self._write("input", rate, epoch)
        self._writer.flush()

    def on_train_end(self, logs: Any = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _number(value: Any) -> Optional[float]:
    """A Python float from a number, numpy scalar or scalar tensor; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Number):
        return float(value)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - not array-like: not a scalar to write
        return None
    if arr.shape == () and np.issubdtype(arr.dtype, np.number):
        return float(arr)
    return None


__all__ = ["WorkerSummaries", "worker_run_dir"]
