"""Shared test fixtures.

After EVERY test, ``_no_leftover_processes_or_shared_memory`` checks that the
test left no child process and no kerasfeed shared-memory segment behind
(worker processes never outlive their owner; shared memory is never leaked).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import psutil
import pytest

# NOTE [ A hang that pytest-timeout cannot end ]
# pytest-timeout (setup.cfg, 300 s) raises from a SIGALRM handler, which Python
# runs only when the main thread executes bytecode: a test stuck inside C (a
# TensorFlow iterator's GetNext waiting on its py_function, a call holding the
# GIL) never sees it, and neither does its teardown after a timeout. Under
# pytest-xdist such a worker also stops answering the other worker's steal
# requests, so the whole run waits. faulthandler's watchdog is a C thread: past
# HARD_TIMEOUT_S it writes every thread's stack to the run's stderr and ends
# the worker process, which xdist reports as a crashed test before going on.
HARD_TIMEOUT_S = 420
_STDERR_FD: list[int] = []


def pytest_configure(config):
    if not _STDERR_FD:
        _STDERR_FD.append(os.dup(sys.__stderr__.fileno()))  # before tests capture fd 2


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True, file=_STDERR_FD[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# Children that exit a little after their owner is released (Keras' pools,
# kernels of executed notebooks) get this long.
LEFTOVER_GRACE_S = 5.0

# Interpreter-wide helper processes that multiprocessing starts once and keeps
# until exit by design (they are not owned by any test).
_SINGLETON_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


# Process trees a module-scoped fixture starts and owns for its whole module, by the
# fixture's name (``owned_process_trees`` below): not a test's leftovers.
_OWNED_TREES: dict[str, frozenset[int]] = {}


@pytest.fixture(scope="session")
def owned_process_trees() -> dict:
    """Where a module-scoped fixture registers the processes it starts for its whole
    module, whose descendants come and go with its tests (tests/test_ray.py's Ray cluster:
    GCS and raylets, whose pooled worker processes outlive the test that started them):
    ``owned_process_trees[fixture_name] = frozenset(root pids)``. The leftover check skips
    those roots and their descendants; the fixture deletes its key at its teardown, after
    checking that they are gone. Every other process is checked as before."""
    return _OWNED_TREES


def _owned(p: psutil.Process, owned: set) -> bool:
    try:
        return p.pid in owned or any(a.pid in owned for a in p.parents())
    except psutil.Error:
        return False


def _children() -> dict[int, str]:
    out = {}
    owned = set().union(*_OWNED_TREES.values())
    for p in psutil.Process().children(recursive=True):
        if owned and _owned(p, owned):
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out[p.pid] = f"<zombie, never waited for> {p.name()}"
                continue
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if any(h in cmd for h in _SINGLETON_HELPERS):
            continue
        out[p.pid] = cmd[:200]
    return out


def kerasfeed_shm_segments() -> list[str]:
    """Names in /dev/shm created by kerasfeed (it unlinks them at once)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("kerasfeed"))
    except FileNotFoundError:  # no /dev/shm (not Linux)
        return []


@pytest.fixture(autouse=True)
def _no_leftover_processes_or_shared_memory():
    before = set(_children())
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        left = {pid: cmd for pid, cmd in _children().items() if pid not in before}
        segments = kerasfeed_shm_segments()
        if not left and not segments:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Do not let the leak spill into the next tests' checks.
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    for name in segments:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    pytest.fail(
        f"the test left {len(left)} child process(es) alive after {LEFTOVER_GRACE_S} s: {left}; "
        f"and kerasfeed shared-memory segments in /dev/shm: {segments}",
        pytrace=False,
    )
