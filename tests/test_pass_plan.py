"""``PassPlan``: the bookkeeping of a pass planned ahead (no thread, no process)."""

from __future__ import annotations

import numpy as np

from kerasfeed.execution.plan import PassPlan


def _start_all(plan, window=None):
    started = []
    while plan.can_start(window):
        index = plan.next_index()
        if index is None:
            break
        plan.started(index, f"h{index}")
        started.append(index)
    return started


def test_items_start_in_order_up_to_the_window_and_are_taken_once():
    plan = PassPlan(2, np.array([5, 3, 8, 1]), window=2)
    assert plan.indices.tolist() == [5, 3, 8, 1] and all(type(i) is int for i in plan.indices)
    assert _start_all(plan) == [5, 3] and plan.outstanding == 2 and not plan.all_started
    assert plan.take(5, 2) == (True, "h5")
    assert plan.take(5, 2) == (False, None)  # already taken
    assert plan.take(3, 1) == (False, None)  # another pass
    assert _start_all(plan) == [8]
    assert [plan.take(i, 2) for i in (3, 8)] == [(True, "h3"), (True, "h8")]
    assert _start_all(plan, window=1) == [1] and plan.all_started
    assert plan.take(1, 2) == (True, "h1") and plan.finished and plan.outstanding == 0


def test_an_item_taken_before_it_started_is_skipped_not_started():
    plan = PassPlan(0, [0, 1, 2, 3], window=4)
    assert plan.take(2, 0) == (True, None)  # the caller makes it
    assert _start_all(plan) == [0, 1, 3]
    assert plan.all_started and not plan.finished


def test_repeated_indices_are_counted():
    plan = PassPlan(0, [4, 4, 7], window=8)
    assert _start_all(plan) == [4, 4, 7]
    assert plan.take(4, 0) == (True, "h4") and plan.take(4, 0) == (True, "h4")
    assert plan.take(4, 0) == (False, None)


def test_is_pass_compares_epoch_and_order():
    plan = PassPlan(3, [2, 0, 1], window=2)
    assert plan.is_pass(3, [2, 0, 1]) and plan.is_pass(3, np.array([2, 0, 1]))
    assert not plan.is_pass(4, [2, 0, 1]) and not plan.is_pass(3, [0, 1, 2]) and not plan.is_pass(3, [2, 0])


def test_drop_cancels_and_returns_the_handles_never_taken():
    plan = PassPlan(0, range(6), window=3)
    _start_all(plan)
    plan.take(0, 0)
    assert sorted(plan.drop()) == ["h1", "h2"]
    assert plan.cancelled and plan.all_started and plan.outstanding == 0 and not plan.can_start()
