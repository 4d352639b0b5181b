"""Closes cached loaders while pool threads are still storing items: the process must survive.

``python close_mid_pass.py ROUNDS``: each round takes one batch, starts a second
iterator (the first pass is abandoned mid-way) and closes the loader at once,
while the threads executor's threads copy 4 MB items into the store.
"""

import sys

import numpy as np

import kerasfeed


class Big(kerasfeed.SceneSequence):
    def __len__(self):
        return 64

    def load(self, i):
        return np.full((1024, 1024), i, np.float32)


for _ in range(int(sys.argv[1])):
    loader = kerasfeed.to_loader(Big(), executor="threads", cache="memory")
    first = next(iter(loader))
    second = next(iter(loader))
    loader.close()
    assert float(first[0, 0]) == 0.0 and float(second[0, 0]) == 0.0  # views still readable after close
print("survived")
