"""Reliability of worker processes: they die with their parent (even inside
a GIL-holding C call or stopped), the timeout counts from ready, running out
of file descriptors is reported as such (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "reliability_scripts"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(_gone(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.02)
    return float("inf")


@pytest.mark.parametrize("stop_one", [False, True], ids=["in-C-call", "one-stopped"])
def test_workers_die_with_a_killed_parent(tmp_path, stop_one):
    """The parent is SIGKILLed while both workers are inside a 60 s libc
    ``sleep`` called with the GIL held (and, in one case, one worker is also
    SIGSTOPped): the kernel's parent-death signal must end them at once."""
    env = {**os.environ, "MARKS": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(SCRIPTS / "orphan_workers.py")], stdout=subprocess.PIPE, env=env, text=True)
    workers = []
    try:
        info = json.loads(parent.stdout.readline())
        workers = info["workers"]
        if stop_one:
            os.kill(workers[0], signal.SIGSTOP)
        parent.kill()
        parent.wait()
        took = _wait_gone(workers, 20)
        assert took < 10, f"workers {workers} outlived their SIGKILLed parent by more than 10 s"
    finally:
        parent.kill()
        parent.wait()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class _Square:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import numpy as np

        return np.full(2, i * i)


def test_workers_started_from_a_short_lived_thread_outlive_that_thread():
    """The parent-death signal follows the thread that forked the worker;
    workers are launched from a lasting thread, so the pool keeps working."""
    import threading

    from kerasfeed.execution.processes.executor import ProcessExecutor

    box = []
    t = threading.Thread(target=lambda: box.append(ProcessExecutor(_Square(), workers=1)))
    t.start()
    t.join()
    ex = box[0]
    try:
        ex.wait_ready(60)
        time.sleep(0.5)  # the thread is long gone
        assert [int(ex.load(i, 0)[0]) for i in range(4)] == [0, 1, 4, 9]
    finally:
        ex.close()


def _slow_init():
    time.sleep(2.5)


class _StuckAt3:
    def __len__(self):
        return 6

    def __getitem__(self, i):
        import numpy as np

        if i == 3:
            time.sleep(60)
        return np.full(2, i)


def test_timeout_starts_when_the_worker_is_ready():
    """A 2.5 s worker_init with timeout=1 must not fail the first item; an
    item stuck after that does fail, naming the index."""
    from kerasfeed.errors import WorkerError
    from kerasfeed.execution.processes.executor import ProcessExecutor

    ex = ProcessExecutor(_StuckAt3(), workers=1, worker_init=_slow_init, timeout=1)
    try:
        assert int(ex.load(0, 0)[0]) == 0  # waited through the start-up
        with pytest.raises(WorkerError, match=r"did not return _StuckAt3\[3\] within timeout=1"):
            ex.load(3, 0)
    finally:
        ex.close()


def test_running_out_of_file_descriptors_is_reported_as_such():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fd_limit.py")], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < got["kept"] < 400, got
    err = got["error"]
    assert err.startswith("WorkerError: kerasfeed: this process ran out of file descriptors"), err
    assert f"RLIMIT_NOFILE) is {got['limit']}" in err and "ulimit -n" in err and err.endswith(f"open fds={err.rsplit('=', 1)[1]}"), err
