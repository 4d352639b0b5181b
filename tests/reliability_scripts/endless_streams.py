"""Endless data on worker processes, iterated until SIGINT (Ctrl-C).

``python endless_streams.py generators|dataset``: prints ``{"pids": [...]}`` (the workers) once items flow,
then iterates until interrupted. ``generators``: eight shards for a cycle of two (producers open further
shards as they go, also while the exit hook closes the pool); ``dataset``: ``to_dataset`` of a long
source (loads in flight when the exit hook closes the pool).
"""

import json
import sys
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


class Long:
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        time.sleep(0.002)
        return np.full(4, i, "float32")


if __name__ == "__main__":
    if sys.argv[1] == "generators":
        ds = kerasfeed.from_generators(factory, 8, executor="processes", workers=2, cycle_length=2)
    else:
        ds = kerasfeed.to_dataset(Long(), executor="processes", workers=2)
    for n, _ in enumerate(ds):
        if n == 20:
            print(json.dumps({"pids": [p.pid for p in psutil.Process().children(recursive=True)]}), flush=True)
