"""Runs a script as N ``tf.distribute`` workers or Keras/JAX processes on 127.0.0.1 (test helper).

Free ports are picked at run time; every worker gets its ``TF_CONFIG`` (or
its ``KERAS_DISTRIBUTION_*`` variables); a hard timeout applies to the whole
group, and when one worker fails (or time runs out) every other one is
killed, so a stuck collective never outlives the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence


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


def tf_config_env(k: int, ports: list[int]) -> dict:
    """Worker ``k``'s ``TF_CONFIG`` for a ``tf.distribute`` cluster on ``ports``."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": k}})}


def keras_jax_env(k: int, ports: list[int]) -> dict:
    """Process ``k``'s environment for ``keras.distribution.initialize()`` on JAX
    (CPU, two devices per process), its coordinator on the first port."""
    return {"KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{ports[0]}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(ports)), "KERAS_DISTRIBUTION_PROCESS_ID": str(k),
            "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def run_workers(script: str, args: Sequence[str], num_workers: int = 2, timeout: float = 240.0, cwd=None,
                env_for: Callable[[int, list[int]], dict] = tf_config_env) -> list[str]:
    """Runs ``script args`` once per worker; returns each worker's output.

    ``env_for(k, ports)``: what worker ``k``'s environment adds (``TF_CONFIG``
    by default, or ``keras_jax_env``); ``ports`` are free ones, one per worker.

    Raises:
        AssertionError: a worker failed or the group timed out (with every
            worker's output tail).
    """
    ports = free_ports(num_workers)
    procs, logs = [], []
    for k in range(num_workers):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1", **env_for(k, ports))
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
