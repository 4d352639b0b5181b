"""Which stage of an item the calling thread runs: the cached one, or not (TF-free, light).

NOTE [ What a cached stage may not read ]
With ``cache=``, ``load(i)`` (or ``__getitem__`` when the source has no
``load``) runs once per item and its result serves every later pass. So it
must be a function of ``i`` alone: draws from ``kerasfeed.item_rng()`` (a
function of the pass too) and the source's ``epoch`` would be frozen into the
cache and repeat every pass. Both ask ``refusal(what)`` and raise its error
inside a cached stage, naming ``cache`` and ``augment`` (where such work
belongs). Draws from the global ``random``/``numpy.random`` cannot be seen
this way; the cached call compares the generators' states around the stage
instead and warns once (``execution/cached_items.py``).
"""

from __future__ import annotations

import threading
from typing import Optional


class _Stage(threading.local):
    cached: Optional[str] = None  # the stage's name ("load" or "__getitem__") while it runs


_STAGE = _Stage()


def enter_cached(name: str) -> Optional[str]:
    """Marks the calling thread as running the cached stage ``name``; returns what ``leave`` restores."""
    previous, _STAGE.cached = _STAGE.cached, name
    return previous


def leave(previous: Optional[str]) -> None:
    _STAGE.cached = previous


def refusal(what: str, remedy: Optional[str] = None) -> Optional[RuntimeError]:
    """The error for ``what`` (e.g. ``"kerasfeed.item_rng()"``) used inside a cached stage, or None outside one.

    ``remedy``: the fix to name instead of moving the work into ``augment`` (which a built-in reader has not).
    """
    name = _STAGE.cached
    if name is None:
        return None
    remedy = remedy or ("Move random augmentation and per-pass work into `augment(item)` (run every pass after "
                        "the cache, where kerasfeed.item_rng() works)")
    return RuntimeError(
        f"{what} was used inside `{name}`, the stage that cache= stores: its result is made once and served every "
        f"pass, so what depends on the pass would repeat. {remedy}, or leave cache= off. "
        f"Received: {what} in {name}"
    )


__all__ = ["enter_cached", "leave", "refusal"]
