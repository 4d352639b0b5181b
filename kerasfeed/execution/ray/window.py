"""The ordered window: a pass's items requested ahead of the consumer, bounded in count and in bytes.

A pass's ``PassPlan`` (``execution/plan.py``: its order, read a window at a
time) gives the order the consumer will ask for the items in; ``fill`` sends
calls for them ahead, in that order, to the least busy lanes (``pool.py``),
keeping each call's ``ObjectRef`` with its index. The consumer takes them in
the pass's order (``take``), whichever actor finished first, so the order is
the plan's by construction.

Bounds (what is requested and not taken yet, over the plan and the next pass):

- **Count**: ``in_flight_per_worker + 1`` calls per lane that is up: each
  actor has its next item queued behind the current one, and one made item
  waits for the consumer.
- **Bytes**: ``bytes_ahead // item_bytes`` calls (at least 2), ``item_bytes``
  the largest item seen so far. Made items sit in the store of the node that
  made them until taken (then in the consumer's node's store while its
  arrays are alive, as Ray pins them).

Once every item of the pass is requested, the first items of the next pass
(``next_pass``, known when the order is seeded) are requested within the same
bounds; ``start`` of that pass adopts them, any other start drops them.
Dropped calls are forgotten: Ray frees their results (nobody refers to them),
though an actor may still make them (at most a window, once per dropped plan).

Lock-free bookkeeping like ``PassPlan``: the executor holds its lock around every call.
"""

from __future__ import annotations

from typing import Any, Optional

from kerasfeed.execution.plan import PassPlan
from kerasfeed.execution.ray.pool import ActorPool, Call


class Window:
    """The plan being loaded and the next pass, as calls sent ahead: at most ``per_lane`` calls not taken
    yet per lane, and ``bytes_ahead`` bytes of made items not taken yet."""

    def __init__(self, per_lane: int, bytes_ahead: int):
        self.per_lane = per_lane
        self.bytes_ahead = bytes_ahead
        self.item_bytes = 0  # the largest item seen so far
        self.plan: Optional[PassPlan] = None  # its handles: Call
        self.next_pass: Optional[tuple[int, Any]] = None  # (epoch, indices) expected after the plan
        self.next_plan: Optional[PassPlan] = None  # the next pass, once started

    def size(self, lanes_up: int) -> int:
        """Calls requested and not taken, at most, now."""
        n = max(1, lanes_up) * self.per_lane
        if self.item_bytes:
            n = min(n, max(2, self.bytes_ahead // self.item_bytes))
        return n

    def saw(self, nbytes: int) -> None:
        """An item of ``nbytes`` was taken (the bytes bound follows the largest)."""
        if nbytes > self.item_bytes:
            self.item_bytes = nbytes

    def start(self, epoch: int, indices: Any, next_pass: Optional[tuple[int, Any]], pool: ActorPool) -> None:
        """Pass ``epoch`` starts in the order ``indices``; ``next_pass`` follows it (or None)."""
        started = self.next_plan
        if started is not None and started.is_pass(epoch, indices):
            self.next_plan = None  # already requested ahead: keep what was made
            self._drop(self.plan, pool)
            self.plan = started
        else:
            self.drop_all(pool)
            self.plan = PassPlan(epoch, indices, window=self.per_lane)
        self.next_pass = next_pass

    def drop_all(self, pool: ActorPool) -> None:
        """Drops the plan, the next pass started after it and the one expected."""
        plan, next_plan = self.plan, self.next_plan
        self.plan = self.next_plan = self.next_pass = None
        self._drop(plan, pool)
        self._drop(next_plan, pool)

    @staticmethod
    def _drop(plan: Optional[PassPlan], pool: ActorPool) -> None:
        if plan is not None:
            for call in plan.drop():
                pool.done(call)

    def fill(self, pool: ActorPool) -> None:
        """Sends the calls the bounds allow now: the plan's, then the next pass's."""
        if self.plan is None and self.next_plan is None and self.next_pass is None:
            return
        room = self.size(pool.up()) - sum(p.outstanding for p in (self.plan, self.next_plan) if p is not None)
        if self.plan is not None:
            room = self._send(self.plan, room, pool)
        if self.plan is None or self.plan.all_started:  # only then the next pass
            if self.next_plan is None and self.next_pass is not None:
                epoch, indices = self.next_pass
                self.next_plan, self.next_pass = PassPlan(epoch, indices, window=self.per_lane), None
            if self.next_plan is not None:
                self._send(self.next_plan, room, pool)

    def _send(self, plan: PassPlan, room: int, pool: ActorPool) -> int:
        while room > 0 and not plan.all_started:
            lane = pool.pick(cap=self.per_lane)
            if lane is None:
                break
            index = plan.next_index()
            if index is None:
                break
            call = Call(index, plan.epoch)
            pool.send(call, lane)
            plan.started(index, call)
            room -= 1
        return room

    def take(self, index: int, epoch: int) -> Optional[Call]:
        """The plan's call for item ``index`` of pass ``epoch``; None when the caller must send its own
        (not planned, or not sent yet: the plan then skips it)."""
        plan = self.plan
        if plan is None:
            return None
        _, call = plan.take(index, epoch)
        if plan.finished:
            self.plan = None
        return call

    def peek(self, index: int, epoch: int) -> Optional[Call]:
        plan = self.plan
        return None if plan is None else plan.peek(index, epoch)

    def pending(self) -> list[Call]:
        """The calls sent ahead and not taken yet."""
        return [c for p in (self.plan, self.next_plan) if p is not None for c in p.pending_handles()]


__all__ = ["Window"]
