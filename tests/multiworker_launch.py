"""Runs a script as N ``tf.distribute`` workers on 127.0.0.1 (test helper).

Free ports are picked at run time; every worker gets its ``TF_CONFIG``; a
hard timeout applies to the whole group, and when one worker fails (or time
runs out) every other one is killed, so a stuck collective never outlives
the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Sequence


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, however it dies (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the timeout and finally still apply
        pass


def run_workers(script: str, args: Sequence[str], num_workers: int = 2, timeout: float = 240.0, cwd=None) -> list[str]:
    """Runs ``script args`` once per worker; returns each worker's output.

    Raises:
        AssertionError: a worker failed or the group timed out (with every
            worker's output tail).
    """
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(num_workers)]}
    procs, logs = [], []
    for k in range(num_workers):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": k}}))
        log = open(os.path.join(cwd or ".", f"worker_{k}.log"), "w+") if cwd else subprocess.PIPE
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, cwd=cwd, stdout=log,
                                      stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                failed = f"a worker exited with {codes}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = f"the workers did not finish within {timeout:.0f} s (exit codes {codes})"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failed:
        tails = "\n".join(f"--- worker {k} ---\n{out[-3000:]}" for k, out in enumerate(outputs))
        raise AssertionError(f"{failed}\n{tails}")
    return outputs
