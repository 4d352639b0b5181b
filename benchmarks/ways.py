"""The registry of ways of feeding a batch source into a training loop: the peers and kerasfeed.

A ``Way`` builds, on a fresh source, a ``Feed``: ``epoch()`` yields one pass
to a plain Python loop, ``x`` (with ``fit_kwargs``) is what ``model.fit``
gets, ``drain`` (graph mode only) consumes one pass inside a compiled
``tf.function``, and ``close()`` releases every thread, process and file the
way started. The ``Context`` says how the pass is consumed and so which front
end each way uses: kerasfeed builds ``to_dataset`` where tf.data consumes the
batches (a compiled drain, ``fit`` on the TensorFlow backend) and
``to_loader`` everywhere else (a Python loop, Keras' JAX and PyTorch
adapters), as a user would. A new peer is one ``Way`` entry in ``_registry``.

Heavy modules (TensorFlow, Keras, PyTorch, Grain) are imported inside the
functions that need them: without TensorFlow, every way that does not need it
still runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

MODES = ("graph", "loop", "adapter", "fit")
KERAS_THREADS = 8
GRAIN_THREADS = 16  # Grain's default ReadOptions.num_threads
GRAIN_PREFETCH = 64
# The in-memory limit keeps at most this much distinct batch data as tf.data
# tensors (big: a few distinct 19 MB batches, cycled); tf.data copies each slice out anyway.
MEMORY_LIMIT_BYTES = 512 * 2**20


@dataclasses.dataclass(frozen=True)
class Context:
    """How one configuration is consumed.

    Attributes:
        mode: ``"graph"`` (each pass drained in a compiled ``tf.function``,
            the way ``fit``'s train function pulls), ``"loop"`` (a plain
            ``for batch in ...`` over numpy batches), ``"adapter"`` (Keras'
            data adapter of ``backend``, drained as its ``fit`` drains it) or
            ``"fit"`` (``model.fit`` epochs).
        backend: the Keras backend (``"tensorflow"``, ``"jax"``, ``"torch"``).
        workers: worker processes of every process-based way (kerasfeed
            processes, PyTorch, Keras ``use_multiprocessing``, Grain ``mp_prefetch``).
        auto_workers: ``workers`` given with ``executor="auto"`` (None: kerasfeed's default).
    """

    mode: str = "graph"
    backend: str = "tensorflow"
    workers: int = 2
    auto_workers: Optional[int] = None

    @property
    def tf_front(self) -> bool:
        """Whether tf.data consumes the batches (kerasfeed then builds ``to_dataset``)."""
        return self.mode == "graph" or (self.mode == "fit" and self.backend == "tensorflow")


# --- nested structures and the consumer's touch ---------------------------------------------


def flatten(item: Any) -> List[Any]:
    if isinstance(item, dict):
        return [leaf for k in sorted(item) for leaf in flatten(item[k])]
    if isinstance(item, (tuple, list)):
        return [leaf for part in item for leaf in flatten(part)]
    return [item]


def touch(batch: Any) -> float:
    """What a training loop does with a batch when the model is free: reads one
    value of every array through a zero-copy numpy view (an EagerTensor or a
    CPU torch tensor too), so the batch must really be there, without a copy."""
    total = 0.0
    for leaf in flatten(batch):
        a = np.asarray(leaf)
        total += float(a.ravel()[0]) if a.size else 0.0
    return total


def graph_drainer(ds: Any) -> Callable[[], Tuple[int, float]]:
    """One pass of ``ds`` consumed as ``model.fit`` does: a fresh iterator made
    eagerly, handed to a compiled function that pulls every batch and touches
    one value of each array in the graph; no Python runs per batch.

    The eager alternative (``for batch in ds``) packs every element into
    Python objects: ~250 us of GIL-holding Python per batch on the 2-core
    machine for every tf.data way, which capped them all near 4,000
    batches/s. Traced here, so the first timed epoch does not pay for it.
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


def executor_stats(ex: Any) -> Dict[str, Any]:
    """What a kerasfeed executor reports (``name``, ``reason``, ``stats()``), JSON-able."""
    out: Dict[str, Any] = {"name": getattr(ex, "name", "?"), "reason": getattr(ex, "reason", "")}
    stats = getattr(ex, "stats", None)
    if stats is not None:
        try:
            value = stats() if callable(stats) else stats
        except Exception as e:  # noqa: BLE001 - stats are a bonus; never fail the run for them
            value = f"error: {type(e).__name__}: {e}"
        out["stats"] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    for attr in ("workers", "num_workers"):
        if isinstance(getattr(ex, attr, None), int):
            out[attr] = getattr(ex, attr)
    return out


# --- feeds -----------------------------------------------------------------------------------


class Feed:
    """One way of feeding built on one source (see the module docstring)."""

    x: Any = None
    fit_kwargs: Dict[str, Any] = {}
    drain: Optional[Callable[[], Tuple[int, float]]] = None

    def __init__(self, x: Any = None, epoch: Optional[Callable[[], Iterator[Any]]] = None,
                 close: Optional[Callable[[], None]] = None, info: Optional[Callable[[], Dict[str, Any]]] = None):
        self.x = x
        self._epoch, self._close, self._info = epoch or (lambda: iter(self.x)), close, info

    def epoch(self) -> Iterator[Any]:
        return self._epoch()

    def close(self) -> None:
        if self._close is not None:
            self._close()
        self.x = self.drain = None

    def info(self) -> Dict[str, Any]:
        return self._info() if self._info is not None else {}


def tf_feed(ds: Any, ctx: Context, **kwargs: Any) -> Feed:
    """A feed of a tf.data dataset (drained in a compiled function in graph mode)."""
    feed = Feed(ds, **kwargs)
    if ctx.mode == "graph":
        feed.drain = graph_drainer(ds)
    return feed


def _serial(seq: Any, ctx: Context) -> Feed:
    return Feed(None, epoch=lambda: (seq[i] for i in range(len(seq))))


def _memory(seq: Any, ctx: Context) -> Feed:
    """The same batches made before timing: tf.data tensors where tf.data consumes them, else numpy arrays."""
    n, first = len(seq), seq[0]
    per_batch = sum(np.asarray(a).nbytes for a in flatten(first))
    if ctx.tf_front:
        import tensorflow as tf

        distinct = max(1, min(n, MEMORY_LIMIT_BYTES // max(per_batch, 1)))
        items = [first] + [seq[i] for i in range(1, distinct)]
        ds = tf.data.Dataset.from_tensor_slices(tuple(np.stack(c) for c in zip(*(flatten(b) for b in items))))
        if distinct < n:  # cycled: at most MEMORY_LIMIT_BYTES of distinct data
            ds = ds.repeat().take(n)
        return tf_feed(ds.prefetch(tf.data.AUTOTUNE), ctx, info=lambda: {"distinct_batches": distinct})
    x, y = (np.concatenate(c) for c in zip(*([np.asarray(a) for a in seq[i]] for i in range(n))))
    b = len(np.asarray(first[0]))
    feed = Feed(x, epoch=lambda: ((x[k:k + b], y[k:k + b]) for k in range(0, len(x), b)))
    feed.fit_kwargs = {"y": y, "batch_size": b}
    return feed


def _from_generator(seq: Any, ctx: Context) -> Feed:
    import tensorflow as tf

    first = seq[0]
    specs = tuple(tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)) for a in flatten(first))
    ds = tf.data.Dataset.from_generator(lambda: (tuple(flatten(seq[i])) for i in range(len(seq))),
                                        output_signature=specs)
    return tf_feed(ds.map(lambda *leaves: tuple(leaves)).prefetch(tf.data.AUTOTUNE), ctx)


def _range_map(private_pool: Optional[int] = None) -> Callable[[Any, Context], Feed]:
    def make(seq: Any, ctx: Context) -> Feed:
        import tensorflow as tf

        leaves = [np.asarray(a) for a in flatten(seq[0])]

        def load_item(i):
            out = tf.numpy_function(lambda k: [np.asarray(a) for a in flatten(seq[int(k)])], [i],
                                    [tf.as_dtype(a.dtype) for a in leaves], stateful=True)
            for t, a in zip(out, leaves):
                t.set_shape(a.shape)
            return tuple(out)

        ds = tf.data.Dataset.range(len(seq)).map(load_item, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.prefetch(tf.data.AUTOTUNE)
        if private_pool:
            options = tf.data.Options()
            options.threading.private_threadpool_size = private_pool
            ds = ds.with_options(options)
        return tf_feed(ds, ctx)

    return make


def _close_keras_pools() -> None:
    from keras.src.trainers.data_adapters import py_dataset_adapter as pda

    for pool in list(pda._DATA_POOLS):  # Keras closes, but does not join, each epoch's pool
        pool.terminate()
        pool.join()


def _keras(processes: bool) -> Callable[[Any, Context], Feed]:
    """Keras' own PyDataset path: ``fit(seq)`` builds ``PyDatasetAdapter(seq)`` and, every
    epoch, calls ``on_epoch_begin``, iterates and calls ``on_epoch_end`` (which stops the
    enqueuer: its thread or process pool is rebuilt every epoch)."""

    def make(seq: Any, ctx: Context) -> Feed:
        seq.workers, seq.use_multiprocessing = (ctx.workers, True) if processes else (KERAS_THREADS, False)
        if ctx.mode in ("fit", "adapter"):  # Keras builds its adapter itself
            return Feed(seq, close=_close_keras_pools)
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        adapter = PyDatasetAdapter(seq, shuffle=False)
        if ctx.mode == "graph":  # fit's tf.data path, distributed with the default strategy
            import tensorflow as tf

            ds = tf.distribute.get_strategy().experimental_distribute_dataset(adapter.get_tf_dataset())
            source, drain_pass = (lambda: iter(ds)), graph_drainer(ds)
        else:
            source, drain_pass = adapter.get_numpy_iterator, None

        def with_hooks(run: Callable[[], Any]) -> Any:
            adapter.on_epoch_begin()
            try:
                return run()
            finally:
                adapter.on_epoch_end()

        def epoch() -> Iterator[Any]:
            adapter.on_epoch_begin()
            try:
                yield from source()
            finally:
                adapter.on_epoch_end()

        def close() -> None:
            if adapter.enqueuer is not None:
                adapter.enqueuer.stop()
            _close_keras_pools()

        feed = Feed(seq, epoch=epoch, close=close)
        if drain_pass is not None:
            feed.drain = lambda: with_hooks(drain_pass)
        return feed

    return make


def _torch(seq: Any, ctx: Context) -> Feed:
    from torch.utils.data import DataLoader

    # batch_size=None: items are whole batches (no collation); numpy arrays become
    # tensors in the workers and travel in shared memory.
    loader = DataLoader(seq, batch_size=None, shuffle=False, num_workers=ctx.workers, persistent_workers=True)

    def close() -> None:
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    return Feed(loader, close=close)


def _grain(multiprocess: bool) -> Callable[[Any, Context], Feed]:
    def make(seq: Any, ctx: Context) -> Feed:
        import grain
        from absl import flags

        if not flags.FLAGS.is_parsed():  # mp_prefetch reads absl flags
            flags.FLAGS.mark_as_parsed()
        ds = grain.MapDataset.source(seq).to_iter_dataset(
            grain.ReadOptions(num_threads=GRAIN_THREADS, prefetch_buffer_size=GRAIN_PREFETCH))
        if multiprocess:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=ctx.workers))
        return Feed(ds)

    return make


def _kerasfeed(executor: str, **loader_kwargs: Any) -> Callable[[Any, Context], Feed]:
    # Both front ends take `cache`; the other keyword arguments are to_loader's. Split once, here: `make`
    # runs once per configuration, and a child process runs several of one way (gpu.py: one per worker count).
    both = {"cache": loader_kwargs.pop("cache")} if "cache" in loader_kwargs else {}

    def make(seq: Any, ctx: Context) -> Feed:
        import kerasfeed

        workers = {"processes": ctx.workers, "auto": ctx.auto_workers}.get(executor)
        kwargs = {**({} if workers is None else {"workers": workers}), **both}
        if ctx.tf_front:
            ds = kerasfeed.to_dataset(seq, executor=executor, **kwargs)
            ex = kerasfeed.executor_of(ds)
            return tf_feed(ds, ctx, close=ex.close, info=lambda: executor_stats(ex))
        loader = kerasfeed.to_loader(seq, executor=executor, **kwargs, **loader_kwargs)
        return Feed(loader, close=loader.close, info=lambda: executor_stats(loader.executor))

    return make


def _kerasfeed_tfdata(seq: Any, ctx: Context) -> Feed:
    import kerasfeed

    ds = kerasfeed.to_dataset(seq, executor="auto")
    ex = kerasfeed.executor_of(ds)
    return Feed(ds, epoch=ds.as_numpy_iterator, close=ex.close, info=lambda: executor_stats(ex))


def _raw_h5(seq: Any, ctx: Context) -> Feed:
    """The limit of one process on an HDF5 workload: the file opened once, slices read in a loop."""
    import h5py

    f = h5py.File(seq.path, "r")
    data, k, n = [f[name] for name in seq.names], seq.per_batch, len(seq)
    return Feed(None, epoch=lambda: (tuple(d[i * k:(i + 1) * k] for d in data) for i in range(n)), close=f.close)


# --- the registry ------------------------------------------------------------------------------


def _not_on_tf_fit(reason: str) -> Callable[[Context], Optional[str]]:
    return lambda ctx: reason if ctx.mode == "fit" and ctx.backend == "tensorflow" else None


@dataclasses.dataclass(frozen=True)
class Way:
    """A way of feeding.

    Attributes:
        name: its id (``--only``, the JSON).
        label: what the tables show; ``{workers}`` and ``{front}`` (``to_dataset``
            or ``to_loader``) are filled in from the context.
        make: ``make(seq, ctx) -> Feed``.
        needs: packages it imports; a missing one makes its row
            ``skipped: <package> not installed``.
        python_only: runs as a Python loop even where tf.data consumes the
            others (graph mode), so it never needs TensorFlow.
        modes: the modes it runs in.
        unsupported: ``ctx -> reason`` when it cannot run in that context, else None.
        measures: one line saying exactly what runs.
    """

    name: str
    label: str
    make: Callable[[Any, Context], Feed]
    needs: Tuple[str, ...] = ()
    python_only: bool = False
    modes: Tuple[str, ...] = MODES
    unsupported: Callable[[Context], Optional[str]] = lambda ctx: None
    measures: str = ""

    def missing(self, ctx: Context) -> Optional[str]:
        """Why it cannot run in ``ctx`` (``skipped: ...`` or ``n/a (...)``), or None."""
        needs = self.needs + (("tensorflow",) if ctx.tf_front and not self.python_only else ())
        for package in needs:
            if importlib.util.find_spec(package) is None:
                return f"skipped: {package} not installed"
        if ctx.mode not in self.modes:
            return f"n/a (not a {ctx.mode} way)"
        return self.unsupported(ctx)

    def title(self, ctx: Context, workers: Optional[int] = None) -> str:
        front = "to_dataset" if ctx.tf_front else "to_loader"
        return self.label.format(workers=ctx.workers if workers is None else workers, front=front)


def _registry() -> List[Way]:
    kf = "kerasfeed `{front}`"
    torch_on_tf = _not_on_tf_fit("n/a (Keras fit on the TensorFlow backend does not accept a torch DataLoader)")
    return [
        Way("serial", "serial loop, one thread", _serial, python_only=True, modes=("graph", "loop", "adapter"),
            measures="for i in range(n): seq[i] in the main thread"),
        Way("memory", "in memory: the same batches, pre-made (the limit)", _memory,
            measures="the batches made before timing: tf.data from_tensor_slices (cycled past 512 MB) where "
                     "tf.data consumes them, else numpy arrays handed to fit with batch_size"),
        Way("tf-from-generator", "`tf.data.Dataset.from_generator`", _from_generator, ("tensorflow",),
            modes=("graph", "fit"), measures="from_generator over seq[i] for i in range(n), then prefetch(AUTOTUNE)"),
        Way("tf-map", "`Dataset.range(n).map(numpy_function(getitem), AUTOTUNE)`", _range_map(), ("tensorflow",),
            modes=("graph", "fit"),
            measures="range(n).map(tf.numpy_function(seq.__getitem__), AUTOTUNE).prefetch(AUTOTUNE)"),
        Way("tf-map-pool64", "the same map with `private_threadpool_size=64`", _range_map(64), ("tensorflow",),
            modes=("graph", "fit"), measures="tf-map with private_threadpool_size=64"),
        Way("keras-threads", f"Keras `PyDataset`, workers={KERAS_THREADS} threads", _keras(False), ("keras",),
            measures=f"PyDatasetAdapter(seq) with seq.workers={KERAS_THREADS} threads, epoch hooks as fit calls them"),
        Way("keras-processes", "Keras `PyDataset`, workers={workers}, use_multiprocessing", _keras(True),
            ("keras",), measures="the same with use_multiprocessing=True (a multiprocessing.Pool rebuilt each epoch)"),
        Way("torch", "PyTorch `DataLoader`, num_workers={workers}, persistent workers", _torch, ("torch",),
            python_only=True, unsupported=torch_on_tf,
            measures="DataLoader(seq, batch_size=None, num_workers=W, persistent_workers=True)"),
        Way("grain-threads", f"Grain `MapDataset`, `ReadOptions(num_threads={GRAIN_THREADS})`", _grain(False),
            ("grain",), python_only=True,
            measures=f"MapDataset.source(seq).to_iter_dataset(ReadOptions({GRAIN_THREADS} threads, "
                     f"prefetch {GRAIN_PREFETCH}))"),
        Way("grain-mp", "Grain, the same + `mp_prefetch(num_workers={workers})`", _grain(True), ("grain",),
            python_only=True,
            measures="the same + mp_prefetch(MultiprocessingOptions(num_workers=W)): workers restart every pass"),
        Way("kerasfeed-threads", kf + ", threads", _kerasfeed("threads"),
            measures="kerasfeed.to_dataset / to_loader (seq, executor='threads')"),
        Way("kerasfeed-processes", kf + ", processes (workers={workers})", _kerasfeed("processes"),
            measures="kerasfeed.to_dataset / to_loader (seq, executor='processes', workers=W)"),
        Way("kerasfeed-auto", kf + ", auto", _kerasfeed("auto"),
            measures="kerasfeed.to_dataset / to_loader (seq, executor='auto'): kerasfeed picks (see its reason)"),
        Way("kerasfeed-cached", kf + ", processes (workers={workers}), cache='memory'",
            _kerasfeed("processes", cache="memory"),
            measures="kerasfeed.to_dataset / to_loader (seq, executor='processes', workers=W, cache='memory'): "
                     "epochs after the first read the store (fit times the best later epoch)"),
        Way("kerasfeed-cached-threads", kf + ", threads, cache='memory'", _kerasfeed("threads", cache="memory"),
            measures="kerasfeed.to_dataset / to_loader (seq, executor='threads', cache='memory')"),
        Way("kerasfeed-no-prefetch", "kerasfeed `to_loader`, processes (workers={workers}), device_prefetch=0",
            _kerasfeed("processes", device_prefetch=0), modes=("loop", "adapter", "fit"),
            unsupported=lambda ctx: "n/a (to_loader only)" if ctx.tf_front else None,
            measures="to_loader(seq, executor='processes', workers=W, device_prefetch=0): Keras places each "
                     "batch in the training thread (the default places 2 ahead on an accelerator)"),
        Way("kerasfeed-tfdata", "kerasfeed `to_dataset` (auto) `.as_numpy_iterator()`", _kerasfeed_tfdata,
            ("tensorflow",), modes=("loop",), measures="to_dataset(seq, executor='auto').as_numpy_iterator()"),
        Way("raw-h5py", "raw sequential h5py read (the limit)", _raw_h5, ("h5py",), python_only=True,
            modes=("graph", "loop"), measures="h5py.File opened once; each dataset's [a:b] in a loop, no class"),
    ]


REGISTRY: Dict[str, Way] = {w.name: w for w in _registry()}


def select(names: List[str], only: Optional[List[str]] = None, always: Tuple[str, ...] = ()) -> List[Way]:
    """The ways ``names`` (in that order), narrowed to ``only`` plus ``always``; unknown names are refused."""
    for name in list(names) + list(only or ()):
        if name not in REGISTRY:
            raise ValueError(f"Unknown way {name!r}; expected some of {sorted(REGISTRY)}. Received: {name!r}")
    return [REGISTRY[n] for n in names if not only or n in only or n in always]
