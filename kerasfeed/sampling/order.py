"""Per-pass index orders: sequential or a seeded shuffle drawn anew each pass."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class IndexOrder:
    """The order in which items ``0 .. length-1`` are read in each pass.

    The order of pass ``epoch`` is a pure function of ``(seed, epoch)``, so it
    is the same whatever executes the items, and a pipeline can resume from
    any ``(epoch, position)``.

    Args:
        length: number of items in the source.
        shuffle: draw a new permutation for every pass.
        seed: seed of the permutations; None draws one from the OS once.

    Example:

    ```python
    order = IndexOrder(5, shuffle=True, seed=1)
    order.indices(0), order.indices(1)  # two different permutations of 0..4
    ```
    """

    length: int
    shuffle: bool = False
    seed: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.length, (int, np.integer)) or self.length <= 0:
            raise ValueError(f"IndexOrder.length must be a positive int. Received: {self.length!r}")
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise TypeError(f"`shuffle` must be True or False. Received: {self.shuffle!r}")
        if self.seed is None:
            # Fixed once per order object: passes still differ from each other.
            object.__setattr__(self, "seed", int(np.random.SeedSequence().entropy % (2**63)))
        elif not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise TypeError(f"`seed` must be an int or None. Received: {self.seed!r}")

    def indices(self, epoch: int) -> np.ndarray:
        """Returns the int64 item indices of pass ``epoch``."""
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        rng = np.random.default_rng([int(self.seed), int(epoch)])
        return rng.permutation(self.length).astype(np.int64)
