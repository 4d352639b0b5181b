"""Batching samples in tf.data: dense, zero-padded when shapes vary, or ragged."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf


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
        return ds.padded_batch(batch_size, padding_values=padding_values, drop_remainder=drop_remainder)
    return ds.batch(batch_size, drop_remainder=drop_remainder)


__all__ = ["batch"]
