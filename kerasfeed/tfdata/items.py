"""The items stage of ``to_dataset``: every pass's items, loaded in order into tf.data.

Each pass starts with one ``tf.numpy_function`` call (its epoch hooks, the
executor's plan, how many items). When the executor makes items ahead, a
sequential ``inline_map`` picks them up one call each, the pass's position
kept in Python (``kerasfeed/loading/in_order.py``: NOTE [ A sequential map
keeps its own position ]); small items go in groups instead: the group loader
(``kerasfeed/loading/groups.py``) keeps each pass's position in its order,
and each call hands over the next items that are ready (``grouped.py``). A
parallel deterministic map (an executor that does not make items ahead, or
``num_parallel_calls``) gets each item's index: they come a window at a time
(``index_windows.py``: never the whole pass). An endless source's pass is a
counter of indices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from kerasfeed.loading.feed import Feed
from kerasfeed.loading.groups import GroupLoader, RunLoader
from kerasfeed.loading.in_order import PassInOrder
from kerasfeed.loading.pipeline import PassPipeline, weak_method
from kerasfeed.loading.stored_passes import StoredPasses
from kerasfeed.tfdata.exit_guard import quiet_at_exit
from kerasfeed.tfdata.functions import flat_map, graph_fn, inline_map, parallel_map
from kerasfeed.tfdata.grouped import group_size, grouped_items, open_leading, uniform_leading
from kerasfeed.tfdata.index_windows import pass_index_stream
from kerasfeed.tfdata.stored_items import stored_in_order, stored_passes
from kerasfeed.tfdata.structure import ItemChecker, flatten


@dataclasses.dataclass(frozen=True)
class Items:
    """The dataset of items, and how they are grouped.

    Attributes:
        dataset: one element per item, in pass order; with ``max_skipped``
            ``(item, kept)``, ``kept`` False for an item left out (its
            element is a placeholder the tail drops: ``batching.drop_left_out``).
        groups: the ``RunLoader``/``GroupLoader`` (or, one item per call,
            the ``PassInOrder``) the dataset owns (held weakly by
            TensorFlow), or None.
        group: items per Python call (1: not grouped).
    """

    dataset: tf.data.Dataset
    groups: Any
    group: int


def item_dataset(
    feed: Feed, pipeline: PassPipeline, checker: ItemChecker, probes: list, sequential: bool, parallel: Optional[int]
) -> Items:
    """The items of every pass, one ``numpy_function`` call per item or per group.

    ``probes``: ``[(i, item), ...]`` probed (for the group size). ``sequential``: the executor
    makes items ahead, for a sequential map; else ``parallel`` calls of a parallel map in flight.

    Raises:
        ValueError: ``group_items`` above 1 for an endless source.
    """
    endless, group_items = feed.endless, feed.options.group_items
    if endless and group_items not in (None, 1):
        raise ValueError(
            f"`group_items={group_items}` cannot group the items of an endless source "
            f"(num_batches=None); use group_items=1 or None. Received: group_items={group_items}"
        )
    flat_specs = checker.specs
    marked = pipeline.skips is not None  # max_skipped: every item comes with its mark
    if marked:
        pipeline.placeholder = placeholder(flat_specs)
    probed = [(i, [np.asarray(leaf) for _, leaf in flatten(item)[1]]) for i, item in probes]  # once, for both
    largest = max((sum(a.nbytes for a in leaves) for _, leaves in probed), default=None)
    group = 1 if endless else group_size(group_items, flat_specs, sequential, largest)
    opened = open_leading(flat_specs)
    if group > 1:
        # Batches of one size (but perhaps the last), or items with no open
        # dimension: dense runs; batches whose size varies: ragged groups.
        ragged = any(opened) and not uniform_leading(probed, opened, feed.total)
        empty = [np.zeros([0] + [d or 0 for d in s.shape.as_list()], s.dtype.as_numpy_dtype) for s in flat_specs]
        loader = GroupLoader if ragged else RunLoader
        if marked:  # the marks are one more (dense) column, before the lengths of ragged groups
            empty.append(np.zeros(0, np.bool_))
        if ragged:
            empty.append(np.zeros((0, sum(opened)), np.int64))
        take = pipeline.take_marked if marked else pipeline.take
        # owned by the dataset; the source's on_epoch_end runs once the group holding the last item is stacked
        groups = loader(pipeline.begin, take, pipeline.ready, opened + [False] * marked, group, empty,
                        end_pass=pipeline.end_pass)
        ds = grouped_items((weak_method(groups, "begin"), weak_method(groups, "load")), checker, ragged, marked,
                           empty)
        return Items(ds, groups, group)
    if sequential and not endless:
        in_order = PassInOrder(pipeline.begin, pipeline.load_marked if marked else pipeline.load)
        # Items a pass reads: its batches times their size, the last one short (it counted full).
        per_pass, size = feed.passes.per_pass or 0, feed.options.batch_size
        pass_items = min(per_pass * size, feed.passes.items or 0) if size else per_pass
        stored = stored_passes(pipeline, in_order, checker, pass_items)  # owns in_order
        return Items(_in_order(in_order, checker, marked, stored), stored or in_order, 1)
    return Items(_one_by_one(feed, pipeline, checker, sequential, parallel), None, 1)


def placeholder(specs: list) -> list:
    """What stands in for an item left out (``max_skipped``): per leaf, no values
    (0 for each open dimension) of its dtype; the tail drops it."""
    out = []
    for s in specs:
        shape = [] if s.shape.rank is None else [d or 0 for d in s.shape.as_list()]
        out.append(np.full(shape, b"", object) if s.dtype == tf.string else np.zeros(shape, s.dtype.as_numpy_dtype))
    return out


def _load_item(load: Any, inputs: list, checker: ItemChecker, marked: bool) -> Any:
    """The element of one item's ``numpy_function`` call of ``load`` (``(item, kept)`` when marked)."""
    out_types = [s.dtype for s in checker.specs] + [tf.bool] * marked
    specs = checker.specs
    load = quiet_at_exit(load, lambda: placeholder(specs) + [np.bool_(False)] * marked)
    return checker.element(list(tf.numpy_function(load, inputs, out_types, stateful=True, name="kerasfeed_load")),
                           marked)


def _in_order(in_order: PassInOrder, checker: ItemChecker, marked: bool,
              stored: Optional[StoredPasses] = None) -> tf.data.Dataset:
    """Each pass: its epoch repeated once per item, each picked up by a sequential map that takes
    the pass's next item (NOTE [ A sequential map keeps its own position ]); with ``stored``, a
    pass whose items are all stored is read in the graph (NOTE [ A stored pass runs in the graph ])."""
    begin, load = weak_method(in_order, "begin"), weak_method(in_order, "load")

    if stored is not None:  # a pass whose items are all stored is read in the graph
        return stored_in_order(stored, checker, marked, load)

    @graph_fn
    def load_next(epoch):
        return _load_item(load, [epoch], checker, marked)

    @graph_fn
    def pass_epochs(_):
        count, epoch = tf.numpy_function(begin, [], (tf.int64, tf.int64), stateful=True, name="kerasfeed_begin_pass")
        return tf.data.Dataset.from_tensors(tf.ensure_shape(epoch, [])).repeat(tf.ensure_shape(count, []))

    return inline_map(flat_map(tf.data.Dataset.range(1), pass_epochs), load_next)


def _one_by_one(
    feed: Feed, pipeline: PassPipeline, checker: ItemChecker, sequential: bool, parallel: Optional[int]
) -> tf.data.Dataset:
    marked = pipeline.skips is not None
    begin, load = weak_method(pipeline, "begin"), weak_method(pipeline, "load_marked" if marked else "load")
    # Each pass's indices reach tf.data a window at a time (index_windows.py).
    index_stream = None if feed.endless else pass_index_stream(
        weak_method(pipeline, "begin_count"), weak_method(pipeline, "window")
    )

    @graph_fn
    def endless_stream(_):
        epoch = tf.numpy_function(begin, [], tf.int64, stateful=True, name="kerasfeed_begin_pass")
        indices = tf.data.Dataset.counter(start=pipeline.first_index(), step=pipeline.step())
        return inline_map(indices, lambda i: (i, epoch))

    @graph_fn
    def load_item(i, epoch):
        return _load_item(load, [i, epoch], checker, marked)

    ds = flat_map(tf.data.Dataset.range(1), endless_stream if feed.endless else index_stream)
    if sequential:
        return inline_map(ds, load_item)
    return parallel_map(ds, load_item, parallel)


__all__ = ["Items", "item_dataset", "placeholder"]
