"""Ways of feeding a batch source into a training loop: the peers and kerasfeed.

Each way is a ``Way``: ``available()`` says whether it can run here (and why
not), ``build(seq)`` returns a ``Feed`` whose ``epoch()`` yields the batches of
one pass the way a training loop receives them, and whose ``close()`` releases
every thread, process and file it started, so the next configuration runs on
a quiet machine.

Heavy modules (TensorFlow, Keras, PyTorch) are imported inside the functions
that need them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

# --- nested structures (tuples, lists, dicts of arrays) --------------------------


def flatten(item: Any) -> List[Any]:
    if isinstance(item, dict):
        return [leaf for k in sorted(item) for leaf in flatten(item[k])]
    if isinstance(item, (tuple, list)):
        return [leaf for part in item for leaf in flatten(part)]
    return [item]


def pack(structure: Any, leaves: List[Any]) -> Any:
    it = iter(leaves)

    def build(s):
        if isinstance(s, dict):
            return {k: build(s[k]) for k in sorted(s)}
        if isinstance(s, (tuple, list)):
            return tuple(build(p) for p in s)
        return next(it)

    return build(structure)


def touch(batch: Any) -> float:
    """What a training loop does with a batch when the model is free.

    Reads one value of every array through a zero-copy numpy view (an
    EagerTensor or a torch tensor on the CPU), so the batch must really be
    there, without adding a copy or a TensorFlow op.
    """
    total = 0.0
    for leaf in flatten(batch):
        a = np.asarray(leaf)
        total += float(a.ravel()[0]) if a.size else 0.0
    return total


def graph_drainer(ds: Any) -> Callable[[], Tuple[int, float]]:
    """Consumes one pass of ``ds`` the way ``model.fit`` does: a fresh iterator
    made eagerly, handed to a compiled function that pulls every batch and
    touches one value of each of its arrays in the graph. No Python runs per
    batch on the consumer side.

    The eager alternative (``for batch in ds``) packs every element into
    Python objects: about 250 us of GIL-holding Python per batch on the
    2-core machine, the same for every tf.data way, which capped all of them
    near 4,000 batches/s and took that CPU from their workers. Iterating the
    dataset itself inside the function (instead of an iterator passed in)
    costs ~20 ms more per pass.

    Traced here, so the first timed epoch does not pay for tracing.
    """
    import tensorflow as tf

    @tf.function
    def drain(iterator):
        count = tf.constant(0, tf.int64)
        total = tf.constant(0.0, tf.float64)
        element = iterator.get_next_as_optional()
        while element.has_value():
            count += 1
            for leaf in tf.nest.flatten(element.get_value()):
                total += tf.reduce_sum(tf.cast(tf.reshape(leaf, [-1])[:1], tf.float64))
            element = iterator.get_next_as_optional()
        return count, total

    drain.get_concrete_function(iter(ds))

    def run() -> Tuple[int, float]:
        count, total = drain(iter(ds))
        return int(count), float(total)

    return run


def tf_signature(seq: Any):
    """TensorSpecs of item 0 (every workload's batches have one fixed shape)."""
    import tensorflow as tf

    item = seq[0]
    leaves = [np.asarray(a) for a in flatten(item)]
    specs = [tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in leaves]
    return item, specs


# --- the Way / Feed interface -----------------------------------------------------


class Feed:
    """One configured way of feeding one source.

    ``epoch()`` yields one pass's batches to a Python loop (epoch 1, which
    also measures the first batch). Feeds of tf.data datasets also have
    ``drain()``: one pass consumed inside a compiled function, used for the
    timed epochs (see ``graph_drainer``).
    """

    drain: Optional[Callable[[], Tuple[int, float]]] = None

    def epoch(self) -> Iterator[Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def info(self) -> Dict[str, Any]:
        return {}


@dataclasses.dataclass(frozen=True)
class Way:
    """A way of feeding.

    Attributes:
        name: short id used by ``--only`` and in the JSON.
        label: what the table shows.
        build: ``build(seq) -> Feed``.
        available: ``() -> None`` when it can run, else the reason it cannot.
        keras_workers: ``(workers, use_multiprocessing)`` to set on the source
            before ``build`` (Keras reads them from the PyDataset itself).
        measures: one line saying exactly what the row measures.
    """

    name: str
    label: str
    build: Callable[[Any], Feed]
    available: Callable[[], Optional[str]] = lambda: None
    keras_workers: Optional[Tuple[int, bool]] = None
    measures: str = ""


# --- serial --------------------------------------------------------------------------


class _Serial(Feed):
    def __init__(self, seq):
        self.seq = seq

    def epoch(self):
        for i in range(len(self.seq)):
            yield self.seq[i]


# --- tf.data peers -------------------------------------------------------------------


class _TfFeed(Feed):
    def __init__(self, ds, on_close: Optional[Callable[[], None]] = None):
        self.ds = ds
        self._on_close = on_close
        self.drain = graph_drainer(ds)

    def epoch(self):
        return iter(self.ds)

    def close(self):
        if self._on_close is not None:
            self._on_close()
        self.ds = None


def _from_generator(seq) -> Feed:
    import tensorflow as tf

    item, specs = tf_signature(seq)

    def gen():
        for i in range(len(seq)):
            yield tuple(flatten(seq[i]))

    ds = tf.data.Dataset.from_generator(gen, output_signature=tuple(specs))
    ds = ds.map(lambda *leaves: pack(item, list(leaves))).prefetch(tf.data.AUTOTUNE)
    return _TfFeed(ds)


def _range_map(seq, private_pool: Optional[int] = None) -> Feed:
    import tensorflow as tf

    item, specs = tf_signature(seq)
    dtypes = [s.dtype for s in specs]

    def load(i):
        return [np.asarray(a) for a in flatten(seq[int(i)])]

    def load_item(i):
        leaves = tf.numpy_function(load, [i], dtypes, stateful=True)
        for t, s in zip(leaves, specs):
            t.set_shape(s.shape)
        return pack(item, list(leaves))

    ds = tf.data.Dataset.range(len(seq)).map(load_item, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    if private_pool:
        options = tf.data.Options()
        options.threading.private_threadpool_size = private_pool
        ds = ds.with_options(options)
    return _TfFeed(ds)


class _KerasFit(Feed):
    """Keras' own PyDataset path on the TF backend, driven as ``fit`` drives it.

    ``fit`` builds ``PyDatasetAdapter(x, shuffle=...)``, takes
    ``get_tf_dataset()`` (``from_generator`` over the adapter's enqueuer,
    after probing two batches for the signature), distributes it with the
    default strategy, and every epoch calls ``adapter.on_epoch_begin()``,
    iterates a fresh iterator and calls ``adapter.on_epoch_end()`` (which
    stops the enqueuer: its thread or process pool is rebuilt every epoch).
    """

    def __init__(self, seq):
        import tensorflow as tf
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        self.adapter = PyDatasetAdapter(seq, shuffle=False)
        ds = self.adapter.get_tf_dataset()
        self.ds = tf.distribute.get_strategy().experimental_distribute_dataset(ds)
        drain_pass = graph_drainer(self.ds)

        def drain():
            self.adapter.on_epoch_begin()
            try:
                return drain_pass()
            finally:
                self.adapter.on_epoch_end()

        self.drain = drain

    def epoch(self):
        self.adapter.on_epoch_begin()
        try:
            for batch in iter(self.ds):
                yield batch
        finally:
            self.adapter.on_epoch_end()

    def close(self):
        from keras.src.trainers.data_adapters import py_dataset_adapter as pda

        if self.adapter is not None and self.adapter.enqueuer is not None:
            self.adapter.enqueuer.stop()
        # Keras closes (but does not join) each epoch's pool; finish them here
        # so their processes are gone before the next configuration starts.
        for pool in list(pda._DATA_POOLS):
            pool.terminate()
            pool.join()
        self.adapter = None
        self.ds = None


# --- PyTorch -------------------------------------------------------------------------


def _torch_missing() -> Optional[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "n/a (torch not installed: pip install -e .[bench])"
    return None


class _Torch(Feed):
    def __init__(self, seq, num_workers: int = 2):
        from torch.utils.data import DataLoader

        # batch_size=None: items are whole batches (no collation), numpy
        # arrays become tensors in the workers and travel in shared memory.
        self.loader = DataLoader(seq, batch_size=None, shuffle=False,
                                 num_workers=num_workers, persistent_workers=True)

    def epoch(self):
        return iter(self.loader)

    def close(self):
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader = None


# --- kerasfeed ------------------------------------------------------------------------


def kerasfeed_executors() -> Tuple[str, ...]:
    from kerasfeed.execution.factory import EXECUTOR_NAMES

    return tuple(EXECUTOR_NAMES)


def _executor_missing(name: str) -> Callable[[], Optional[str]]:
    def check():
        if name not in kerasfeed_executors():
            return f"n/a (not available: kerasfeed executor {name!r} is not in EXECUTOR_NAMES)"
        return None

    return check


def executor_stats(ex: Any) -> Dict[str, Any]:
    """Whatever statistics an executor exposes, as a JSON-able dict."""
    out: Dict[str, Any] = {"name": getattr(ex, "name", "?"), "reason": getattr(ex, "reason", "")}
    for attr in ("stats", "summary", "statistics"):
        value = getattr(ex, attr, None)
        if value is None:
            continue
        try:
            value = value() if callable(value) else value
        except Exception as e:  # noqa: BLE001 - stats are a bonus; never fail the run for them
            value = f"error: {type(e).__name__}: {e}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        out[attr] = value
    for attr in ("workers", "num_workers"):
        value = getattr(ex, attr, None)
        if isinstance(value, int):
            out[attr] = value
    return out


class _Kerasfeed(Feed):
    def __init__(self, seq, executor: str, workers: Optional[int]):
        import kerasfeed

        kwargs = {} if workers is None else {"workers": workers}
        self.ds = kerasfeed.to_dataset(seq, executor=executor, **kwargs)
        self.executor = self.ds._kerasfeed_executor
        self.drain = graph_drainer(self.ds)

    def epoch(self):
        return iter(self.ds)

    def info(self):
        return executor_stats(self.executor)

    def close(self):
        if self.executor is not None:
            self.executor.close()
        self.executor = None
        self.ds = None


# --- the registry ------------------------------------------------------------------------


def ways(process_workers: int = 2) -> List[Way]:
    """Every way of feeding, in table order."""
    return [
        Way("serial", "serial loop, one thread", _Serial,
            measures="for i in range(n): touch(seq[i]) in the main thread"),
        Way("tf-from-generator", "`tf.data.Dataset.from_generator`", _from_generator,
            measures="from_generator over seq[i] for i in range(n), then prefetch(AUTOTUNE)"),
        Way("tf-map", "`Dataset.range(n).map(numpy_function(getitem), AUTOTUNE)`", _range_map,
            measures="range(n).map(tf.numpy_function(seq.__getitem__), num_parallel_calls=AUTOTUNE)"
                     ".prefetch(AUTOTUNE), default tf.data options"),
        Way("keras-threads", "Keras `PyDataset`, workers=8 threads (fit's tf.data path)",
            _KerasFit, keras_workers=(8, False),
            measures="PyDatasetAdapter(seq).get_tf_dataset() with seq.workers=8 (thread pool), "
                     "on_epoch_begin/iterate/on_epoch_end as fit does"),
        Way("keras-processes", "Keras `PyDataset`, workers=2, use_multiprocessing",
            _KerasFit, keras_workers=(2, True),
            measures="the same with seq.workers=2, use_multiprocessing=True "
                     "(multiprocessing.Pool, default start method, rebuilt each epoch)"),
        Way("torch", "PyTorch `DataLoader`, num_workers=2, persistent workers",
            lambda seq: _Torch(seq, process_workers), available=_torch_missing,
            measures="DataLoader(seq, batch_size=None, num_workers=2, persistent_workers=True)"),
        Way("kerasfeed-threads", "kerasfeed `to_dataset`, threads",
            lambda seq: _Kerasfeed(seq, "threads", None),
            measures="kerasfeed.to_dataset(seq, executor='threads')"),
        Way("kerasfeed-processes", f"kerasfeed `to_dataset`, processes (workers={process_workers})",
            lambda seq: _Kerasfeed(seq, "processes", process_workers),
            available=_executor_missing("processes"),
            measures=f"kerasfeed.to_dataset(seq, executor='processes', workers={process_workers})"),
        Way("kerasfeed-auto", "kerasfeed `to_dataset`, auto",
            lambda seq: _Kerasfeed(seq, "auto", None),
            available=_executor_missing("auto"),
            measures="kerasfeed.to_dataset(seq, executor='auto'): kerasfeed picks (see its reason)"),
    ]


def extra_ways() -> List[Way]:
    """Rows that run only when named in ``--only``."""
    return [
        Way("tf-map-pool64", "the same map with `private_threadpool_size=64`",
            lambda seq: _range_map(seq, private_pool=64),
            measures="tf-map with tf.data.Options().threading.private_threadpool_size=64"),
    ]
