"""Sources for tests whose worker processes need nothing but numpy: a worker imports the module that
defines its source to unpickle it, and a test module (tensorflow at its top) took 5-11 s of a worker's
start-up on a loaded machine, each time a worker started."""

from __future__ import annotations

import time

import numpy as np


class StuckAt0:
    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 0:
            time.sleep(30)  # a probed item; the plan sends it again, with item 2 behind it on one worker
        return np.full(2, i, np.float32)
