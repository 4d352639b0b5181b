"""The tf.data side of passes read from the item store in the graph (NOTE [ A stored pass runs in the graph ],
``kerasfeed/loading/stored_passes.py``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import tensorflow as tf

from kerasfeed.loading.in_order import PassInOrder
from kerasfeed.loading.pipeline import PassPipeline, weak_method
from kerasfeed.loading.stored_passes import StoredPasses
from kerasfeed.tfdata.functions import flat_map, graph_fn, inline_map, stays_multi_device
from kerasfeed.tfdata.structure import ItemChecker

# Leaf dtypes read straight from the store's bytes (a bitcast; bool: a cast of its bytes).
_READABLE = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128, tf.bool,
                       tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64})


# Items per pass below which passes are not read in the graph. Its iterator costs ~1.3 ms more to make
# (2 cores; Keras makes one per epoch; NOTE [ kerasfeed's functions are instantiated single-device ] in
# functions.py) and an item ~0.11 ms less than through ``load``. `fit` on `h5` (benchmarks/README.md,
# *Iterators made without Grappler*), against ``load``: 0.90-0.97x at 20 items a pass, 1.02-1.17x at 50,
# 1.05-1.06x at 100, 1.01-1.09x at 200. With an int32 leaf the reader's functions stay multi-device
# (NOTE there), its iterator ~15 ms dearer than ``load``'s: no faster at 200 items, 1.0-1.1x at 500
# (*Stored passes read in the graph*).
MIN_PASS_ITEMS = 50
MIN_PASS_ITEMS_INT32 = 400


def stored_passes(pipeline: PassPipeline, in_order: PassInOrder, checker: ItemChecker,
                  pass_items: int) -> Optional[StoredPasses]:
    """The passes' start for a pipeline whose stored passes may be read in the graph, or None
    (no ``cache=``, an ``augment``, a leaf that is not read from bytes, strings, or passes
    shorter than ``MIN_PASS_ITEMS``, or ``MIN_PASS_ITEMS_INT32`` where the reader's functions stay
    multi-device: an int32 leaf)."""
    front, specs = pipeline.executor, checker.specs
    least = MIN_PASS_ITEMS_INT32 if stays_multi_device(tuple(specs)) else MIN_PASS_ITEMS
    if getattr(front, "whole_passes", False) is not True or pass_items < least:
        return None
    if not all(s.dtype in _READABLE and s.shape.rank is not None for s in specs):
        return None
    return StoredPasses(pipeline, in_order, front, checker, [s.dtype.size for s in specs],
                        [s.shape.rank for s in specs], [s.shape.is_fully_defined() for s in specs])


def stored_in_order(stored: StoredPasses, checker: ItemChecker, marked: bool, load: Callable) -> tf.data.Dataset:
    """Each pass: ``stored.begin``, then one row per item: either ``load(epoch)`` takes the pass's
    next item (a ``numpy_function`` call, as ``items._in_order``), or, for a pass read in the
    graph, the item is sliced out of the store's file (its last row also calls ``stored.end``).

    Every function is a top-level one, made once per iterator: a function inside the per-pass
    ``flat_map`` is made again at every pass (~5 ms each on 2 cores, multi-device). The branches are a ``Case``
    kept from lowering (``_keep_case``)."""
    specs, fixed = checker.specs, stored.fixed
    begin, end = weak_method(stored, "begin"), weak_method(stored, "end")
    column_shapes = stored.column_shapes
    out_types = [s.dtype for s in specs] + [tf.bool] * marked

    @graph_fn
    def one_pass(_):
        out = tf.numpy_function(begin, [], [tf.int64] * 3 + [tf.uint8] + [tf.int64] * len(column_shapes),
                                stateful=True, name="kerasfeed_begin_pass")
        count, epoch, read_count = (tf.ensure_shape(t, []) for t in out[:3])
        shared = tf.data.Dataset.from_tensors((epoch, tuple(_views(tf.ensure_shape(out[3], [None]), specs)))).repeat()
        table = [tf.ensure_shape(t, [None] + shape) for t, shape in zip(out[4:], column_shapes)]
        none = tuple([tf.zeros([], tf.int64)] + [tf.zeros(shape, tf.int64) for shape in column_shapes])
        made = tf.data.Dataset.zip((tf.data.Dataset.from_tensors(none).repeat(count), shared))
        # kind 1: read here; 2: read here, the pass's last item (then ``end``)
        kinds = 1 + tf.cast(tf.range(read_count) == read_count - 1, tf.int64)
        read = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(tuple([kinds] + table)), shared))
        return made.concatenate(read)

    def loaded(epoch):
        return list(tf.numpy_function(load, [epoch], out_types, stateful=True, name="kerasfeed_load"))

    def sliced(views, row):
        leaves, at = [], 0
        for view, spec, f in zip(views, specs, fixed):
            if f:
                flat = tf.slice(view, row[at], tf.constant([spec.shape.num_elements()], tf.int64))
                leaf, at = tf.reshape(flat, spec.shape.as_list()), at + 1
            else:
                leaf, at = tf.reshape(tf.slice(view, row[at], row[at + 1]), row[at + 2]), at + 3
            leaves.append(tf.cast(leaf, tf.bool) if spec.dtype == tf.bool else leaf)
        return leaves + [tf.constant(True)] * marked

    def sliced_then_end(epoch, views, row):
        leaves = sliced(views, row)
        with tf.control_dependencies([tf.numpy_function(end, [epoch], tf.int64, stateful=True,
                                                        name="kerasfeed_end_stored_pass")]):
            return [tf.identity(t) for t in leaves]

    @graph_fn
    def step(row, shared):
        (kind, *columns), (epoch, views) = row, shared
        flat = tf.switch_case(tf.cast(kind, tf.int32), [lambda: loaded(epoch), lambda: sliced(views, columns),
                                                        lambda: sliced_then_end(epoch, views, columns)])
        _keep_case(flat[0].op)
        return checker.element(flat, marked)

    return inline_map(flat_map(tf.data.Dataset.range(1), one_pass), step)


def _keep_case(op: Any) -> None:
    """Keeps a ``Case`` op a Case: lowered to Switch/Merge, as TensorFlow does by default, the
    single-threaded executor of ``inline_map`` refuses it."""
    from tensorflow.core.framework import attr_value_pb2

    while op.type not in ("Case", "StatelessCase"):
        if not op.inputs:
            raise RuntimeError(f"kerasfeed: tf.switch_case made no Case op under TensorFlow {tf.__version__} (the "
                               "stored passes' reader needs one). Received: ops ending in " + op.type)
        op = op.inputs[0].op  # the outputs pass through an Identity
    op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))


def _views(data: tf.Tensor, specs: list) -> list:
    """Per leaf, the store's file (``data``, uint8) as a flat tensor of its dtype (bitcasts: no copy;
    made once per pass)."""
    by_dtype: dict = {}
    for s in specs:
        if s.dtype not in by_dtype:
            if s.dtype in (tf.uint8, tf.bool):
                by_dtype[s.dtype] = data
            elif s.dtype.size == 1:
                by_dtype[s.dtype] = tf.bitcast(data, s.dtype)
            else:
                by_dtype[s.dtype] = tf.bitcast(tf.reshape(data, [-1, s.dtype.size]), s.dtype)
    return [by_dtype[s.dtype] for s in specs]


__all__ = ["stored_in_order", "stored_passes"]
