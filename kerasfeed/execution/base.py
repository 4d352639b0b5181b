"""The executor seam: how one item is produced, wherever it runs.

``to_dataset`` maps the index stream through ``tf.numpy_function``; each call
asks the executor for one item. An executor only has to be thread-safe and
blocking. By default tf.data's parallel, order-preserving map provides the
concurrency. An executor that ``prefetches`` instead gets each pass's order
up front (``plan``) and makes items ahead by itself; the map then calls it
sequentially, which saves the main process tf.data's per-call thread hops.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence


class Executor(abc.ABC):
    """Produces ``source[index]`` for the consumer.

    Attributes:
        name: ``"threads"`` or ``"processes"``.
        reason: why this executor was chosen (set by ``executor="auto"``).
    """

    name: str = "?"
    reason: str = ""
    prefetches: bool = False

    @abc.abstractmethod
    def load(self, index: int, epoch: int) -> Any:
        """Returns item ``index`` of pass ``epoch`` as nested numpy data.

        Called concurrently from many threads. Raises
        ``kerasfeed.ItemError`` when ``source[index]`` raises.
        """

    def plan(self, epoch: int, indices: Sequence[int]) -> None:
        """Called when pass ``epoch`` starts, with the order its items will be
        asked in. Executors that ``prefetch`` start making them."""

    def parallel_calls(self) -> int:
        """How many ``load`` calls tf.data should keep in flight by default."""
        return 1

    def close(self) -> None:
        """Releases threads, processes and memory. Idempotent."""

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<{type(self).__name__} name={self.name!r}{why}>"
