"""How many workers by default, and the priority they run at (NOTE [ Default worker count ])."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest

from kerasfeed import ProcessExecutor
from kerasfeed.execution.processes.options import MAX_DEFAULT_WORKERS, NICE_ENV, PoolOptions, default_workers

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Niceness:
    """Item i: the worker's pid and its own niceness (os.nice(0) reads it)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid(), os.nice(0)


@pytest.mark.parametrize(
    "cpus, workers",
    [(1, 1), (2, 2), (3, 2), (4, 3), (8, 7), (9, 7), (16, 14), (24, 22), (34, 32), (64, MAX_DEFAULT_WORKERS), (192, 32)],
)
def test_default_workers_leave_the_consumer_cpus(cpus, workers):
    assert default_workers(cpus) == workers


def test_pool_options_default_to_the_machine_and_nice_workers(monkeypatch):
    monkeypatch.delenv(NICE_ENV, raising=False)
    opts = PoolOptions()
    assert opts.worker_nice == 10 and opts.resolved().workers == default_workers()
    monkeypatch.setenv(NICE_ENV, "3")
    assert PoolOptions().worker_nice == 3 and PoolOptions(worker_nice=0).worker_nice == 0
    monkeypatch.setenv(NICE_ENV, "lots")
    with pytest.raises(ValueError, match=r"`KERASFEED_WORKER_NICE` must be an int from 0 to 19.*Received: KERASFEED_WORKER_NICE='lots'"):
        PoolOptions()
    with pytest.raises(ValueError, match=r"`worker_nice` must be an int from 0 to 19.*Received: worker_nice=20"):
        PoolOptions(worker_nice=20)
    with pytest.raises(ValueError, match=r"`worker_nice` must be a non-negative int. Received: worker_nice=-1"):
        PoolOptions(worker_nice=-1)


def test_workers_run_at_the_configured_niceness():
    """Real workers: os.nice(0) inside them and getpriority from here agree."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (5, 0):
        ex = ProcessExecutor(Niceness(), workers=1, worker_nice=nice)
        try:
            pid, inside = ex.load(0, 0)
            assert inside == min(19, own + nice), (nice, own, inside)
            assert os.getpriority(os.PRIO_PROCESS, int(pid)) == inside
            assert ex.pids == [int(pid)]
        finally:
            ex.close()


@pytest.mark.parametrize("workers", [3, 8, None])
def test_no_more_workers_start_than_a_pass_has_items(workers, monkeypatch):
    """A 4-item source (a small validation set) starts 4 workers, not 8 or the machine's default."""
    import psutil

    from kerasfeed.execution.processes import options as pool_options

    monkeypatch.setattr(pool_options, "usable_cpus", lambda: 16)  # default_workers() is 14 here
    ex = ProcessExecutor(Niceness(), workers=workers)
    try:
        expected = 3 if workers == 3 else 4
        assert ex.workers == expected and len(ex.pids) == expected
        assert len(psutil.Process().children()) == expected
        pids = {ex.load(i, 0)[0] for i in range(4)}  # every item is still made, by the workers started
        assert pids <= set(ex.pids)
    finally:
        ex.close()
