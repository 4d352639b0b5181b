"""The threads executor: a pass planned ahead on a pool of Python threads."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from _util import wait_until

import kerasfeed
from kerasfeed.errors import ItemError
from kerasfeed.execution.threads import ThreadExecutor
from kerasfeed.execution.waits import WaitAbandoned


class Recorder:
    """Item i = i; records which thread made which index, and how often."""

    def __init__(self, n=40, delay=0.0, fail=None):
        self.n, self.delay, self.fail = n, delay, fail
        self.lock = threading.Lock()
        self.calls = collections.Counter()
        self.threads = {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.calls[i] += 1
            self.threads[i] = threading.current_thread().name
        if i == self.fail:
            raise ValueError(f"cannot make {i}")
        return np.full((2,), i, np.int64)



@contextlib.contextmanager
def _executor(source, parallelism):
    ex = ThreadExecutor(source, parallelism=parallelism)
    try:
        yield ex
    finally:
        ex.close()


def test_a_plan_makes_items_ahead_on_pool_threads_in_order():
    src = Recorder(n=10)
    with _executor(src, 4) as ex:
        order = [7, 3, 9, 0, 1, 2, 4, 5, 6, 8]
        ex.plan(0, order)
        # Before any load: the first `parallelism` items of the pass are made.
        assert wait_until(lambda: sum(src.calls.values()) == 4)
        assert set(src.calls) == set(order[:4])
        got = [int(ex.load(i, 0)[0]) for i in order]
        assert got == order
        assert all(src.calls[i] == 1 for i in order)  # each made once
        assert all(name.startswith("kerasfeed-thread-") for name in src.threads.values())
        # Outside the plan (another pass, no plan for it): made in the caller.
        assert int(ex.load(5, 1)[0]) == 5
        assert src.threads[5] == threading.current_thread().name


def test_loads_ahead_of_the_window_run_in_the_caller_and_are_not_made_twice():
    src = Recorder(n=12, delay=0.01)
    with _executor(src, 2) as ex:
        ex.plan(0, list(range(12)))
        assert int(ex.load(8, 0)[0]) == 8  # far ahead: not started yet
        assert src.threads[8] == threading.current_thread().name
        rest = [i for i in range(12) if i != 8]
        assert [int(ex.load(i, 0)[0]) for i in rest] == rest
        assert all(src.calls[i] == 1 for i in range(12)), src.calls
        assert ex._plan is None  # the pass is complete


class Gated:
    """Items from ``stuck_from`` on wait for ``gate`` (at most 20 s, so a
    regression fails instead of hanging); records who made each item."""

    def __init__(self, n=12, stuck_from=0):
        self.n, self.stuck_from = n, stuck_from
        self.gate = threading.Event()
        self.threads = {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.threads[i] = threading.current_thread().name
        if i >= self.stuck_from:
            self.gate.wait(20)
        return np.full((2,), i, np.int64)


def _load_in_a_thread(ex, index, epoch=0):
    """Runs ``ex.load`` on another thread (as tf.data's map threads do);
    returns the thread and a dict that gets ``value`` or ``error``."""
    out = {}

    def body():
        try:
            out["value"] = ex.load(index, epoch)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_a_load_ahead_of_a_stuck_window_can_still_be_abandoned():
    """Off the main thread, an item the pool has not started is made on a
    thread of its own: the load waits for it like any other, so the consumer
    leaving ends the wait (before, the calling thread ran the stuck item
    itself, and at exit TensorFlow's join of that thread hung)."""
    src = Gated(n=12)
    ex = ThreadExecutor(src, parallelism=2)
    try:
        began = threading.Event()  # the load's wait is in progress (a leave before it does not count)
        begin = ex.waits.begin
        ex.waits.begin = lambda **kw: (began.set(), begin(**kw))[1]
        ex.plan(0, list(range(12)))
        assert wait_until(lambda: len(src.threads) == 2)  # the window: items 0 and 1, both stuck
        t, out = _load_in_a_thread(ex, 5)
        assert began.wait(10) and wait_until(lambda: 5 in src.threads)
        assert src.threads[5] == "kerasfeed-thread-aside"
        ex.waits.cancel()  # what the last iterator's deletion does
        t.join(5)
        assert not t.is_alive(), "the load went on waiting after its consumer left"
        assert isinstance(out.get("error"), WaitAbandoned), out
        assert "[5]" in str(out["error"])
    finally:
        src.gate.set()
        ex.close()


@pytest.mark.parametrize("caller", ["main thread", "other thread"])
def test_timeout_holds_for_a_load_outside_the_plan(caller):
    """``timeout=`` bounds an item loaded outside the plan too (before, such
    a load ran the item in the caller, unbounded)."""
    src = Gated(n=4, stuck_from=2)
    ex = ThreadExecutor(src, parallelism=2, timeout=0.3)
    try:
        assert int(ex.load(0, 0)[0]) == 0  # no plan: a quick item is simply made
        t0 = time.monotonic()
        if caller == "main thread":
            with pytest.raises(TimeoutError, match=r"\[3\].*timeout=0.3"):
                ex.load(3, 0)
        else:
            t, out = _load_in_a_thread(ex, 3)
            t.join(10)
            assert isinstance(out.get("error"), TimeoutError), out
        assert time.monotonic() - t0 < 10  # the gate opens only after 20 s
    finally:
        src.gate.set()
        ex.close()


def test_loads_after_a_timeout_raise_the_same_item_timeout():
    """The executor is closed by a timed-out item, and every later load raises that error: an ItemTimeout (an
    ItemError with the index), not a bare TimeoutError an `except kerasfeed.ItemError` misses (helper, 2 of 2)."""
    from kerasfeed.errors import ItemTimeout

    src = Gated(n=4, stuck_from=2)
    ex = ThreadExecutor(src, parallelism=2, timeout=0.3)
    try:
        with pytest.raises(ItemTimeout) as first:
            ex.load(3, 0)
        for _ in range(2):
            with pytest.raises(ItemTimeout) as later:
                ex.load(0, 1)
            assert later.value.index == first.value.index == 3 and str(later.value) == str(first.value)
    finally:
        src.gate.set()
        ex.close()


def test_an_error_made_ahead_is_raised_by_the_load_that_takes_it():
    src = Recorder(n=6, fail=3)
    with _executor(src, 4) as ex:
        ex.plan(0, list(range(6)))
        assert [int(ex.load(i, 0)[0]) for i in range(3)] == [0, 1, 2]
        with pytest.raises(ItemError) as info:
            ex.load(3, 0)
        msg = str(info.value)
        assert "3" in msg and "ValueError" in msg and "cannot make 3" in msg
        assert [int(ex.load(i, 0)[0]) for i in (4, 5)] == [4, 5]


def test_a_new_pass_drops_the_items_the_old_one_did_not_start():
    src = Recorder(n=200, delay=0.005)
    with _executor(src, 4) as ex:
        ex.plan(0, list(range(200)))
        assert int(ex.load(0, 0)[0]) == 0  # then the consumer abandons the pass
        ex.plan(1, [10, 11])
        assert [int(ex.load(i, 1)[0]) for i in (10, 11)] == [10, 11]
        time.sleep(0.1)
        # Only what the old pass had started (its window) was made, not all 200.
        assert sum(src.calls.values()) < 20


def test_large_items_are_made_fewer_at_a_time_ahead():
    class Big:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.full(1_000_000, i, np.uint8)  # 1 MB

    ex = ThreadExecutor(Big(), parallelism=16, bytes_ahead=4_000_000)
    try:
        assert int(ex.load(0, 0)[0]) == 0  # a probe: the item size is known from now on
        ex.plan(0, range(40))
        time.sleep(0.2)
        assert ex._plan.outstanding == 4  # 4 MB ahead, not 16 items
        assert [int(ex.load(i, 0)[0]) for i in range(40)] == list(range(40))
    finally:
        ex.close()


def test_close_and_garbage_collection_stop_the_pool_threads():
    # Checks this executor's own threads: other tests' datasets may be
    # collected (and their threads stop) at any moment in between.
    ex = ThreadExecutor(Recorder(n=5), parallelism=3)
    ex.plan(0, range(5))
    mine = list(ex._threads)
    assert len(mine) == 3 and all(t.is_alive() and t.name.startswith("kerasfeed-thread-") for t in mine)
    ex.close()
    assert wait_until(lambda: not any(t.is_alive() for t in mine))
    # Refused, as worker processes refuse (it made every item inline, one at a time: a closed threads loader
    # ran its next pass at one item at a time without a word).
    with pytest.raises(RuntimeError, match=r"the thread executor of Recorder is closed; create the dataset \(or loader\) "
                                           r"again. Received: index=2"):
        ex.load(2, 0)
    t, out = _load_in_a_thread(ex, 3)  # other threads (tf.data's, at exit) start no more calls
    t.join(10)
    assert isinstance(out.get("error"), RuntimeError) and "is closed" in str(out["error"]), out
    ex.plan(1, range(5))  # a closed executor plans nothing
    assert not ex._threads and not any(t.is_alive() for t in mine)  # none restarted; close() let go of them

    ds = kerasfeed.to_dataset(Recorder(n=8))
    assert [int(x[0]) for x in ds] == list(range(8))
    mine = list(ds._kerasfeed_executor._threads)
    assert len(mine) == 64 and all(t.is_alive() for t in mine)
    del ds
    gc.collect()
    assert wait_until(lambda: not any(t.is_alive() for t in mine))


def test_to_dataset_reads_through_the_plan_and_an_explicit_parallel_map_still_works():
    src = Recorder(n=30)
    ds = kerasfeed.to_dataset(src, shuffle=True, seed=4)
    first = [int(x[0]) for x in ds]
    assert sorted(first) == list(range(30)) and first != list(range(30))
    assert all(name.startswith("kerasfeed-thread-") for i, name in src.threads.items())
    parallel = kerasfeed.to_dataset(src, shuffle=True, seed=4, num_parallel_calls=8)
    assert [int(x[0]) for x in parallel] == first  # same seed, same first pass


class ReusingBuffers:
    """A source that returns one buffer per thread, overwritten by the thread's next item (400 KB: large enough
    for TensorFlow to take the array without a copy)."""

    def __init__(self, n=64):
        self.n, self.local = n, threading.local()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not hasattr(self.local, "buffer"):
            self.local.buffer = np.zeros(100_000, np.float32)
        self.local.buffer[:] = i
        time.sleep(0.001)
        return self.local.buffer


@pytest.mark.parametrize("how", [{"copy": True}, {"copy": True, "batch_size": 4}, {"cache": "memory"},
                                 {"cache": "memory", "batch_size": 4}])
def test_to_dataset_keeps_items_of_a_source_that_reuses_one_buffer_per_thread(how):
    """Before: 40-48 of 64 items held a later item's values (the threads run up to 64 items ahead, and tf.data
    read the buffer after its thread had reused it); to_dataset had no `copy=`. With cache= the pass that
    stored an item handed on the source's buffer, not the stored copy later passes read: its first pass was
    wrong and the others right."""
    ds = kerasfeed.to_dataset(ReusingBuffers(), executor="threads", **how)
    for _ in range(2):
        firsts = [float(x) for b in ds for x in np.reshape(b.numpy(), (-1, 100_000))[:, 0]]
        assert firsts == list(range(64))
    with pytest.raises(TypeError, match=r"`copy` must be True or False. Received: copy='yes'"):
        kerasfeed.to_dataset(ReusingBuffers(), copy="yes")


class AstRaceOnce(Recorder):
    """Fails chosen indices the way CPython 3.11.7's AST race does, ``times`` times each."""

    def __init__(self, n, racy, times=1, message="AST constructor recursion depth mismatch (before=33, after=31)"):
        super().__init__(n)
        self.racy, self.times, self.message = racy, times, message

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if i in self.racy and self.calls[i] <= self.times:
            raise SystemError(self.message)
        return item


def test_an_item_failed_only_by_cpython_s_ast_race_is_made_again_and_warned_about(monkeypatch):
    # python/cpython#106905 (np.load's header parse on threads; fixed in 3.11.8).
    from kerasfeed.execution import interpreter_races

    monkeypatch.setattr(interpreter_races, "_warned", threading.Event())
    def run(source):
        loader = kerasfeed.to_loader(source, batch_size=None, executor=ThreadExecutor(source, parallelism=3))
        return [int(x[0]) for x in loader]

    clean = Recorder(12)
    assert run(clean) == list(range(12))
    source = AstRaceOnce(12, racy={0, 5, 11})
    with pytest.warns(RuntimeWarning, match=r"AstRaceOnce\[\d+\].*3\.11\.8"):
        assert run(source) == list(range(12))
    # each racy index made once more than in a clean run (the loader also probes some items)
    assert {i: source.calls[i] - clean.calls[i] for i in range(12)} == {i: int(i in (0, 5, 11)) for i in range(12)}


def test_other_system_errors_and_a_race_that_never_ends_still_fail_the_item(monkeypatch):
    from kerasfeed.execution import interpreter_races

    other = AstRaceOnce(4, racy={2}, message="some other interpreter failure")
    with contextlib.closing(ThreadExecutor(other, parallelism=2)) as ex:
        with pytest.raises(ItemError, match=r"\[2\].*some other") as info:
            ex.load(2, 0)
    assert info.value.index == 2 and other.calls[2] == 1

    monkeypatch.setattr(interpreter_races, "_warned", threading.Event())
    endless = AstRaceOnce(4, racy={1}, times=10**6)
    with contextlib.closing(ThreadExecutor(endless, parallelism=2)) as ex:
        with pytest.raises(ItemError, match="recursion depth mismatch"), pytest.warns(RuntimeWarning):
            ex.load(1, 0)
    assert endless.calls[1] == interpreter_races.AST_RACE_RETRIES + 1


def test_a_closed_loader_over_a_shared_executor_refuses_its_next_pass_and_leaves_the_executor_open():
    """A loader given an executor closed nothing and went on reading after close() (the docs: its next pass is
    refused); the executor stays open for its other loaders."""
    rows = np.arange(6.0)[:, None]
    with contextlib.closing(ThreadExecutor(rows, parallelism=2)) as ex:
        loader = kerasfeed.to_loader(rows, executor=ex)
        loader.close()
        with pytest.raises(RuntimeError, match=r"this loader was closed .*make the loader again"):
            list(loader)
        assert [int(x[0]) for x in kerasfeed.to_loader(rows, executor=ex)] == list(range(6))


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_closed_loader_refuses_its_next_pass_on_every_executor(executor):
    """A closed threads loader made its next pass one item at a time on the main thread, without a word;
    a closed processes loader refused. Both refuse now."""
    kw = {"workers": 2} if executor == "processes" else {}
    loader = kerasfeed.to_loader(np.arange(6.0)[:, None], executor=executor, **kw)
    assert [int(x[0]) for x in loader] == list(range(6))
    loader.close()
    with pytest.raises(RuntimeError, match=r"this loader was closed .*make the loader again"):
        list(loader)
    # The executor itself refuses too (a pass started without the loader's check).
    with pytest.raises((RuntimeError, kerasfeed.WorkerError), match=r"is closed; create the dataset \(or loader\) again"):
        loader.executor.plan(1, [0, 1])
        loader.executor.load(0, 1)


def test_a_forked_child_is_refused_the_parent_s_threads_not_left_waiting(tmp_path):
    """A fork after the loader was read (a fork-based multiprocessing.Pool): the child queued its items for the
    parent's threads, which it does not have, and waited for ever (6 of 6)."""
    loader = kerasfeed.to_loader(Recorder(40), batch_size=4, executor="threads")
    it = iter(loader)
    next(it)
    out = tmp_path / "child.txt"
    pid = os.fork()
    if pid == 0:  # the child: its answer in a file, killed by SIGALRM should it wait
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler: the default ends it
        signal.alarm(20)
        try:
            sum(1 for _ in loader)
            out.write_text("read")
        except Exception as e:  # noqa: BLE001 - the answer
            out.write_text(f"{type(e).__name__}: {e}")
        os._exit(0)
    deadline, status = time.monotonic() + 60, None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = code if done else time.sleep(0.1)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    loader.close()
    assert os.WIFEXITED(status), f"the child was killed by signal {os.WTERMSIG(status)} (it waited)"
    assert re.fullmatch(rf"WorkerError: kerasfeed: the threads of the executor of Recorder belong to process "
                        rf"{os.getpid()}; it cannot be used from the forked process \d+\. Create the dataset in that "
                        r"process instead\.", out.read_text()), out.read_text()


def test_system_exit_in_an_item_on_a_pool_thread_is_that_item_s_error():
    """A library's sys.exit() on a bad record came out bare (to_loader) or without index or source (to_dataset);
    worker processes name the item (helper, 2 of 2)."""

    class Exits:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i == 3:
                raise SystemExit(2)
            return np.full(3, i, np.float32)

    with kerasfeed.to_loader(Exits(), executor="threads") as loader:
        with pytest.raises(ItemError, match=r"Exits\[3\] raised SystemExit: 2") as info:
            list(loader)
    assert info.value.index == 3
