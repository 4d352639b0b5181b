"""Per-pass index orders: sequential or a seeded shuffle drawn anew each pass."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.sampling.fingerprints import hash_parts


@dataclasses.dataclass(frozen=True)
class IndexOrder:
    """The order in which items ``0 .. length-1`` are read in each pass.

    The order of pass ``epoch`` is a pure function of ``(seed, epoch)``, so it
    is the same whatever executes the items, and a pipeline can resume from
    any ``(epoch, position)``.

    With ``num_shards > 1`` (one input pipeline per worker under
    ``tf.distribute``) every shard takes every ``num_shards``-th entry of the
    same pass order, cut to ``length // num_shards`` entries so that all
    shards have the same number of steps (synchronous training would hang
    otherwise); with shuffling, the dropped remainder differs every pass.

    Args:
        length: number of items in the source.
        shuffle: draw a new permutation for every pass.
        seed: seed of the permutations; None draws one from the OS once
            (not allowed with several shards: they must agree on the order).
        num_shards: number of disjoint shards the order is split into.
        shard_index: which shard this order yields, in ``[0, num_shards)``.

    Example:

    ```python
    order = IndexOrder(5, shuffle=True, seed=1)
    order.indices(0), order.indices(1)  # two different permutations of 0..4
    ```
    """

    length: int
    shuffle: bool = False
    seed: Optional[int] = None
    num_shards: int = 1
    shard_index: int = 0

    def __post_init__(self):
        _v.positive_int("length", self.length, owner="IndexOrder")
        _v.flag("shuffle", self.shuffle)
        # Checked here, not when the first pass draws its permutation.
        _v.seed("seed", self.seed)
        for name in ("num_shards", "shard_index"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"`{name}` must be an int. Received: {name}={value!r}")
        if not 1 <= self.num_shards <= self.length:
            raise ValueError(
                f"`num_shards` must be in [1, {self.length}] (the number of items). "
                f"Received: num_shards={self.num_shards}"
            )
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"`shard_index` must be in [0, {self.num_shards}). Received: shard_index={self.shard_index}"
            )
        if self.seed is None and self.shuffle and self.num_shards > 1:
            raise ValueError(
                "Sharded shuffling needs an explicit `seed` so that all shards draw the same "
                f"permutation and stay disjoint. Received: seed=None, num_shards={self.num_shards}"
            )
        if self.seed is None:
            # Fixed once per order object: passes still differ from each other.
            object.__setattr__(self, "seed", int(np.random.SeedSequence().entropy % (2**63)))

    @property
    def shard_length(self) -> int:
        """Number of indices in every pass of this shard."""
        return self.length // self.num_shards

    @property
    def fingerprint(self) -> str:
        """Identifies the pass sequence over all shards (kept in resume states)."""
        seed = int(self.seed) if self.shuffle else None  # unused when not shuffling
        return hash_parts("IndexOrder", int(self.length), bool(self.shuffle), seed, int(self.num_shards))

    def indices(self, epoch: int) -> np.ndarray:
        """Returns the int64 item indices of pass ``epoch`` for this shard."""
        if self.shuffle:
            rng = np.random.default_rng([int(self.seed), int(epoch)])
            order = rng.permutation(self.length).astype(np.int64)
        else:
            order = np.arange(self.length, dtype=np.int64)
        if self.num_shards == 1:
            return order
        return order[self.shard_index :: self.num_shards][: self.shard_length]
