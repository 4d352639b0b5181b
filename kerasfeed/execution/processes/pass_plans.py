"""The pass being loaded and the next pass, as requests sent ahead to the workers.

When a pass starts, its ``PassPlan`` (``execution/plan.py``) gives the order
its items will be asked in; ``fill`` requests them ahead, up to
``in_flight_per_worker`` unanswered requests per worker and a window of items
requested and not taken. Once every item of the plan is requested, the first
items of the pass expected next (``next_pass``) are requested too, as
``next_pass_plan``: the ``start`` call for that pass adopts it, any other drops
it, so workers do not idle while the consumer builds its next iterator.

Lock-free bookkeeping: the owner (the ``Dispatcher``) holds its lock around
every call and sends the requests ``fill`` returns after releasing it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from kerasfeed.execution.plan import PassPlan
from kerasfeed.execution.processes.lanes import Lanes, Request, WorkerLane
from kerasfeed.execution.processes.slots import SlotTable


class PlanView(NamedTuple):
    """A snapshot of one ``PassPlan``: its pass, how far it was requested (``started`` positions
    of ``indices``, the pass's lazy ``IndexView``), its items requested and not taken (``outstanding``)."""

    epoch: int
    indices: Any
    started: int
    outstanding: int
    all_started: bool

    @classmethod
    def of(cls, plan: Optional[PassPlan]) -> Optional["PlanView"]:
        if plan is None:
            return None
        return cls(plan.epoch, plan.indices, plan.next, plan.outstanding, plan.all_started)


class PlanStatus(NamedTuple):
    """A snapshot of the plans (``Dispatcher.plan_status``).

    Attributes:
        current: the pass being loaded, or None.
        next_pass: the next pass once started ahead, or None.
        next_pass_expected: a next pass is known but not started yet.
        plans_made: how many plans were made so far (one adopted from the
            next pass is not made again).
    """

    current: Optional[PlanView]
    next_pass: Optional[PlanView]
    next_pass_expected: bool
    plans_made: int


# (lane, request, epoch) of a request to send.
Send = tuple[WorkerLane, Request, int]


class PassPlans:
    """The current plan and the next pass over the pool's workers.

    Args:
        lanes: the workers' lanes (where requests go).
        slots: the slot table (returned loans are collected before filling).
        new_id: gives request ids.
        in_flight_per_worker: requests one worker may have at once.
    """

    def __init__(self, lanes: Lanes, slots: SlotTable, new_id: Callable[[], int], in_flight_per_worker: int):
        self._lanes = lanes
        self._slots = slots
        self._new_id = new_id
        self._in_flight_per_worker = in_flight_per_worker
        self.plan: Optional[PassPlan] = None  # its handles: (lane, request)
        # The pass expected next: ``next_pass`` until ``plan`` has started all
        # its items, then started as ``next_pass_plan``.
        self.next_pass: Optional[tuple[int, Any]] = None
        self.next_pass_plan: Optional[PassPlan] = None
        self.plans_made = 0

    def window(self) -> int:
        """Requested and not taken yet, at most, over the plan and the next pass."""
        return len(self._lanes) * (self._in_flight_per_worker + 1)

    def _new_plan(self, epoch: int, indices: Any) -> PassPlan:
        self.plans_made += 1
        return PassPlan(epoch, indices, window=self.window())

    def status(self) -> PlanStatus:
        return PlanStatus(
            PlanView.of(self.plan), PlanView.of(self.next_pass_plan), self.next_pass is not None, self.plans_made
        )

    def start(self, epoch: int, indices: Any, next_pass: Optional[tuple[int, Any]]) -> None:
        """Pass ``epoch`` starts in the order ``indices``; ``next_pass``: ``(epoch, indices)`` of the
        pass expected after it, or None."""
        started, current = self.next_pass_plan, self.plan
        if started is not None and started.is_pass(epoch, indices):
            # The workers already started this pass: keep what they made.
            self.next_pass_plan = None
            self._drop(self.plan)
            self.plan = started
        elif current is not None and not current.cancelled and current.is_pass(epoch, indices):
            # The same pass begun again, the workers' source unchanged (a change drops the plans first):
            # what they made and no load took is kept (NOTE [ A pass begun again keeps what was made ]).
            self.plan = None
            self.drop_all()  # the next pass's, if any
            self.plan = self._new_plan(epoch, indices)
            self._release([h for h in current.drop() if not self.plan.adopt(h[1].index, h)])
        else:
            self.drop_all()
            self.plan = self._new_plan(epoch, indices)
        self.next_pass = next_pass

    def drop_all(self) -> None:
        """Drops the plan, the next pass started after it, and the one that would have been."""
        plan, next_pass_plan = self.plan, self.next_pass_plan
        self.plan = self.next_pass_plan = self.next_pass = None
        self._drop(plan)
        self._drop(next_pass_plan)

    def unfinished(self) -> Optional[tuple[int, Any, int, Optional[tuple[int, Any]]]]:
        """``(epoch, indices, taken, next_pass)``: the pass being read (its order, and how many of
        its items loads took, in order) and the pass expected next; None when none is being read."""
        plan = self.plan
        if plan is None or plan.finished:
            return None
        upcoming = self.next_pass_plan
        next_pass = self.next_pass if upcoming is None else (upcoming.epoch, upcoming.indices)
        return plan.epoch, plan.indices, plan.taken, next_pass

    def forget(self) -> None:
        """Forgets every plan without touching their requests (the pool is closing)."""
        self.plan = self.next_pass_plan = self.next_pass = None

    def _drop(self, plan: Optional[PassPlan]) -> None:
        # Requests sent ahead and never taken give their slot back (now if answered, else when it comes).
        if plan is None:
            return
        self._release(plan.drop())

    def _release(self, handles: list) -> None:
        for lane, req in handles:
            req.planned = False
            if req.done:
                lane.waiting -= 1
                self._lanes.slot_done(lane, req.slot)
            else:
                req.abandoned = True

    def fill(self) -> list[Send]:
        """Requests the plan (then the next pass) may send now."""
        sends: list[Send] = []
        if self.plan is None and self.next_pass_plan is None and self.next_pass is None:
            return sends
        self._slots.collect_returned()
        room = self.window() - sum(p.outstanding for p in (self.plan, self.next_pass_plan) if p is not None)
        if self.plan is not None:
            room = self._start(self.plan, room, sends)
        if self.plan is None or self.plan.all_started:  # only then the next pass
            if self.next_pass_plan is None and self.next_pass is not None:
                epoch, indices = self.next_pass
                self.next_pass_plan, self.next_pass = self._new_plan(epoch, indices), None
            if self.next_pass_plan is not None:
                self._start(self.next_pass_plan, room, sends)
        return sends

    def _start(self, plan: PassPlan, room: int, sends: list[Send]) -> int:
        # Requests up to ``room`` more items of ``plan`` (appended to ``sends``); returns the room left.
        while room > 0 and not plan.all_started:
            lane = self._lanes.least_busy(planned=True)
            if lane is None:
                break
            index = plan.next_index()
            if index is None:
                break
            req = self._lanes.new_request(lane, self._new_id(), index)
            req.planned = True
            plan.started(index, (lane, req))
            sends.append((lane, req, plan.epoch))
            room -= 1
        return room

    def take(self, index: int, epoch: int) -> Optional[tuple[WorkerLane, Request]]:
        """The plan's request for ``index``; None if the caller must request it itself."""
        plan = self.plan
        if plan is None:
            return None
        _, handle = plan.take(index, epoch)
        if plan.finished:
            self.plan = None
        if handle is None:
            # Not planned, or asked ahead of the plan (a parallel map far ahead, a direct load): the
            # caller requests it and the plan skips it. Waiting for the plan could wait for ever on
            # items that nobody takes.
            return None
        lane, req = handle
        req.planned = False
        if req.done:
            lane.waiting -= 1
        return lane, req
