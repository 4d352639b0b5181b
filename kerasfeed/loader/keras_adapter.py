"""The Keras side of ``to_loader``: a data adapter that ``fit`` takes as is.

Keras >= 3.7 passes an instance of ``keras.src.trainers.data_adapters.
data_adapter.DataAdapter`` given to ``fit``/``evaluate``/``predict`` straight
through to its epoch iterator, which then drains ``get_jax_iterator()``
(JAX), ``get_torch_dataloader()`` (PyTorch), ``get_numpy_iterator()``
(NumPy) or ``get_tf_dataset()`` (TensorFlow) once per epoch. That class is
private Keras API: the version is checked here, and the test suite runs
``fit`` through it on every backend.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from typing import Any

from kerasfeed._backend_errors import keras_backend_error
from kerasfeed._keras_epoch_iterator import epoch_iterator_arguments
from kerasfeed._keras_fit import refuse, remember_fit
from kerasfeed._leaves import short_repr
from kerasfeed.loader.loader import Loader
from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged

# The first Keras release whose get_data_adapter returns DataAdapter instances unchanged.
MIN_KERAS = (3, 7)


def check_keras_version(version: str) -> None:
    """Raises RuntimeError when Keras ``version`` cannot take a data adapter."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or tuple(int(g) for g in match.groups()) < MIN_KERAS:
        need = ".".join(map(str, MIN_KERAS))
        raise RuntimeError(
            f"kerasfeed.to_loader needs Keras >= {need}: older Keras does not accept a data adapter in "
            f"`model.fit` (pip install -U keras), or use kerasfeed.to_dataset with TensorFlow. "
            f"Received: keras {version}"
        )


@functools.lru_cache(maxsize=None)
def loader_class() -> type:
    """``Loader`` with Keras' ``DataAdapter`` as a second base (made once)."""
    try:
        import keras
    except ModuleNotFoundError as e:  # Keras on its default backend, TensorFlow, without TensorFlow
        backend_error = keras_backend_error(e, "kerasfeed.to_loader")
        if backend_error is None:
            raise
        raise backend_error from e

    check_keras_version(keras.version())
    try:
        from keras.src.trainers.data_adapters.data_adapter import DataAdapter
    except ImportError as e:  # private Keras structure (NOTE [ Keras' private structure ], _keras_fit.py)
        raise refuse("it has no keras.src.trainers.data_adapters.data_adapter.DataAdapter, the class fit takes as "
                     "is", "kerasfeed.to_loader cannot be a Keras data adapter: use kerasfeed.to_dataset.") from e

    # Loader comes first: its methods implement the adapter's.
    body = {
        "__module__": Loader.__module__,
        "__doc__": Loader.__doc__,
        "get_tf_dataset": get_tf_dataset,
        "num_batches": property(_num_batches, doc=Loader.num_batches.__doc__),
    }
    return type("Loader", (Loader, DataAdapter), body)


# NOTE [ fit arguments a data adapter never sees ]
# Keras hands a DataAdapter given as `x` to its epoch iterator as it is, so `y`, `sample_weight`
# and `class_weight` passed beside a loader reach no code and would be ignored in silence (Keras
# refuses `y`/`sample_weight` beside a PyDataset, and applies `class_weight` to it). The epoch
# iterator reads `num_batches` right after choosing the adapter, in its `__init__`, whose
# arguments are those of the fit/evaluate/predict call: that read checks them. Private Keras
# structure, read (and checked) by `_keras_epoch_iterator.epoch_iterator_arguments`: the backend
# tests call fit with each argument under every backend.
_DROPPED = {
    "y": "the targets are the second element of each item (x, y)",
    "sample_weight": "return (x, y, sample_weight) items from the source",
    "class_weight": "return (x, y, sample_weight) items with each sample's class weight, or draw the classes "
    "evenly with order=kerasfeed.BalancedOrder(labels)",
}


def _num_batches(loader: Any) -> int:
    if refuse_arguments_keras_drops(sys._getframe(1)):
        # A Keras call begins (its epoch iterator is made): a pass an earlier call left after a batch or two (a
        # fit stopped early) is not its model build's, which its reset would hand over to its loop.
        loader._passes.release()
    remember_fit()  # read on the fit's own thread (NOTE [ Another thread's frames ])
    return Loader.num_batches.fget(loader)


def refuse_arguments_keras_drops(frame: Any) -> bool:
    """Raises ValueError when ``frame`` is Keras' epoch iterator being made
    with ``y``, ``sample_weight`` or ``class_weight`` for a loader (see NOTE above); returns whether it is
    that iterator being made (a Keras call beginning)."""
    given = epoch_iterator_arguments(frame)
    for name, value in (given or {}).items():
        if value is not None:
            raise ValueError(
                f"kerasfeed: Keras does not pass `{name}` on to a data adapter such as a kerasfeed.to_loader "
                f"loader, so it would be ignored; {_DROPPED[name]}. Received: {name}={_short(value)}"
            )
    return given is not None


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return short_repr(value) if shape is None else f"<{type(value).__name__} of shape {tuple(shape)}>"


def get_tf_dataset(loader: Any) -> Any:
    """The adapter's ``get_tf_dataset``: ``tf_dataset(loader)``, made once per loader."""
    if loader._tf_dataset is None:
        loader._tf_dataset = tf_dataset(loader)
        # Its passes are the ones Keras reads: after a resumed first pass, num_batches is a whole pass.
        loader._tf_pipeline = find_tagged(loader._tf_dataset, PIPELINE_ATTR)
        # Its pipeline reads the passes Keras asks for, the loader's own those iterated by hand: both count in the
        # loader's collector (stats(loader), InputStats(dataset=loader)), and so does the shared executor. With
        # the dataset's own, the loader's counts before a fit were lost and its passes after it not counted.
        own = loader._pipeline.stats
        if own is not None and loader._tf_pipeline is not None:
            loader._tf_pipeline.stats = own
            loader.executor.attach_stats(own)
    return loader._tf_dataset


def tf_dataset(loader: Any) -> Any:
    """What the TensorFlow backend drains: ``to_dataset`` with the loader's arguments on its
    executor (same batches, same order; the dataset counts its passes from ``initial_state``)."""
    from kerasfeed.tfdata.adapter import to_dataset  # TensorFlow: only on that backend

    options, feed = loader._options, loader._feed
    order, seed = feed.shards.order, options.seed
    if order is None and seed is None:
        seed = feed.passes.order.seed  # the seed IndexOrder drew: the same permutations
    with warnings.catch_warnings():
        # The loader's own executor (or the user's, warned about when the loader was made): its item seed
        # is the loader's, whatever seed orders these passes.
        warnings.filterwarnings("ignore", message=r"seed=\d+ orders the items", category=UserWarning)
        return to_dataset(
            feed.source,
            batch_size=options.batch_size,
            shuffle=options.shuffle,
            seed=seed,
            executor=loader.executor,
            drop_remainder=options.drop_remainder,
            padding_values=options.padding_values,
            probe=options.probe,
            num_shards=feed.shards.num_shards,
            shard_index=feed.shards.shard_index,
            # None stays None: the dataset's passes then follow fit's epochs as the loader's do.
            initial_state=None if options.initial_state is None else options.resume.to_dict(),
            order=order,
            max_skipped=options.max_skipped,  # retries and worker limits: the loader's executor has them
        )


__all__ = [
    "MIN_KERAS",
    "check_keras_version",
    "get_tf_dataset",
    "loader_class",
    "refuse_arguments_keras_drops",
    "tf_dataset",
]
