"""The order protocol: what any front end needs from a per-pass index order (TF-free).

An *order* decides which items of a source are read in every pass, and in which sequence.
``IndexOrder`` (sequential or a seeded shuffle), ``BalancedOrder`` and ``WeightedOrder`` are orders; so
is any object with:

- ``shard_length``: the number of indices in every pass of its shard (an int > 0, the same every pass);
- ``indices(epoch)``: the item indices of pass ``epoch`` for its shard, a 1-D integer array of
  ``shard_length`` entries, a pure function of the pass (resume and the worker processes rely on that);

and optionally:

- ``at(epoch, positions)``: the item indices at those positions (of its shard) of pass ``epoch``, an
  array as long as ``positions``. The front ends then read every pass a window of positions at a time
  (``kerasfeed.sampling.views``) and never ask for ``indices``: a pass of 10^9 items costs no memory.
  The built-in orders have it; without it, each pass's ``indices`` array is read whole;
- ``length``: the number of items the order picks from (checked against ``len(source)``);
- ``fingerprint``: a short string that identifies the pass sequence over all shards (saved in resume
  states; a resumed run must have the same one).

``resolve_order`` turns the arguments of a front end (``to_dataset`` or a TF-free loader) into a checked
order; ``order_fingerprint`` and ``check_resume_order`` tie resume states to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import numpy as np

from kerasfeed import _validation as v
from kerasfeed.sampling.fingerprints import process_shards_fingerprint
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

    Without ``order``: an ``IndexOrder(total, shuffle, seed, num_shards, shard_index)``, as ``to_dataset``
    always did. With ``order``: that order, checked once against the source and wrapped so that every pass
    is checked too (length, integer dtype, range) before any item is loaded.

    Args:
        total: number of items in the source.
        order: an order object (see ``Order``) or None.
        shuffle, seed, num_shards, shard_index: the front end's own order arguments; they must keep their
            defaults when ``order`` is given (the order already fixes shuffling, seed and sharding).

    Returns:
        An object with ``shard_length``, ``indices(epoch)``, ``at(epoch, positions)`` and ``fingerprint``
        (read it with ``kerasfeed.sampling.views.pass_view``).

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
    """Wraps a user's order: every window is checked before anything is loaded. An order with ``at`` is
    read per window; any other has each pass's ``indices`` checked whole once (the last two passes kept)."""

    def __init__(self, order: Any, total: int, shard_length: int):
        self.order, self.total, self.shard_length = order, total, shard_length
        self._per_window = callable(getattr(order, "at", None))
        self._passes: dict = {}

    @property
    def fingerprint(self) -> str:
        return order_fingerprint(self.order)

    @property
    def legacy_fingerprints(self) -> Any:
        return getattr(self.order, "legacy_fingerprints", ())

    @property
    def fingerprint_aliases(self) -> Any:
        return getattr(self.order, "fingerprint_aliases", ())

    def at(self, epoch: int, positions: Any) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not self._per_window:
            return self.indices(epoch)[positions]
        idx = np.asarray(self.order.at(epoch, positions))
        self._check(idx, f"{type(self.order).__name__}.at({int(epoch)}, ...)", len(positions), "positions asked")
        return idx.astype(np.int64, copy=False)

    def indices(self, epoch: int) -> np.ndarray:
        epoch = int(epoch)
        idx = self._passes.get(epoch)
        if idx is None:
            idx = np.asarray(self.order.indices(epoch))
            self._check(idx, f"{type(self.order).__name__}.indices({epoch})", self.shard_length,
                        "the order's shard_length")
            idx = idx.astype(np.int64, copy=False)
            if len(self._passes) >= 2:
                self._passes.pop(min(self._passes))
            self._passes[epoch] = idx
        return idx

    def _check(self, idx: np.ndarray, where: str, length: int, what: str) -> None:
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise TypeError(f"{where} must return a 1-D integer array. Received: dtype={idx.dtype}, shape={idx.shape}")
        if len(idx) != length:
            raise ValueError(
                f"{where} returned {len(idx)} indices but {what} is {length}; every pass must have shard_length "
                f"indices. Received: {len(idx)} indices"
            )
        if not idx.size:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.total:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{where} returned index {bad}, outside the source's items [0, {self.total}). Received: index={bad}"
            )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_passes": {}}

    def __repr__(self) -> str:
        return repr(self.order)


def order_shards(order: Any) -> int:
    """The shards an order object fixes itself (1: none, or no order)."""
    shards = getattr(order, "num_shards", 1)
    return shards if isinstance(shards, int) and shards > 0 else 1


def _given(order: Any) -> Any:
    """The order object as given, through the wrappers kerasfeed puts around it (``_CheckedOrder``, a process's
    shard of an unsharded one: each keeps it as ``order``)."""
    for _ in range(4):
        inner = getattr(order, "order", None)
        if inner is None or callable(inner):
            break
        order = inner
    return order


def order_shard(order: Any) -> Optional[int]:
    """The ``shard_index`` of an order object given sharded (``num_shards > 1``), else None."""
    given = _given(order)
    shard = getattr(given, "shard_index", None) if order_shards(given) > 1 else None
    return int(shard) if isinstance(shard, (int, np.integer)) else None


def order_summary(order: Any) -> dict:
    """An order as a person reads it, for messages: its kind and its plain arguments (``length``, ``shuffle``,
    ``seed``, ``replacement``, ``num_samples``), of the order as given (``_given``)."""
    order = _given(order)
    out: dict = {"kind": type(order).__name__}
    for name in ("length", "shuffle", "seed", "replacement", "num_samples"):
        value = getattr(order, name, None)
        if isinstance(value, (bool, int, float, str, np.integer, np.bool_, np.floating)):
            out[name] = value.item() if isinstance(value, np.generic) else value
    if out.get("shuffle") is False:
        out.pop("seed", None)  # drawn, never used
    return out


def order_fingerprint(order: Any) -> str:
    """A short string identifying ``order``'s pass sequence over all shards.

    Orders may define ``fingerprint`` themselves (the built-in ones hash their arguments and labels or
    weights, leaving the shard index out so that every shard of one run resumes from the same saved
    state). For any other order it is a hash of its type, pass length and first two passes.
    """
    fp = getattr(order, "fingerprint", None)
    if fp is not None:
        return str(fp() if callable(fp) else fp)
    h = hashlib.sha1(f"{type(order).__module__}.{type(order).__qualname__}:{int(order.shard_length)}".encode())
    for epoch in (0, 1):
        h.update(np.ascontiguousarray(np.asarray(order.indices(epoch), dtype=np.int64)).tobytes())
    return h.hexdigest()[:16]


def pass_fingerprint(order: Any) -> str:
    """The fingerprint of ``order``'s passes over all shards, whatever their number, where the order knows
    it (``pass_fingerprint``); else its own."""
    fp = getattr(order, "pass_fingerprint", None)
    return str(fp) if fp is not None else order_fingerprint(order)


def check_resume_order(state: Any, order: Any) -> None:
    """Refuses to resume from ``state`` (a ``ResumeState``) with a different order.

    A state saved without a fingerprint (older kerasfeed, or no order given to ``TrainingProgress``)
    resumes with any order, as before.

    Raises:
        ValueError: the fingerprints differ.
    """
    saved = getattr(state, "order", None)
    if saved is None:
        return
    current = order_fingerprint(order)
    if saved != current and saved in getattr(order, "fingerprint_aliases", ()):
        return  # the same passes, as an earlier kerasfeed named them
    legacy = getattr(order, "legacy_fingerprints", ())
    if saved != current and saved in legacy:
        # A mapping names the algorithm of each old fingerprint; a plain sequence is kerasfeed 0.1's.
        if isinstance(legacy, Mapping) and legacy[saved] != "0.1":
            was = (
                f"`initial_state` was saved by an earlier kerasfeed whose shuffled and balanced orders permuted "
                f"small index spaces (up to 65,536 items, samples or class items) with a Feistel network, measurably "
                f"far from uniform there (order version {legacy[saved]!r}, fingerprint {saved!r}); this version draws "
                f"those permutations exactly uniformly"
            )
        else:
            was = (
                f"`initial_state` was saved by kerasfeed 0.1, whose shuffled and sampled orders drew every pass whole "
                f"(fingerprint {saved!r}); this version computes each position with a seeded bijection"
            )
        raise ValueError(
            f"{was} (docs/sampling.md, *Compatibility*), so the same seed gives other passes and the saved position "
            f"cannot be continued exactly. To go on with the new order from a pass boundary, resume from a state "
            f"without the fingerprint, e.g. initial_state={{'epoch': {state.epoch + 1}, 'batches': 0}} with "
            f"fit(..., initial_epoch={state.epoch + 1}). Received: initial_state={state.to_dict()}, order={order!r}"
        )
    if saved != current:
        if _other_shard_count(state, order, saved):
            return  # a pass boundary: the same position whatever the number of shards
        raise ValueError(
            f"`initial_state` was saved with a different order (fingerprint {saved!r}; this pipeline's order "
            f"has {current!r}): resuming would not continue the saved run's passes. Build the order with the "
            "same labels or weights, seed, num_samples, replacement and num_shards as the saved run "
            f"(or the same shuffle and seed). Received: initial_state={state.to_dict()}, order={order!r}"
        )


def _other_shard_count(state: Any, order: Any, saved: str) -> bool:
    """Whether ``saved`` is this order's fingerprint as read in another number of shards (one per training
    process, by automatic sharding: ``loading/hosts.py``; or ``num_shards=``) at a pass boundary, which is
    the same position whatever the shards: True, resumed. Inside a pass, raises naming both counts (the
    fingerprints alone said "a different order" of an order built the same way). False: another order."""
    now, base = _shards_and_base(order)
    if base is None:
        return False
    then = next((k for k in range(1, _MAX_SHARDS + 1) if saved in _fingerprints_in(base, k)), None)
    if then is None or then == now:
        return False
    if not state.batches and not state.skipped_in(state.epoch):
        return True
    raise ValueError(
        f"`initial_state` was saved by a run reading this order in {then} shard(s) (one per training process: "
        f"JAX processes or tf.distribute workers; or num_shards=), and this run reads it in {now}: batch counts "
        f"are per shard, so the saved position ({state.batches} batches into pass {state.epoch}) would point at "
        f"other items. Resume with {then} shard(s), or from a pass boundary: initial_state={{'epoch': "
        f"{state.epoch + 1}, 'batches': 0}} (the rest of pass {state.epoch} is not read). "
        f"Received: initial_state={state.to_dict()}, order={order!r}"
    )


def _shards_and_base(order: Any) -> tuple:
    """``(shards this order is read in, the order unsharded)``, or ``(1, None)`` when that is not known."""
    inner = order
    for _ in range(4):  # through the wrappers a front end adds (a checked user order, say)
        if inner is None:
            break
        if hasattr(inner, "process_shards"):  # an unsharded order cut per process (automatic sharding)
            base, now = inner.process_shards
            return now, base
        if dataclasses.is_dataclass(inner) and hasattr(inner, "num_shards") and hasattr(inner, "shard_index"):
            try:
                return int(inner.num_shards), dataclasses.replace(inner, num_shards=1, shard_index=0)
            except (TypeError, ValueError):
                return 1, None
        inner = getattr(inner, "order", None)
    unsharded = int(getattr(order, "num_shards", 1) or 1) == 1
    return (1, order) if unsharded else (1, None)  # an order of one shard is its own base


def _fingerprints_in(base: Any, k: int) -> set:
    """The fingerprints of ``base`` read in ``k`` shards: cut per process, or built with ``num_shards=k``."""
    fp = order_fingerprint(base)
    found = {fp if k == 1 else process_shards_fingerprint(fp, k)}
    if k > 1 and dataclasses.is_dataclass(base):
        try:
            found.add(order_fingerprint(dataclasses.replace(base, num_shards=k, shard_index=0)))
        except (TypeError, ValueError):  # more shards than the order has entries
            pass
    return found


_MAX_SHARDS = 256  # shard counts a refusal looks through (only on the refusal's path)


__all__ = [
    "Order", "check_resume_order", "order_fingerprint", "order_shard", "order_shards", "order_summary",
    "pass_fingerprint", "resolve_order",
]
