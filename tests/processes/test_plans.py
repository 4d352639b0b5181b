"""Passes planned ahead: items requested before they are asked for, the next
pass started ahead, and stale plans that never block or leak slots.
"""

from __future__ import annotations

import sys
import threading

import cloudpickle
import numpy as np
from _kit import count_up, dataset_kinds, drive, slots_in_use
from _util import wait_until
from tensorflow.core.framework import graph_pb2

import kerasfeed
from kerasfeed.execution.processes.pass_plans import PlanView

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Stands in for "no next pass started yet" while waiting for one.
ahead_none = PlanView(epoch=-1, indices=[], started=0, outstanding=0, all_started=False)


def test_a_planned_pass_requests_items_ahead_in_order_and_maps_sequentially(kit):
    pool = kit._dispatcher
    order = [5, 2, 9, 0, 7, 1]
    kit.plan(3, order)
    # Requested before any load asked: the window covers the whole (short) pass.
    assert wait_until(lambda: pool.plan_status().current.started == len(order))
    assert pool.plan_status().current.indices.tolist() == order
    got = [kit.load(i, 3) for i in order]
    assert [int(x[0, 0]) for x, _ in got] == order
    assert {int(m["epoch"]) for _, m in got} == {3}
    assert pool.plan_status().current is None  # finished once every item was taken
    assert pool.request_counts()[:3] == (0, 0, 0)

    n = len(kit.source)  # an executor reads the source it was made with
    ds = kerasfeed.to_dataset(kit.source, executor=kit, shuffle=True, seed=3)
    first = [int(x[0, 0]) for x, _ in ds]
    assert sorted(first) == list(range(n)) and first != list(range(n))
    kinds = dataset_kinds(ds)
    assert "map" in kinds and "parallel_map" not in kinds, kinds  # kerasfeed/tfdata/functions.py
    # ... and inline: the pick-up runs on tf.data's own thread, not handed to
    # the inter-op pool (one thread wake-up less per element).
    graph = graph_pb2.GraphDef.FromString(ds._as_serialized_graph().numpy())
    maps = [n for n in graph.node if n.op == "MapDataset"]
    assert len(maps) == 1 and maps[0].attr["use_inter_op_parallelism"].b is False
    kinds = dataset_kinds(kerasfeed.to_dataset(kit.source, executor=kit, num_parallel_calls=4))
    assert "parallel_map" in kinds, kinds  # asked for explicitly


def test_an_abandoned_plan_never_blocks_later_loads_or_leaks_slots(kit):
    pool = kit._dispatcher
    kit.plan(0, list(range(30)))
    assert int(kit.load(0, 0)[0][0, 0]) == 0
    # The pass is dropped here: answers sent ahead wait, unclaimed.
    assert wait_until(lambda: pool.request_counts().waiting > 0)
    # Direct loads (another epoch, many threads) do not wait for the stale plan.
    out = drive(kit, range(20, 28), epoch=5, threads=8)
    assert [int(x[0, 0]) for x, _ in out] == list(range(20, 28))
    # A new plan drops the old one and frees its slots.
    kit.plan(1, [3, 4])
    assert [int(kit.load(i, 1)[0][0, 0]) for i in (3, 4)] == [3, 4]
    assert wait_until(pool.idle)
    assert slots_in_use(kit) == 0  # every slot is free again


def test_the_next_pass_is_started_ahead_and_kept_by_its_plan(kit):
    pool = kit._dispatcher
    first, second = [4, 0, 2, 6], [7, 1, 5, 3, 2]
    kit.plan(2, first, next_pass=(3, second))
    assert [int(kit.load(i, 2)[0][0, 0]) for i in first] == first
    # Pass 2 is all requested, so the workers went on with pass 3 (5 items,
    # within the window of 2 x 3) before anybody asked for it.
    assert wait_until(lambda: (pool.plan_status().next_pass or ahead_none).all_started)
    started_ahead = pool.plan_status().next_pass
    assert started_ahead.epoch == 3 and started_ahead.outstanding == len(second)
    assert wait_until(lambda: pool.request_counts().pending == 0)  # made already
    made = pool.plan_status().plans_made
    kit.plan(3, second)
    status = pool.plan_status()
    # Kept, not requested again: no new plan, the same items started.
    assert status.plans_made == made and status.next_pass is None and status.current == started_ahead
    out = [kit.load(i, 3) for i in second]
    assert [int(x[0, 0]) for x, _ in out] == second
    assert {int(m["epoch"]) for _, m in out} == {3}  # the workers made them for pass 3
    assert pool.plan_status().current is None
    assert wait_until(pool.idle)


def test_a_next_pass_that_does_not_come_is_dropped_without_leaking_slots(kit):
    pool = kit._dispatcher
    kit.plan(0, [1, 2], next_pass=(1, [10, 11, 12]))
    assert [int(kit.load(i, 0)[0][0, 0]) for i in (1, 2)] == [1, 2]
    assert wait_until(lambda: (pool.plan_status().next_pass or ahead_none).all_started)
    kit.plan(1, [12, 11, 10])  # the same pass in another order: what was made ahead is dropped
    status = pool.plan_status()
    assert status.next_pass is None and status.current.indices.tolist() == [12, 11, 10]
    out = [kit.load(i, 1) for i in (12, 11, 10)]
    assert [int(x[0, 0]) for x, _ in out] == [12, 11, 10]
    assert {int(m["epoch"]) for _, m in out} == {1}
    kit.plan(7, [5], next_pass=(8, [6]))
    assert int(kit.load(5, 7)[0][0, 0]) == 5
    assert wait_until(lambda: (pool.plan_status().next_pass or ahead_none).all_started)
    items = list(kit.stream(count_up, 2))  # a stream needs an idle worker: the next pass goes
    status = pool.plan_status()
    assert [int(d["i"]) for d in items] == [0, 1] and status.next_pass is None and not status.next_pass_expected
    assert wait_until(pool.idle)
    assert slots_in_use(kit) == 0


def test_to_dataset_starts_each_next_epoch_ahead_in_its_own_order(kit):
    pool = kit._dispatcher
    made = pool.plan_status().plans_made  # the pool is shared with the other tests
    ds = kerasfeed.to_dataset(kit.source, executor=kit, shuffle=True, seed=5)
    previous = None
    for epoch in range(3):
        got = [(int(x[0, 0]), int(m["epoch"])) for x, m in ds]
        order = [i for i, _ in got]
        assert sorted(order) == list(range(len(kit.source))) and {e for _, e in got} == {epoch}
        if previous is not None:
            assert order == previous.indices.tolist()  # what was started ahead was this pass
        previous = pool.plan_status().next_pass
        assert previous is not None and previous.epoch == epoch + 1 and previous.outstanding > 0
        assert previous.indices.tolist() != order  # a new permutation each epoch
    # Each pass started ahead was adopted by its own plan, not made again: one
    # plan for pass 0, then one per next pass (its order is a lazy view, matched by key).
    assert pool.plan_status().plans_made == made + 4


def test_a_load_far_ahead_of_the_plan_is_requested_directly_and_not_twice(kit):
    pool = kit._dispatcher
    order = list(range(100, 140))
    kit.plan(4, order)
    result = {}
    t = threading.Thread(target=lambda: result.update(x=kit.load(130, 4)))
    t.start()
    t.join(10)
    assert not t.is_alive(), "a load ahead of the plan waited for it"
    assert int(result["x"][0][0, 0]) == 130
    rest = [i for i in order if i != 130]
    assert [int(kit.load(i, 4)[0][0, 0]) for i in rest] == rest
    assert pool.plan_status().current is None  # complete: 130 was skipped, not requested again
    assert wait_until(lambda: pool.request_counts()[:2] == (0, 0))


class _Reshuffled(kerasfeed.SceneSequence):
    """Its hook changes it as every pass begins (an index list reshuffled); each call is logged to a file."""

    def __init__(self, log):
        super().__init__()
        self.log, self.shift = log, 0

    def __len__(self):
        return 24

    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return np.full((2,), i + self.shift, np.float32)

    def on_epoch_begin(self):
        self.shift += 100


def test_no_next_pass_is_made_ahead_for_a_source_its_hooks_change_at_every_begin(tmp_path):
    """Such a source's next begin sends the workers its new state and drops what they made of that pass ahead:
    20 calls thrown away over 4 passes of 24 items (what the window held at each begin). A pass that begins with a change
    now makes no next pass ahead; the batches are the same."""
    log = str(tmp_path / "calls")
    with kerasfeed.to_loader(_Reshuffled(log), batch_size=4, executor="processes", workers=2) as loader:
        passes = [np.concatenate(list(loader))[:, 0].tolist() for _ in range(4)]
        calls = len(open(log).read().split())
    assert passes == [[i + 100 * (p + 1) for i in range(24)] for p in range(4)]
    probes = len(loader._feed.probe_indices())
    assert calls == 4 * 24 + probes, calls
