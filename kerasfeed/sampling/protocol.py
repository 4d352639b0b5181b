"""The order protocol: what any front end needs from a per-pass index order (TF-free).

An *order* decides which items of a source are read in every pass, and in
which sequence. ``IndexOrder`` (sequential or a seeded shuffle),
``BalancedOrder`` and ``WeightedOrder`` are orders; so is any object with:

- ``shard_length``: the number of indices in every pass of its shard (an int
  > 0, the same every pass);
- ``indices(epoch)``: the item indices of pass ``epoch`` for its shard, a
  1-D integer array of ``shard_length`` entries, a pure function of the pass
  (resume and the worker processes rely on that);

and optionally:

- ``length``: the number of items the order picks from (checked against
  ``len(source)``);
- ``fingerprint``: a short string that identifies the pass sequence over all
  shards (saved in resume states; a resumed run must have the same one).

``resolve_order`` turns the arguments of a front end (``to_dataset`` or a
TF-free loader) into a checked order; ``order_fingerprint`` and
``check_resume_order`` tie resume states to it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

from kerasfeed import _validation as v
from kerasfeed.sampling.order import IndexOrder


@runtime_checkable
class Order(Protocol):
    """Any per-pass index order (see the module docs)."""

    @property
    def shard_length(self) -> int: ...

    def indices(self, epoch: int) -> np.ndarray: ...


def resolve_order(
    total: int,
    order: Any = None,
    shuffle: bool = False,
    seed: Optional[int] = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> Any:
    """Returns the order a pipeline over ``total`` items reads in.

    Without ``order``: an ``IndexOrder(total, shuffle, seed, num_shards,
    shard_index)``, as ``to_dataset`` always did. With ``order``: that order,
    checked once against the source and wrapped so that every pass is checked
    too (length, integer dtype, range) before any item is loaded.

    Args:
        total: number of items in the source.
        order: an order object (see ``Order``) or None.
        shuffle, seed, num_shards, shard_index: the front end's own order
            arguments; they must keep their defaults when ``order`` is given
            (the order already fixes shuffling, seed and sharding).

    Returns:
        An object with ``shard_length``, ``indices(epoch)`` and ``fingerprint``.

    Raises:
        TypeError: ``order`` lacks ``indices``/``shard_length``.
        ValueError: ``order`` and order arguments both given, or the order
            does not fit the source.
    """
    if order is None:
        return IndexOrder(total, shuffle=bool(shuffle), seed=seed, num_shards=num_shards, shard_index=shard_index)
    given = {
        name: value
        for name, value, default in (
            ("shuffle", shuffle, False),
            ("seed", seed, None),
            ("num_shards", num_shards, 1),
            ("shard_index", shard_index, 0),
        )
        # None counts as not given: front ends that derive shards later pass None.
        if not (value is None or value is default or value == default)
    }
    if given:
        detail = ", ".join(f"{k}={val!r}" for k, val in given.items())
        raise ValueError(
            "Pass either `order` or `shuffle`/`seed`/`num_shards`/`shard_index` (or `input_context`), not both: "
            "an order fixes its own shuffling, seed and sharding (e.g. "
            "kerasfeed.BalancedOrder(labels, seed=0, num_shards=2, shard_index=1)). "
            f"Received: order={order!r}, {detail}"
        )
    if isinstance(order, _CheckedOrder):
        order = order.order
    if not callable(getattr(order, "indices", None)) or not hasattr(order, "shard_length"):
        raise TypeError(
            "`order` must be an order object with `shard_length` and `indices(epoch)` (e.g. "
            "kerasfeed.IndexOrder, BalancedOrder, WeightedOrder). "
            f"Received: order={order!r} of type {type(order).__name__}"
        )
    n = v.positive_int("order.shard_length", order.shard_length)
    length = getattr(order, "length", None)
    if length is not None and int(length) != total:
        raise ValueError(
            f"`order` picks from {int(length)} items (one label or weight per item) but the source has "
            f"{total} items; build the order from exactly one label or weight per item of the source. "
            f"Received: order={order!r}, len(source)={total}"
        )
    return _CheckedOrder(order, total, n)


class _CheckedOrder:
    """Wraps a user's order: every pass is checked before anything is loaded."""

    def __init__(self, order: Any, total: int, shard_length: int):
        self.order, self.total, self.shard_length = order, total, shard_length

    @property
    def fingerprint(self) -> str:
        return order_fingerprint(self.order)

    def indices(self, epoch: int) -> np.ndarray:
        idx = np.asarray(self.order.indices(epoch))
        where = f"{type(self.order).__name__}.indices({int(epoch)})"
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise TypeError(f"{where} must return a 1-D integer array. Received: dtype={idx.dtype}, shape={idx.shape}")
        if len(idx) != self.shard_length:
            raise ValueError(
                f"{where} returned {len(idx)} indices but the order's shard_length is {self.shard_length}; "
                f"every pass must have shard_length indices. Received: {len(idx)} indices"
            )
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.total:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{where} returned index {bad}, outside the source's items [0, {self.total}). Received: index={bad}"
            )
        return idx.astype(np.int64, copy=False)

    def __repr__(self) -> str:
        return repr(self.order)


def order_fingerprint(order: Any) -> str:
    """A short string identifying ``order``'s pass sequence over all shards.

    Orders may define ``fingerprint`` themselves (the built-in ones hash
    their arguments and labels or weights; the shard index is left out so
    that every shard of one run resumes from the same saved state). For any
    other order it is a hash of its type, pass length and first two passes.
    """
    fp = getattr(order, "fingerprint", None)
    if fp is not None:
        return str(fp() if callable(fp) else fp)
    h = hashlib.sha1(f"{type(order).__module__}.{type(order).__qualname__}:{int(order.shard_length)}".encode())
    for epoch in (0, 1):
        h.update(np.ascontiguousarray(np.asarray(order.indices(epoch), dtype=np.int64)).tobytes())
    return h.hexdigest()[:16]


def check_resume_order(state: Any, order: Any) -> None:
    """Refuses to resume from ``state`` (a ``ResumeState``) with a different order.

    A state saved without a fingerprint (older kerasfeed, or no order given
    to ``TrainingProgress``) resumes with any order, as before.

    Raises:
        ValueError: the fingerprints differ.
    """
    saved = getattr(state, "order", None)
    if saved is None:
        return
    current = order_fingerprint(order)
    if saved != current:
        raise ValueError(
            f"`initial_state` was saved with a different order (fingerprint {saved!r}; this pipeline's order "
            f"has {current!r}): resuming would not continue the saved run's passes. Build the order with the "
            "same labels or weights, seed, num_samples, replacement and num_shards as the saved run "
            f"(or the same shuffle and seed). Received: initial_state={state.to_dict()}, order={order!r}"
        )


__all__ = ["Order", "check_resume_order", "order_fingerprint", "resolve_order"]
