"""Sources and helpers shared by the process tests.

Registered with cloudpickle by value: they reach the workers like code
defined in a notebook cell or in ``__main__``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np
import psutil

import kerasfeed

cloudpickle.register_pickle_by_value(sys.modules[__name__])

Point = collections.namedtuple("Point", ["xy", "label"])


def record_init():
    info = kerasfeed.get_worker_info()
    os.environ["KF_TEST_INIT"] = json.dumps(
        {
            "id": info.id,
            "n": info.num_workers,
            "seed": info.seed,
            "np": int(np.random.randint(2**31)),
            "py": random.random(),
        }
    )


class Kit(kerasfeed.SceneSequence):
    """Item i: x full of i; a dict describing the process that made it.
    Items whose index ends in 999 raise."""

    def __init__(self, n=64, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 1000 == 999:
            raise ValueError(f"bad item {i}")
        info = kerasfeed.get_worker_info()
        meta = {
            "pid": np.int64(os.getpid()),
            "worker": np.int64(-1 if info is None else info.id),
            "epoch": np.int64(self.epoch),
            "tensorflow": "tensorflow" in sys.modules,
            "keras": "keras" in sys.modules,
            "init": os.environ.get("KF_TEST_INIT", ""),
        }
        return np.full((4, 3), i, np.float32), meta


def drive(ex, indices, epoch=0, threads=None):
    """What tf.data's ordered parallel map does: many concurrent loads, results in order."""
    with ThreadPoolExecutor(threads or ex.parallel_calls()) as tp:
        return list(tp.map(lambda i: ex.load(int(i), epoch), indices))


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_slots(ex, worker_id):
    """Worker ``worker_id``'s free shared-memory slots of a ``ProcessExecutor``, sorted."""
    d = ex._dispatcher
    with d.lock:
        return d.slots.free_slots(worker_id)


def slots_in_use(ex):
    """Slots in flight, lent to the consumer or streaming, over all workers."""
    d = ex._dispatcher
    with d.lock:
        return d.slots.in_use()


def wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def count_up(n):
    for i in range(n):
        yield {"i": np.int64(i), "x": np.full(i + 1, i, np.int32)}


def dataset_kinds(ds):
    kinds, stack = set(), [ds]
    while stack:
        d = stack.pop()
        kinds.add(getattr(d, "kind", None) if type(d).__name__ == "_Transformation" else type(d).__name__)
        stack.extend(d._inputs())
    return kinds
