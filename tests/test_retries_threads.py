"""Retries on the threads executor: an item that raised or timed out is made
again on another thread; a timed-out call's thread is left behind, counted,
and replaced; used-up retries raise naming every attempt; a skipped item
lets the pass go on (docs/reliability.md, "Long runs: retries and recycled
workers")."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _util import wait_until

import kerasfeed
from kerasfeed.errors import ItemError, ItemTimeout
from kerasfeed.execution.threads import ThreadExecutor

N = 10


class Flaky:
    """Item ``i``: ``i`` and two draws of ``item_rng()``; items in ``bad`` fail
    (raise, or block until ``gate`` opens) on their first ``fails`` attempts."""

    def __init__(self, bad=(), how="raise", fails=1):
        self.bad, self.how, self.fails = set(bad), how, fails
        self.tries: dict[int, int] = {}
        self.lock = threading.Lock()
        self.gate = threading.Event()

    def __len__(self):
        return N

    def __getitem__(self, i):
        with self.lock:
            tries = self.tries.get(i, 0)
            self.tries[i] = tries + 1
        if i in self.bad and tries < self.fails:
            if self.how == "raise":
                raise ValueError(f"corrupt item {i}")
            self.gate.wait(60)  # stuck until the test ends
        return np.concatenate([[float(i)], kerasfeed.item_rng().random(2)])


def read_pass(ex, indices, epoch=0):
    ex.plan(epoch, indices)
    return [ex.load(i, epoch) for i in indices]


def fault_free():
    with ThreadExecutor(Flaky(), seed=0) as ex:
        return read_pass(ex, list(range(N)))


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_an_item_whose_first_attempt_fails_is_made_again_on_another_thread(how):
    expected = fault_free()
    src = Flaky([4], how)
    ex = ThreadExecutor(src, parallelism=4, seed=0, retries=1, timeout=0.5 if how == "hang" else None)
    try:
        got = read_pass(ex, list(range(N)))
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        assert src.tries[4] == 2 and all(src.tries[i] == 1 for i in range(N) if i != 4)
        gauges = ex.gauges()
        assert gauges["retried_items"] == 1 and gauges["failed_items"] == 0
        if how == "hang":
            assert gauges["abandoned_threads"] == 1 and gauges["abandoned_threads_running"] == 1
            assert len(ex._threads) == 4 and all(t.is_alive() for t in ex._threads)  # one took its place
            src.gate.set()  # the stuck call returns: its thread leaves, the pool keeps 4
            assert wait_until(lambda: ex.gauges()["abandoned_threads_running"] == 0)
            assert [int(x[0]) for x in read_pass(ex, list(range(N)), epoch=1)] == list(range(N))
            assert len(ex._threads) == 4
    finally:
        src.gate.set()
        ex.close()


def test_used_up_retries_raise_naming_every_attempt_and_the_pass_goes_on_after_a_skip():
    src = Flaky([3], "raise", fails=99)
    ex = ThreadExecutor(src, parallelism=4, seed=0, retries=2)
    try:
        ex.plan(0, list(range(N)))
        assert [int(ex.load(i, 0)[0]) for i in range(3)] == [0, 1, 2]
        with pytest.raises(ItemError) as info:
            ex.load(3, 0)
        err = info.value
        assert err.index == 3 and err.attempts == 3 and err.causes == ["ValueError: corrupt item 3"] * 3
        assert str(err).endswith("[3 attempts: 1) ValueError: corrupt item 3; 2) ValueError: corrupt item 3; "
                                 "3) ValueError: corrupt item 3]")
        ex.item_skipped(3, 0)
        assert [int(ex.load(i, 0)[0]) for i in range(4, N)] == list(range(4, N))
        assert src.tries[3] == 3
    finally:
        ex.close()


def test_a_call_that_times_out_every_time_fails_after_its_retries_and_leaves_the_pool_whole():
    src = Flaky([3], "hang", fails=99)
    ex = ThreadExecutor(src, parallelism=2, seed=0, retries=1, timeout=0.3)
    try:
        ex.plan(0, list(range(N)))
        with pytest.raises(ItemTimeout) as info:
            for i in range(4):
                ex.load(i, 0)
        err = info.value
        assert isinstance(err, TimeoutError) and err.index == 3 and err.attempts == 2
        assert all("timeout=0.3" in c for c in err.causes), err.causes
        ex.item_skipped(3, 0)  # the executor never closed: nothing to do
        assert [int(ex.load(i, 0)[0]) for i in range(4, N)] == list(range(4, N))
        assert ex.gauges()["abandoned_threads"] == 2 and len(ex._threads) == 2
    finally:
        src.gate.set()
        ex.close()


def test_without_retries_a_timeout_closes_the_executor_and_a_skip_opens_it_for_the_rest_of_the_pass():
    src = Flaky([3], "hang", fails=99)
    ex = ThreadExecutor(src, parallelism=2, seed=0, timeout=0.3)
    try:
        ex.plan(0, list(range(N)))
        assert [int(ex.load(i, 0)[0]) for i in range(3)] == [0, 1, 2]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"\[3\].*the dataset's executor is closed") as info:
            ex.load(3, 0)
        assert time.monotonic() - t0 < 10
        assert isinstance(info.value, ItemTimeout) and info.value.attempts == 1
        with pytest.raises(TimeoutError):  # fail-fast as always
            ex.load(4, 0)
        ex.item_skipped(3, 0)
        assert [int(ex.load(i, 0)[0]) for i in range(4, N)] == list(range(4, N))
        assert src.tries[3] == 1 and ex.gauges()["abandoned_threads"] == 1
    finally:
        src.gate.set()
        ex.close()


def test_retries_are_checked_by_name():
    with pytest.raises(ValueError, match=r"ThreadExecutor: `retries` must be a non-negative int. Received: retries=-2"):
        ThreadExecutor(Flaky(), retries=-2)
