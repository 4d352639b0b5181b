"""Ray started by kerasfeed ends with its owner, even one killed by SIGKILL.

NOTE [ Ray started by kerasfeed ends with its owner ]
``ray.init()`` without an address starts the GCS, a raylet and the raylet's
agents as this process's children. A process killed by SIGKILL (a preempted
machine, the OOM killer) runs no exit hook: its GCS and raylet go with it, but
the agents (dashboard, runtime-env) wait for the dead GCS about a minute
before they exit (Ray 2.60 on the 2-core machine: 42 to 90 s). So with the
Ray it starts kerasfeed starts a guard: a small process holding the read end
of a pipe whose write end only the owner holds, following the processes Ray
started (and theirs: the actors' workers) by pid and start time. When the
owner ends, however it ends, the pipe reads end-of-file and the guard kills
what is still alive of them (a reused pid is never hit: its start time
differs), then exits (after ``ray.shutdown()``, only exits). It ignores
Ctrl-C (the owner's shutdown closes the pipe) and imports only psutil.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

import psutil

SCAN_S = 1.0  # how often the guard looks for processes Ray started since (the actors' workers)

_GUARD = r"""
import json, os, select, signal, sys
import psutil
signal.signal(signal.SIGINT, signal.SIG_IGN)
roots, scan_s = json.loads(sys.stdin.readline())
known = {}
def remember(p):
    try:
        known.setdefault(p.pid, p.create_time())
    except psutil.Error:
        pass
fd = sys.stdin.fileno()
while True:
    for pid, created in roots:
        try:
            root = psutil.Process(pid)
            if root.create_time() != created:
                continue
            remember(root)
            for child in root.children(recursive=True):
                remember(child)
        except psutil.Error:
            pass
    ready, _, _ = select.select([fd], [], [], scan_s)
    if ready and not os.read(fd, 4096):
        break
for pid, created in known.items():
    try:
        p = psutil.Process(pid)
        if p.create_time() == created:
            p.kill()
    except psutil.Error:
        pass
"""


def descendants() -> set:
    """``{(pid, start time)}`` of this process's descendants now."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            out.add((p.pid, p.create_time()))
        except psutil.Error:
            pass
    return out


class Guard:
    """The guard of the processes ``ray.init()`` started here (``before``: the descendants before it).
    ``close()`` once Ray is shut down; the owner's end, however it comes, does the same."""

    def __init__(self, before: set):
        roots = sorted(descendants() - before)
        self._proc: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-c", _GUARD], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
        )
        self._proc.stdin.write((json.dumps([roots, SCAN_S]) + "\n").encode())
        self._proc.stdin.flush()

    def close(self, timeout: float = 10.0) -> None:
        """Ends the guard (it kills what is left of Ray's processes first), and waits for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


__all__ = ["Guard", "descendants"]
