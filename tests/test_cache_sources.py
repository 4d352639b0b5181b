"""cache= with the sources a kept key or a pass check got wrong: an array or a list as the source, a long
list attribute, a held function, an HDF5 reader's keys and file order, a multi-file reader on threads; and
a kept directory's damaged spec, a fork's copy of its lock, and the arguments that name it."""

from __future__ import annotations

import logging
import multiprocessing
import os

import numpy as np
import pytest

import kerasfeed
from kerasfeed.cache.keys import container_digest, key_change, source_key
from kerasfeed.cache.store import ItemStore
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.execution.cache_front import CacheFront
from kerasfeed.execution.cached_items import ItemCache
from kerasfeed.execution.threads import ThreadExecutor


def _copy(item):
    if isinstance(item, dict):
        return {k: _copy(v) for k, v in item.items()}
    if isinstance(item, tuple):
        return tuple(_copy(v) for v in item)
    return np.array(item)


def _items(source, cache, **kw) -> list:
    with kerasfeed.to_loader(source, cache=cache, executor="threads", **kw) as loader:
        return [_copy(b) for b in loader]


# ---------------------------------------------------------------- what the key holds


def test_an_array_or_a_list_given_as_the_source_is_keyed_by_its_values(tmp_path, caplog):
    """They have no attributes or files: only their class and length were keyed, so the second run got the
    first array's float32 (3, 2) items for an int64 (3, 4) array."""
    directory = str(tmp_path / "c")
    first = np.zeros((3, 2), np.float32)
    assert np.array_equal(np.stack(_items(first, directory)), first)
    caplog.set_level(logging.INFO, logger="kerasfeed")
    other = np.ones((3, 4), np.int64)
    got = np.stack(_items(other, directory))
    assert got.dtype == np.int64 and np.array_equal(got, other)
    assert "`<the items>` changed" in caplog.text
    pairs = [(np.full(2, k, np.float32), k) for k in range(4)]
    again = [(np.full(2, 10 + k, np.float32), k) for k in range(4)]
    assert float(_items(pairs, directory)[0][0][0]) == 0.0
    assert float(_items(again, directory)[0][0][0]) == 10.0  # the same length and class, other values
    with pytest.raises(TypeError, match=r"holds objects whose values cannot be keyed .* Received: list of 3 items"):
        kerasfeed.to_loader([object()] * 3, cache=directory)
    days = np.array(["2020-01-01", "2021-01-01"], "datetime64[D]")  # no buffer protocol: hashed from a copy
    assert container_digest(days) != container_digest(days + 1)


class _Names(kerasfeed.SceneSequence):
    def __init__(self, names, files=()):
        super().__init__()
        self.names, self.files = names, list(files)

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.frombuffer(self.names[i].encode().ljust(24), np.uint8)


def test_a_list_attribute_of_any_length_is_keyed_and_a_long_list_of_paths_is_checked(tmp_path):
    """Past 10,000 values a list was left out of the key (a fold's names: the last fold's items served)."""
    names = [f"fold0/img{i:06d}.png" for i in range(10_001)]
    key = source_key(_Names(names), 2, None, 1)
    renamed = source_key(_Names([n.replace("fold0", "fold1") for n in names]), 2, None, 1)
    assert "`names` changed" in key_change(key, renamed)
    paths = []
    for k in range(3):
        paths.append(str(tmp_path / f"f{k}.bin"))
        with open(paths[-1], "wb") as f:
            f.write(b"x")
    long = paths + [str(tmp_path / f"absent{k}") for k in range(10_001)]
    before = source_key(_Names(names, long), 2, None, 1)
    assert set(paths) <= set(before["files"])  # a long list of paths: its files' sizes and times count
    os.utime(paths[2], ns=(5, 5))
    assert "f2.bin changed" in key_change(before, source_key(_Names(names, long), 2, None, 1))


class _Held(kerasfeed.SceneSequence):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.fn(np.full(2, i, np.float32))


def test_a_function_an_attribute_holds_is_keyed_by_its_code():
    key = source_key(_Held(lambda x: x * 2), 2, None, 1)
    assert key_change(key, source_key(_Held(lambda x: x * 2), 2, None, 1)) is None  # the same code
    assert "`fn` changed" in key_change(key, source_key(_Held(lambda x: x * 3), 2, None, 1))


@pytest.fixture
def two_files(tmp_path):
    return [str(make_synthetic_scenes(tmp_path / f"s{k}.h5", num_scenes=16, points_per_scene=8, chunk_scenes=4,
                                      seed=k)) for k in range(2)]


def test_a_reader_s_keys_and_file_order_are_in_the_key(tmp_path, two_files, caplog):
    """Both were in underscored attributes or sorted away: other keys got the old fields, a reordered list
    the old order's items."""
    directory = str(tmp_path / "c")
    a, b = two_files

    def first(paths, keys, cache):
        return _items(kerasfeed.H5SliceSequence(paths, keys, 4), cache)[0]

    first(a, ("points", "labels"), directory)
    caplog.set_level(logging.INFO, logger="kerasfeed")
    got = first(a, ("points", "point_labels"), directory)
    assert got[1].shape == (4, 8) and "settings changed" in caplog.text
    first([a, b], ("points", "labels"), directory)
    got, want = first([b, a], ("points", "labels"), directory), first([b, a], ("points", "labels"), None)
    assert np.array_equal(got[0], want[0])

    class Holder(kerasfeed.SceneSequence):  # a reader held by the user's source: its settings count too
        def __init__(self, keys):
            super().__init__()
            self.reader = kerasfeed.H5SliceSequence(a, keys, 4)

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return self.reader[i]

    held = source_key(Holder(("points", "labels")), 1, None, 1)
    assert "reader in `reader`" in key_change(held, source_key(Holder(("points", "point_labels")), 1, None, 1))


def test_readers_held_in_a_list_or_with_other_arguments_are_keyed_by_what_makes_their_items(tmp_path, two_files,
                                                                                             caplog):
    """A reader in a list counted by its type and its files only, and a reader held as an attribute by its keys
    and files only: other keys, another window or transform read the last run's items from a kept directory."""
    a, b = two_files

    class Readers(kerasfeed.SceneSequence):
        def __init__(self, keys=("points", "labels"), transform=None, window=None):
            super().__init__()
            self.readers = [kerasfeed.H5SliceSequence(a, keys, 4, transform=transform)]
            self.windows = None if window is None else kerasfeed.H5WindowSequence(b, ("points",), window=window,
                                                                                 batch_size=2)

        def __len__(self):
            return 2

        def __getitem__(self, i):
            item = self.readers[0][i]
            return item if self.windows is None else (self.windows[i], item[1])

    def key(**kwargs):
        return source_key(Readers(**kwargs), 2, None, 1)

    assert key_change(key(), key()) is None  # the same readers: the same key, whatever seed each drew
    assert "`readers` changed" in key_change(key(), key(keys=("points", "point_labels")))
    assert "`readers` changed" in key_change(key(), key(transform=lambda x: x))
    assert "reader in `windows`" in key_change(key(window=2), key(window=3))
    # end to end: a kept directory serves the new keys' items, not the last run's
    directory = str(tmp_path / "c")
    _items(Readers(), directory)
    caplog.set_level(logging.INFO, logger="kerasfeed")
    got = _items(Readers(("points", "point_labels")), directory)[0]
    assert got[1].shape == (4, 8) and "`readers` changed" in caplog.text


# ---------------------------------------------------------------- passes


@pytest.mark.parametrize("reader", ["slices", "rows"])
def test_a_reader_of_several_files_on_threads_reads_every_cached_pass(tmp_path, reader):
    """Its threads fill its lazy dict of open datasets during pass 0 (the probe opened the first file only):
    pass 1 failed, 'the source's attribute `_h5_datasets` changed'. What a source leaves out of its pickled
    state is not what items are made from."""
    paths = [str(make_synthetic_scenes(tmp_path / f"m{k}.h5", num_scenes=64, points_per_scene=8, seed=k))
             for k in range(3)]
    if reader == "slices":
        seq = kerasfeed.H5SliceSequence(paths, ("points", "labels"), 4)
    else:
        seq = kerasfeed.H5RowSequence(paths, ("points", "labels"), 4, order=kerasfeed.IndexOrder(192))
    with kerasfeed.to_loader(seq, shuffle=True, seed=0, cache="memory", executor="threads") as loader:
        passes = [[b[0].copy() for b in loader] for _ in range(3)]
        figures = kerasfeed.stats(loader)
    assert figures["cache_misses"] <= len(seq) and figures["cache_hits"] >= 2 * len(seq)
    sums = [sorted(float(b.sum()) for b in p) for p in passes]
    assert len(passes[0]) == len(seq) and sums[0] == sums[1] == sums[2]  # every batch, each pass


class _Counted:
    """An inner executor's source that counts its calls (a Ray actor's, which cannot read the store)."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.calls += 1
        return np.full(3, i, np.float32)


def test_the_probe_of_a_stored_item_does_not_reach_the_executor():
    """The probe runs before pass 0 has a cut, so it went to the executor: Ray's actors read the object
    store again for a kept cache that held every item (and failed without their credentials)."""
    source = _Counted()
    store = ItemStore.memory(4, 1 << 16)
    for i in range(4):
        assert store.put(i, np.full(3, i, np.float32))
    front = CacheFront(ThreadExecutor(source, parallelism=1), ItemCache.for_source(source, store), source,
                       remote=True, on_close=store.close)
    try:
        assert [float(front.load(i, 0)[0]) for i in range(4)] == [0, 1, 2, 3]
        assert source.calls == 0
    finally:
        front.close()


# ---------------------------------------------------------------- a kept directory


class _Spec(kerasfeed.SceneSequence):
    def __len__(self):
        return 6

    def load(self, i):
        return {"x": np.full((100,), i, np.float32), "name": f"item{i}"}


def test_a_record_whose_spec_is_damaged_is_made_again_with_a_warning(tmp_path, caplog):
    """Past a sound header, a damaged pickled spec raised UnpicklingError out of the run (named no item)."""
    directory = str(tmp_path / "c")
    first = _items(_Spec(), directory)
    index = np.fromfile(os.path.join(directory, "index.bin"), np.uint64)
    entries = index[-3 * 6:].reshape(6, 3)  # (offset, length, cut) per item, after the header
    with open(os.path.join(directory, "data.bin"), "r+b") as f:
        f.seek(int(entries[3, 0]) + 64)  # the first byte of item 3's spec
        f.write(b"\xff")
    caplog.set_level(logging.WARNING, logger="kerasfeed")
    again = _items(_Spec(), directory)
    assert [float(b["x"][0]) for b in again] == [float(b["x"][0]) for b in first]
    assert "item 3 failed its check" in caplog.text


def _fork_holder(conn):
    conn.recv()  # holds the parent's descriptors until told to end


def test_a_child_forked_while_a_kept_cache_was_open_does_not_keep_its_directory_locked(tmp_path):
    directory = str(tmp_path / "c")
    loader = kerasfeed.to_loader(_Spec(), cache=directory, executor="threads")
    list(loader)
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_fork_holder, args=(child,))
    proc.start()
    try:
        loader.close()
        with kerasfeed.to_loader(_Spec(), cache=directory, executor="threads") as again:  # refused before
            assert len(list(again)) == 6
    finally:
        parent.send(None)
        proc.join(10)


def test_cache_arguments_name_what_is_wrong(tmp_path, monkeypatch, caplog):
    with pytest.raises(ValueError, match=r"'memroy' looks like the former misspelt"):
        kerasfeed.to_loader(_Spec(), cache="memroy")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match=r"cannot be made \('.*a_file' is a file\).*Received: cache="):
        kerasfeed.to_loader(_Spec(), cache=str(blocker / "sub"))
    with pytest.raises(ValueError, match=r"no store of max_bytes=1,125,899,906,842,624 bytes can be made in RAM"):
        kerasfeed.to_loader(_Spec(), cache=kerasfeed.Cache(max_bytes=2**50))
    directory = str(tmp_path / "huge")
    with pytest.raises(ValueError, match=r"can be made in '.*huge'"):
        kerasfeed.to_loader(_Spec(), cache=kerasfeed.Cache(directory, max_bytes=2**50))
    for huge in (2**63, 2**64):  # past a C off_t: an OverflowError inside, named here too
        with pytest.raises(ValueError, match=rf"no store of max_bytes={huge:,} bytes can be made in RAM"):
            kerasfeed.to_loader(_Spec(), cache=kerasfeed.Cache(max_bytes=huge))
        with pytest.raises(ValueError, match=r"can be made in '.*huge'.*Received: max_bytes="):
            kerasfeed.to_loader(_Spec(), cache=kerasfeed.Cache(directory, max_bytes=huge))
    # Refused before either file was renamed in: a new index.bin was left beside no data.bin, and the next open
    # warned "rebuilt: its data.bin is missing".
    assert not {"index.bin", "data.bin", "index.bin.new", "data.bin.new"} & set(os.listdir(directory))
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        with kerasfeed.to_loader(_Spec(), cache=kerasfeed.Cache(directory, max_bytes=1 << 20)) as loader:
            assert len(list(loader)) == 6  # the directory is not left locked
    assert "rebuilt" not in caplog.text
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kerasfeed.Cache("~/items").directory == str(tmp_path / "home" / "items")


def test_a_kept_cache_under_an_order_gets_this_process_s_subdirectory(tmp_path):
    """With ``order=``, the plan's shard count is None (the order fixes the shards): to_dataset with a kept
    directory raised TypeError ('>' between None and int). An unsharded order cut per process (hosts.py)
    gave every process the bare directory, so the second one was refused as 'in use by another run'."""
    from kerasfeed.loading.feed import _store_shard
    from kerasfeed.loading.hosts import _ProcessShardOrder
    from kerasfeed.loading.shards import ShardPlan

    labels = np.arange(24) % 3
    balanced = kerasfeed.BalancedOrder(labels, seed=0)
    cut = [_store_shard(ShardPlan(1, 0, 1, _ProcessShardOrder(balanced, 2, k), None)) for k in (0, 1)]
    assert cut == [(0, 2), (1, 2)]
    fixed = kerasfeed.IndexOrder(24, shuffle=True, seed=0, num_shards=2, shard_index=1, fixed_shards=True)
    assert _store_shard(ShardPlan(None, None, 2, fixed, None)) == (1, 2)
    assert _store_shard(ShardPlan(None, None, 1, balanced, None)) == (0, 1)

    class Src:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return np.array([i]), np.array([i % 3])

    directory = tmp_path / "c"
    for order in (balanced, fixed):
        ds = kerasfeed.to_dataset(Src(), batch_size=4, order=order, cache=str(directory))
        try:
            assert sum(len(x) for x, _ in ds.as_numpy_iterator()) == order.shard_length
        finally:
            kerasfeed.executor_of(ds).close()
    assert sorted(os.listdir(directory)) == ["data.bin", "index.bin", "key.json", "lock", "shard-1-of-2"]


class _Split(kerasfeed.SceneSequence):
    """``load`` and ``augment``, and a ``__getitem__`` of its own (``how``): what the cache serves or not."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def __len__(self):
        return 4

    def load(self, i):
        return np.full((2,), i * 10, "float32")

    def augment(self, x):
        return x + kerasfeed.item_rng().normal(size=x.shape).astype("float32") + np.float32(np.random.rand())

    def __getitem__(self, i):
        item = self.augment(self.load(i))
        return {"same": item, "label": (item, np.int64(i)), "scaled": item / 100}[self.how]


def test_a_class_s_own_getitem_that_is_not_augment_of_load_is_refused_or_warned(caplog):
    """With cache= items are augment(load(i)); a class whose own __getitem__ made other items (a label added,
    a scale after augment) trained on those silently (a helper's report). Item 0 made both ways, from the same
    random states: another structure is refused, other values are a warning, the same items pass."""
    with pytest.raises(ValueError, match=r"own __getitem__ makes other items: item 0 by __getitem__ is tuple of 2 "
                                         r"leaves .*by augment\(load\(0\)\) ndarray of 1 leaves"):
        kerasfeed.to_loader(_Split("label"), cache="memory")
    for how in ("scaled", "same"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kerasfeed"):
            with kerasfeed.to_loader(_Split(how), cache="memory") as loader:
                assert len(list(loader)) == 4
        assert ("item 0 by its own __getitem__ has other values" in caplog.text) == (how == "scaled"), caplog.text
