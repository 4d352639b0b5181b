"""The between-pass check of a cached source (NOTE [ A source that changes between passes ],
kerasfeed/execution/source_changes.py): sources that change nothing are never refused, changes made by the
hooks always are (a helper's report: five false refusals, three changes missed)."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest

import kerasfeed


def _passes(source, count=3, **kwargs):
    with kerasfeed.to_loader(source, cache="memory", **kwargs) as loader:
        return [[np.asarray(b[0] if isinstance(b, tuple) else b).tolist() for b in loader] for _ in range(count)]


@pytest.fixture
def two_files(tmp_path):
    paths = []
    for k in range(2):
        paths.append(str(tmp_path / f"r{k}.h5"))
        with h5py.File(paths[-1], "w") as f:
            f["x"] = (np.arange(32) + 100 * k).astype("float32")
            f["y"] = np.arange(32) % 2
    return paths


class _HoldsReader:
    def __init__(self, paths):
        self.reader = kerasfeed.H5SliceSequence(paths, ("x", "y"), 8)

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        return self.reader[i]


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_mix_of_hdf5_readers_and_a_held_reader_cache_over_passes(two_files, executor):
    """Refused at pass 1, every time: a reader's state holds a lock, so its fingerprint was a new object's."""
    kw = dict(executor=executor, workers=2) if executor == "processes" else {}
    mixed = kerasfeed.mix([kerasfeed.H5SliceSequence(p, ("x", "y"), 8) for p in two_files], seed=0)
    for source in (mixed, _HoldsReader(two_files)):
        passes = _passes(source, shuffle=True, seed=0, **kw)
        assert all(sorted(map(sorted, p)) == sorted(map(sorted, passes[0])) for p in passes)


class _OpenFiles:
    def __init__(self, path):
        self.files = [open(path, "rb")]
        self.parts = (np.arange(8), threading.Lock())

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([self.parts[0][i]])


def test_lists_holding_what_cannot_be_pickled_are_compared_part_by_part(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("0\n")
    source = _OpenFiles(path)
    try:
        assert _passes(source) == [[[i] for i in range(8)]] * 3
    finally:
        source.files[0].close()


class _ThreeFiles:
    """Memory-maps each part file on the first item that reads it, under public names."""

    def __init__(self, folder):
        self.folder, self.part0, self.part1, self.part2 = folder, None, None, None

    def __len__(self):
        return 96

    def __getitem__(self, i):
        name = f"part{i // 32}"
        if getattr(self, name) is None:
            setattr(self, name, np.load(f"{self.folder}/{name}.npy", mmap_mode="r"))
        return np.array([getattr(self, name)[i % 32]])


def test_files_opened_lazily_by_items_of_a_pass_are_not_changes(tmp_path):
    """Set from None during pass 0 by items the probe did not make: refused at pass 1 (helper, 3 of 3)."""
    for k in range(3):
        np.save(tmp_path / f"part{k}.npy", np.arange(32) + 1000 * k)
    passes = _passes(_ThreeFiles(str(tmp_path)), shuffle=True, seed=0)
    assert all(sorted(p) == sorted([[1000 * (i // 32) + i % 32] for i in range(96)]) for p in passes)


class _Labeled:
    def __init__(self):
        self.labels = np.arange(32) % 2
        self.order = kerasfeed.BalancedOrder(self.labels, seed=0)

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return np.array([i], "float32"), self.labels[i]


def test_a_held_balanced_order_used_as_the_order_is_not_a_change():
    """Its permutation tables are made lazily, in pass 0: refused at pass 1 (helper, 3 of 3)."""
    source = _Labeled()
    passes = _passes(source, order=source.order)
    assert [len(p) for p in passes] == [32, 32, 32]


class _ClassLevel:
    LEVEL = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.array([i + 100 * self.LEVEL])

    def on_epoch_end(self):
        type(self).LEVEL += 1


class _Slotted:
    __slots__ = ("level",)

    def __init__(self):
        self.level = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.array([i + 100 * self.level])

    def on_epoch_end(self):
        self.level += 1


class _Settings:
    def __init__(self):
        self.lock, self.level = threading.Lock(), 0


class _LockedSettings:
    def __init__(self):
        self.settings = _Settings()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.array([i + 100 * self.settings.level])

    def on_epoch_end(self):
        self.settings.level += 1


@pytest.mark.parametrize("make, name", [(_ClassLevel, "_ClassLevel.LEVEL"), (_Slotted, "level"),
                                        (_LockedSettings, "settings")])
def test_a_class_level_a_slot_or_a_field_beside_a_lock_changed_by_a_hook_fails_the_pass(make, name):
    """Each served pass 0's stored items in every later pass, silently (helper, 3 of 3)."""
    _ClassLevel.LEVEL = 0
    with kerasfeed.to_loader(make(), cache="memory") as loader:
        list(loader)
        with pytest.raises(ValueError, match=rf"attribute `{name}` changed since the last pass"):
            list(loader)


class _CountsCalls:
    CALLS = 0  # a count the items keep in the class body: not what they are made from

    def __len__(self):
        return 6

    def __getitem__(self, i):
        type(self).CALLS += 1
        return np.array([i])


def test_a_class_level_count_the_items_keep_is_not_a_change():
    assert _passes(_CountsCalls()) == [[[i] for i in range(6)]] * 3


SCALE = 1  # a module global the stored stage (load) reads
JITTER = 0  # one only augment reads: free to change every pass


class _GlobalScale(kerasfeed.SceneSequence):
    def __len__(self):
        return 4

    def load(self, i):
        return np.array([i * SCALE])

    def augment(self, item):
        return item + JITTER


class _Rescaled(_GlobalScale):
    def on_epoch_end(self):
        global SCALE
        SCALE += 1


class _Jittered(_GlobalScale):
    def on_epoch_end(self):
        global JITTER
        JITTER += 10


def test_a_module_global_the_stored_stage_reads_changed_by_a_hook_fails_the_pass():
    """Served pass 0's items in every later pass, silently; one only augment reads changes them each pass."""
    global SCALE, JITTER
    SCALE, JITTER = 1, 0
    with kerasfeed.to_loader(_Rescaled(), cache="memory") as loader:
        assert [b.tolist() for b in loader] == [[i] for i in range(4)]
        with pytest.raises(ValueError, match=r"module global `test_cache_changes.SCALE` changed since the last pass"
                                             r".*does not read `SCALE`.*Received: test_cache_changes.SCALE changed"):
            list(loader)
    SCALE = 1
    with kerasfeed.to_loader(_Jittered(), cache="memory") as loader:
        assert [[b.tolist() for b in loader] for _ in range(2)] == [[[i] for i in range(4)], [[i + 10] for i in range(4)]]
    JITTER = 0


TABLE = np.zeros(4)  # a module global array the stored stage reads
_LAZY_TABLE = None  # one the items make on first use


class _TableRows:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return TABLE[i:i + 1] + 0


class _LazyTableRows:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        global _LAZY_TABLE
        if _LAZY_TABLE is None:
            _LAZY_TABLE = {k: np.array([k * 10]) for k in range(4)}
        return _LAZY_TABLE[i]


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_module_global_array_rebound_between_passes_fails_the_pass(executor):
    """Served pass 0's stored items in every later pass, silently (helper, 4 of 4): a global array, list,
    dict or set is compared by identity, so `TABLE = TABLE + 1` is seen (a change in place is not)."""
    global TABLE, _LAZY_TABLE
    TABLE = np.zeros(4)
    kw = {"workers": 2} if executor == "processes" else {}
    with kerasfeed.to_loader(_TableRows(), cache="memory", executor=executor, **kw) as loader:
        assert [b.tolist() for b in loader] == [[0.0]] * 4
        TABLE = TABLE + 1
        with pytest.raises(ValueError, match=r"module global `test_cache_changes.TABLE` changed since the last pass"):
            list(loader)
    TABLE = np.zeros(4)
    _LAZY_TABLE = None  # made by the items during pass 0: the source's own, not a change
    assert _passes(_LazyTableRows(), executor="threads") == [[[k * 10] for k in range(4)]] * 3
    _LAZY_TABLE = None


class _PicklesItsOwn(_ClassLevel):
    """A source with its own ``__getstate__`` (as kerasfeed's readers and sources that drop a handle have)."""

    def __getstate__(self):
        return {}


def test_a_class_level_of_a_source_pickling_its_own_state_changed_by_a_hook_fails_the_pass():
    """Its class values were left out with the attributes its ``__getstate__`` drops: not checked at all."""
    _ClassLevel.LEVEL = 0
    with kerasfeed.to_loader(_PicklesItsOwn(), cache="memory") as loader:
        list(loader)
        with pytest.raises(ValueError, match=r"attribute `_PicklesItsOwn.LEVEL` changed|attribute `_ClassLevel.LEVEL` changed"):
            list(loader)
    _ClassLevel.LEVEL = 0


class _IgnoresItsLevel(_ClassLevel):
    cache_ignores = ("LEVEL",)  # as the error says to: the class value by its own name, not "_ClassLevel.LEVEL"


def test_a_class_value_named_in_cache_ignores_by_its_name_is_not_checked():
    _ClassLevel.LEVEL = 0
    with kerasfeed.to_loader(_ClassLevel(), cache="memory") as loader:
        list(loader)
        with pytest.raises(ValueError, match=r"`_ClassLevel.LEVEL` changed.*does not read `LEVEL`, name it in"):
            list(loader)
    _ClassLevel.LEVEL = 0
    assert _passes(_IgnoresItsLevel()) == [[[i] for i in range(4)]] * 3  # pass 0's stored items, as asked
    _ClassLevel.LEVEL = 0


_FREED_TABLE = None  # made by the items on first use; a hook frees it (set back to None), the items make it again


class _FreesItsTable(_LazyTableRows):
    def __getitem__(self, i):
        global _FREED_TABLE
        if _FREED_TABLE is None:
            _FREED_TABLE = np.arange(4) * 10
        return _FREED_TABLE[i : i + 1] + 0

    def on_epoch_end(self):
        global _FREED_TABLE
        _FREED_TABLE = None


def test_an_underscored_global_freed_by_a_hook_is_the_source_s_own_state_as_an_attribute_is():
    """``self._table = None`` in a hook is lazy state; the same with a module global was refused (a review)."""
    global _FREED_TABLE
    _FREED_TABLE = None
    assert _passes(_FreesItsTable(), executor="threads") == [[[k * 10] for k in range(4)]] * 3
    _FREED_TABLE = None
