"""The bookkeeping of a pass planned ahead, shared by the prefetching executors.

An executor that ``prefetches`` gets each pass's index order when the pass
starts (``Executor.plan``), starts items in that order up to a window, and
hands each to the ``load`` that asks for it. A ``load`` that asks for an item
not started yet (a parallel map far ahead, a direct call) makes it itself; the
plan then skips it, so nothing ever waits for an item nobody takes.

NOTE [ A plan holds a window of its pass, never the pass ]
The order is a lazy view (``kerasfeed.sampling.views``) that the plan reads a
chunk of positions at a time. What it keeps is bounded by the window, whatever
the pass length: the items started and not taken, and the positions ahead
that a load claimed before they were started. A load's item not started is
looked for in the next ``LOOKAHEAD`` positions only; one further ahead is not
the plan's (the caller makes it, and the plan again when it gets there; a
parallel map is never that far ahead). A pass of 10^9 items costs the same
as one of 10^3.

NOTE [ A pass begun again keeps what was made ]
A pass may be begun again before its plan is done: Keras' JAX and torch trainers build the model
from one batch of a throwaway iterator, then the fit's own iterator begins the same pass (a fit an
exception ended, begun again, too). A new plan of the same pass in the same order adopts the items
the old one started and no load took (``adopt``); only the taken ones are made again. Not when a hook
ran in between (the threads' shared source; a worker process's copy changed drops the plans first):
those items may hold what the hook changed. ``to_dataset`` under JAX, a pass of 100 batches of 1.6 MB:
170 items made for pass 0 on threads before, 106 after (the probe's 4, and what the build's iterator
took; docs/backends.md).
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np

from kerasfeed.sampling.views import IndexView, as_view

LOOKAHEAD = 4096  # positions past the next one to start where a load's item is looked for


class PassPlan:
    """One pass's order and the items started ahead of the consumer.

    Not thread-safe: the executor holds its own lock around every call.

    Args:
        epoch: the pass.
        indices: the order its items will be asked in: an ``IndexView``, or any sequence or array of them.
        window: started items not taken yet, at most (executors may pass a smaller one to ``can_start``).
    """

    def __init__(self, epoch: int, indices: Any, window: int):
        self.epoch = int(epoch)
        self.indices = as_view(indices)
        self.length = len(self.indices)
        self.window = window
        self.cancelled = False
        self.next = 0  # position of the next index to start
        self._started: dict[int, collections.deque] = {}  # index -> handles not taken yet
        self.outstanding = 0  # started and not taken
        self.taken = 0  # items of the pass handed to a load (started, or claimed)
        self._claimed: set[int] = set()  # positions ahead made by a load before being started
        self._ahead: list[int] = []  # indices at positions [_ahead_at, _ahead_at + len)
        self._ahead_at = 0

    @property
    def finished(self) -> bool:
        """Every item of the pass was taken."""
        return self.taken >= self.length

    @property
    def all_started(self) -> bool:
        """No index left to start (every one started, claimed, or the plan cancelled)."""
        return self.cancelled or self.next >= self.length

    def can_start(self, window: Optional[int] = None) -> bool:
        return not self.all_started and self.outstanding < (window or self.window)

    def is_pass(self, epoch: int, indices: Any) -> bool:
        """This plan is pass ``epoch`` in the order ``indices``."""
        return self.epoch == int(epoch) and self.indices.same_pass(indices)

    def _index_at(self, position: int) -> int:
        k = position - self._ahead_at
        if not 0 <= k < len(self._ahead):
            self._ahead_at = position
            self._ahead = self.indices.window(position, position + LOOKAHEAD).tolist()
            k = 0
        return self._ahead[k]

    def next_index(self) -> Optional[int]:
        """The next index to start (claimed ones skipped); None at the end."""
        while self.next < self.length:
            position = self.next
            self.next += 1
            if position in self._claimed:
                self._claimed.discard(position)
                continue
            return self._index_at(position)
        return None

    def started(self, index: int, handle: Any) -> None:
        """Records that ``index`` was started; ``handle`` is what ``take`` returns."""
        self._started.setdefault(index, collections.deque()).append(handle)
        self.outstanding += 1

    def _claim(self, index: int) -> bool:
        # Marks the first unclaimed position ahead holding ``index``, if any.
        if self.cancelled:
            return False
        ahead = self.indices.window(self.next, self.next + LOOKAHEAD)
        for k in np.flatnonzero(ahead == index).tolist():
            if self.next + k not in self._claimed:
                self._claimed.add(self.next + k)
                return True
        return False

    def adopt(self, index: int, handle: Any) -> bool:
        """Takes over item ``index`` that an earlier plan of this pass started (made, or being made): a load
        takes ``handle`` from here, and the plan does not start the item again. False: ``index`` is not
        among the next ``LOOKAHEAD`` positions (the plan starts it when it gets there)."""
        if not self._claim(index):
            return False
        self.started(index, handle)
        return True

    def take(self, index: int, epoch: int) -> tuple[bool, Any]:
        """Hands item ``index`` of pass ``epoch`` to a load.

        Returns:
            ``(False, None)``: not this plan's (another pass, already taken,
            or beyond ``LOOKAHEAD``): the caller makes it. ``(True, None)``:
            planned but not started: the caller makes it, the plan skips it.
            ``(True, handle)``: started; ``handle`` as given to ``started``.
        """
        if epoch != self.epoch:
            return False, None
        handles = self._started.get(index)
        if not handles:
            if not self._claim(index):
                return False, None
            self.taken += 1
            return True, None
        handle = handles.popleft()
        if not handles:
            del self._started[index]
        self.outstanding -= 1
        self.taken += 1
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
        handles = self.pending_handles()
        self._started.clear()
        self._claimed.clear()
        self.outstanding = 0
        return handles


class _Omitting(IndexView):
    """``parent`` without its position ``gap``."""

    def __init__(self, parent: IndexView, gap: int):
        super().__init__(len(parent) - 1)
        self.parent, self.gap = parent, gap

    def _compute(self, start: int, stop: int) -> np.ndarray:
        gap, parent = self.gap, self.parent
        if stop <= gap:
            return parent.window(start, stop)
        if start >= gap:
            return parent.window(start + 1, stop + 1)
        return np.concatenate([parent.window(start, gap), parent.window(gap + 1, stop + 1)])


def rest_of_pass(indices: Any, start: int, skipped: int) -> IndexView:
    """Positions ``start`` on of ``indices``, without the first ``skipped``
    among the next ``LOOKAHEAD`` (an item left out: ``Executor.item_skipped``)."""
    rest = as_view(indices)[start:]
    found = np.flatnonzero(rest.window(0, LOOKAHEAD) == skipped)
    return _Omitting(rest, int(found[0])) if found.size else rest

