"""A parent whose two workers are busy in a 60 s C call holding the GIL.

Prints the worker pids as JSON once both are inside the call, then waits to
be killed. No TensorFlow: the executor is used directly.
"""

import ctypes
import json
import os
import threading
import time

import numpy as np

import kerasfeed


class HoldsTheGil:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i < 2:
            with open(os.path.join(os.environ["MARKS"], f"{os.getpid()}"), "w"):
                pass
            ctypes.PyDLL(None).sleep(60)  # libc sleep, called with the GIL held
        return np.zeros(2)


ex = kerasfeed.ProcessExecutor(HoldsTheGil(), workers=2)
ex.wait_ready()
for i in range(2):
    threading.Thread(target=ex.load, args=(i, 0), daemon=True).start()
pids = ex.pids
while len(os.listdir(os.environ["MARKS"])) < 2:
    time.sleep(0.05)
print(json.dumps({"parent": os.getpid(), "workers": pids}), flush=True)
time.sleep(600)
