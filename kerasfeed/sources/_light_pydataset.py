"""A Keras-free stand-in for ``keras.utils.PyDataset`` (``Sequence``) used in worker processes.

Worker processes only need to unpickle a source and call ``__getitem__``; the
Keras class itself is pure Python, but importing Keras imports its backend.
This stand-in has Keras 3's attributes and behaviour (``workers``,
``use_multiprocessing``, ``max_queue_size`` with their setters and defaults,
``num_batches``, ``__iter__``, the epoch hooks), so a pickled state restores
unchanged. It is the base of ``SceneSequence`` in workers, and of a user's own
``keras.utils.Sequence`` subclass there (NOTE [ Light framework stand-ins in
workers ] in ``kerasfeed/execution/processes/light_modules.py``).
"""

from __future__ import annotations

import itertools

_DEFAULTS = (("_workers", 1), ("_use_multiprocessing", False), ("_max_queue_size", 10))


class PyDataset:
    def __init__(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        self._workers = workers
        self._use_multiprocessing = use_multiprocessing
        self._max_queue_size = max_queue_size

    def _warn_if_super_not_called(self):
        # Keras sets the defaults (and warns, which the consumer process did already).
        for name, default in _DEFAULTS:
            if not hasattr(self, name):
                setattr(self, name, default)

    @property
    def workers(self):
        self._warn_if_super_not_called()
        return self._workers

    @workers.setter
    def workers(self, value):
        self._workers = value

    @property
    def use_multiprocessing(self):
        self._warn_if_super_not_called()
        return self._use_multiprocessing

    @use_multiprocessing.setter
    def use_multiprocessing(self, value):
        self._use_multiprocessing = value

    @property
    def max_queue_size(self):
        self._warn_if_super_not_called()
        return self._max_queue_size

    @max_queue_size.setter
    def max_queue_size(self, value):
        self._max_queue_size = value

    def __getitem__(self, index):
        raise NotImplementedError

    @property
    def num_batches(self):
        if hasattr(self, "__len__"):
            return len(self)
        raise NotImplementedError(
            "You need to implement the `num_batches` property:\n\n@property\ndef num_batches(self):\n  return ..."
        )

    def __iter__(self):
        try:
            n = self.num_batches
        except NotImplementedError:
            n = None
        for index in range(n) if n is not None else itertools.count():
            yield self[index]

    def on_epoch_begin(self):
        pass

    def on_epoch_end(self):
        pass
