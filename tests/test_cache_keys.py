"""A kept cache's key (``kerasfeed/cache/keys.py``): what its code digest sees, which stage is stored, and which
files count.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kerasfeed
from kerasfeed.cache.keys import key_change, source_key, stage_of
from kerasfeed.datasets import make_synthetic_scenes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code(source) -> str:
    return source_key(source, 4, None, 1)["code"]


# ------------------------------------------------------------------ a set literal, under any string hashing
_SET_SCRIPT = textwrap.dedent('''
    from kerasfeed.cache.keys import source_key

    class Src:
        def load(self, i):
            mode = "train"
            names = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}
            pick = [x for x in range(i) if str(x) in {"1", "2", "3", "5", "8", "13"}]
            return (2.0 if mode in names else 1.0), pick, ("k", frozenset({"u", "v", "w", "x"}))

    const = next(c for c in Src.load.__code__.co_consts if isinstance(c, frozenset))
    print(repr(const))
    print(source_key(Src(), 4, None, 1)["code"])
''')


def _set_run(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SET_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_a_set_literal_in_load_gives_the_same_digest_under_another_hash_seed():
    (order_a, digest_a), (order_b, digest_b) = _set_run("1"), _set_run("2")
    assert order_a != order_b, "the two seeds iterate the set alike: the test would show nothing"
    assert digest_a == digest_b


# ------------------------------------------------------------------ defaults, closures, decorators
class _Scale1:
    def load(self, i, scale=1.0):
        return np.full((2,), i * scale)


class _Scale10:
    def load(self, i, scale=10.0):
        return np.full((2,), i * scale)


class _Scale1Again:
    def load(self, i, scale=1.0):
        return np.full((2,), i * scale)


class _KwScale1:
    def load(self, i, *, scale=1.0):
        return np.full((2,), i * scale)


class _KwScale10:
    def load(self, i, *, scale=10.0):
        return np.full((2,), i * scale)


def _closing_over(scale):
    class Src:
        def load(self, i):
            return np.full((2,), i * scale)
    return Src()


def test_a_changed_default_or_closure_value_changes_the_digest():
    assert _code(_Scale1()) != _code(_Scale10())
    assert _code(_KwScale1()) != _code(_KwScale10())
    assert _code(_closing_over(1.0)) != _code(_closing_over(10.0))
    assert _code(_Scale1()) == _code(_Scale1Again())  # the same code in another place: the same digest
    assert _code(_closing_over(1.0)) == _code(_closing_over(1.0))


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(self, i):
        return fn(self, i)
    return wrapper


def _bare(fn):  # a decorator without functools.wraps: the function is only in its closure
    def wrapper(self, i):
        return fn(self, i)
    return wrapper


def _load_1(self, i):
    return np.full((2,), i * 1.0)


def _load_10(self, i):
    return np.full((2,), i * 10.0)


def _decorated(deco, load):
    class Src(kerasfeed.SceneSequence):
        def __len__(self):
            return 4

    Src.load = deco(load)
    return Src()


def test_editing_a_decorated_load_changes_the_digest():
    for deco in (_logged, _bare, functools.lru_cache(maxsize=None), functools.cache):
        one, ten = _decorated(deco, _load_1), _decorated(deco, _load_10)
        assert key_change(source_key(one, 4, None, 1), source_key(ten, 4, None, 1)) == \
            "the code of `load` changed", deco
        assert _code(one) == _code(_decorated(deco, _load_1)), deco
        assert not _code(one).startswith("<no code"), deco


# ------------------------------------------------------------------ which stage is stored
class _Images(kerasfeed.SceneSequence):
    """Its own ``__getitem__`` and a helper named ``load``: the items are ``__getitem__``'s."""

    def __len__(self):
        return 4

    def load(self, i):
        return np.full((2, 2), 200 + i, np.uint8)

    def __getitem__(self, i):
        return self.load(i).astype("float32") / 255.0


class _Split(kerasfeed.SceneSequence):
    def __len__(self):
        return 4

    def load(self, i):
        return np.full((2,), i, np.float32)


class _SplitAugmented(_Split):
    def augment(self, item):
        return item + 1


class _OwnGetitemAugmented(_SplitAugmented):
    def __getitem__(self, i):
        return self.augment(self.load(i))


def test_the_stored_stage_is_load_only_where_items_are_augment_of_load():
    assert stage_of(_Split()) == "load"
    assert stage_of(_SplitAugmented()) == "load"
    assert stage_of(_OwnGetitemAugmented()) == "load"
    assert stage_of(_Images()) == "__getitem__"
    assert stage_of(_Numbered("log")) == "__getitem__"  # no load at all


def test_a_load_helper_under_its_own_getitem_gives_the_uncached_items():
    with kerasfeed.to_loader(_Images(), executor="threads") as loader:
        plain = list(loader)
    with kerasfeed.to_loader(_Images(), executor="threads", cache="memory") as loader:
        cached = [list(loader) for _ in range(2)]
    for items in cached:
        assert [x.dtype for x in items] == [np.float32] * 4
        np.testing.assert_array_equal(np.stack(items), np.stack(plain))


# ------------------------------------------------------------------ cache_ignores and files
class _Numbered(kerasfeed.SceneSequence):
    cache_ignores = ("log_path",)  # a log the script appends to: not read by the stored stage
    made: list = []  # on the class: not an attribute of the key

    def __init__(self, log_path, data_path=None):
        super().__init__()
        self.log_path, self.data_path = log_path, data_path

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.made.append(i)
        return np.full((2,), i, np.float32)


def test_a_file_named_by_an_ignored_attribute_is_not_in_the_key(tmp_path):
    log, data = tmp_path / "train.log", tmp_path / "data.bin"
    log.write_text("run 1\n")
    data.write_bytes(b"0123")
    key = source_key(_Numbered(str(log), str(data)), 4, None, 1)
    assert str(data) in key["files"] and str(log) not in key["files"]  # the other attribute's file counts
    with open(log, "a") as f:
        f.write("run 2\n" * 10)
    assert key_change(key, source_key(_Numbered(str(log), str(data)), 4, None, 1)) is None

    cache = tmp_path / "kept"
    _Numbered.made.clear()
    with kerasfeed.to_loader(_Numbered(str(log)), executor="threads", cache=str(cache)) as loader:
        list(loader)
    assert sorted(_Numbered.made) == [0, 1, 2, 3]
    with open(log, "a") as f:
        f.write("run 3\n" * 10)
    with kerasfeed.to_loader(_Numbered(str(log)), executor="threads", cache=str(cache)) as loader:
        list(loader)
    assert sorted(_Numbered.made) == [0, 1, 2, 3], "the kept cache was rebuilt: its items made again"


class _Mapped(kerasfeed.SceneSequence):
    def __init__(self, path):
        super().__init__()
        self.data = np.load(path, mmap_mode="r")

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return np.asarray(self.data[i])


def test_a_memory_mapped_array_s_file_is_in_the_key(tmp_path):
    path = str(tmp_path / "data.npy")
    np.save(path, np.zeros((4, 3), "float32"))
    before = source_key(_Mapped(path), 4, None, 1)
    assert os.path.abspath(path) in before["files"], before["files"]
    np.save(path, np.ones((4, 3), "float32"))
    os.utime(path, ns=(1, 1))  # another modification time, whatever the clock's resolution
    after = source_key(_Mapped(path), 4, None, 1)
    assert key_change(before, after) is not None


# ------------------------------------------------------------------ what a kept cache served stale before
class _Configured(kerasfeed.SceneSequence):
    """Items scaled by a value held the ways a user's source may hold it."""

    made: list = []

    def __init__(self, how, value, path=None):
        super().__init__()
        if how == "optional" and value != 1.0:  # set only when given: absent in one run, present in the next
            self.scale = value
        elif how == "dict":
            self.cfg = {"norm": {"scale": value, "eps": 1e-6}, "names": ["points"]}
        elif how == "nested":
            self.mean = [[value, 0.0], [0.0, value]]
        elif how == "reader":
            self.reader = kerasfeed.H5SliceSequence(path, "x", 1)
        self.how, self._value, self.path = how, value, path  # _value: not in the key, only the holding above

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.made.append(i)
        if self.how == "reader":
            return np.asarray(self.reader[i], np.float32).reshape(-1)
        return np.full((2,), i * self._value, np.float32)


def test_a_kept_cache_is_rebuilt_when_an_attribute_appears_a_nested_value_or_a_held_reader_changes(tmp_path, caplog):
    """Each of these served the first run's items in the second: an attribute set in one run only (the key
    compared the attributes both runs had), a config dict or a list of lists (left out of the key), and a
    kerasfeed reader held as an attribute (its file left out)."""
    import h5py

    path = str(tmp_path / "d.h5")
    for how in ("optional", "dict", "nested", "reader"):
        directory = str(tmp_path / how)
        for value in (1.0, 2.0):
            if how == "reader":
                with h5py.File(path, "w") as f:
                    f["x"] = np.full((4, 2), value, np.float32)
                os.utime(path, ns=(int(value), int(value)))  # another mtime whatever the clock's resolution
            _Configured.made.clear()
            caplog.clear()
            source = _Configured(how, value, path)
            with kerasfeed.to_loader(source, executor="threads", cache=directory) as loader:
                got = np.concatenate([np.asarray(b).reshape(-1) for b in loader])
            if how == "reader":
                source.reader.close()  # its file is written again next
            want = np.full(8, value, np.float32) if how == "reader" else np.repeat(np.arange(4) * value, 2)
            assert np.array_equal(got, want), (how, value, got)
            assert sorted(_Configured.made) == [0, 1, 2, 3], (how, value)  # made again: rebuilt
        assert "rebuilt" in caplog.text, (how, caplog.text)


def test_nested_values_are_keyed_by_content_and_objects_inside_by_type():
    a = source_key(_Configured("dict", 1.0), 4, None, 1)
    assert key_change(a, source_key(_Configured("dict", 1.0), 4, None, 1)) is None  # same content, same key
    b = source_key(_Configured("dict", 3.0), 4, None, 1)
    assert "`cfg` changed" in key_change(a, b)

    class Holder(_Numbered):
        def __init__(self, log_path, extra):
            super().__init__(log_path)
            self.extra = extra

    plain = source_key(Holder("x.log", {"model": object(), "k": 1}), 4, None, 1)
    again = source_key(Holder("x.log", {"model": object(), "k": 1}), 4, None, 1)  # another object, same type
    assert key_change(plain, again) is None
    assert key_change(plain, source_key(Holder("x.log", {"model": object(), "k": 2}), 4, None, 1)) is not None


def test_dict_keys_of_nested_tuples_and_values_past_four_levels_are_keyed_by_content():
    def key(extra):
        return source_key(Holder("x.log", extra), 4, None, 1)

    class Holder(_Numbered):
        def __init__(self, log_path, extra):
            super().__init__(log_path)
            self.extra = extra

    # Two dict keys that differ two levels down (a nested tuple) were one key: a kept cache served stale items.
    assert key_change(key({((1, 2), "a"): 1.0}), key({((4, 5), "a"): 1.0})) is not None
    assert key_change(key({((1, 2), "a"): 1.0}), key({((1, 2), "a"): 1.0})) is None
    deep = [[[[[[1.0, 2.0]]]]]]  # six levels: the last two past NESTED_DEPTH
    other = [[[[[[1.0, 3.0]]]]]]
    assert key_change(key(deep), key(other)) is not None
    assert key_change(key(deep), key([[[[[[1.0, 2.0]]]]]])) is None


def test_an_unshuffled_order_s_drawn_seed_is_not_in_the_key_a_shuffled_one_s_is():
    class Holder(_Numbered):
        def __init__(self, log_path, shuffle):
            super().__init__(log_path)
            self.order = kerasfeed.IndexOrder(8, shuffle=shuffle)  # seed drawn: another in every run

    # Unshuffled, the seed decides nothing: a kept cache was rebuilt in every run.
    assert key_change(source_key(Holder("x.log", False), 4, None, 1), source_key(Holder("x.log", False), 4, None, 1)) is None
    assert key_change(source_key(Holder("x.log", True), 4, None, 1), source_key(Holder("x.log", True), 4, None, 1))


class _ClassSet(kerasfeed.SceneSequence):
    """``load`` reads a constant and a file named in the class body (``self.SCALE``, ``self.PATH``)."""

    PATH = ""
    SCALE = 1.0
    made: list = []  # the test's count of load calls: a class's list is shared state, not in the key

    def __len__(self):
        return 4

    def load(self, i):
        type(self).made.append(i)
        return np.load(self.PATH)[i] * self.SCALE


def test_a_kept_cache_is_rebuilt_when_a_class_attribute_or_a_file_it_names_changes(tmp_path, monkeypatch):
    """Class-body values are the source's attributes too: both served the first run's items before."""
    path = tmp_path / "values.npy"
    np.save(path, np.ones(4))
    monkeypatch.setattr(_ClassSet, "PATH", str(path))
    directory = str(tmp_path / "items")

    def run():
        _ClassSet.made.clear()
        with kerasfeed.to_loader(_ClassSet(), executor="threads", cache=directory) as loader:
            return [float(b) for b in loader], sorted(_ClassSet.made)

    assert run() == ([1.0] * 4, [0, 1, 2, 3])
    assert run() == ([1.0] * 4, [])  # the same: reused
    monkeypatch.setattr(_ClassSet, "SCALE", 10.0)
    assert run() == ([10.0] * 4, [0, 1, 2, 3])
    np.save(path, np.full(4, 2.0))
    os.utime(path, ns=(1, 1))  # another mtime whatever the clock's resolution
    assert run() == ([20.0] * 4, [0, 1, 2, 3])
    key = source_key(_ClassSet(), 4, None, 1)
    assert key["attributes"]["SCALE"] == "10.0" and str(path) in key["files"]
    assert set(key["attributes"]) == {"PATH", "SCALE"}  # no method, no class list


class _Mode(enum.Enum):
    RAW = 1
    NORM = 2


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    values: str = ""


class _Set(kerasfeed.SceneSequence):
    def __init__(self, setting):
        super().__init__()
        self.setting = setting

    def __len__(self):
        return 4

    def load(self, i):
        return np.full(2, i)


def test_settings_of_other_kinds_are_keyed_by_value():
    """A dtype, a class, an enum member, a set, a slice, a range and a dataclass config were left out of the
    key (a helper's runs: the second served the first run's items after one changed)."""
    pairs = {
        "dtype class": (np.float32, np.float16), "dtype": (np.dtype("float32"), np.dtype("float16")),
        "class": (float, int), "enum": (_Mode.RAW, _Mode.NORM), "set": ({0, 1}, {0, 1, 2}),
        "slice": (slice(0, 2), slice(0, 3)), "range": (range(2), range(3)), "dataclass": (_Cfg(1.0), _Cfg(2.0)),
        "nested": ({"dtype": np.float32, "modes": [_Mode.RAW]}, {"dtype": np.float32, "modes": [_Mode.NORM]}),
    }
    for kind, (first, second) in pairs.items():
        key = source_key(_Set(first), 4, None, 1)
        assert "setting" in key["attributes"], kind
        assert key_change(key, source_key(_Set(first), 4, None, 1)) is None, kind
        assert "`setting` changed" in key_change(key, source_key(_Set(second), 4, None, 1)), kind
    same = source_key(_Set({"b", "a", "c"}), 4, None, 1)
    assert key_change(same, source_key(_Set({"c", "b", "a"}), 4, None, 1)) is None  # a set's order is no change


class _Deep(kerasfeed.SceneSequence):
    """``load`` reads a file named two levels down in a config, in a dataclass or in the class body's list."""

    FILES: list = []

    def __init__(self, how, path):
        super().__init__()
        self.how = how
        if how == "config":
            self.cfg = {"data": {"values": path}}
        elif how == "dataclass":
            self.cfg = _Cfg(1.0, path)
        self.path = None if how == "class list" else path  # for load only, left out below
        self.cache_ignores = ("path",)

    def __len__(self):
        return 4

    def load(self, i):
        return np.load(self.path or self.FILES[0])[i:i + 1]


def test_a_file_named_deep_in_a_config_a_dataclass_or_a_class_list_rebuilds_the_cache(tmp_path, monkeypatch,
                                                                                       caplog):
    """Only one level of lists and dicts was read for files, and no class-body list: rewriting the file served
    the first run's items."""
    path = str(tmp_path / "values.npy")
    monkeypatch.setattr(_Deep, "FILES", [path])
    for how in ("config", "dataclass", "class list"):
        directory = str(tmp_path / how.replace(" ", "_"))
        for value in (1.0, 2.0):
            np.save(path, np.full(4, value))
            os.utime(path, ns=(int(value), int(value)))  # another mtime whatever the clock's resolution
            caplog.clear()
            with kerasfeed.to_loader(_Deep(how, path), executor="threads", cache=directory) as loader:
                assert [float(b[0]) for b in loader] == [value] * 4, (how, value)
            assert source_key(_Deep(how, path), 4, None, 1)["files"] == {path: f"size={os.stat(path).st_size},"
                                                                         f"mtime_ns={int(value)}"}, how
        assert "rebuilt" in caplog.text and "values.npy changed" in caplog.text, (how, caplog.text)


# ------------------------------------------------------------------ a helper's second round (2026-11-27)
_STABLE_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    from kerasfeed.cache.keys import source_key

    def flip(x):
        return x[::-1]

    class Obj:
        pass

    class Src:
        def __init__(self, folder):
            self.weights = {frozenset({"car", "truck", "bus"}): 2.0, ("x", frozenset({"a", "b"})): 1.0}
            self.augs = {flip: 0.5, Obj(): 0.1}
            self.annotations = {f"{folder}/f{i}.npy" if i < 5 else f"{folder}/missing_{i}" for i in range(20000)}

        def __len__(self):
            return 4

        def load(self, i, table={frozenset({"u", "v", "w"}): 2}):
            return i

    print(json.dumps(source_key(Src(sys.argv[1]), 4, None, 1), sort_keys=True))
''')


def test_keys_holding_frozensets_functions_objects_and_big_sets_are_the_same_in_every_run(tmp_path):
    """A dict keyed by frozensets (ordered by a repr that follows the run's string hashing), a dict keyed by a
    function or an object (a repr with an address) and a set of 20,000 paths (sampled in hash order) gave
    another key in the next run: every run rebuilt the cache. Two processes, two hash seeds, one key."""
    for i in range(5):
        np.save(tmp_path / f"f{i}.npy", np.zeros(2))
    keys = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed,
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", _STABLE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
        keys.append(json.loads(proc.stdout))
    assert keys[0] == keys[1]
    assert len(keys[0]["files"]) == 5 and {"weights", "augs", "annotations"} <= set(keys[0]["attributes"])


class _Kinds(kerasfeed.SceneSequence):
    DTYPE = np.float16

    def __init__(self, **settings):
        super().__init__()
        self.__dict__.update(settings)

    def __len__(self):
        return 4

    def load(self, i):
        return np.full(2, i)


def test_more_settings_and_files_are_in_the_key_and_none_raises(tmp_path, monkeypatch):
    """Each was missed (the old items served), or raised while the key was made (a helper's report)."""
    changed = {
        "structured dtype": (np.dtype([("x", "f4"), ("y", "i4")]), np.dtype([("x", "i4"), ("y", "f4")])),
        "subarray dtype": (np.dtype(("f4", (3,))), np.dtype(("i4", (3,)))),
        "path to a folder": (tmp_path / "v1", tmp_path / "v2"),
        "deep config": ({"scale": 1.0, "stages": [[["crop", 64]]]}, {"scale": 2.0, "stages": [[["crop", 64]]]}),
        "numpy slice": (slice(np.int64(0), np.int64(5)), slice(np.int64(0), np.int64(6))),
        "float slice": (slice(0.0, 0.5), slice(0.0, 0.7)),
        "enum value": (_Mode.RAW, enum.Enum("_Mode", {"RAW": 255})["RAW"]),
        "function in a list": ([lambda x: x], [lambda x: -x]),
    }
    for kind, (first, second) in changed.items():
        key = source_key(_Kinds(setting=first), 4, None, 1)
        assert "`setting` changed" in (key_change(key, source_key(_Kinds(setting=second), 4, None, 1)) or ""), kind
    key = source_key(_Kinds(), 4, None, 1)
    monkeypatch.setattr(_Kinds, "DTYPE", np.float32)  # a class body's dtype (a class: it was left out as a method)
    assert "`DTYPE` changed" in key_change(key, source_key(_Kinds(), 4, None, 1))
    from unittest import mock

    for odd in (np.floating, np.integer, np.generic, mock.Mock()):  # raised TypeError
        source_key(_Kinds(setting=odd, inside=[odd, {odd}]), 4, None, 1)


def test_files_in_long_lists_of_pairs_and_in_dict_keys_are_in_the_key(tmp_path):
    """A list of 12,000 ``(path, label)`` pairs was sampled for bare paths, found none and was not looked at;
    a ``{path: label}`` dict's keys were never looked at."""
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"p{i}.npy"))
        np.save(paths[-1], np.zeros(2))
    pairs = [(paths[i % 3], i % 5) for i in range(12_000)]
    for setting in (pairs, [{"path": p, "y": 1} for p, _ in pairs], {p: 1 for p in paths}):
        assert set(source_key(_Kinds(setting=setting), 4, None, 1)["files"]) == set(paths)


def test_a_subclass_s_cache_ignores_adds_to_its_bases(tmp_path):
    """A subclass of a kerasfeed reader naming its log in ``cache_ignores`` replaced the reader's ``("seed",)``:
    the drawn seed entered the key, and every run rebuilt the cache (a helper's report, a test script's)."""
    from kerasfeed.cache.key_sources import ignored

    path = make_synthetic_scenes(str(tmp_path / "s.h5"), num_scenes=8, points_per_scene=8)

    class Logged(kerasfeed.H5SliceSequence):
        cache_ignores = ("log",)

    seq = Logged(path, "labels", 4, shuffle=True)
    seq.cache_ignores = ("note",)
    assert ignored(seq) == {"seed", "log", "note"}
    assert "seed" not in source_key(seq, len(seq), None, 1)["attributes"]


_SWMR_WRITER = textwrap.dedent('''
    import sys, h5py, numpy as np
    f = h5py.File(sys.argv[1], "w", libver="latest")
    rows = f.create_dataset("labels", (0,), maxshape=(None,), dtype="i8", chunks=(16,))
    f.swmr_mode = True
    n = 0
    print("ok", flush=True)
    for line in sys.stdin:
        k = int(line)
        if k == 0:
            break
        rows.resize((n + k,))
        rows[n:n + k] = np.arange(n, n + k) + 1
        f.flush()
        n += k
        print("ok", flush=True)
    f.close()
''')


def test_a_kept_cache_over_a_file_a_swmr_writer_grew_is_rebuilt(tmp_path):
    # Run 1's sequence saw 95 rows of a live file; the writer then appended 5 and closed it (its size
    # and mtime are of 100 rows when the key is made). Run 2's sequence sees 100 rows: the same number
    # of batches, but its last one has 50 rows, not run 1's 45.
    path, directory = str(tmp_path / "growing.h5"), str(tmp_path / "kept")
    writer = subprocess.Popen([sys.executable, "-c", _SWMR_WRITER, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ok"

        def append(k):
            writer.stdin.write(f"{k}\n")
            writer.stdin.flush()
            if k:
                assert writer.stdout.readline().strip() == "ok"

        append(95)
        first = kerasfeed.H5SliceSequence(path, "labels", batch_size=50, swmr=True)
        append(5)
        append(0)
        assert writer.wait(60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
    with kerasfeed.to_loader(first, cache=directory) as loader:
        assert [len(b) for b in loader] == [50, 45]
    first.close()
    second = kerasfeed.H5SliceSequence(path, "labels", batch_size=50, swmr=True)
    with kerasfeed.to_loader(second, cache=directory) as loader:
        got = list(loader)
    second.close()
    assert [len(b) for b in got] == [50, 50]
    np.testing.assert_array_equal(np.concatenate(got), np.arange(100) + 1)


def test_a_kept_cache_of_rows_read_in_another_order_is_rebuilt(tmp_path):
    # The reader's order (wrapped by resolve_order: no dataclass) was left out of the key: shard 1 of an
    # IndexOrder was served shard 0's stored batches (helper, 3 of 3).
    import h5py

    path, directory = str(tmp_path / "rows.h5"), str(tmp_path / "kept")
    with h5py.File(path, "w") as f:
        f["y"] = np.arange(64, dtype="i8")
    for shard in (0, 1):
        order = kerasfeed.IndexOrder(64, shuffle=False, num_shards=2, shard_index=shard)
        seq = kerasfeed.H5RowSequence(path, "y", 8, order=order)
        with kerasfeed.to_loader(seq, cache=directory) as loader:
            got = np.concatenate(list(loader))
        np.testing.assert_array_equal(got, np.arange(shard, 64, 2))


class _Scale:
    def __init__(self, k):
        self.k = k

    def apply(self, x):
        return x * self.k

    def __call__(self, x):
        return x * self.k


class _Holds(kerasfeed.SceneSequence):
    def __init__(self, pre):
        super().__init__()
        self.pre = pre

    def __len__(self):
        return 4

    def load(self, i):
        return self.pre(np.full((2,), i + 1, "f4"))


@pytest.mark.parametrize("make", [
    lambda k: functools.partial(np.multiply, k),  # a partial of a ufunc: left out, arguments and all
    lambda k: _Scale(k).apply,  # a bound method: its object's settings were not keyed
    lambda k: _Scale(k),  # a callable object (a transform such as ScenePointSampler(...)): not keyed at all
], ids=["partial-of-ufunc", "bound-method", "callable-object"])
def test_a_held_callable_s_settings_are_in_the_key(make):
    two, three = (source_key(_Holds(make(k)), 4, None, 1) for k in (2.0, 3.0))
    assert "`pre` changed" in (key_change(two, three) or "")
    assert key_change(three, source_key(_Holds(make(3.0)), 4, None, 1)) is None  # stable while nothing changes


class _Steps:
    """Holds its own bound methods (``self.steps = [self.double]``) and a callable with a bookkeeping field."""

    def __init__(self, started):
        self.steps = [self.double]
        self.aug = _Stamped(2.0, started)

    def double(self, x):
        return x * 2

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.aug(self.steps[0](np.full((2,), i, "f4")))


class _Stamped:
    cache_ignores = ("started",)

    def __init__(self, k, started):
        self.k, self.started = k, started

    def __call__(self, x):
        return x * self.k


class _Layer:
    def __call__(self, x):
        return self.call(x)


def _call_2(self, x):
    return x * 2


def _call_5(self, x):
    return x * 5


def test_held_callables_of_the_source_itself_and_their_ignored_fields_key_as_before():
    # The source's own bound methods in a list made the key recurse (RecursionError: no kept cache opened),
    # and a held callable's cache_ignores were keyed, rebuilding the cache every run (helper, 6 of 6, 3 of 3).
    first, again = source_key(_Steps(1.0), 4, None, 1), source_key(_Steps(2.0), 4, None, 1)
    assert key_change(first, again) is None
    # A class whose __call__ is its base's (a Keras layer, a torch module): its own call/forward is keyed.
    two, five = (type("Aug", (_Layer,), {"call": fn})() for fn in (_call_2, _call_5))
    assert "`pre` changed" in (key_change(source_key(_Holds(two), 4, None, 1), source_key(_Holds(five), 4, None, 1))
                               or "")


class _OwnItemSeed:
    """A plain source whose attribute happens to be called ``item_seed``: its own data, which counts."""

    def __init__(self, item_seed):
        self.item_seed = item_seed

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return np.random.default_rng([self.item_seed, i]).random(2)


class _SceneWithSeed(kerasfeed.SceneSequence):
    def __len__(self):
        return 3

    def load(self, i):
        return np.full(2, i, np.float32)


def test_item_seed_is_left_out_of_the_key_only_for_a_scene_sequence():
    """A SceneSequence's ``item_seed`` seeds items made outside kerasfeed: no stored item changes. Another
    source's attribute of that name was skipped too, and its kept cache served another seed's items."""
    assert source_key(_OwnItemSeed(1), 3, None, 1) != source_key(_OwnItemSeed(2), 3, None, 1)
    a, b = _SceneWithSeed(), _SceneWithSeed()
    b.item_seed = 7
    assert source_key(a, 3, None, 1) == source_key(b, 3, None, 1)
