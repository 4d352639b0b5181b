"""Generator streams in a worker: order, errors, back-pressure, worker death,
timeouts, and the pool's stats.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import numpy as np
import pytest
from _kit import count_up, drive, free_slots
from _util import wait_until

from kerasfeed import ProcessExecutor
from kerasfeed.errors import ItemError, WorkerError
from kerasfeed.execution.processes.options import PoolOptions

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------- streams (for generator sources)


def broken_after_two(_):
    yield np.zeros(1)
    yield np.ones(1)
    raise OSError("disk went away")


def endless_with_times(_):
    n = 0
    while True:
        yield np.array([n, time.time()])
        n += 1


def test_stream_yields_generator_items_in_order(kit):
    items = list(kit.stream(count_up, 5))
    assert [int(d["i"]) for d in items] == list(range(5))
    for i, d in enumerate(items):
        np.testing.assert_array_equal(d["x"], np.full(i + 1, i, np.int32))


def test_stream_error_names_item_and_worker_and_pool_survives(kit):
    it = kit.stream(broken_after_two, None, name="reader('a.csv')")
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(ItemError) as e:
        next(it)
    assert e.value.index == 2 and e.value.exc_type == "OSError"
    assert "reader('a.csv')[2] raised OSError in worker" in str(e.value) and "disk went away" in str(e.value)
    assert kit.load(7, 0)[0][0, 0] == 7


def test_stream_is_bounded_and_closing_it_frees_the_worker(kit):
    k = kit.options.in_flight_per_worker
    it = kit.stream(endless_with_times, None)
    made, taken = [], []
    for _ in range(k + 3):
        item = next(it)
        taken.append(time.time())
        made.append(item[1])
        assert item[0] == len(made) - 1
        time.sleep(0.3)
    # At most k items wait in shared memory, plus the one being made: item
    # k+1 could only be made once item 0 was taken, item k+2 once item 1 was
    # (unbounded, all would be made at once).
    assert made[k + 1] >= taken[0] - 0.05 and made[k + 2] >= taken[1] - 0.05
    it.close()
    assert wait_until(lambda: kit._dispatcher.request_counts().streams == 0, timeout=5)
    assert kit._dispatcher.idle() and all(free_slots(kit, w) == list(range(k)) for w in range(kit.workers))
    assert [int(x[0, 0]) for x, _ in drive(kit, range(6))] == list(range(6))


def dies_after_one(_):
    yield np.zeros(1)
    os._exit(5)


def test_stream_worker_death_is_reported():
    pool = ProcessExecutor.from_options(None, PoolOptions(workers=1), name="streams")
    try:
        it = pool.stream(dies_after_one, None)
        t0 = time.monotonic()
        got = []
        with pytest.raises(WorkerError, match=r"exited unexpectedly with exit code 5"):
            for _ in range(3):
                got.append(float(next(it)[0]))
        assert time.monotonic() - t0 < 10
        # The item sent before the death comes first, unless the death closed the pool (unmapping the
        # item's memory) before it was read: then the death is reported in its place, never another error.
        assert got in ([0.0], []), got
    finally:
        pool.close()


def test_an_item_read_after_the_worker_s_death_closed_the_pool_reports_the_death():
    pool = ProcessExecutor.from_options(None, PoolOptions(workers=1), name="streams")
    try:
        it = pool.stream(dies_after_one, None)
        # The death closes the pool; the sent item's memory is unmapped at the end of that shutdown
        # (``closed`` is set at its start: waiting for that alone read the item before the unmapping).
        assert pool._dispatcher.shut_down.wait(30), "the worker's death did not shut the pool down"
        assert pool._dispatcher.closed
        with pytest.raises(WorkerError, match=r"exited unexpectedly with exit code 5"):
            next(it)
    finally:
        pool.close()


def test_stats_report_startup_memory_and_consumer_cost(kit):
    drive(kit, range(30))
    s = kit.stats()
    assert s["workers"] == 2 and s["in_flight_limit"] == 4
    assert 0 < s["startup_s"] < 60
    # a light worker: far below TensorFlow's ~500 MB
    assert 0 < s["rss_mb_per_worker"] < 300 and 0 < s["uss_mb_per_worker"] <= s["rss_mb_per_worker"]
    assert s["items"] >= 30 and s["consumer_us_per_item"] > 0
    print(
        f"\nworker start-up {s['startup_s']:.2f} s, RSS {s['rss_mb_per_worker']:.0f} MB "
        f"(USS {s['uss_mb_per_worker']:.0f} MB), consumer {s['consumer_us_per_item']:.0f} us/item"
    )


def slow_start(_):
    time.sleep(30)
    yield np.zeros(1)


def test_stream_timeout_stops_a_stuck_task():
    pool = ProcessExecutor.from_options(None, PoolOptions(workers=1, timeout=0.5), name="streams")
    try:
        pool.wait_ready(60)  # the worker's start-up is not the task's time (a busy machine took seconds)
        it = pool.stream(slow_start, None, name="stuck()")
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"produced no item of stuck\(\) within timeout=0.5 s"):
            next(it)
        assert time.monotonic() - t0 < 15  # the task sleeps 30 s: the timeout, then the kill, 4x slower under load
    finally:
        pool.close()
