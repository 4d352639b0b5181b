"""The bookkeeping of a pass planned ahead, shared by the prefetching executors.

An executor that ``prefetches`` gets each pass's index order when the pass
starts (``Executor.plan``), starts items in that order up to a window, and
hands each to the ``load`` that asks for it. A ``load`` that asks for an item
not started yet (a parallel map far ahead, a direct call) makes it itself; the
plan then skips it, so nothing ever waits for an item nobody takes.
"""

from __future__ import annotations

import collections
from typing import Any, Optional, Sequence


class PassPlan:
    """One pass's order and the items started ahead of the consumer.

    Not thread-safe: the executor holds its own lock around every call.

    Args:
        epoch: the pass.
        indices: the order its items will be asked in.
        window: started items not taken yet, at most (executors may use a
            smaller one, see ``can_start``).
    """

    def __init__(self, epoch: int, indices: Sequence[int], window: int):
        self.epoch = int(epoch)
        self.indices = [int(i) for i in indices]
        self.window = window
        self.cancelled = False
        self.next = 0  # position of the next index to start
        self._started: dict[int, collections.deque] = {}  # index -> handles not taken yet
        self.outstanding = 0  # started and not taken
        self._todo = collections.Counter(self.indices)  # not taken yet
        self._claimed: collections.Counter = collections.Counter()  # made by a load before being started

    @property
    def finished(self) -> bool:
        """Every item of the pass was taken."""
        return not self._todo

    @property
    def all_started(self) -> bool:
        """No index left to start (every one started, claimed, or the plan cancelled)."""
        return self.cancelled or self.next >= len(self.indices)

    def can_start(self, window: Optional[int] = None) -> bool:
        return not self.all_started and self.outstanding < (window or self.window)

    def is_pass(self, epoch: int, indices: Sequence[int]) -> bool:
        """This plan is pass ``epoch`` in the order ``indices``."""
        return (
            self.epoch == int(epoch)
            and len(self.indices) == len(indices)
            and all(a == b for a, b in zip(self.indices, indices))
        )

    def next_index(self) -> Optional[int]:
        """The next index to start (claimed ones skipped); None at the end."""
        while self.next < len(self.indices):
            index = self.indices[self.next]
            self.next += 1
            if self._claimed[index]:
                self._claimed[index] -= 1
                continue
            return index
        return None

    def started(self, index: int, handle: Any) -> None:
        """Records that ``index`` was started; ``handle`` is what ``take`` returns."""
        self._started.setdefault(index, collections.deque()).append(handle)
        self.outstanding += 1

    def take(self, index: int, epoch: int) -> tuple[bool, Any]:
        """Hands item ``index`` of pass ``epoch`` to a load.

        Returns:
            ``(False, None)``: not an item of this plan (another pass, or
            already taken): the caller makes it. ``(True, None)``: part of the
            plan but not started: the caller makes it, the plan will skip it.
            ``(True, handle)``: started; ``handle`` as given to ``started``.
        """
        if epoch != self.epoch or not self._todo.get(index):
            return False, None
        self._todo[index] -= 1
        if not self._todo[index]:
            del self._todo[index]
        handles = self._started.get(index)
        if not handles:
            self._claimed[index] += 1
            return True, None
        handle = handles.popleft()
        if not handles:
            del self._started[index]
        self.outstanding -= 1
        return True, handle

    def peek(self, index: int, epoch: int) -> Any:
        """The handle ``take`` would return now, without taking it; None when
        ``index`` of pass ``epoch`` was not started by this plan (or is taken)."""
        if epoch != self.epoch:
            return None
        handles = self._started.get(index)
        return handles[0] if handles else None

    def pending_handles(self) -> list[Any]:
        """The handles started and not taken yet (for stats)."""
        return [h for entries in self._started.values() for h in entries]

    def drop(self) -> list[Any]:
        """Cancels the plan; returns the handles started and never taken."""
        self.cancelled = True
        handles = [h for entries in self._started.values() for h in entries]
        self._started.clear()
        self.outstanding = 0
        return handles
