"""Sources for the export tests: plain indexables in a module that imports neither TensorFlow
nor Keras, so worker processes and exporting scripts that import it start fast."""

from __future__ import annotations

import os
import time

import numpy as np

NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64", "complex64", "complex128")  # fmt: skip


class Mixed:
    """Tuples, dicts, bytes, str, variable shapes, scalars and every numeric dtype."""

    def __init__(self, n=13):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        numbers = {d: (rng.standard_normal((2, i % 3 + 1)) * 100).astype(d) for d in NUMERIC}
        numbers["uint64"] = np.array([[2**64 - 1 - i, i]], dtype="uint64")  # extremes survive
        words = np.array([f"w{j}-é" for j in range(i % 4)], dtype=object)  # may be empty
        return (
            {"numbers": numbers, "words": words, "raw": bytes([i, 0, 255]) * i, "id": np.int64(i)},
            (np.full((i % 5, 3), i, np.float32), f"item {i}"),
        )


class Slow:
    """Item i is (i, a payload of `size` bytes) after `delay` seconds; `bad`: index -> what goes wrong.

    A plain indexable (not a Keras PyDataset), so that a script using it never imports TensorFlow."""

    def __init__(self, n, delay=0.0, size=16, bad=None):
        self.n, self.delay, self.size, self.bad = n, delay, size, bad or {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        what = self.bad.get(i)
        if what == "raise":
            raise KeyError(f"no row {i}")
        if what == "exit":
            os._exit(3)
        size = self.size + 1 if what == "shape" else self.size
        return np.int64(i), None if what == "none" else np.full(size, i % 256, np.uint8)


class Work:
    """Item i is (i, the pid that made it) after 5 ms of `work`: "wait" (a sleep) or "spin"
    (pure Python, GIL-bound). `lock=True` adds a lock: the source cannot go to worker processes."""

    def __init__(self, n, work, lock=False):
        self.n, self.work = n, work
        if lock:
            import threading

            self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.work == "wait":
            time.sleep(0.005)
        else:
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                sum(range(100))
        return np.int64(i), np.int64(os.getpid())


class Passes:
    """Item i is (the epoch that made it, 5 floats, or 3 for the pass's short item: the last one in
    pass 0, one earlier every pass). ``epoch`` and ``set_epoch`` as a ``SceneSequence`` has them."""

    def __init__(self, n=9):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, i):
        short = (self.n - 1 - self.epoch) % self.n
        return np.int64(self.epoch), np.zeros(3 if i == short else 5, np.float32)
