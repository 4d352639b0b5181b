"""A load that waits for a slot (a pass started while an abandoned one still
has requests in flight, another loader on the same executor) gets the next
free slot before the plan's refill, and is woken by the answer that frees it,
not by the end of a poll slice; and an item that raises KeyboardInterrupt or
SystemExit in the worker is an item error, not a worker death.

Deterministic: the abandoned items wait for a file flag the test creates, and
the dispatcher's poll slice is made far longer than any test wait, so a load
that only the slice would wake fails the test instead of slowing it down.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest
from _util import wait_until

from kerasfeed import ProcessExecutor
from kerasfeed._keras_fit_frames import current_frames
from kerasfeed.errors import ItemError
from kerasfeed.execution.processes import dispatcher as dispatcher_module

# Classes below reach the workers by value, like code defined in `__main__`.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Longer than every wait below: only a notification wakes a waiting load in time.
_LONG_POLL_S = 120.0
_JOIN_S = 20.0


class Gated:
    """Items below 100 wait for the file ``gate_<i>`` in ``folder``; every
    item is ``[i, n]`` where ``n`` counts the items its worker made before."""

    def __init__(self, folder):
        self.folder = folder
        self.made = 0

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        if i < 100:
            flag, deadline = os.path.join(self.folder, f"gate_{i}"), time.monotonic() + 60
            while not os.path.exists(flag):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gate {i} was never opened")
                time.sleep(0.002)
        n, self.made = self.made, self.made + 1
        return np.array([i, n], np.int64)


def _open(folder, *indices):
    for i in indices:
        with open(os.path.join(folder, f"gate_{i}"), "w"):
            pass


def _waiting_for_a_slot(thread):
    """The thread sleeps on the dispatcher's condition (a load waiting for a slot)."""
    frame = current_frames().get(thread.ident)  # without the collector (kerasfeed/_keras_fit_frames.py)
    names = []
    while frame is not None:
        names.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))
        frame = frame.f_back
    return ("threading.py", "wait") in names and any(f == "dispatcher.py" for f, _ in names)


def _load_in_thread(ex, index, epoch):
    out = {}

    def run():
        try:
            out["item"] = ex.load(index, epoch)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run, name="test-direct-load", daemon=True)
    t.start()
    assert wait_until(lambda: _waiting_for_a_slot(t) or not t.is_alive())
    return t, out


@pytest.fixture
def gated(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "_POLL_S", _LONG_POLL_S)
    ex = ProcessExecutor(Gated(str(tmp_path)), workers=1, in_flight_per_worker=2)
    try:
        ex.wait_ready(60)
        yield ex, str(tmp_path)
    finally:
        _open(str(tmp_path), *range(100))  # nothing stays stuck in the worker
        ex.close()


def test_a_pass_after_an_abandoned_one_gets_its_first_item_before_the_plan_refills(gated):
    ex, folder = gated
    pool = ex._dispatcher
    ex.plan(0, list(range(10)))
    assert wait_until(lambda: pool.request_counts().pending == 2)  # items 0 and 1: every slot, both stuck
    # The pass is abandoned (`break`, Ctrl-C, `del it`) and a new one starts:
    # its plan cannot send anything while 0 and 1 are in flight.
    ex.plan(1, list(range(100, 110)))
    t, out = _load_in_thread(ex, 100, 1)  # the new pass's first item: a direct load waiting for a slot
    assert t.is_alive(), out
    _open(folder, 0, 1)
    t.join(_JOIN_S)
    assert not t.is_alive(), "the new pass's first load still waits for a slot"
    assert "error" not in out, out["error"]
    # Made right after the abandoned items 0 and 1, before any item the new
    # pass's plan requested ahead (before: after 101, 102 and 103, and woken
    # only by the end of a poll slice).
    assert out["item"].tolist() == [100, 2]
    assert [ex.load(i, 1).tolist() for i in (101, 102)] == [[101, 3], [102, 4]]
    assert sorted(ex.load(i, 1)[0] for i in range(103, 110)) == list(range(103, 110))
    assert wait_until(lambda: pool.request_counts()[:3] == (0, 0, 0))


def test_a_plan_s_answer_wakes_a_load_waiting_for_a_slot(gated):
    ex, folder = gated
    pool = ex._dispatcher
    ex.plan(0, list(range(10)))
    assert wait_until(lambda: pool.request_counts().pending == 2)
    # Another pass's load (another loader on this executor): every slot is the plan's.
    t, out = _load_in_thread(ex, 500, 7)
    assert t.is_alive(), out
    # Item 0 answered and waiting for its load: its slot no longer counts
    # against the direct load (which the worker then makes after item 1).
    _open(folder, 0, 1)
    t.join(_JOIN_S)
    assert not t.is_alive(), "an answer of the plan did not wake the load waiting for a slot"
    assert "error" not in out, out["error"]
    assert out["item"].tolist() == [500, 2]  # right after 0 and 1, before the plan's refill
    _open(folder, *range(100))
    assert [ex.load(i, 0)[0] for i in range(10)] == list(range(10))
    assert wait_until(lambda: pool.request_counts()[:3] == (0, 0, 0))


# ---------------------------------------------------------------- BaseException in the source


class Raising:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 3:
            raise KeyboardInterrupt
        if i == 4:
            raise SystemExit(4)
        if i == 5:
            raise GeneratorExit
        return np.full(2, i)


def raising_stream(kind):
    yield np.zeros(1)
    if kind == "kbi":
        raise KeyboardInterrupt
    raise SystemExit(4)


def test_keyboard_interrupt_and_system_exit_in_an_item_or_stream_are_item_errors():
    ex = ProcessExecutor(Raising(), workers=1)
    try:
        pids = ex.pids
        for index, kind in ((3, "KeyboardInterrupt"), (4, "SystemExit"), (5, "GeneratorExit")):
            with pytest.raises(ItemError) as e:
                ex.load(index, 0)
            assert e.value.index == index and e.value.exc_type == kind, str(e.value)
            assert f"Raising[{index}] raised {kind} in worker 0" in str(e.value)
        for kind, name in (("kbi", "KeyboardInterrupt"), ("exit", "SystemExit")):
            it = ex.stream(raising_stream, kind, name="gen")
            assert next(it)[0] == 0
            with pytest.raises(ItemError) as e:
                next(it)
            assert e.value.index == 1 and e.value.exc_type == name, str(e.value)
        # The pool is still usable, with the same worker.
        assert ex.load(7, 0).tolist() == [7, 7] and ex.pids == pids
    finally:
        ex.close()
