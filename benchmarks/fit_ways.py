"""The ways of feeding measured by ``benchmarks/fit.py``, run inside one child process.

Two views of the same workloads:

- ``fit``: epoch time of ``model.fit`` (TensorFlow backend) with a tiny model,
  so the train step is cheap and the input path decides the rate. The limit is
  ``fit`` on the same batches already in memory.
- ``numpy``: a plain ``for batch in ...`` over numpy batches (what a JAX or
  PyTorch loop gets), touching one value of every array.

Each function here returns what the child measures; ``fit.py`` runs every
configuration in its own subprocess so that one configuration's threads,
worker processes and TensorFlow state never slow down the next one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np

from benchmarks import peers

GRAIN_THREADS = 16  # Grain's default ReadOptions.num_threads
GRAIN_PREFETCH = 64
PROCESS_WORKERS = 2
KERAS_THREADS = 8
# The in-memory limit keeps at most this much distinct batch data (big: a
# few distinct 19 MB batches, cycled); tf.data copies each slice out anyway.
MEMORY_LIMIT_BYTES = 512 * 2**20

FIT_WAYS = (
    "memory", "keras-threads", "keras-processes", "grain-threads", "grain-mp",
    "torch", "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto",
)
NUMPY_WAYS = (
    "serial", "grain-threads", "grain-mp", "torch",
    "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto", "kerasfeed-tfdata",
)

LABELS = {
    "fit": {
        "memory": "in memory: the same batches, pre-made (the limit)",
        "keras-threads": f"Keras `PyDataset`, workers={KERAS_THREADS} threads",
        "keras-processes": f"Keras `PyDataset`, workers={PROCESS_WORKERS}, use_multiprocessing",
        "grain-threads": f"Grain `MapDataset`, `ReadOptions(num_threads={GRAIN_THREADS})`",
        "grain-mp": f"Grain, the same + `mp_prefetch(num_workers={PROCESS_WORKERS})`",
        "torch": "PyTorch `DataLoader`",
        "kerasfeed-threads": "kerasfeed `to_dataset`, threads",
        "kerasfeed-processes": f"kerasfeed `to_dataset`, processes (workers={PROCESS_WORKERS})",
        "kerasfeed-auto": "kerasfeed `to_dataset`, auto",
    },
    "numpy": {
        "serial": "serial loop, one thread",
        "grain-threads": f"Grain `ReadOptions(num_threads={GRAIN_THREADS})`",
        "grain-mp": f"Grain + `mp_prefetch(num_workers={PROCESS_WORKERS})`",
        "torch": f"PyTorch `DataLoader`, num_workers={PROCESS_WORKERS}, persistent",
        "kerasfeed-threads": "kerasfeed threads, numpy iteration",
        "kerasfeed-processes": f"kerasfeed processes (workers={PROCESS_WORKERS}), numpy iteration",
        "kerasfeed-auto": "kerasfeed auto, numpy iteration",
        "kerasfeed-tfdata": "kerasfeed `to_dataset` (auto) `.as_numpy_iterator()`",
    },
}

TORCH_FIT_NA = "n/a (Keras fit on the TensorFlow backend does not accept a torch DataLoader)"


# --- Grain ------------------------------------------------------------------------------


def _grain(seq: Any, multiprocess: bool) -> Any:
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():  # mp_prefetch reads absl flags
        flags.FLAGS.mark_as_parsed()
    ds = grain.MapDataset.source(seq).to_iter_dataset(
        grain.ReadOptions(num_threads=GRAIN_THREADS, prefetch_buffer_size=GRAIN_PREFETCH))
    if multiprocess:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=PROCESS_WORKERS))
    return ds


# --- kerasfeed's numpy iteration -------------------------------------------------------


class _ExecutorLoop:
    """``for batch in loop``: kerasfeed's numpy path without TensorFlow.

    ``kerasfeed.to_loader`` when this kerasfeed has it; otherwise the
    executor driven directly, as ``to_dataset`` drives it: ``plan`` the pass,
    then ``load`` every index in order.
    """

    def __init__(self, seq: Any, executor: str):
        import kerasfeed

        workers = PROCESS_WORKERS if executor == "processes" else None
        to_loader = getattr(kerasfeed, "to_loader", None)
        self.executor = None
        if to_loader is not None:
            kwargs = {} if workers is None else {"workers": workers}
            self.loader = to_loader(seq, executor=executor, **kwargs)
            self.how = "kerasfeed.to_loader"
        else:
            from kerasfeed.execution.factory import make_executor
            from kerasfeed.execution.processes.options import PoolOptions

            self.loader = None
            self.seq = seq
            self.executor = make_executor(executor, seq, PoolOptions(workers=workers))
            self.how = "executor.plan + executor.load (kerasfeed.to_loader not available)"
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        if self.loader is not None:
            return iter(self.loader)
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        indices = list(range(len(self.seq)))
        self.executor.plan(epoch, indices)
        for i in indices:
            yield self.executor.load(i, epoch)

    def close(self) -> None:
        for obj in (self.loader, self.executor):
            closer = getattr(obj, "close", None)
            if callable(closer):
                closer()


# --- the numpy view -----------------------------------------------------------------------


def numpy_iterable(way: str, seq: Any) -> Tuple[Any, Callable[[], None], str]:
    """``(iterable, close, how)``: each ``iter(iterable)`` is one pass."""
    if way == "serial":
        class _Serial:
            def __iter__(self):
                return (seq[i] for i in range(len(seq)))
        return _Serial(), lambda: None, "seq[i] for i in range(n)"
    if way in ("grain-threads", "grain-mp"):
        ds = _grain(seq, way == "grain-mp")
        return ds, lambda: None, "grain IterDataset, numpy out"
    if way == "torch":
        feed = peers._Torch(seq, PROCESS_WORKERS)

        class _Loader:
            def __iter__(self):
                return feed.epoch()
        return _Loader(), feed.close, "DataLoader(batch_size=None), torch tensors (zero-copy numpy view read)"
    if way.startswith("kerasfeed-") and way != "kerasfeed-tfdata":
        loop = _ExecutorLoop(seq, way.split("-", 1)[1])
        return loop, loop.close, loop.how
    if way == "kerasfeed-tfdata":
        import kerasfeed

        ds = kerasfeed.to_dataset(seq, executor="auto")

        class _Numpy:
            def __iter__(self):
                return ds.as_numpy_iterator()
        return _Numpy(), ds._kerasfeed_executor.close, "to_dataset(executor='auto').as_numpy_iterator()"
    raise ValueError(f"Unknown numpy way {way!r}; expected one of {NUMPY_WAYS}. Received: {way!r}")


def run_numpy(way: str, seq: Any, epochs: int) -> Dict[str, Any]:
    """Epoch 1 untimed, then ``epochs - 1`` timed passes of ``for batch in ...``."""
    n = len(seq)
    iterable, close, how = numpy_iterable(way, seq)
    timed: List[Dict[str, float]] = []
    try:
        for e in range(epochs):
            c0, t0 = time.process_time(), time.perf_counter()
            count = 0
            for count, batch in enumerate(iterable, 1):
                peers.touch(batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if count != n:
                raise RuntimeError(f"pass {e + 1} delivered {count} batches, expected {n}")
            if e:
                timed.append({"wall_s": wall, "main_cpu_s": cpu})
    finally:
        close()
    return _summary(n, timed, how=how)


# --- the fit view ---------------------------------------------------------------------------


def tiny_model(x: np.ndarray, num_classes: int, steps_per_execution: int) -> Any:
    """Averages every axis but the batch and the last one, then one Dense."""
    import keras

    inputs = keras.Input(x.shape[1:], dtype=str(x.dtype))
    h = inputs
    if x.ndim > 2:
        axes = tuple(range(1, len(x.shape) - 1))
        h = keras.layers.Lambda(lambda t: keras.ops.mean(t, axis=axes))(h)
    outputs = keras.layers.Dense(num_classes)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


class _EpochClock:
    """A Keras callback recording when each epoch starts and how many batches ran."""

    def __new__(cls, num_batches: int):
        import keras

        class Clock(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.marks: List[Tuple[float, float]] = []
                self.batches: List[int] = []

            def on_epoch_begin(self, epoch, logs=None):
                self.marks.append((time.perf_counter(), time.process_time()))
                self.batches.append(0)

            def on_train_batch_end(self, batch, logs=None):
                # Keras passes the last step of each execution, uncapped when
                # steps_per_execution does not divide the epoch.
                self.batches[-1] = min(batch + 1, num_batches)

            def on_train_end(self, logs=None):
                self.marks.append((time.perf_counter(), time.process_time()))

        return Clock()


def _in_memory(seq: Any) -> Any:
    """The same batches, made before timing, as a tf.data dataset of tensors."""
    import tensorflow as tf

    n = len(seq)
    first = seq[0]
    per_batch = sum(np.asarray(a).nbytes for a in peers.flatten(first))
    distinct = max(1, min(n, MEMORY_LIMIT_BYTES // max(per_batch, 1)))
    items = [first] + [seq[i] for i in range(1, distinct)]
    leaves = [np.stack(col) for col in zip(*(peers.flatten(b) for b in items))]
    ds = tf.data.Dataset.from_tensor_slices(tuple(leaves))
    if distinct < n:  # cycled: at most MEMORY_LIMIT_BYTES of distinct data
        ds = ds.repeat().take(n)
    return ds.prefetch(tf.data.AUTOTUNE), distinct


def fit_input(way: str, seq: Any) -> Tuple[Any, Callable[[], None], Dict[str, Any]]:
    """``(x for fit, close, info)``."""
    if way == "memory":
        ds, distinct = _in_memory(seq)
        return ds, lambda: None, {"distinct_batches": distinct}
    if way in ("keras-threads", "keras-processes"):
        seq.workers, seq.use_multiprocessing = ((KERAS_THREADS, False) if way == "keras-threads"
                                                else (PROCESS_WORKERS, True))

        def close():
            from keras.src.trainers.data_adapters import py_dataset_adapter as pda

            for pool in list(pda._DATA_POOLS):  # Keras closes, but does not join, its pools
                pool.terminate()
                pool.join()
        return seq, close, {}
    if way in ("grain-threads", "grain-mp"):
        return _grain(seq, way == "grain-mp"), lambda: None, {}
    if way.startswith("kerasfeed-"):
        import kerasfeed

        executor = way.split("-", 1)[1]
        kwargs = {"workers": PROCESS_WORKERS} if executor == "processes" else {}
        ds = kerasfeed.to_dataset(seq, executor=executor, **kwargs)
        ex = ds._kerasfeed_executor
        return ds, ex.close, {"executor": peers.executor_stats(ex)}
    raise ValueError(f"Unknown fit way {way!r}; expected one of {FIT_WAYS}. Received: {way!r}")


def run_fit(way: str, seq: Any, epochs: int, steps_per_execution: int = 1) -> Dict[str, Any]:
    """``model.fit(x, epochs=epochs)``; epoch 1 untimed, the others timed."""
    n = len(seq)
    x0, y0 = seq[0]
    num_classes = int(max(10, np.max(np.asarray(y0)) + 1))
    model = tiny_model(np.asarray(x0), num_classes, steps_per_execution)
    x, close, info = fit_input(way, seq)
    clock = _EpochClock(n)
    try:
        model.fit(x, epochs=epochs, verbose=0, callbacks=[clock], shuffle=False)
    finally:
        close()
    for e, count in enumerate(clock.batches):
        if count != n:
            raise RuntimeError(f"epoch {e + 1} ran {count} batches, expected {n}")
    marks = clock.marks
    timed = [{"wall_s": b[0] - a[0], "main_cpu_s": b[1] - a[1]} for a, b in zip(marks[1:-1], marks[2:])]
    return _summary(n, timed, **info)


def _summary(n: int, timed: List[Dict[str, float]], **extra: Any) -> Dict[str, Any]:
    best = min(timed, key=lambda e: e["wall_s"])
    return {
        "status": "ok",
        "batches": n,
        "batches_per_s": n / best["wall_s"],
        "timed_epochs_s": [e["wall_s"] for e in timed],
        "main_cpu_us_per_batch": best["main_cpu_s"] / n * 1e6,
        "main_cpu_us_per_batch_min": min(e["main_cpu_s"] for e in timed) / n * 1e6,
        **extra,
    }
