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
# Where Keras defines the class this stands in for (a pickle names it there; ``light_modules``).
KERAS_PATH = ("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDataset")


def differences(real: type) -> list:
    """How Keras' ``PyDataset`` class ``real`` differs from what this stand-in assumes: its module and
    name, and the attributes its ``__init__`` sets with their defaults (what a pickled instance holds
    and ``_setting`` reads). Empty when it is the same. Called in the consumer, where Keras is loaded."""
    found = []
    where = (getattr(real, "__module__", None), getattr(real, "__qualname__", None))
    if where != KERAS_PATH:
        found.append(f"keras.utils.PyDataset is {where[0]}.{where[1]}, not {'.'.join(KERAS_PATH)}")
    try:
        made = real.__new__(real)
        real.__init__(made)
        held = dict(vars(made))
    except Exception as e:  # noqa: BLE001 - a signature or a base that moved: reported, not raised
        return found + [f"PyDataset() could not be made: {type(e).__name__}: {e}"]
    if held != dict(_DEFAULTS):
        found.append(f"PyDataset() holds {held}, not {dict(_DEFAULTS)}")
    return found


def _setting(name: str) -> property:
    """Keras' property ``name`` over the attribute ``_name`` (its default set on first read, as Keras
    does when a subclass's ``__init__`` skipped ``super()``; Keras also warns, which the consumer
    process did already)."""
    private = f"_{name}"

    def get(self):
        for attr, default in _DEFAULTS:
            if not hasattr(self, attr):
                setattr(self, attr, default)
        return getattr(self, private)

    def put(self, value):
        setattr(self, private, value)

    return property(get, put)


class PyDataset:
    def __init__(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        self._workers = workers
        self._use_multiprocessing = use_multiprocessing
        self._max_queue_size = max_queue_size

    workers = _setting("workers")
    use_multiprocessing = _setting("use_multiprocessing")
    max_queue_size = _setting("max_queue_size")

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
