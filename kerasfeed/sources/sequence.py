"""``SceneSequence``: one indexable class for ``model.fit`` and ``to_dataset``."""

from __future__ import annotations

import functools
import operator
import os
import sys
import types
from typing import Any

from kerasfeed import _validation as _v
from kerasfeed._keras_epoch_iterator import beginning_epoch_iterator, called_by_epoch_iterator_reset
from kerasfeed._keras_fit import find_fit, remember_fit, report
from kerasfeed._keras_iterators_at_exit import watch_keras_epoch_iterator
from kerasfeed.sources import item_random, stage

if os.environ.get("KERASFEED_LIGHT_WORKER") == "1":
    # Inside a kerasfeed worker process: avoid importing Keras (and with it
    # TensorFlow, ~2 s and ~500 MB per process) just to unpickle a subclass.
    from kerasfeed.sources._light_pydataset import PyDataset as _PyDataset
else:
    from keras.utils import PyDataset as _PyDataset


def _as_item(fn):
    """``fn``, a ``__getitem__``, marked as an item where nothing else marked one: Keras' own ``fit(seq)``
    (its threads or processes) or ``seq[i]``. Item ``index`` of the pass ``epoch``, seeded by ``item_seed``,
    so that ``kerasfeed.item_rng()`` draws there what ``to_loader(seq, seed=item_seed)`` draws (NOTE [ Random
    augmentation is a function of (seed, pass, index) ]). Under kerasfeed the executor marked it already."""

    @functools.wraps(fn)
    def __getitem__(self, index):
        if item_random.making_item():
            return fn(self, index)
        try:
            i = operator.index(index)
        except TypeError:  # a slice, a key: not one item
            return fn(self, index)
        if i < 0:
            return fn(self, index)  # seq[-1]: no item of its own (item_rng() says so)
        if not getattr(self, "_kf_in_epoch", False):
            _follow_fit(self)
        previous = item_random.enter(_ItemSeed(self), getattr(self, "_kf_epoch", 0), i)
        try:
            return fn(self, index)
        finally:
            item_random.leave(previous)

    __getitem__._kf_item = True
    return __getitem__


def _follow_fit(seq) -> None:
    """An item Keras makes before its pass began: Keras' data adapter starts its workers before it calls
    ``on_epoch_begin``, so in the first epoch of a resumed ``fit`` (``initial_epoch``, ``BackupAndRestore``)
    they read the pass before it (0), silently: a forked pool for the whole epoch (helper's review: 5 of 8
    runs), threads until ``on_epoch_begin``. The fit's own ``epoch`` is already set: read it from its frame,
    on this thread's stack (a pool forked from the fit's thread) or kept where Keras read ``workers`` on the
    fit's thread (threads). The other threads are not walked: no such fit, no cost beyond this stack."""
    fit = find_fit(lambda x: x is seq, others=False)
    if fit is not None and not fit.missing:
        _take_epoch(seq, fit)


def _take_epoch(seq, fit) -> None:
    """The pass is the fit's epoch, where the fit's epochs are passes of ``seq`` (epochs of another length
    read passes across them: counted as before)."""
    if fit.epoch is None:
        return
    if fit.steps_per_epoch is None or fit.steps_per_epoch == getattr(seq, "num_batches", None):
        seq._kf_epoch = fit.epoch


class _ItemSeed:
    """The seeds of a ``SceneSequence``'s items made outside kerasfeed: its ``item_seed``, checked when
    ``item_rng()`` first needs it (an attribute of that name the class uses for itself breaks nothing else)."""

    __slots__ = ("seq",)
    given = True

    def __init__(self, seq):
        self.seq = seq

    def generator(self, epoch: int, index: int):
        return item_random.ItemSeeds(_item_seed(self.seq)).generator(epoch, index)


def _item_seed(seq) -> int:
    seed = getattr(seq, "item_seed", 0)
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < 2**64:  # to_loader's seed= takes the same
        raise TypeError(f"{type(seq).__name__}.item_seed must be an int in [0, 2**64) (the seed of "
                        f"kerasfeed.item_rng() in items made outside kerasfeed). Received: item_seed={seed!r}")
    return value


class SceneSequence(_PyDataset):
    """An indexable batch source that trains through Keras and ``tf.data``.

    Subclass it, call ``super().__init__(**kwargs)``, and implement
    ``__len__`` (number of batches) and ``__getitem__(i)`` (batch ``i``: an
    ndarray, a tuple ``(x, y)`` / ``(x, y, sample_weight)``, or dicts/nests of
    arrays). The same object then works with:

    - ``model.fit(seq)``: Keras' own machinery; ``workers``,
      ``use_multiprocessing`` and ``max_queue_size`` pass through to
      ``keras.utils.PyDataset``.
    - ``kerasfeed.to_dataset(seq)``: a real ``tf.data.Dataset`` with parallel
      loading, batching and prefetching.

    Instead of ``__getitem__`` a subclass may define ``load(i)`` (the costly,
    deterministic part: reading and decoding) and optionally
    ``augment(item)`` (what runs every pass: random crops, noise, drawing from
    ``kerasfeed.item_rng()``); ``__getitem__(i)`` is then
    ``augment(load(i))``. With ``cache=`` (``to_dataset``, ``to_loader``)
    only ``load`` is stored: ``docs/cache.md``. Inside ``load`` under
    ``cache=``, ``epoch`` and ``item_rng()`` raise (their values would be
    stored and repeat every pass); attributes that change between passes but
    that ``load`` does not read are named in a class attribute
    ``cache_ignores = ("name", ...)``. Where Keras calls ``__getitem__``
    itself (``model.fit(seq)``, on its threads or processes) or you call
    ``seq[i]``, ``item_rng()`` draws as ``to_loader(seq, seed=item_seed)``
    does, for the pass ``epoch``: ``item_seed`` is 0 unless set.

    Args:
        workers: Keras' thread or process count for ``model.fit(seq)``.
        use_multiprocessing: whether Keras uses processes for ``fit(seq)``.
        max_queue_size: Keras' queue length for ``fit(seq)``.

    The current pass number is available as ``self.epoch`` (from 0):
    ``to_dataset`` sets it through ``set_epoch`` in every process that runs
    items, and under ``model.fit(seq)`` it advances in ``on_epoch_end``, so
    both paths number epochs alike (also when an override of
    ``on_epoch_begin``/``on_epoch_end`` does not call ``super()``, and under
    JAX and PyTorch, where Keras reads one batch to build the model and ends
    that "epoch" before the first: it is not a pass).

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Squares(kerasfeed.SceneSequence):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            x = np.full((8, 3), i, dtype="float32")
            return x, x.sum(axis=1) ** 2

    ds = kerasfeed.to_dataset(Squares())
    x, y = next(iter(ds))
    ```
    """

    def __init__(self, workers: int = 1, use_multiprocessing: bool = False, max_queue_size: int = 10):
        # Checked here: Keras reads them only in model.fit(seq), and fails there bare (workers="2") or hangs
        # (max_queue_size="a").
        owner = type(self).__name__
        workers = _v.non_negative_int("workers", workers, owner=owner)
        max_queue_size = _v.positive_int("max_queue_size", max_queue_size, owner=owner)
        super().__init__(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self._kf_epoch = 0

    @property
    def epoch(self) -> int:
        """The pass (epoch) currently being read, starting at 0."""
        refused = stage.refusal(f"{type(self).__name__}.epoch")  # NOTE [ What a cached stage may not read ]
        if refused is not None:
            raise refused
        return getattr(self, "_kf_epoch", 0)

    # The seed of ``kerasfeed.item_rng()`` in items made outside kerasfeed (Keras' own ``fit(seq)``, ``seq[i]``).
    item_seed: int = 0

    @property
    def workers(self) -> int:
        """Keras' thread or process count for ``model.fit(seq)``."""
        remember_fit()  # Keras reads it on the fit's thread as it makes its data adapter (``_follow_fit``)
        return self._workers

    @workers.setter
    def workers(self, value: int) -> None:
        self._workers = value

    def __getitem__(self, index: int) -> Any:
        """Batch ``index``: ``augment(load(index))`` when the class defines
        ``load`` (``augment`` optional); otherwise a subclass implements it."""
        load = getattr(self, "load", None)
        if load is None:
            raise NotImplementedError(f"{type(self).__name__} must implement `__getitem__` (or `load`)")
        augment = getattr(self, "augment", None)
        return load(index) if augment is None else augment(load(index))

    __getitem__ = _as_item(__getitem__)

    def set_epoch(self, epoch: int) -> None:
        """Sets the pass number (an int >= 0); called by kerasfeed before items of a pass."""
        self._kf_epoch = _v.non_negative_int("epoch", epoch, owner="SceneSequence.set_epoch")

    def on_epoch_begin(self) -> None:
        """Called at the start of every pass (by Keras and ``to_dataset``)."""
        _begin_pass(self)

    def on_epoch_end(self) -> None:
        """Called at the end of every pass; ``epoch`` then advances."""
        _end_pass(self)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Keep the epoch bookkeeping even when an override skips super().
        for name, book in (("on_epoch_begin", _begin_pass), ("on_epoch_end", _end_pass)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_kf_keeps_epoch", False):
                setattr(cls, name, _with_bookkeeping(fn, book, before=name == "on_epoch_begin"))
        # The class's own, or a mixin's before SceneSequence in the MRO (``class C(Mixin, SceneSequence)``).
        getitem = next((k.__dict__["__getitem__"] for k in cls.__mro__ if "__getitem__" in k.__dict__), None)
        if isinstance(getitem, types.FunctionType) and not getattr(getitem, "_kf_item", False):
            cls.__getitem__ = _as_item(getitem)


def _begin_pass(seq) -> None:
    seq._kf_in_epoch = True
    _retired_at_exit(sys._getframe(1))
    # Under model.fit(seq) the pass is the fit's epoch, from any initial_epoch (given or restored:
    # NOTE [ The pass follows Keras' epoch ]); outside it (and under to_dataset/to_loader) nothing changes.
    fit = find_fit(lambda x: x is seq)
    if fit is not None and fit.missing:
        fit.unreadable()  # counted as outside fit; a fit from a later epoch is refused
        return
    if fit is not None:
        _take_epoch(seq, fit)


def _retired_at_exit(frame) -> None:
    # Keras' own fit(seq) under TensorFlow: its tf.data iterator is retired at exit, or a Ctrl-C could hang the
    # exit (NOTE [ Keras' own iterators at exit ], _keras_iterators_at_exit.py). Outside Keras' epoch iterator
    # (to_dataset, to_loader, a direct call): nothing.
    epoch_iterator = beginning_epoch_iterator(frame)
    if epoch_iterator is not None:
        watch_keras_epoch_iterator(epoch_iterator)


def _end_pass(seq) -> None:
    # Only a call that ends a begun pass counts, and not the one from EpochIterator.reset (a few frames
    # up, through PyDatasetAdapter.on_epoch_end and overrides) before a fit's first epoch: under JAX and
    # PyTorch (and TensorFlow with a distribution strategy) it ends the one batch Keras read to build the
    # model, and counted, the first epoch would read pass 1 (to_loader and to_dataset read 0). An end of
    # epoch proper comes from the iterator's generator.
    if getattr(seq, "_kf_in_epoch", False):
        seq._kf_in_epoch = False
        if not called_by_epoch_iterator_reset(sys._getframe(1)):
            seq._kf_epoch = seq.epoch + 1
    elif not called_by_epoch_iterator_reset(sys._getframe(1)):
        _end_not_begun(seq)


def _end_not_begun(seq) -> None:
    # A Keras whose data adapter ends a fit's epochs without beginning them (no ``on_epoch_begin``): every
    # epoch read pass 0, silently. The fit's frame says which epoch ended.
    fit = find_fit(lambda x: x is seq)
    if fit is None or fit.missing or fit.epoch is None:
        return
    report("its data adapter ended an epoch of a PyDataset it did not begin (`on_epoch_end` without "
           "`on_epoch_begin`)", "A kerasfeed.SceneSequence given to fit takes its pass from the epoch that ended; "
           "an epoch that begins the fit (epoch 0, or a later initial_epoch) reads pass 0.")
    seq._kf_epoch = fit.epoch + 1


def _with_bookkeeping(fn, book, before: bool):
    @functools.wraps(fn)
    def hook(self, *args, **kwargs):
        if before:
            book(self)
        result = fn(self, *args, **kwargs)
        if not before:
            book(self)  # a no-op if the override already called super()
        return result

    hook._kf_keeps_epoch = True
    return hook
