"""Peak RSS growth of the stream APIs with large items; prints JSON.

The cyclic garbage collector is off: every item must be freed by reference
counting alone, as soon as tf.data is done with it.
"""

import gc
import json
import threading
import time

import numpy as np
import psutil

import kerasfeed

gc.disable()
MB = 2**20
proc = psutil.Process()


def peak_growth_mb(make):
    """Builds the dataset, iterates it once; returns (items, peak RSS growth in MB)."""
    base = proc.memory_info().rss
    ds = make()
    it = iter(ds)
    peak = [base]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    n = sum(1 for _ in it)
    done.set()
    t.join()
    del it, ds
    gc.collect()
    return n, (peak[0] - base) / MB


def small_epoch(put):
    for _ in range(8):
        put(np.zeros(1000, np.float32))
    put(kerasfeed.END_OF_EPOCH)


def big_epoch(put):
    for i in range(48):
        put(np.full(8 * MB // 4, i, np.float32))  # 8 MB items
    put(kerasfeed.END_OF_EPOCH)


def big_shard(k):
    for i in range(20):
        yield np.full(4 * MB // 4, i, np.float32)  # 4 MB items


out = {}
# One-off TensorFlow and pool costs first, so that they are not counted.
list(kerasfeed.from_queue(small_epoch, maxsize=4))
list(kerasfeed.from_generators(lambda k: iter([np.zeros(9, np.float32)]), 2, executor="processes", workers=1))
gc.collect()
out["from_queue"] = peak_growth_mb(lambda: kerasfeed.from_queue(big_epoch, maxsize=4))
out["from_generators"] = peak_growth_mb(
    lambda: kerasfeed.from_generators(big_shard, 4, executor="processes", workers=2, buffer_size=2)
)
print(json.dumps(out))
