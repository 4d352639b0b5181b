"""``Loader``: any indexable source as numpy batches, for every Keras 3 backend.

The same pass pipeline as ``to_dataset`` (``PassPipeline``: pass numbering,
seeded orders, epoch hooks, resume, the executor making items ahead), drained
from plain Python instead of a ``tf.data`` graph, so it needs no TensorFlow.
Batching happens in numpy. The returned object is also a Keras data adapter
(``keras_adapter.py``), which ``model.fit``/``evaluate``/``predict`` accept
as is on the JAX, PyTorch and TensorFlow backends; ``to_loader`` (``api.py``)
makes it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Iterator, Optional

from kerasfeed._keras_epoch_iterator import called_by_epoch_iterator_reset
from kerasfeed.loader.batches import BatchReader
from kerasfeed.loader.collate import Signature
from kerasfeed.loader.convert import TorchBatches
from kerasfeed.loader.device import DeviceFeed
from kerasfeed.loader.options import LoaderOptions
from kerasfeed.loader.passes import Passes
from kerasfeed.loading import host_batches, hosts
from kerasfeed.loading.arguments import count_batches
from kerasfeed.loading.feed import Feed


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
    throwaway iterator, then resets its epoch iterator. If the newest iterator
    had read no more than such a build reads (one batch; two under JAX on an
    accelerator, where Keras reads one ahead; plus the device prefetch's),
    the next iterator takes over that pass and yields those batches again
    first: epoch ``k`` of ``fit`` reads pass ``k`` on every backend
    (``passes.py``).

    Args:
        feed: the front end's feed (``kerasfeed/loading/feed.py``): shards,
            passes and executor, from ``options``.
        options: ``to_loader``'s arguments, checked.

    Attributes:
        executor: the executor running ``source[i]``.

    Example:

    ```python
    loader = kerasfeed.to_loader(seq, batch_size=32, shuffle=True, seed=0)
    for x, y in loader:        # one pass; the next `for` reads the next pass
        ...
    loader.close()             # its threads or worker processes stop (also `with loader:`)
    ```
    """

    def __init__(self, feed: Feed, options: LoaderOptions):
        self._feed = feed
        self._options = options
        self._closed = False  # by close(): a next pass is refused before it starts (``_check_open``)
        self.executor = feed.executor
        with feed.closing_on_error():
            # A shard probes its own first items, as to_dataset's do: none of another process's.
            probes = feed.probe(feed.probe_indices())
            self._signature = Signature.infer(probes)
            # The probed batch sizes, for the per-device check (check_batches).
            self._leading = [s[0] if len(s) else None for s in self._signature.shapes]
            if options.batch_size is None:
                self._signature = self._signature.open_leading()
            self._padding = self._signature.padding(options.padding_values)
            del probes
            self._pipeline = feed.pipeline(self._signature)
        self._reader = BatchReader(
            self._pipeline.load, self._signature, options.batch_size, self._padding, options.copy
        )
        count = functools.partial(count_batches, batch_size=options.batch_size, drop_remainder=options.drop_remainder)
        self._passes = Passes(
            self._pipeline.begin, self._reader.read, feed.passes.per_pass, feed.passes.first_pass,
            feed.passes.items, count, self._pipeline.takes_over,
        )
        # What kerasfeed.stats(loader) / kerasfeed.executor_of(loader) look up.
        self._kerasfeed_pipeline, self._kerasfeed_executor = self._pipeline, self.executor
        self._tf_dataset = None  # made by get_tf_dataset (keras_adapter.py), once
        self._tf_pipeline = None  # that dataset's pipeline: under TensorFlow it reads the passes, not this one
        self._device = DeviceFeed(options.device_prefetch, self._passes, self._pipeline.stats,  # device.py
                                  getattr(self.executor, "waits", None))
        # What Keras was told by num_batches, and its epochs since (on_epoch_begin).
        self._keras_told: tuple[Optional[int], int] = (None, 0)

    def _join(self, processes: hosts.ProcessShards) -> dict:
        """Under several processes (``kerasfeed/loading/hosts.py``): checks the
        per-process batch, names the process in the stats, and returns what
        the processes must agree on."""
        self.check_batches(processes)
        if self._pipeline.stats is not None:
            self._pipeline.stats.process = processes.process_index
        options, feed = self._options, self._feed
        return hosts.pass_facts(feed.total, feed.passes, shuffle=options.shuffle, seed=options.seed,
                                num_shards=feed.shards.num_shards, batch_size=options.batch_size,
                                drop_remainder=options.drop_remainder)

    def check_batches(self, processes: Optional[hosts.ProcessShards]) -> None:
        """Refuses batches the distribution cannot split among this process's
        devices (``host_batches.check_local_batches``); None: nothing to check.
        Items that are whole batches are also checked one by one as they are
        read, their sizes may vary (``host_batches.item_batch_check``)."""
        if self.batch_size is None:
            self._reader.check_item = host_batches.item_batch_check(processes, "to_loader")
        if processes is None:
            return
        host_batches.check_local_batches(processes, batch_size=self.batch_size, partial=self.partial_batch_size,
                                  leading=self._leading, owner="to_loader")

    # -- iteration -----------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """One pass of numpy batches (nests of ``np.ndarray``)."""
        self._check_open()
        return self._passes.iterator()

    def __len__(self) -> int:
        """Batches in a whole pass (a resumed first pass has fewer: ``num_batches``)."""
        return self._passes.per_pass

    # -- conversions ---------------------------------------------------------

    def numpy(self) -> Iterator[Any]:
        """One pass of numpy batches (the same as ``iter(loader)``)."""
        return iter(self)

    def torch(self, device: Any = None) -> TorchBatches:
        """An iterable of torch tensors, one pass per ``iter()``, on ``device``
        (None: the current CUDA device if there is one, else the CPU). On the
        CPU they share memory with the numpy batches (``torch.from_numpy``);
        on a GPU they are copied from pinned memory ``device_prefetch``
        batches ahead (``kerasfeed/loader/device.py``)."""
        return self._device.torch(self, device)

    def jax(self, device: Any = None) -> Iterator[Any]:
        """One pass of batches as JAX arrays on ``device`` (default device if
        None), placed ``device_prefetch`` batches ahead."""
        return self._device.jax(device)

    # -- Keras data adapter (keras.src.trainers.data_adapters.DataAdapter) ----
    # (get_tf_dataset is the adapter class's own: keras_adapter.py)

    def get_numpy_iterator(self) -> Iterator[Any]:
        return iter(self)

    def get_jax_iterator(self) -> Iterator[Any]:
        # A distribution set after the loader was made (as in on_epoch_begin,
        # for a caller outside fit): refused before any batch, not at the one.
        self.check_batches(hosts.local_distribution())
        # Placed where Keras' JAX trainer puts them, device_prefetch ahead (device.py).
        return self._device.keras_jax()

    def get_torch_dataloader(self) -> TorchBatches:
        return self._device.torch(self, keras_backend=True)

    @property
    def num_batches(self) -> int:
        """Batches in the pass read next (Keras reads it when an epoch iterator starts or resets)."""
        tf_pipeline = self._tf_pipeline
        n = self._passes.next_batches if tf_pipeline is None else self._passes.next_batches_of(tf_pipeline.next_skip())
        self._keras_told = (n, 0)
        return n

    @property
    def batch_size(self) -> Optional[int]:
        """Samples per batch, or None when items are already batches."""
        return self._options.batch_size

    @property
    def has_partial_batch(self) -> bool:
        return self.partial_batch_size is not None

    @property
    def partial_batch_size(self) -> Optional[int]:
        if self.batch_size is None or self._options.drop_remainder:
            return None
        return (self._feed.passes.items % self.batch_size) or None

    def on_epoch_begin(self) -> None:
        """Keras' hook (a pass starts on its first batch instead).

        Keras reads ``num_batches`` once per ``fit`` call and keeps it for
        every epoch of the call: after a resumed (shorter) first pass the
        next epochs would read only that many batches of each whole pass, so
        the second epoch of such a call is refused (after the resumed one
        trained) instead of losing data silently. Batches that a Keras
        distribution set after the loader was made cannot split among the
        devices are refused here, before the epoch's first step purges the
        model's variables into the step's state (an error at the first batch
        would leave the model without them).

        Raises:
            ValueError: an epoch after a resumed one in the same Keras call;
                batches the active distribution cannot split.
        """
        self._check_open()
        self.check_batches(hosts.local_distribution())
        told, epochs = self._keras_told
        self._keras_told = (told, epochs + 1)
        if epochs and told is not None and told != self._passes.per_pass:
            state = self._options.resume
            raise ValueError(
                f"kerasfeed: this `fit` call began on a resumed pass (initial_state={state.to_dict()}) of {told} "
                f"batches, and Keras keeps that length for every epoch of one call: the next pass would be cut from "
                f"{self._passes.per_pass} batches to {told}. Finish the interrupted epoch in a `fit` call of its own "
                f"(initial_epoch={state.epoch}, epochs={state.epoch + 1}), then go on with a new loader made with "
                f"initial_state={{'epoch': {state.epoch + 1}, 'batches': 0}} (docs/resume.md). Received: "
                f"epoch {epochs + 1} of one Keras call on this loader, whose first epoch had {told} batches."
            )

    def on_epoch_end(self) -> None:
        """Keras' hook (the source's own hook runs when a pass ends). Called by Keras' epoch iterator's
        ``reset``, after a model build took one batch, the next iterator takes over that pass; called
        at an epoch's end, the pass is over, however few batches the call read (``steps=1``)."""
        if called_by_epoch_iterator_reset(sys._getframe(1)):
            self._passes.hand_over()
        else:
            self._passes.release()

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Stops the executor's threads or worker processes (if this loader made it: one given stays open for
        its other users); its next pass is refused either way."""
        self._closed = True
        self._passes.release()  # the open pass's kept batches: with cache=, views that hold the store mapped
        if self._feed.owns_executor:
            self.executor.close()

    def _check_open(self) -> None:
        # Before a pass, and in Keras' on_epoch_begin: before the JAX trainer's first step purges the model's
        # variables into its state, where an error at the first batch left the model without its weights.
        if self._closed:
            raise RuntimeError(
                "kerasfeed: this loader was closed (close(), or the end of its `with` block), so its next pass "
                f"is refused: make the loader again with to_loader(...). Received: {self!r}"
            )

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kerasfeed.Loader batches={len(self)} batch_size={self.batch_size} executor={self.executor.name!r}>"


__all__ = ["Loader"]
