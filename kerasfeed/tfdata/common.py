"""Pieces shared by every tf.data assembly: argument checks, batching, the tail."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from kerasfeed import _validation as _v

AUTOTUNE = tf.data.AUTOTUNE


def check_positive_int(name: str, value: Any, allow_none: bool = True, allow_autotune: bool = False) -> None:
    _v.positive_int(name, value, allow_none=allow_none, allow_autotune=allow_autotune)


def check_flag(name: str, value: Any) -> None:
    _v.flag(name, value)


def check_prefetch_and_device(prefetch: Any, device: Any) -> None:
    _v.prefetch(prefetch)
    _v.device(device)


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


def prefetch_tail(
    ds: tf.data.Dataset, prefetch: Optional[int], device: Optional[str], *, autotune: bool = False
) -> tf.data.Dataset:
    """Prefetches, then (always last: docs/field_notes.md, *Prefetch to device*) prefetches onto ``device``.

    Unless ``autotune``, it also turns tf.data's autotuning model off. Its
    optimization thread takes CPU that worker processes need on a small
    machine, and deleting an iterator waits for it: measured 70-300 ms at the
    end of one epoch in four on 2 cores, in every tf.data pipeline. The
    parallelism here is fixed anyway, and an AUTOTUNE prefetch buffer still
    adapts (tf.data's legacy prefetch autotuner does not need the model).
    """
    if not autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    if prefetch:
        ds = ds.prefetch(prefetch)
    if device is not None:
        ds = ds.apply(tf.data.experimental.prefetch_to_device(device))
    return ds


def inline_map(ds: tf.data.Dataset, fn: Any) -> tf.data.Dataset:
    """A sequential ``ds.map(fn)`` whose function runs on the calling thread.

    A plain sequential map hands each call's ops to TensorFlow's inter-op
    pool: one more thread wake-up per element, whose spinning workers take
    CPU that worker processes need on a small machine (measured on 2 cores:
    ~100 us less main-process CPU per element inline, with the same
    elements). Only the private ``_MapDataset`` exposes the switch; if a
    TensorFlow version lacks it, this is ``ds.map(fn)``.
    """
    try:
        from tensorflow.python.data.ops import map_op

        return map_op._MapDataset(ds, fn, use_inter_op_parallelism=False, preserve_cardinality=True)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other TensorFlow versions
        return ds.map(fn)
