"""Per-pass index orders: sequential or a seeded shuffle drawn anew each pass, per position."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.sampling.bijection import MAX_N, SMALL_N, shuffled
from kerasfeed.sampling.fingerprints import ORDER_VERSION, ORDER_VERSION_1, hash_parts
from kerasfeed.sampling.views import check_positions, indices_by_windows

# The generator stream of IndexOrder's pass keys (the sampled orders use 11-15), and with
# fixed_shards the fixed partition into shards and each shard's order within a pass.
STREAM_INDEX, STREAM_PARTITION, STREAM_WITHIN = 16, 17, 18


@dataclasses.dataclass(frozen=True)
class IndexOrder:
    """The order in which items ``0 .. length-1`` are read in each pass.

    The index at position ``p`` of pass ``epoch`` is a pure function of ``(seed, epoch, p)``: a seeded
    bijection of ``[0, length)`` (a Feistel network, see ``kerasfeed/sampling/bijection.py``) computed for
    a window of positions at a time, so no pass is ever held whole (a pass of 10^9 items costs no memory),
    the order is the same whatever executes the items, and a pipeline can resume from any ``(epoch,
    position)``. Up to 65,536 items a pass is an exactly uniform permutation instead
    (``numpy.random.default_rng([seed, 16, epoch]).permutation(length)``, a table of 2 bytes per item,
    cached).

    With ``num_shards > 1`` (one input pipeline per worker under ``tf.distribute``) every shard takes every
    ``num_shards``-th entry of the same pass order, cut to ``length // num_shards`` entries so that all
    shards have the same number of steps (synchronous training would hang otherwise); with shuffling, the
    dropped remainder differs every pass.

    With ``fixed_shards=True`` (and ``shuffle``) each shard keeps the same items every pass, read in a new
    order each pass: the items are split into shards once, by a seeded permutation (the same ``length %
    num_shards`` items are left out of every pass), and each shard's pass is a permutation of its own
    items drawn from ``(seed, epoch, shard)``. That is the order for ``cache=`` under several processes or
    hosts: each process stores what it reads, and reads only that from its second pass on (with a fresh
    global order every pass, a host would find about ``1/num_shards`` of its items stored). The global
    batches then differ from the default order's; a resume needs the same shard count.

    Args:
        length: number of items in the source.
        shuffle: draw a new permutation for every pass.
        seed: seed of the permutations; None draws one from the OS once (not allowed with several shards:
            they must agree on the order).
        num_shards: number of disjoint shards the order is split into.
        shard_index: which shard this order yields, in ``[0, num_shards)``.
        fixed_shards: keep each shard's items the same every pass (see above).

    Example:

    ```python
    order = IndexOrder(5, shuffle=True, seed=1)
    order.indices(0), order.indices(1)  # two different permutations of 0..4
    order.at(0, [2, 3])                 # positions 2 and 3 of pass 0 only
    ```
    """

    length: int
    shuffle: bool = False
    seed: Optional[int] = None
    num_shards: int = 1
    shard_index: int = 0
    fixed_shards: bool = False
    # The seed was drawn for this object: another process's order made anew draws another (sources.base).
    seed_drawn: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        _v.positive_int("length", self.length, owner="IndexOrder")
        if self.length > MAX_N:
            raise ValueError(f"IndexOrder: `length` must be at most 2^62. Received: length={self.length}")
        _v.flag("shuffle", self.shuffle, owner="IndexOrder")
        _v.flag("fixed_shards", self.fixed_shards, owner="IndexOrder")
        # Checked here, not when the first pass draws its permutation.
        _v.seed("seed", self.seed, owner="IndexOrder")
        for name in ("num_shards", "shard_index"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"IndexOrder: `{name}` must be an int. Received: {name}={value!r}")
        # Plain ints from here on (a numpy integer would show in reprs and states).
        for name in ("length", "num_shards", "shard_index"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if not 1 <= self.num_shards <= self.length:
            raise ValueError(
                f"IndexOrder: `num_shards` must be in [1, {self.length}] (the number of items). "
                f"Received: num_shards={self.num_shards}"
            )
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"IndexOrder: `shard_index` must be in [0, {self.num_shards}). Received: shard_index={self.shard_index}"
            )
        if self.seed is None and self.shuffle and self.num_shards > 1:
            raise ValueError(
                "IndexOrder: sharded shuffling needs an explicit `seed` so that all shards draw the same "
                f"permutation and stay disjoint. Received: seed=None, num_shards={self.num_shards}"
            )
        if self.seed is None:
            # Fixed once per order object: passes still differ from each other.
            object.__setattr__(self, "seed", int(np.random.SeedSequence().entropy % (2**63)))
            object.__setattr__(self, "seed_drawn", True)
        if not self.shuffle:  # the seed decides nothing: a kept cache's key leaves it out (a drawn one differs per run)
            object.__setattr__(self, "cache_ignores", ("seed", "seed_drawn"))

    def __repr__(self) -> str:
        # fixed_shards shows only when set: the repr names the order in messages, as it always did.
        fixed = ", fixed_shards=True" if self.fixed_shards else ""
        return (f"IndexOrder(length={self.length!r}, shuffle={self.shuffle!r}, seed={self.seed!r}, "
                f"num_shards={self.num_shards!r}, shard_index={self.shard_index!r}{fixed})")

    @property
    def _fixed(self) -> bool:
        return self.fixed_shards and self.shuffle and self.num_shards > 1

    @property
    def shard_length(self) -> int:
        """Number of indices in every pass of this shard."""
        return self.length // self.num_shards

    @property
    def fingerprint(self) -> str:
        """Identifies the pass sequence over all shards (kept in resume states)."""
        if not self.shuffle:  # the same passes whatever the algorithm: states stay valid
            return hash_parts("IndexOrder", self.length, False, None, self.num_shards)
        # Past SMALL_N items the passes are those of ORDER_VERSION_1: its states stay valid.
        version = "fixed" if self._fixed else ORDER_VERSION if self.length <= SMALL_N else ORDER_VERSION_1
        return hash_parts("IndexOrder", self.length, True, self.seed, self.num_shards, version)

    @property
    def pass_fingerprint(self) -> str:
        """The fingerprint of the pass over all shards, whatever their number: a shard is every
        ``num_shards``-th entry of one permutation, so runs with other shard counts read the same passes
        (elastic resume)."""
        if self.num_shards == 1 or self._fixed:  # fixed shards: their passes are those of this shard count
            return self.fingerprint
        return dataclasses.replace(self, num_shards=1, shard_index=0).fingerprint

    @property
    def legacy_fingerprints(self) -> dict:
        """Fingerprints the same arguments had under earlier algorithms, each with the algorithm's name
        ("0.1": kerasfeed 0.1's materialized permutations; ORDER_VERSION_1: a Feistel network over small
        passes too): a state saved with one is refused with its own message."""
        if not self.shuffle or self._fixed:
            return {}
        parts = ("IndexOrder", self.length, True, self.seed, self.num_shards)
        legacy = {hash_parts(*parts): "0.1"}
        if self.length <= SMALL_N:
            legacy[hash_parts(*parts, ORDER_VERSION_1)] = ORDER_VERSION_1
        return legacy

    def at(self, epoch: int, positions: Any) -> np.ndarray:
        """The int64 item indices at ``positions`` (of this shard, in ``[0, shard_length)``) in pass
        ``epoch``; position ``q`` of shard ``k`` is position ``q * num_shards + k`` of the pass over all shards."""
        epoch = _v.non_negative_int("epoch", epoch, owner="IndexOrder")
        g = check_positions(positions, self.shard_length, "IndexOrder")
        if self._fixed:  # this shard's own items, in this pass's order among them
            within = shuffled(g, self.shard_length, int(self.seed), STREAM_WITHIN, int(epoch), self.shard_index)
            return shuffled(within * self.num_shards + self.shard_index, self.length, int(self.seed), STREAM_PARTITION)
        if self.num_shards > 1:
            g = g * self.num_shards + self.shard_index
        if not self.shuffle:
            return g.copy()
        return shuffled(g, self.length, int(self.seed), STREAM_INDEX, int(epoch))

    def indices(self, epoch: int) -> np.ndarray:
        """The int64 item indices of pass ``epoch`` for this shard (the whole pass: 8 bytes per index; the
        front ends read ``at`` by windows)."""
        return indices_by_windows(self.at, _v.non_negative_int("epoch", epoch, owner="IndexOrder"), self.shard_length)
