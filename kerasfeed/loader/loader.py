"""``to_loader``: any indexable source as numpy batches, for every Keras 3 backend.

The same pass pipeline as ``to_dataset`` (``PassPipeline``: pass numbering,
seeded orders, epoch hooks, resume, the executor making items ahead), drained
from plain Python instead of a ``tf.data`` graph, so it needs no TensorFlow.
Batching happens in numpy. The returned object is also a Keras data adapter
(``keras_adapter.py``), which ``model.fit``/``evaluate``/``predict`` accept
as is on the JAX, PyTorch and TensorFlow backends.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from kerasfeed import _validation as _v
from kerasfeed.execution.base import Executor
from kerasfeed.execution.factory import make_executor
from kerasfeed.execution.processes.options import PoolOptions
from kerasfeed.loader.batches import BatchReader
from kerasfeed.loader.collate import Signature
from kerasfeed.loader.convert import TorchBatches, map_arrays
from kerasfeed.loader.passes import Pass, PassIterator
from kerasfeed.loading.arguments import resolve_passes, resume_state
from kerasfeed.loading.pipeline import PassPipeline, probe_indices
from kerasfeed.sources.base import source_length


class Loader:
    """Numpy batches from an indexable source; a Keras data adapter too.

    Made by ``kerasfeed.to_loader`` (see there for the arguments). Every
    ``iter(loader)`` reads one pass: pass ``e`` uses the order of
    ``(seed, e)``, the source's ``set_epoch``/``on_epoch_begin``/
    ``on_epoch_end`` run once per pass, and passes are numbered from
    ``initial_state["epoch"]``. An iterator starts its pass on its first
    ``next``, so iterators made and never read (Keras makes one at the end of
    every epoch) start nothing.

    Keras builds an unbuilt model under JAX and PyTorch from one batch of a
    throwaway iterator, then resets its epoch iterator. When Keras resets it
    while the newest iterator has read exactly one batch, the next iterator
    takes over that pass and yields that batch again first: epoch ``k`` of
    ``fit`` reads pass ``k`` on every backend.

    Attributes:
        executor: the executor running ``source[i]``.
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: Optional[int],
        shuffle: bool,
        seed: Optional[int],
        executor: Union[str, Executor],
        workers: Optional[int],
        worker_init: Optional[Callable[[], None]],
        drop_remainder: bool,
        padding_values: Any,
        probe: int,
        num_shards: int,
        shard_index: int,
        initial_state: Optional[Mapping[str, int]],
        order: Any = None,
        copy: bool = False,
    ):
        total = source_length(source)
        # Built (and checked) once here, used whole by every process executor.
        pool_options = PoolOptions(workers=workers, worker_init=worker_init, seed=seed)
        batch_size = _v.positive_int("batch_size", batch_size, allow_none=True, owner="to_loader")
        probe = _v.positive_int("probe", probe, owner="to_loader")
        shuffle = _v.flag("shuffle", shuffle, owner="to_loader")
        copy = _v.flag("copy", copy, owner="to_loader")
        drop_remainder = _v.flag("drop_remainder", drop_remainder, owner="to_loader")
        if drop_remainder and batch_size is None:
            raise ValueError(
                "to_loader: `drop_remainder=True` needs `batch_size`; items are already batches when "
                "batch_size=None. Received: drop_remainder=True, batch_size=None"
            )
        order_args = dict(order=order, shuffle=shuffle, seed=seed, num_shards=num_shards, shard_index=shard_index)
        passes = resolve_passes(
            total, **order_args, batch_size=batch_size, drop_remainder=drop_remainder,
            resume=resume_state(initial_state), owner="to_loader",
        )
        order, resume = passes.order, passes.resume
        self._per_pass = passes.per_pass
        self._source = source
        self._order = order
        self._order_args = order_args  # as given: to_dataset gets the same (TensorFlow backend)
        self._owns_executor = not isinstance(executor, Executor)
        self.executor = make_executor(executor, source, pool_options, handover="numpy")
        try:
            probes = [(i, self.executor.load(i, 0)) for i in probe_indices(total, probe)]
            self._signature = Signature.infer(probes)
            self._padding = self._signature.padding(padding_values)
        except BaseException:
            self.close()
            raise
        del probes
        self._batch_size = batch_size
        self._drop_remainder = drop_remainder
        self._padding_values = padding_values
        self._probe = probe
        self._resume = resume
        self._first_length = passes.first_pass
        self._pipeline = PassPipeline(source, order, self.executor, self._signature, resume.epoch, passes.skip)
        self._reader = BatchReader(self._pipeline.load, self._signature, batch_size, self._padding, copy)
        if self._pipeline.stats is not None:  # kerasfeed.stats(loader)
            self._pipeline.stats.kind, self._pipeline.stats.items_per_batch = "to_loader", batch_size or 1
        # What kerasfeed.stats(loader) / kerasfeed.executor_of(loader) look up.
        self._kerasfeed_pipeline, self._kerasfeed_executor = self._pipeline, self.executor
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._newest = 0  # id of the newest iterator
        self._open: Optional[Pass] = None  # the pass begun last
        self._peek: Optional[Pass] = None  # a pass the next iterator takes over
        self._begun = False
        self._tf_dataset = None

    # -- iteration -----------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """One pass of numpy batches (nests of ``np.ndarray``)."""
        with self._lock:
            ident = next(self._ids)
            self._newest = ident
            adopted, self._peek = self._peek, None
            if adopted is not None:
                adopted.reader = ident
        return PassIterator(self, ident, adopted)

    def __len__(self) -> int:
        """Batches in a whole pass (a resumed first pass has fewer: ``num_batches``)."""
        return self._per_pass

    def _begin(self, reader: int) -> Pass:
        with self._lock:
            if self._open is not None and self._open is not self._peek:
                self._open.first = None  # no longer replayable: release it
            indices, epoch = self._pipeline.begin()
            batches = self._first_length if not self._begun else self._per_pass
            self._begun = True
            p = self._open = Pass(int(epoch), indices, batches, reader)
            return p

    def _continue(self, p: Pass) -> None:
        # The reader went on with its own iterator (Keras with steps_per_epoch):
        # the pass is no longer one to take over.
        if self._peek is p:
            with self._lock:
                if self._peek is p:
                    self._peek = None

    def _read(self, p: Pass) -> Any:
        return self._reader.read(p)

    def _replayable(self) -> Optional[Pass]:
        p = self._open
        if p is not None and p.position == 1 and p.first is not None and p.reader == self._newest:
            return p
        return None

    # -- conversions ---------------------------------------------------------

    def numpy(self) -> Iterator[Any]:
        """One pass of numpy batches (the same as ``iter(loader)``)."""
        return iter(self)

    def torch(self) -> TorchBatches:
        """An iterable of torch tensors, one pass per ``iter()`` (shares memory
        with the numpy batches: ``torch.from_numpy``)."""
        return TorchBatches(self)

    def jax(self, device: Any = None) -> Iterator[Any]:
        """One pass of batches as JAX arrays on ``device`` (default device if None)."""
        import jax

        for batch in self:
            yield map_arrays(lambda a: jax.device_put(a, device) if a.dtype != object else a, batch)

    # -- Keras data adapter (keras.src.trainers.data_adapters.DataAdapter) ----

    def get_numpy_iterator(self) -> Iterator[Any]:
        return iter(self)

    def get_jax_iterator(self) -> Iterator[Any]:
        # Keras' JAX trainer moves numpy batches to the device itself.
        return iter(self)

    def get_torch_dataloader(self) -> TorchBatches:
        return TorchBatches(self)

    def get_tf_dataset(self) -> Any:
        from kerasfeed.loader.keras_adapter import tf_dataset

        if self._tf_dataset is None:
            self._tf_dataset = tf_dataset(self)
        return self._tf_dataset

    @property
    def num_batches(self) -> int:
        """Batches in the pass read next (Keras reads it when an epoch iterator starts or resets)."""
        with self._lock:
            p = self._peek or self._replayable()
            if p is not None:
                return p.batches
            return self._per_pass if self._begun else self._first_length

    @property
    def batch_size(self) -> Optional[int]:
        """Samples per batch, or None when items are already batches."""
        return self._batch_size

    @property
    def has_partial_batch(self) -> bool:
        return self.partial_batch_size is not None

    @property
    def partial_batch_size(self) -> Optional[int]:
        if self.batch_size is None or self._drop_remainder:
            return None
        return (self._order.shard_length % self.batch_size) or None

    def on_epoch_begin(self) -> None:
        """Keras' hook; a pass starts on its first batch instead."""

    def on_epoch_end(self) -> None:
        """Keras' hook. After a model build took one batch, the next iterator
        takes over that pass (the source's own hook runs when a pass ends)."""
        with self._lock:
            p = self._replayable()
            if p is not None:
                self._peek = p

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Stops the executor's threads or worker processes (if this loader made it)."""
        if self._owns_executor:
            self.executor.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<kerasfeed.Loader batches={self._per_pass} batch_size={self.batch_size} "
            f"executor={self.executor.name!r}>"
        )


def to_loader(
    source: Any,
    *,
    batch_size: Optional[int] = None,
    shuffle: bool = False,
    seed: Optional[int] = None,
    executor: Union[str, Executor] = "threads",
    workers: Optional[int] = None,
    worker_init: Optional[Callable[[], None]] = None,
    drop_remainder: bool = False,
    padding_values: Any = None,
    ragged: bool = False,
    probe: int = 3,
    num_shards: Optional[int] = None,
    shard_index: Optional[int] = None,
    initial_state: Optional[Mapping[str, int]] = None,
    order: Any = None,
    input_context: Any = None,
    copy: bool = False,
) -> Loader:
    """Turns an indexable source into numpy batches for any Keras 3 backend.

    The batches, their order and the pass numbering are those of
    ``to_dataset`` with the same arguments, without TensorFlow: ``source[i]``
    runs on the executor (threads or worker processes with shared memory),
    which makes each pass's items ahead; batching happens in numpy. Pass the
    result to ``model.fit``/``evaluate``/``predict`` on the JAX, PyTorch or
    TensorFlow backend (Keras >= 3.7), or iterate it in a custom loop.

    Args:
        source: an object with ``__len__`` and ``__getitem__``, such as a
            ``kerasfeed.SceneSequence`` or ``keras.utils.PyDataset``.
        batch_size: None when items are already batches (the Keras
            convention); an int to treat items as samples and stack them.
        shuffle: read items in a new seeded random order every pass.
        seed: seed of the shuffle (and base seed of worker processes).
        executor: ``"threads"``, ``"processes"``, ``"auto"`` or an
            ``Executor`` instance (not closed by the loader).
        workers: number of worker processes (process executors only).
        worker_init: called once in each worker process.
        drop_remainder: with ``batch_size``, drop the last short batch.
        padding_values: with ``batch_size``, what samples whose shapes vary
            are padded with: one scalar, or a nest shaped like the items;
            default 0 (``b""`` for strings).
        ragged: not supported: numpy has no ragged arrays (pad, or return
            whole batches with ``batch_size=None``).
        probe: leading items probed (and the last) to learn the structure,
            dtypes and which dimensions may vary.
        num_shards: split every pass into this many disjoint, equal shards
            (None: 1), as ``to_dataset`` splits them.
        shard_index: the shard this loader yields (None: 0).
        initial_state: ``{"epoch": e, "batches": b}`` (from
            ``TrainingProgress``): the first pass is pass ``e`` and starts
            after its first ``b`` batches; use ``fit(..., initial_epoch=e)``.
            A state saved with an order fingerprint is refused with another order.
        order: the index order of every pass instead of ``shuffle``/``seed``/
            ``num_shards``/``shard_index``: any object with ``shard_length``
            and ``indices(epoch)``, such as ``kerasfeed.BalancedOrder`` or
            ``kerasfeed.WeightedOrder`` (as in ``to_dataset``).
        input_context: a ``tf.distribute.InputContext``, or any object with
            ``num_input_pipelines`` and ``input_pipeline_id`` (TensorFlow is
            not needed): sets ``num_shards``/``shard_index`` to them, as in
            ``to_dataset``.
        copy: False (the default): batches are handed over without a copy
            where that is safe: with ``batch_size=None``, the arrays
            ``source[i]`` returned (threads) or views of the worker's shared
            memory, which stays lent to the batch until the batch and every
            view of it are gone (processes). True: every batch is made of
            fresh arrays that share nothing with the source or the workers
            (one copy per batch). See ``kerasfeed/loader/batches.py``.

    Returns:
        A ``kerasfeed.Loader``: ``iter(loader)`` reads one pass of numpy
        batches; ``loader.torch()`` / ``loader.jax()`` convert them. It is a
        ``keras`` data adapter, so ``model.fit(loader, epochs=n)`` works.

    Raises:
        TypeError, ValueError: a non-indexable or empty source, or bad
            arguments (``ragged=True`` included).
        RuntimeError: Keras older than 3.7 (it cannot take a data adapter).
        kerasfeed.ItemError: ``source[i]`` raised (while probing or
            iterating): index, type, message and traceback.
        kerasfeed.SignatureError: an item does not fit the probed structure.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Points(kerasfeed.SceneSequence):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full((4, 3), i, "float32"), np.int64(i % 2)

    loader = kerasfeed.to_loader(Points(), batch_size=4, shuffle=True, seed=0)
    for x, y in loader:
        print(x.shape, y.shape)  # (4, 4, 3) (4,) ... then (2, 4, 3) (2,)
    ```
    """
    if ragged is not False:
        _v.flag("ragged", ragged, owner="to_loader")
        raise ValueError(
            "to_loader batches in numpy, which has no ragged arrays: samples whose shapes vary are padded "
            "(`padding_values=`), or return whole batches from `source[i]` with batch_size=None "
            "(use to_dataset for tf.RaggedTensor batches). Received: ragged=True"
        )
    from kerasfeed.loader.keras_adapter import loader_class
    from kerasfeed.loading.shards import shards_from

    num_shards, shard_index = shards_from(num_shards, shard_index, input_context, owner="to_loader")
    return loader_class()(
        source,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        executor=executor,
        workers=workers,
        worker_init=worker_init,
        drop_remainder=drop_remainder,
        padding_values=padding_values,
        probe=probe,
        num_shards=1 if num_shards is None else num_shards,
        shard_index=0 if shard_index is None else shard_index,
        initial_state=initial_state,
        order=order,
        copy=copy,
    )


__all__ = ["Loader", "to_loader"]
