"""The tf.data side of grouped hand-over (see ``kerasfeed.loading.groups``)."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from kerasfeed import _validation as _v
from kerasfeed.loading.groups import auto_group_size
from kerasfeed.tfdata.exit_guard import quiet_at_exit
from kerasfeed.tfdata.functions import flat_map, inline_map, take_while
from kerasfeed.tfdata.unbatching import unbatch_rows


def open_leading(specs: list) -> list:
    """Per leaf: its leading dimension varies (the batch dimension of batches)."""
    return [bool(s.shape.rank) and s.shape[0] is None for s in specs]


def group_size(group_items: Optional[int], specs: list, sequential: bool, item_bytes: Optional[int] = None) -> int:
    """Items per ``numpy_function`` call: ``group_items``, or chosen by item size when None.

    Grouping needs items that stack (every dimension but a leading one fixed,
    no strings) and an executor that makes items ahead (the map is then
    sequential). ``item_bytes``: the largest probed item's size, needed when
    a leading dimension varies.
    """
    _v.positive_int("group_items", group_items, allow_none=True)
    stackable = all(
        s.dtype != tf.string and s.shape.rank is not None and (s.shape.rank == 0 or s.shape[1:].is_fully_defined())
        for s in specs
    )
    if group_items is None:
        if not sequential or not stackable:
            return 1
        if all(s.shape.is_fully_defined() for s in specs):
            item_bytes = sum(s.shape.num_elements() * s.dtype.size for s in specs)
        if item_bytes is None:
            return 1
        return auto_group_size(item_bytes, stackable)
    if group_items > 1 and not (stackable and sequential):
        why = ("every leaf of an item must have a fixed shape (but for a leading batch dimension) and a numeric dtype"
               if not stackable else "it needs the executor's own prefetching (num_parallel_calls=None)")
        raise ValueError(
            f"`group_items={group_items}` cannot group these items: {why}. Use group_items=1 or None. "
            f"Received: group_items={group_items}, item signature={[str(s) for s in specs]}"
        )
    return int(group_items)


def grouped_items(loader: Any, checker: Any, ragged: bool, marked: bool = False,
                  empty: Optional[list] = None) -> tf.data.Dataset:
    """Each pass: ``begin`` records the order; ``load`` gives groups of items
    until an empty one (``kerasfeed.loading.groups``); tf.data splits them in C++.

    Args:
        loader: ``(begin, load)`` callables, held weakly, of a ``RunLoader`` (dense groups) or,
            with ``ragged``, a ``GroupLoader`` (open leaves concatenated, their lengths last).
        checker: the item signature.
        marked: each group also holds every item's mark (``max_skipped``:
            False for an item left out), after the leaves; the elements are
            then ``(item, kept)``.
        empty: a group of no items: what a load the exit hook failed gives instead (``quiet_at_exit``).
    """
    specs = checker.specs
    opened = open_leading(specs) if ragged else [False] * len(specs)
    out_types = [s.dtype for s in specs] + ([tf.bool] if marked else []) + ([tf.int64] if ragged else [])
    begin, load = loader
    if empty is not None:
        load = quiet_at_exit(load, lambda: empty)

    def pass_groups(_):
        epoch = tf.numpy_function(begin, [], tf.int64, stateful=True, name="kerasfeed_begin_pass")
        return tf.data.Dataset.from_tensors(epoch).repeat()

    def load_group(epoch):
        flat = tf.numpy_function(load, [epoch], out_types, stateful=True, name="kerasfeed_load_group")
        lengths = flat[-1] if ragged else None
        leaves, k = [], 0
        for t, spec, is_open in zip(flat, specs, opened):
            if is_open:  # concatenated along the varying leading dimension
                t.set_shape([None] + spec.shape.as_list()[1:])
                t = tf.RaggedTensor.from_row_lengths(t, lengths[:, k], validate=False)
                k += 1
            else:
                t.set_shape([None] + spec.shape.as_list())
            leaves.append(t)
        if marked:
            kept = flat[len(specs)]
            kept.set_shape([None])
            return checker.pack(leaves), kept
        return checker.pack(leaves)

    def has_items(*group):
        first = tf.nest.flatten(group)[0]
        rows = first.nrows() if isinstance(first, tf.RaggedTensor) else tf.shape(first, out_type=tf.int64)[0]
        return rows > 0

    ds = flat_map(tf.data.Dataset.range(1), pass_groups)
    ds = unbatch_rows(take_while(inline_map(ds, load_group), has_items))
    if ragged:  # unbatched ragged rows are dense tensors; say so in the element spec (a 1-tuple stays one)
        ds = inline_map(ds, (lambda *e: e) if isinstance(ds.element_spec, tuple) else (lambda e: e))
    return ds


def uniform_leading(probed: list, open_flags: list, n: int) -> bool:
    """The probed items (but the last of the source) share their open leaves'
    leading lengths. ``probed``: ``[(index, [leaf array, ...]), ...]``."""
    seen = {
        tuple(len(a) for a, is_open in zip(leaves, open_flags) if is_open) for index, leaves in probed if index != n - 1
    }
    return len(seen) <= 1


__all__ = ["group_size", "grouped_items", "open_leading", "uniform_leading"]
