"""The executor seam: how one item is produced, wherever it runs.

``to_dataset`` maps the index stream through ``tf.numpy_function`` with a
parallel, order-preserving map; each call asks the executor for one item.
An executor therefore only has to be thread-safe and blocking: tf.data's
thread pool provides the concurrency and the ordering.
"""

from __future__ import annotations

import abc
from typing import Any


class Executor(abc.ABC):
    """Produces ``source[index]`` for the consumer.

    Attributes:
        name: ``"threads"`` or ``"processes"``.
        reason: why this executor was chosen (set by ``executor="auto"``).
    """

    name: str = "?"
    reason: str = ""

    @abc.abstractmethod
    def load(self, index: int, epoch: int) -> Any:
        """Returns item ``index`` of pass ``epoch`` as nested numpy data.

        Called concurrently from many threads. Raises
        ``kerasfeed.ItemError`` when ``source[index]`` raises.
        """

    def parallel_calls(self) -> int:
        """How many ``load`` calls tf.data should keep in flight by default."""
        return 1

    def close(self) -> None:
        """Releases threads, processes and memory. Idempotent."""

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<{type(self).__name__} name={self.name!r}{why}>"
