"""State that ``__getitem__`` reads outside the instance, changed by ``on_epoch_end``: a class attribute, a
module global read through a helper function, and a module-level dict rebound (not changed in place)."""

import os
import threading

import keras
import numpy as np

import byo_sources.outside_cfg
from byo_sources import outside_cfg
from byo_sources.outside_cfg import scale

STRENGTH = 0
CONFIG = {"scale": 1}
LOCK = False  # rebound in on_epoch_end to what cannot be pickled: the workers keep theirs


def _strength():
    return STRENGTH


class Leveled(keras.utils.Sequence):
    level = 0

    def __init__(self, n=4, lock=False, **kwargs):
        super().__init__(**kwargs)
        global STRENGTH, CONFIG, LOCK
        type(self).level, STRENGTH, CONFIG, LOCK = 0, 0, {"scale": 1}, False  # import-time values again
        self.n, self.lock = n, lock

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, type(self).level, _strength(), CONFIG["scale"], LOCK is False])

    def on_epoch_end(self):
        global STRENGTH, CONFIG, LOCK
        type(self).level += 1
        STRENGTH += 10
        CONFIG = {"scale": CONFIG["scale"] * 2}
        if self.lock:
            LOCK = threading.Lock()


class LeveledTable(Leveled):
    """Also rewrites a 1.2 MB table every pass: the states a pool keeps for successors outgrow the payload,
    so it pickles the source anew (a rebase), which does not carry the class attribute and the globals."""

    def __init__(self, n=4):
        super().__init__(n)
        self.table = np.zeros(150_000, np.int64)

    def __getitem__(self, i):
        import os

        return np.concatenate([super().__getitem__(i), [int(self.table[-1]), os.getpid()]])

    def on_epoch_end(self):
        super().on_epoch_end()
        self.table = np.full(150_000, type(self).level, np.int64)


class Configured(keras.utils.Sequence):
    """Reads another module's global, as an attribute and through a function imported from it."""

    def __init__(self):
        super().__init__()
        outside_cfg.SCALE = 1

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.array([i, outside_cfg.SCALE, scale(), byo_sources.outside_cfg.SCALE])

    def on_epoch_end(self):
        outside_cfg.SCALE *= 3


_RNG = None  # each process's own generator, made on first use


def _rng():
    global _RNG
    if _RNG is None:
        _RNG = np.random.default_rng([os.getpid(), 12345])
    return _RNG


class Drawing(keras.utils.Sequence):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([i, int(_rng().integers(1 << 40)), os.getpid()])
