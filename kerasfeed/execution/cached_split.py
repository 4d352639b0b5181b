"""A source whose own ``__getitem__`` is not ``augment(load(i))``, checked once when a cache is opened.

NOTE [ A class's own __getitem__ beside load and augment ]
With ``cache=``, a source that defines ``load`` and ``augment`` gets ``augment(load(i))`` for item ``i``
(``keys.stage_of``): ``load`` is what is stored. A class that also defines its own ``__getitem__`` (a
``keras.utils.PyDataset`` must) gives those items only if its ``__getitem__`` is ``augment(load(i))``; one
that does more (normalises after ``augment``, adds a label) would train on other items with the cache on,
silently. So item 0 is made both ways once, with the same ``item_rng()`` and global random states: items of
another structure, shape or dtype are refused; other values are a warning (an ``augment`` that draws
from a generator of its own differs each call). The ``load(0)`` made here is stored (in a store of every
item): a pass does not load it again.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np

from kerasfeed import _nest
from kerasfeed.execution import item_random
from kerasfeed.execution.cached_items import read_only, run_augment, run_stage

logger = logging.getLogger("kerasfeed")


def _own_getitem(source: Any) -> bool:
    owner = next((k for k in type(source).__mro__ if "__getitem__" in vars(k)), None)
    return owner is not None and owner.__module__.split(".")[0] not in ("kerasfeed", "keras")


def _both_ways(source: Any, seeds: item_random.ItemSeeds) -> tuple[Any, Any, Any]:
    """Item 0 by ``__getitem__`` and by ``augment(load(0))``, each from the same random states, and what
    ``load(0)`` returned."""
    states = random.getstate(), np.random.get_state()
    made = []
    try:
        for way in ("__getitem__", "load"):
            random.setstate(states[0])
            np.random.set_state(states[1])
            previous = item_random.enter(seeds, 0, 0)
            try:
                if way == "__getitem__":
                    made.append(source[0])
                else:
                    made.append(run_stage(source, way, 0))
                    made.append(run_augment(source, read_only(made[-1])))
            finally:
                item_random.leave(previous)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return made[0], made[2], made[1]


def _layout(item: Any) -> tuple:
    skeleton, leaves = _nest.flatten(item, index=0)
    return skeleton, [(np.shape(v), np.asarray(v).dtype.str) for _, v in leaves]


def check_split(source: Any, api: str) -> Any:
    """Refuses (or warns about) a source whose own ``__getitem__`` makes other items than the
    ``augment(load(i))`` a cache serves (the NOTE).

    Returns:
        What ``load(0)`` returned, for the store (None: nothing was checked, for other sources).

    Raises:
        ValueError: item 0 differs in structure, shape or dtype between the two.
    """
    if len(source) == 0 or not _own_getitem(source):
        return None
    own, split, loaded = _both_ways(source, item_random.probe_seeds())
    name = type(source).__name__
    if _layout(own) != _layout(split):
        raise ValueError(
            f"{api}: with `cache`, {name}'s items are augment(load(i)) (load is stored), and its own __getitem__ "
            f"makes other items: item 0 by __getitem__ is {_describe(own)}, by augment(load(0)) {_describe(split)}. "
            f"Make __getitem__ return self.augment(self.load(i)), or move what it adds into augment. Received: "
            f"{name} with its own __getitem__, load and augment"
        )
    own_leaves, split_leaves = (_nest.flatten(x, index=0)[1] for x in (own, split))
    if not all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(own_leaves, split_leaves)):
        logger.warning(
            "kerasfeed: with `cache`, %s's items are augment(load(i)), and item 0 by its own __getitem__ has other "
            "values (the same random states for both). If __getitem__ does more than augment(load(i)), move that "
            "into augment, or the cached run trains on other items than model.fit(seq).", name)
    return loaded


def _describe(item: Any) -> str:
    skeleton, leaves = _layout(item)
    return f"{type(item).__name__} of {len(leaves)} leaves " + ", ".join(f"{s}:{d}" for s, d in leaves)


__all__ = ["check_split"]
