"""A Keras-free stand-in for ``keras.utils.PyDataset`` used in worker processes.

Worker processes only need to unpickle a source and call ``__getitem__``; the
Keras class itself is pure Python, but importing Keras imports TensorFlow.
This stand-in keeps the same attributes so pickled state restores unchanged.
"""

from __future__ import annotations

import itertools


class PyDataset:
    def __init__(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        self._workers = workers
        self._use_multiprocessing = use_multiprocessing
        self._max_queue_size = max_queue_size

    workers = property(lambda self: getattr(self, "_workers", 1))
    use_multiprocessing = property(lambda self: getattr(self, "_use_multiprocessing", False))
    max_queue_size = property(lambda self: getattr(self, "_max_queue_size", 10))

    @property
    def num_batches(self):
        return len(self) if hasattr(self, "__len__") else None

    def __iter__(self):
        n = self.num_batches
        for index in range(n) if n is not None else itertools.count():
            yield self[index]

    def on_epoch_begin(self):
        pass

    def on_epoch_end(self):
        pass
