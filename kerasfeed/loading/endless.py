"""Infinite sources (``num_batches`` is None): one endless pass per iterator (TF-free).

Keras 3 lets a ``PyDataset`` say it has no end (``num_batches`` returns
None); ``model.fit`` then needs ``steps_per_epoch`` and keeps one iterator
across its epochs. So does ``to_dataset``: every iterator is one endless pass
reading indices 0, 1, 2, ... (of its shard). The executor plans finite lists,
so it gets the pass in blocks of ``BLOCK`` indices: the next is planned when
a block's last item is taken, and worker processes start it ahead.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from kerasfeed.execution.base import Executor
from kerasfeed.loading.pipeline import PassPipeline

BLOCK = 512  # indices per plan: the state of the source is checked once per block


def check_endless_arguments(
    source: Any, shuffle: bool, initial_state: Optional[Mapping[str, int]], order: Any = None, max_skipped: Any = 0
) -> None:
    """Refuses what an endless pass cannot do, naming why.

    Raises:
        ValueError: ``shuffle=True``, ``order``, ``initial_state`` or a
            fraction ``max_skipped`` with an infinite source.
    """
    name = type(source).__name__
    if isinstance(max_skipped, float):
        raise ValueError(
            f"`max_skipped` as a fraction of a pass needs a finite source: {name}.num_batches is None (infinite). "
            f"Give a count of items instead (an endless pass is one pass for the whole run). "
            f"Received: max_skipped={max_skipped!r}"
        )
    if order is not None:
        raise ValueError(
            f"`order` needs a finite source: {name}.num_batches is None (infinite), so there is no pass to "
            f"order; an endless pass reads indices 0, 1, 2, ... Received: order={order!r}"
        )
    if shuffle:
        raise ValueError(
            f"`shuffle=True` needs a finite source: {name}.num_batches is None (infinite), so there is no pass "
            "to permute. Draw random items inside `__getitem__` instead (seeded by the index and "
            "`kerasfeed.get_worker_info()` if needed). Received: shuffle=True"
        )
    if initial_state:
        raise ValueError(
            f"`initial_state` needs a finite source: {name}.num_batches is None (infinite), so a saved "
            "position cannot be mapped back to an index. Received: "
            f"initial_state={dict(initial_state)!r}"
        )


class EndlessPipeline(PassPipeline):
    """``PassPipeline`` for an infinite source: each ``begin`` starts one
    endless pass (its number increases as for finite passes), calls
    ``set_epoch`` and ``on_epoch_begin`` and plans the first block;
    ``on_epoch_end`` is never called (the pass never ends)."""

    def __init__(self, source: Any, executor: Executor, checker: Any, num_shards: int = 1, shard_index: int = 0):
        super().__init__(source, None, executor, checker, 0, 0)
        self._num_shards = int(num_shards)
        self._shard_index = int(shard_index)
        self._current = -1  # the newest pass: older iterators no longer plan

    def first_index(self) -> int:
        return self._shard_index

    def step(self) -> int:
        return self._num_shards

    def _indices(self, k: int) -> np.ndarray:
        positions = np.arange(k * BLOCK, (k + 1) * BLOCK, dtype=np.int64)
        return positions * self._num_shards + self._shard_index

    def _plan(self, epoch: int, k: int) -> None:
        upcoming = (epoch, self._indices(k + 1)) if self.executor.plans_next_pass else None
        self.executor.plan(epoch, self._indices(k), upcoming)

    def begin(self):
        with self._lock:
            epoch = self._next
            self._next += 1
            self._current = epoch
        if self.stats is not None:
            self.stats.pass_begin(epoch)
        if self.skips is not None:
            self.skips.begin(epoch, 0)
        self._run_begin_hooks(epoch)
        self._plan(epoch, 0)
        return np.int64(epoch)

    def position_of(self, index: int, epoch: int) -> int:
        return (int(index) - self._shard_index) // self._num_shards

    def load(self, i, epoch):
        index, epoch = int(i), int(epoch)
        arrays = self._arrays(index, epoch)  # an endless pass's ticket is its number; None: left out (max_skipped)
        position = self.position_of(index, epoch)
        if position % BLOCK == BLOCK - 1 and epoch == self._current:
            self._plan(epoch, position // BLOCK + 1)
        return arrays


__all__ = ["BLOCK", "EndlessPipeline", "check_endless_arguments"]
