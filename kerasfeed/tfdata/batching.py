"""Batching samples in tf.data: dense, zero-padded when shapes vary, or ragged."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from kerasfeed._leaves import padding_leaves
from kerasfeed._nest import flatten


def batch(
    ds: tf.data.Dataset,
    batch_size: Optional[int],
    *,
    drop_remainder: bool,
    ragged: bool,
    variable: bool,
    padding_values: Any,
) -> tf.data.Dataset:
    """Batches samples: ragged on request, zero-padded when shapes vary."""
    if batch_size is None:
        return ds
    if ragged:
        return ds.ragged_batch(batch_size, drop_remainder=drop_remainder)
    if variable:
        padding = _padding(ds.element_spec, padding_values)
        return ds.padded_batch(batch_size, padding_values=padding, drop_remainder=drop_remainder)
    return ds.batch(batch_size, drop_remainder=drop_remainder)


def _padding(spec: Any, padding_values: Any) -> Any:
    """One constant per leaf in the leaf's dtype: ``padded_batch`` takes a
    scalar only of every leaf's exact dtype (-1 for float32 leaves failed)."""
    skeleton, leaves = flatten(spec)
    dtypes = [leaf.dtype.as_numpy_dtype for _, leaf in leaves]
    varying = [leaf.shape.rank is None or None in leaf.shape.as_list() for _, leaf in leaves]
    values = padding_leaves(padding_values, skeleton, dtypes, varying)
    constants = [tf.constant(v, dtype=leaf.dtype) for v, (_, leaf) in zip(values, leaves)]
    return tf.nest.pack_sequence_as(spec, constants)


__all__ = ["batch"]
