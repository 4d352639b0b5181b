"""A source whose own ``__getitem__`` is not ``augment(load(i))``, checked once when a cache is opened.

NOTE [ A class's own __getitem__ beside load and augment ]
With ``cache=``, a source that defines ``load`` and ``augment`` gets ``augment(load(i))`` for item ``i``
(``keys.stage_of``): ``load`` is what is stored. A class that also defines its own ``__getitem__`` (a
``keras.utils.PyDataset`` must) gives those items only if its ``__getitem__`` is ``augment(load(i))``; one
that does more (normalises after ``augment``, adds a label) would train on other items with the cache on,
silently. So one item (0, or a shard's first: ``ItemCache.probe_at``) is made both ways once, with the same
``item_rng()`` and global random states: items of another structure, shape or dtype are refused; other
values are a warning (an ``augment`` that draws from a generator of its own differs each call). The
``load`` made here is stored: a pass does not load it again.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable

import numpy as np

from kerasfeed import _nest
from kerasfeed.cache.key_sources import defining_class
from kerasfeed.execution import own_state
from kerasfeed.execution.cached_items import read_only, run_augment, run_stage
from kerasfeed.sources import item_random

logger = logging.getLogger("kerasfeed")


def _own_getitem(source: Any) -> bool:
    owner = defining_class(source, "__getitem__")
    return owner is not None and owner.__module__.split(".")[0] not in ("kerasfeed", "keras")


def _from(states: tuple, index: int, make: Callable[[], Any]) -> Any:
    """``make()`` as item ``index`` of pass 0, from the global random ``states``."""
    random.setstate(states[0])
    np.random.set_state(states[1])
    with item_random.item_scope(index):
        return make()


def _both_ways(source: Any, index: int) -> tuple[Any, Any, Any]:
    """Item ``index`` by ``__getitem__``, by ``augment(load(index))``, each from the same random states, and
    what ``load(index)`` returned."""
    states = random.getstate(), np.random.get_state()

    def split() -> tuple[Any, Any]:
        loaded = run_stage(source, "load", index)
        return loaded, run_augment(source, read_only(loaded))

    try:
        with own_state.undone(source):  # made here for this process, not the workers' (its NOTE); each way from
            own = _from(states, index, lambda: source[index])  # the same state of the source
        with own_state.undone(source):
            loaded, augmented = _from(states, index, split)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return own, augmented, loaded


def _layout(leaves: list) -> list:
    return [(np.shape(v), np.asarray(v).dtype.str) for _, v in leaves]


def check_split(source: Any, api: str, index: int = 0) -> Any:
    """Refuses (or warns about) a source whose own ``__getitem__`` makes other items than the
    ``augment(load(i))`` a cache serves (the NOTE), made both ways for item ``index``.

    Returns:
        What ``load(index)`` returned, for the store (None: nothing was checked, for other sources).

    Raises:
        ValueError: the item differs in structure, shape or dtype between the two.
    """
    if len(source) == 0 or not _own_getitem(source):
        return None
    own, split, loaded = _both_ways(source, index)
    (own_skeleton, own_leaves), (split_skeleton, split_leaves) = (_nest.flatten(x, index=index) for x in (own, split))
    name = type(source).__name__
    if (own_skeleton, _layout(own_leaves)) != (split_skeleton, _layout(split_leaves)):
        raise ValueError(
            f"{api}: with `cache`, {name}'s items are augment(load(i)) (load is stored), and its own __getitem__ "
            f"makes other items: item {index} by __getitem__ is {_describe(own, own_leaves)}, by "
            f"augment(load({index})) {_describe(split, split_leaves)}. Make __getitem__ return "
            f"self.augment(self.load(i)), or move what it adds into augment. Received: {name} with its own "
            "__getitem__, load and augment"
        )
    if not all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(own_leaves, split_leaves)):
        logger.warning(
            "kerasfeed: with `cache`, %s's items are augment(load(i)), and item %d by its own __getitem__ has other "
            "values (the same random states for both). If __getitem__ does more than augment(load(i)), move that "
            "into augment, or the cached run trains on other items than model.fit(seq). (An augment that draws from "
            "a generator of its own rather than kerasfeed.item_rng() differs at each call: then nothing is wrong.)",
            name, index)
    return loaded


def _describe(item: Any, leaves: list) -> str:
    return f"{type(item).__name__} of {len(leaves)} leaves " + ", ".join(f"{s}:{d}" for s, d in _layout(leaves))


__all__ = ["check_split"]
