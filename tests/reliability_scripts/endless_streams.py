"""Endless generator shards on worker processes, iterated until SIGINT (Ctrl-C).

``python endless_streams.py``: prints ``{"pids": [...]}`` (the workers) once items flow, then iterates until
interrupted. Eight shards for a cycle of two: producers open further shards as they go, also while the exit
hook closes the pool.
"""

import json
import time

import numpy as np
import psutil

import kerasfeed


def factory(i):
    def gen():
        for k in range(10**9):
            time.sleep(0.002)
            yield np.full(4, i * 1000 + k, "float32")

    return gen()


if __name__ == "__main__":
    ds = kerasfeed.from_generators(factory, 8, executor="processes", workers=2, cycle_length=2)
    for n, _ in enumerate(ds):
        if n == 20:
            print(json.dumps({"pids": [p.pid for p in psutil.Process().children(recursive=True)]}), flush=True)
