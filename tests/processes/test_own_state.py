"""State a source makes for itself on first use (``self._rng = default_rng()``) stays in the process that made it
(NOTE [ State each process makes for itself ], kerasfeed/execution/own_state.py): made in the consumer, by
kerasfeed's probes or by the user's ``seq[i]`` between passes, it was sent to every worker process, whose draws
were then the same (a helper's review: 12 distinct draws of 24 items, silently)."""

from __future__ import annotations

import collections
import os
import pickle
import threading
import types

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution import own_state
from kerasfeed.execution.auto import make_auto_executor


class Drawing(kerasfeed.SceneSequence):
    """Each process makes its own generator on first use; an item says which process drew what."""

    def __init__(self, n=16):
        super().__init__()
        self.n, self._rng, self._order = n, None, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self._rng is None:
            self._rng = np.random.default_rng()
        j = i if self._order is None else self._order[i]
        return np.array([j, os.getpid()]), self._rng.integers(0, 2**62, 2)


class Reversing(Drawing):
    def on_epoch_end(self):
        self._order = np.arange(self.n)[::-1].copy()  # set from None by the hook: the workers must get it


class Split(Drawing):
    """A class's own ``__getitem__`` beside ``load`` and ``augment`` (checked once when a cache opens)."""

    def load(self, i):
        return np.array([i], np.int64)

    def augment(self, item):
        if self._rng is None:
            self._rng = np.random.default_rng()
        return np.array([int(item[0]), os.getpid()]), self._rng.integers(0, 2**62, 2)

    def __getitem__(self, i):
        return self.augment(self.load(i))


class Stated(Drawing):
    """Sent its whole state at a change ("setstate" mode): a worker keeps the generator it made (seeded by its
    pid: made again, it would repeat its draws; a review found 12 distinct of 24)."""

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __getitem__(self, i):
        if self._rng is None:
            self._rng = np.random.default_rng(os.getpid())
        return super().__getitem__(i)


def _draws(rows):
    return len({tuple(d.tolist()) for _, d in rows}), {int(ip[1]) for ip, _ in rows}


@pytest.mark.parametrize("cls", [Drawing, Stated])
def test_a_generator_the_consumer_makes_between_passes_stays_its_own(cls):
    src = cls()
    with kerasfeed.to_loader(src, executor="processes", workers=2) as loader:
        passes = []
        for _ in range(3):
            passes.append(list(loader))
            src[0]  # the consumer makes its own generator: not the workers'
            src.level = len(passes)  # a public attribute changed between passes: sent, with the rest as it was
        stats = kerasfeed.executor_of(loader).stats()
    for rows in passes:
        assert _draws(rows)[0] == 16  # every worker its own generator: no draw made twice
    distinct, pids = _draws([row for rows in passes for row in rows])
    assert distinct == 48 and len(pids) == 2 and os.getpid() not in pids  # nor in a later pass
    assert stats["state"]["syncs"] == 2  # `level`, not `_rng`


def test_data_set_from_none_between_passes_reaches_the_workers():
    """A Keras callback's curriculum (``seq._scale = epoch + 2``, None before): data, not a process's own object;
    the first version of the rule kept it from the workers (a review: losses 1, 1, 1 against 1, 2, 3)."""

    class Scaled(Drawing):
        def __getitem__(self, i):
            return np.array([1.0 if self._scale is None else self._scale])

    src = Scaled(4)
    src._scale = None
    with kerasfeed.to_loader(src, executor="processes", workers=2) as loader:
        seen = []
        for epoch in range(3):
            seen.append(sorted({float(b[0]) for b in loader}))
            src._scale = float(epoch + 2)
    assert seen == [[1.0], [2.0], [3.0]]


class Sharded(kerasfeed.SceneSequence):
    """Its own ``__getstate__``/``__setstate__`` ("setstate" mode); the hook moves to the next shard and drops
    the file each process opened, to be opened again (a review: the workers kept the first shard's)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.shard, self._f = path, 0, None

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if self._f is None:
            self._f = open(f"{self.path}.{self.shard}", "rb")
        self._f.seek(0)
        return np.frombuffer(self._f.read(8), np.float64).copy()

    def on_epoch_end(self):
        self.shard += 1
        self._f = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_f"}

    def __setstate__(self, state):
        self.__dict__.update(state, _f=None)


def test_a_file_a_hook_drops_is_opened_again_by_workers_of_a_class_with_its_own_setstate(tmp_path):
    for k in range(3):
        np.array([10.0 * k]).tofile(tmp_path / f"shard.{k}")
    with kerasfeed.to_loader(Sharded(str(tmp_path / "shard")), executor="processes", workers=2) as loader:
        assert [sorted({float(b[0]) for b in loader}) for _ in range(3)] == [[0.0], [10.0], [20.0]]


def test_an_underscored_attribute_a_hook_sets_from_none_reaches_the_workers():
    with kerasfeed.to_loader(Reversing(8), executor="processes", workers=2) as loader:
        order = [[int(ip[0]) for ip, _ in loader] for _ in range(2)]
    assert order == [list(range(8)), list(range(8))[::-1]]


def test_auto_s_probe_leaves_nothing_it_made_on_the_source():
    src = Drawing()
    ex = make_auto_executor(src)
    try:
        assert ex.probe is not None and src._rng is None  # the probe ran items here, then undid _rng
        assert pickle.loads(pickle.dumps(src))._rng is None  # what a worker process would be given
    finally:
        ex.close()


def test_undone_puts_back_what_the_calls_set_when_they_made_a_process_s_own_state():
    """Made with a generator, a file or a lock set from None, every attribute the calls set is put back (a flag
    beside it, ``self._ready``, stays consistent: a review found ``_ready`` True with ``_rng`` None); with none
    made (an order, a table: data), what they set stays."""

    class Plain:
        pass

    obj = Plain()
    obj._file, obj._ready, obj._kf_epoch = None, False, None
    with own_state.undone(obj):
        obj._file, obj._ready, obj.lock, obj._kf_epoch = open(os.devnull), True, threading.Lock(), 3
    assert obj._file is None and obj._ready is False and not hasattr(obj, "lock") and obj._kf_epoch == 3
    obj._shape = obj._table = None
    with own_state.undone(obj):
        obj._shape, obj._table, obj._ready = (2,), types.SimpleNamespace(rows=[1]), True
    assert obj._shape == (2,) and obj._table.rows == [1] and obj._ready is True
    with own_state.undone(obj):
        obj._file = {"rng": np.random.default_rng()}  # a generator held in a dict: each process's own too
    assert obj._file is None

    class Slotted:
        __slots__ = ("_rng", "_order")

    obj = Slotted()
    obj._rng = obj._order = None
    with own_state.undone(obj):
        obj._order = [2, 0, 1]  # an order made on first use: data, kept
    assert obj._order == [2, 0, 1]
    with own_state.undone(obj):
        obj._rng, obj._order = np.random.default_rng(), [1, 0, 2]
    assert obj._rng is None and obj._order == [2, 0, 1]


def test_the_cache_s_check_of_its_own_getitem_leaves_each_worker_its_own_generator():
    src = Split(12)
    with kerasfeed.to_loader(src, executor="processes", workers=2, cache="memory") as loader:
        assert src._rng is None  # the check made item 0 both ways here, then undid what it made
        passes = [list(loader) for _ in range(2)]
    for rows in passes:
        distinct, pids = _draws(rows)
        assert distinct == 12 and sorted(int(ip[0]) for ip, _ in rows) == list(range(12))


def test_an_augment_drawing_from_its_own_generator_on_threads_is_no_change_of_the_source():
    """On threads ``augment`` runs on the consumer's source: its generator moves every pass. That is not a change
    of what ``load`` reads (it raised "the source's attribute `_rng` changed since the last pass")."""
    src = Split(6)
    with kerasfeed.to_loader(src, executor="threads", cache="memory") as loader:
        passes = [list(loader) for _ in range(3)]
    counts = collections.Counter(tuple(d.tolist()) for rows in passes for _, d in rows)
    assert len(counts) == 18 and all(sorted(int(ip[0]) for ip, _ in rows) == list(range(6)) for rows in passes)
