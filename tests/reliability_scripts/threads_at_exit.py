"""The threads executor's pool threads at interpreter exit (a helper of the tests).

argv[1] = "to_loader" (TensorFlow never imported, with KERAS_BACKEND=numpy) | "to_dataset"; then one or more of
"moment" (some items sleep 1 s) and "forever" (they never return). For each, it reads the first 2 batches of a
pass and ends with the iterator alive, those items in progress on pool threads.

An ``atexit`` hook registered before kerasfeed is imported runs after kerasfeed's own hooks; it prints one JSON
line: per source, the threads that called it and are still alive then, and how long the exit took until then.
"""

import atexit
import json
import sys
import threading
import time

ENDED = [0.0]
CALLERS = {}  # source name -> the threads that called it


def _report():
    left = {name: sorted(t.name for t in threads if t.is_alive()) for name, threads in CALLERS.items()}
    exit_s = time.monotonic() - ENDED[0]
    print(json.dumps({"left": left, "exit_s": round(exit_s, 2), "tf": "tensorflow" in sys.modules}), flush=True)


atexit.register(_report)  # before kerasfeed's hooks: it runs after them

import logging  # noqa: E402

import numpy as np  # noqa: E402

import kerasfeed  # noqa: E402

logging.getLogger("kerasfeed").setLevel(logging.DEBUG)
logging.getLogger("kerasfeed").addHandler(logging.StreamHandler(sys.stderr))
never = threading.Event()


class Blocks:
    def __init__(self, how):
        self.how = how
        CALLERS[how] = set()

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if threading.current_thread() is not threading.main_thread():
            CALLERS[self.how].add(threading.current_thread())
        if 8 <= i < 31 and i % 2:  # the last one is probed: quick
            if self.how == "forever":
                never.wait()
            else:
                time.sleep(1.0)
        return np.full(2, i, np.float32)


front = getattr(kerasfeed, sys.argv[1])
iterators = []
for how in sys.argv[2:]:
    it = iter(front(Blocks(how), batch_size=4, executor="threads"))
    first = [np.asarray(next(it)).ravel()[0].item() for _ in range(2)]
    iterators.append(it)
    print(json.dumps({how: first}), flush=True)
ENDED[0] = time.monotonic()
