"""Batching samples in tf.data: dense, zero-padded when shapes vary, or ragged."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from kerasfeed._leaves import padding_leaves
from kerasfeed._nest import flatten
from kerasfeed.tfdata.functions import filter_by, inline_map, map_each


def batch(
    ds: tf.data.Dataset,
    batch_size: Optional[int],
    *,
    drop_remainder: bool,
    ragged: bool,
    variable: bool,
    padding_values: Any,
    marked: bool = False,
) -> tf.data.Dataset:
    """Batches samples: ragged on request, zero-padded when shapes vary.

    ``marked``: elements are ``(item, kept)`` (``max_skipped``); items left
    out are dropped from their batch after batching (``drop_left_out``)."""
    if batch_size is None:
        return drop_left_out(ds, batched=False) if marked else ds
    if ragged:
        out = ds.ragged_batch(batch_size, drop_remainder=drop_remainder)
    elif variable:
        spec = ds.element_spec
        padding = (_padding(spec[0], padding_values), tf.constant(False)) if marked else _padding(spec, padding_values)
        out = ds.padded_batch(batch_size, padding_values=padding, drop_remainder=drop_remainder)
    else:
        out = ds.batch(batch_size, drop_remainder=drop_remainder)
    return drop_left_out(out, batched=True) if marked else out


def drop_left_out(ds: tf.data.Dataset, *, batched: bool) -> tf.data.Dataset:
    """``(item, kept)`` elements without the items left out (``max_skipped``).

    NOTE [ A skipped item and its batch ] (``kerasfeed/loading/skips.py``):
    batches are made first, by position, so a batch keeps its positions and
    loses only its rows left out (a boolean mask per leaf); unbatched items
    left out are filtered (the pass is shorter)."""
    if not batched:
        return inline_map(filter_by(ds, lambda item, kept: kept), lambda item, kept: item)

    def mask(t: Any, kept: tf.Tensor) -> Any:
        return tf.ragged.boolean_mask(t, kept) if isinstance(t, tf.RaggedTensor) else tf.boolean_mask(t, kept)

    return map_each(ds, lambda item, kept: tf.nest.map_structure(lambda t: mask(t, kept), item))


def _padding(spec: Any, padding_values: Any) -> Any:
    """One constant per leaf in the leaf's dtype: ``padded_batch`` takes a
    scalar only of every leaf's exact dtype (-1 for float32 leaves failed)."""
    skeleton, leaves = flatten(spec)
    dtypes = [leaf.dtype.as_numpy_dtype for _, leaf in leaves]
    varying = [leaf.shape.rank is None or None in leaf.shape.as_list() for _, leaf in leaves]
    values = padding_leaves(padding_values, skeleton, dtypes, varying)
    constants = [tf.constant(v, dtype=leaf.dtype) for v, (_, leaf) in zip(values, leaves)]
    return tf.nest.pack_sequence_as(spec, constants)


__all__ = ["batch", "drop_left_out"]
