"""``unbatch_rows``: ``ds.unbatch()`` that survives elements holding no values.

NOTE [ Unbatching empty elements ]
==================================

Items and chunks travel as groups (one tensor of many items per leaf) and
tf.data splits them in C++ with ``unbatch()``. In TensorFlow 2.21 that split
crashes the process (SIGSEGV, no exception) when a dense numeric leaf's
element holds no values: an item of shape ``(0, 3)`` (a scene without
points, a batch that filtering emptied) or ``(4, 0)``. Ragged and string
leaves are split by other code and do not crash. ``from_tensor_slices`` over
each group yields the same rows without the crash, at ~15 us more per group
(measured on 2 cores, 64-item groups of small arrays: 330k -> 220k items/s at
most, far above what a Python source makes), so it is used only where such
an element can occur: a dense numeric leaf whose element shape is not fully
known or has a zero. Of the 2-core benchmarks only ``io`` (batches of varying
size) takes it (2026-11-23, alternating runs): drained, threads 5.7-6.1k
batches/s against 5.1-6.1k before, processes 356-358 against 359-362, with
~0.35 ms more main-process CPU per batch on processes (workers bound, idle
CPU); ``fit``: processes 348/354 steps/s against 355/346.
"""

from __future__ import annotations

import tensorflow as tf

from kerasfeed.tfdata.functions import flat_map


def may_hold_no_values(spec: tf.TypeSpec) -> bool:
    """Whether an element of this group leaf (rows along axis 0) can have zero values."""
    if not isinstance(spec, tf.TensorSpec) or spec.dtype == tf.string:
        return False
    element = spec.shape[1:] if spec.shape.rank else spec.shape
    return not element.is_fully_defined() or element.num_elements() == 0


def unbatch_rows(ds: tf.data.Dataset) -> tf.data.Dataset:
    """``ds.unbatch()``, or the same rows through ``from_tensor_slices`` where a
    leaf's element may hold no values (see NOTE above)."""
    if not any(may_hold_no_values(s) for s in tf.nest.flatten(ds.element_spec)):
        return ds.unbatch()

    # flat_map passes a tuple element's parts as arguments, a bare tensor as one: a 1-tuple stays one.
    keep_tuple = isinstance(ds.element_spec, tuple)

    def rows(*group):
        return tf.data.Dataset.from_tensor_slices(group if keep_tuple else group[0])

    return flat_map(ds, rows)


__all__ = ["may_hold_no_values", "unbatch_rows"]
