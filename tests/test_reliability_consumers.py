"""A stuck item without a timeout: deleting the iterator and Ctrl-C still end
the wait, the exit hook freezes the heap, and the exit joins the pool threads (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest

from kerasfeed.execution.waits import Wait, WaitAbandoned, WaitScope

SCRIPT = Path(__file__).parent / "reliability_scripts" / "stuck_consumer.py"
ROOT = Path(__file__).resolve().parents[1]
# Only tells a hang (items sleep 10 minutes) from a slow start on a loaded machine.
HARD_TIMEOUT_S = 150


def _start(executor: str, mode: str) -> subprocess.Popen:
    return _start_script(SCRIPT.name, executor, mode)


def _start_script(script: str, *args: str, env: Optional[dict] = None) -> subprocess.Popen:
    """Runs ``reliability_scripts/<script> args...`` with this checkout first on the path (and ``env`` set)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT.parent / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script hung (killed after {HARD_TIMEOUT_S} s); stdout: {out[-1500:]} stderr: {err[-1500:]}")


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("executor, mode", [("processes", "delete-break"), ("threads", "delete-del")])
def test_deleting_an_iterator_does_not_wait_for_a_stuck_item(executor, mode):
    """``break`` out of a loop, or ``del it``, while a load waits for an item
    that never comes (no timeout) returns, and the script exits with the
    dataset still alive, leaving no worker behind."""
    proc = _start(executor, mode)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["got"] == [0, 1, 2], got
    assert _gone(got["pids"]), got


@pytest.mark.parametrize(
    "executor, mode", [("threads", "sigint-next"), ("processes", "sigint-next"), ("processes", "sigint-take"),
                       ("threads", "sigint-fit")]
)
def test_ctrl_c_interrupts_a_main_thread_waiting_inside_tensorflow(executor, mode):
    """SIGINT while the main thread waits inside TensorFlow for a stuck item
    (``next(it)``; the end of ``take(3)``, where TensorFlow itself destroys
    the prefetching iterator; a ``fit`` step) raises KeyboardInterrupt; no worker is left.
    Before, under ``fit`` it came out as pybind11's ``RuntimeError: ... MISMATCH of original and
    normalized active exception types`` (the Ctrl-C handled in TensorFlow's error class's ``__init__``)."""
    proc = _start(executor, mode)
    first = json.loads(proc.stdout.readline())
    time.sleep(2.0)  # the main thread is blocked in TensorFlow by now
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert "not interrupted" not in out, out
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith("KeyboardInterrupt") and "MISMATCH" not in err, err[-3000:]
    assert _gone(first["pids"]), first


def test_a_wait_ends_when_the_last_consumer_goes_and_later_waits_do_not():
    scope = WaitScope()
    scope.consumer_started()
    scope.consumer_started()
    before = Wait(scope)
    scope.consumer_gone()
    before.check("x[1]")  # one consumer is left: the wait goes on
    scope.consumer_gone()
    with pytest.raises(WaitAbandoned, match=r"x\[1\].*Received: x\[1\]"):
        before.check("x[1]")
    Wait(scope).check("x[2]")  # begun after: waits as usual


def test_the_exit_hook_freezes_the_heap_after_retiring_iterators():
    """After the exit hook, objects alive at exit are out of the final
    collections (most of a busy machine's exit time went to those)."""
    code = (
        "import gc, numpy as np, kerasfeed\n"
        "from kerasfeed.tfdata import exit_guard\n"
        "class S:\n"
        "    def __len__(self): return 8\n"
        "    def __getitem__(self, i): return np.zeros(2, np.float32)\n"
        "ds = kerasfeed.to_dataset(S())\n"
        "it = iter(ds); next(it)\n"
        "assert gc.get_freeze_count() == 0\n"
        "print(exit_guard.retire_live_iterators(), gc.get_freeze_count() > 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HARD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "True"], proc.stdout


def test_the_exit_joins_kerasfeed_threads_within_one_bound():
    """At exit, kerasfeed stops the threads executor's pools and its other daemon threads and joins them (NOTE
    [ Pool threads at exit ]): a call that returns in a moment is waited for, one stuck for ever costs at most
    ``EXIT_JOIN_S`` in all, and the threads left are named in a debug log; under ``to_loader`` in a process that
    never imports TensorFlow (the pools' own exit hook) and under ``to_dataset`` (the exit guard's). Before, every
    pool thread ran on into finalization (58 of 64 after ``to_loader``), where a daemon thread ended inside a C++
    call aborts the process (a JAX child, rc -6, "FATAL: exception not rethrown"); so did a device prefetch
    thread (left to a finalizer) and the producers of streams (closed, not joined). The script's own exit hook,
    registered before kerasfeed's, runs after them and reports."""
    script = "threads_at_exit.py"
    loader = _start_script(script, "to_loader", "moment", "forever", "device", env={"KERAS_BACKEND": "numpy"})
    dataset = _start_script(script, "to_dataset", "moment", "generators", "queue")
    try:
        runs = {"to_loader": (loader, *_finish(loader)), "to_dataset": (dataset, *_finish(dataset))}
    finally:
        for proc in (loader, dataset):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    got = {}
    for front, (proc, out, err) in runs.items():
        assert proc.returncode == 0, (front, err[-3000:])
        got[front] = json.loads(out.strip().splitlines()[-1])
    assert got["to_loader"]["tf"] is False and got["to_dataset"]["tf"] is True, got
    assert set(got["to_loader"]["left"]) == {"moment", "forever", "device"}, got
    assert set(got["to_dataset"]["left"]) == {"moment", "generators", "queue"}, got
    assert all(n > 0 for run in got.values() for n in run["callers"].values()), got  # each had threads to join
    # Returned within the bound: joined, on both fronts.
    joined = {**got["to_dataset"]["left"], "device": got["to_loader"]["left"]["device"]}
    assert got["to_loader"]["left"]["moment"] == [] and all(v == [] for v in joined.values()), got
    from kerasfeed.execution.thread_tasks import EXIT_JOIN_S

    stuck = got["to_loader"]["left"]["forever"]
    assert stuck and all(name.startswith("kerasfeed-thread-") for name in stuck), got
    # One bound for all (not per thread); the rest is the slack of a busy 2-core machine.
    assert EXIT_JOIN_S - 0.5 < got["to_loader"]["exit_s"] < EXIT_JOIN_S + 5, got
    err = runs["to_loader"][2]
    assert f"{len(stuck)} thread(s) still in a call after {EXIT_JOIN_S} s" in err, err[-3000:]
