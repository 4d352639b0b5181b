"""A pass's indices as a tf.data stream, a window at a time.

``to_dataset`` never hands tf.data a whole pass: ``begin`` (a
``numpy_function``) starts the pass and says how many items it has; the
indices then come ``INDEX_WINDOW`` at a time from ``window`` calls, as
tf.data reaches them (``PassPipeline.begin_count`` and ``window``). A pass of
10^9 items costs a window of indices in memory, one Python call per window.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from kerasfeed.loading.pipeline import INDEX_WINDOW
from kerasfeed.tfdata.functions import flat_map, graph_fn


def pass_index_stream(begin_count: Callable, window: Callable) -> Callable:
    """A ``flat_map`` function: one pass as elements ``(index, epoch)``. ``begin_count() -> (items,
    epoch)`` (int64 both) starts the pass; ``window(epoch, start)`` gives its int64 indices at
    positions ``start`` to ``start + INDEX_WINDOW``."""

    def index_stream(_):
        count, epoch = tf.numpy_function(
            begin_count, [], (tf.int64, tf.int64), stateful=True, name="kerasfeed_begin_pass"
        )
        count, epoch = tf.ensure_shape(count, []), tf.ensure_shape(epoch, [])

        def one_window(start):
            idx = tf.numpy_function(window, [epoch, start], tf.int64, stateful=True, name="kerasfeed_pass_window")
            idx = tf.ensure_shape(idx, [None])
            n = tf.size(idx, out_type=tf.int64)
            return tf.data.Dataset.from_tensor_slices((idx, tf.fill([n], epoch)))

        starts = tf.data.Dataset.range(tf.constant(0, tf.int64), count, INDEX_WINDOW)
        return flat_map(starts, one_window)

    return graph_fn(index_stream)


__all__ = ["pass_index_stream"]
