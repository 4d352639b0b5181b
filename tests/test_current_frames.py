"""``find_fit`` looks at every thread's frames without the CPython 3.11 deadlock.

NOTE [ sys._current_frames and the garbage collector ] (kerasfeed/_keras_fit.py):
a collection inside ``sys._current_frames()`` that runs a finalizer starting or
joining a thread (closing a thread pool does) deadlocks on the runtime's
thread-list lock, inside C. Each pass begun under ``model.fit`` looks for the
fit that way. The script below makes that collection happen on every call; it
runs in its own process, since the deadlock cannot be interrupted.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc, sys, threading
    from kerasfeed._keras_fit import current_frames

    look = current_frames if sys.argv[1] == "kerasfeed" else sys._current_frames
    stop = threading.Event()

    def spin():  # a thread whose frames have no frame objects yet: each look makes some (allocations)
        k = 0
        while not stop.is_set():
            k = (lambda v: v + 1)(k)

    class ClosesAPool:
        def __del__(self):
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    spinner = threading.Thread(target=spin)
    spinner.start()
    gc.set_threshold(1, 1, 1)
    for i in range(300):
        garbage = ClosesAPool()
        garbage.me = garbage
        del garbage
        look()
    stop.set()
    spinner.join()
    print("done", gc.isenabled())
    """
)


def _run(how: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=timeout)


def test_current_frames_never_deadlocks_with_a_collection_that_joins_a_thread():
    done = _run("kerasfeed", timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["done", "True"]  # the collector is on again after each look


def test_find_fit_looks_through_current_frames(monkeypatch):
    from kerasfeed import _keras_fit

    calls = []

    def spy():
        calls.append(1)
        return sys._current_frames()

    monkeypatch.setattr(_keras_fit, "current_frames", spy)
    assert _keras_fit.find_fit(lambda x: False) is None and calls == [1]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython 3.12 holds the collector off itself (cpython#106883)")
def test_the_scenario_deadlocks_plain_sys_current_frames():
    """The control: the same script with ``sys._current_frames()`` itself never finishes on 3.11."""
    with pytest.raises(subprocess.TimeoutExpired):
        _run("plain", timeout=5)
