"""cache=: what a store leaves behind and reports at its end: a pipeline dropped without close(), a
dataset that outlives its pipeline, a kept directory reused under another budget, written back before
it is marked clean, a disk that fills up, figures after close()."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kerasfeed
from kerasfeed.cache import kept as kept_module
from kerasfeed.cache import kept_directory
from kerasfeed.cache.kept import close_kept, open_kept
from kerasfeed.cache.store import H_CLEAN
from kerasfeed.loading.stored_passes import StoredPasses
from tests._util import wait_until

N = 8
KIB8 = 2048  # float32 values per 8 KiB item


class Numbered(kerasfeed.SceneSequence):
    def __init__(self, n: int = N, width: int = 4):
        super().__init__()
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((self.width,), i, np.float32)


def _memfds() -> set:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:kerasfeed-cache" in link:
            found.add(fd)
    return found


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("kerasfeed-cache" in line for line in f)


def _clean_mark(directory) -> int:
    """The header's clean slot, as ``kept.py`` reads it (``store.header(H_CLEAN)``: u64 slots of index.bin)."""
    return int(np.fromfile(os.path.join(directory, "index.bin"), np.uint64, count=H_CLEAN + 1)[H_CLEAN])


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _cache_figures(pipeline) -> dict:
    return {k: v for k, v in kerasfeed.stats(pipeline).items() if k.startswith("cache_")}


# ---------------------------------------------------------------- a pipeline dropped without close()
def test_loaders_dropped_without_close_leave_no_memfd_open():
    gc.collect()
    before = _memfds()
    for _ in range(3):
        loader = kerasfeed.to_loader(Numbered(), executor="threads", cache="memory")
        list(loader)
        assert len(_memfds() - before) >= 2  # the store's index and data
        del loader
    # Collected once its pool threads have stopped (they let go of the store as they leave).
    assert wait_until(lambda: gc.collect() >= 0 and not _memfds() - before), sorted(_memfds() - before)


def test_a_kept_directory_dropped_without_close_is_reopened_in_the_same_process(tmp_path, monkeypatch):
    directory = str(tmp_path / "kept")
    loader = kerasfeed.to_loader(Numbered(), executor="threads", cache=directory)
    list(loader)
    collections = kept_directory._OWN_COLLECTIONS
    monkeypatch.setattr(kept_directory, "_OWN_WAIT_S", 0.2)
    monkeypatch.setattr(kept_directory, "_OWN_COLLECTIONS", 1)  # refused after one (the default's 12 take ~4 s)
    with pytest.raises(RuntimeError, match=rf"in use by another pipeline of this process \(pid {os.getpid()}; or a "
                                           r"process of another container with that pid, sharing the directory\)"):
        kerasfeed.to_loader(Numbered(), executor="threads", cache=directory)  # the first one is still open
    # A dataset has no close() of its own: the message says how (it named only close() and `with`).
    with pytest.raises(RuntimeError, match=r"`kerasfeed.executor_of\(ds\).close\(\)` for a dataset"):
        kerasfeed.to_dataset(Numbered(), executor="threads", cache=directory)
    monkeypatch.setattr(kept_directory, "_OWN_WAIT_S", 10.0)
    monkeypatch.setattr(kept_directory, "_OWN_COLLECTIONS", collections)
    del loader
    gc.collect()
    with kerasfeed.to_loader(Numbered(), executor="threads", cache=directory) as again:
        list(again)
        assert kerasfeed.stats(again)["cache_hits"] == N  # every item served from what the dropped one stored


class _Fails(kerasfeed.SceneSequence):
    def __len__(self):
        return 12

    def load(self, i):
        if i == 9:
            raise ValueError("bad item 9")
        return np.full((4,), i, np.float32)


def test_a_kept_directory_of_worker_processes_dropped_after_an_item_error_is_reopened(tmp_path):
    """The item error's traceback closes rings of reference cycles around the store (the pipeline, the executor,
    its dispatcher): each ring went on the next collection only, and the single one before waiting left the
    directory locked for the cell run again (a helper's report: refused in 3 of 5 runs)."""
    for _ in range(3):
        loader = kerasfeed.to_loader(_Fails(), executor="processes", workers=2, cache=str(tmp_path / "kept"))
        with pytest.raises(kerasfeed.ItemError, match=r"bad item 9"):
            list(loader)
        del loader


_UNCLOSED = """
import sys
import numpy as np
from kerasfeed.cache.kept import open_kept
store, kept = open_kept(sys.argv[1], {"k": 1}, 8, 2**20)
for i in range(8):
    assert store.put(i, np.full((4,), i, np.float32))
"""  # no close: the interpreter exits with the store open (as a pipeline left open, fit(loader)'s)


def test_a_process_that_exits_without_close_leaves_the_kept_store_marked_clean(tmp_path, monkeypatch, caplog):
    directory = str(tmp_path / "kept")
    proc = subprocess.run([sys.executable, "-c", _UNCLOSED, directory], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _clean_mark(directory) == 1
    monkeypatch.setattr(kept_module, "boot_id", lambda: 12345)  # after a restart, a store left unclean is emptied
    with caplog.at_level(logging.INFO, logger="kerasfeed"):
        store, kept = open_kept(directory, {"k": 1}, 8, 2**20)
    try:
        assert store.figures()["items"] == 8 and "rebuilt" not in caplog.text, caplog.text
        np.testing.assert_array_equal(store.get(5), np.full((4,), 5, np.float32))
    finally:
        close_kept(store, kept)


# ---------------------------------------------------------------- to_dataset after close()
def test_a_closed_pipeline_s_dataset_keeps_none_of_the_store_mapped():
    from kerasfeed.tfdata.stored_items import MIN_PASS_ITEMS

    gc.collect()
    fds, maps = _memfds(), _maps()
    ds = kerasfeed.to_dataset(Numbered(MIN_PASS_ITEMS + 10, 256), executor="threads", group_items=1, cache="memory")
    assert isinstance(ds._kerasfeed_groups, StoredPasses)
    for _ in range(3):  # pass 0 stores, the later ones are read in the graph (the store's file mapped)
        for element in ds:
            pass
    del element  # an element may be a view of the mapping
    assert ds._kerasfeed_groups._data is not None and _maps() > maps
    kerasfeed.executor_of(ds).close()
    gc.collect()
    assert ds._kerasfeed_groups._data is None
    assert _maps() <= maps and not _memfds() - fds, (_maps(), sorted(_memfds() - fds))
    del ds


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_closed_loader_whose_last_pass_was_peeked_keeps_none_of_the_store_mapped(executor):
    """``with to_loader(...) as loader: x = next(iter(loader))``: the pass's first batch, kept for a Keras call
    that may take it over, is a view of the store; close() let the whole store stay mapped (helper: +400 MB)."""
    gc.collect()
    fds = _memfds()
    loader = kerasfeed.to_loader(Numbered(8, 4096), executor=executor, cache="memory")
    for _ in range(2):
        for x in loader:
            pass
    x = next(iter(loader))
    del x
    assert _memfds() - fds
    loader.close()
    assert wait_until(lambda: gc.collect() >= 0 and not _memfds() - fds), sorted(_memfds() - fds)
    del loader


# ---------------------------------------------------------------- a reused directory's budget
@pytest.mark.parametrize("where", ["memory", "directory"])
def test_max_bytes_of_k_items_stores_k_items(tmp_path, where):
    # A budget of exactly what a full run reports for k items (cache_bytes / items) holds k, not k - 1.
    source = Numbered(16, KIB8)
    with kerasfeed.to_loader(source, executor="threads", cache="memory") as full:
        list(full)
        figures = _cache_figures(full)
    assert figures["cache_items"] == 16
    record = figures["cache_bytes"] // 16
    directory = str(tmp_path / "kept") if where == "directory" else None
    budget = kerasfeed.Cache(directory, max_bytes=5 * record)
    with kerasfeed.to_loader(source, executor="threads", cache=budget) as five:
        list(five)
        list(five)
        figures = _cache_figures(five)
    assert figures["cache_items"] == 5 and figures["cache_bytes"] == 5 * record, figures
    assert figures["cache_capacity"] == 5 * record and figures["cache_full"], figures


def test_a_reused_directory_stores_up_to_this_run_s_max_bytes_and_reports_it(tmp_path, caplog):
    directory = str(tmp_path / "kept")
    item = np.zeros(KIB8, np.float32)
    store, kept = open_kept(directory, {"k": 1}, 16, 2**20)
    assert store.put(0, item) and store.put(1, item)
    close_kept(store, kept)
    store, kept = open_kept(directory, {"k": 1}, 16, 32 * 1024)  # a smaller budget than the file's length
    try:
        assert store.figures()["capacity"] == 32 * 1024 and not store.figures()["full"]
        stored = [i for i in range(2, 16) if store.put(i, item)]
        figures = store.figures()
        assert stored == [2] and figures["used"] <= 32 * 1024 and figures["full"], figures
        assert store.get(0) is not None  # what an earlier run held is served
    finally:
        close_kept(store, kept)
    # End to end: a larger budget than the last run's, which filled up.
    directory = str(tmp_path / "end-to-end")
    source = Numbered(16, KIB8)
    with kerasfeed.to_loader(source, executor="threads", cache=kerasfeed.Cache(directory, max_bytes=20 * 1024)) as a:
        list(a)
        assert kerasfeed.stats(a)["cache_full"] and kerasfeed.stats(a)["cache_items"] == 2
    with kerasfeed.to_loader(source, executor="threads", cache=kerasfeed.Cache(directory, max_bytes=2**20)) as b:
        assert _cache_figures(b)["cache_full"] is False  # this run's budget has room
        list(b)
        list(b)
        figures = _cache_figures(b)
    assert figures["cache_items"] == 16 and figures["cache_capacity"] == 2**20 and not figures["cache_full"]
    # A smaller budget than the directory holds: trimmed to the records that fit (as many as above: 2 + 1).
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        with kerasfeed.to_loader(source, executor="threads", cache=kerasfeed.Cache(directory, max_bytes=32 * 1024)) as c:
            list(c)
            figures = _cache_figures(c)
    fits = 2 + len(stored)
    trimmed = [r.getMessage() for r in caplog.records if "trimmed" in r.getMessage()]
    # Sizes under a MB in KB (the records' headers included): not "(0.0 of 0.1 MB)".
    assert len(trimmed) == 1 and re.search(rf"{fits} of its 16 items kept \(2\d\.\d KB of 1\d\d\.\d KB\)", trimmed[0]), trimmed
    assert figures["cache_items"] == fits and figures["cache_hits"] == fits, figures
    assert figures["cache_capacity"] == 32 * 1024 and figures["cache_full"]


# ---------------------------------------------------------------- written back before the clean mark
_WORKER = """
import json, sys
import numpy as np
from kerasfeed.cache.store import ItemStore
store = ItemStore.attach(json.loads(sys.argv[1]), [int(fd) for fd in sys.argv[2:]])
for i in range(8):
    assert store.put(i, np.full((4,), i, np.float32))
"""  # a worker process's side (``ItemCache.in_worker``), without the pool around it


def test_a_kept_store_written_by_worker_processes_is_synced_before_it_is_marked_clean(tmp_path, monkeypatch):
    directory = str(tmp_path / "kept")
    store, kept = open_kept(directory, {"k": 1}, N, 2**20)
    try:
        proc = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(store.described()), *map(str, store.fds())],
                              pass_fds=store.fds(), capture_output=True, text=True, env=_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert store.figures()["items"] == N  # all written by the other process: this one wrote nothing
        synced, real = [], os.fdatasync

        def spy(fd):
            synced.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), _clean_mark(directory)))
            return real(fd)

        monkeypatch.setattr(os, "fdatasync", spy)
    finally:
        close_kept(store, kept)
    assert ("data.bin", 0) in synced, synced  # the worker's records reach the disk before the clean mark
    assert _clean_mark(directory) == 1


# ---------------------------------------------------------------- a disk that fills up
def test_a_full_disk_stops_storing_with_one_warning_and_the_batches_stay_right(tmp_path, monkeypatch, caplog):
    source = Numbered(24, 64)
    with kerasfeed.to_loader(source, batch_size=4, shuffle=True, seed=1, executor="threads") as plain:
        want = [[b.copy() for b in plain] for _ in range(2)]
    real, calls = os.pwritev, [0]

    def full_disk(fd, buffers, offset):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_disk)
    directory = str(tmp_path / "kept")
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        with kerasfeed.to_loader(source, batch_size=4, shuffle=True, seed=1, executor="threads",
                                 cache=directory) as cached:
            got = [[np.array(b) for b in cached] for _ in range(2)]
            figures = _cache_figures(cached)
    assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want))
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)
    warnings = [r.getMessage() for r in caplog.records if "storing stopped" in r.getMessage()]
    assert len(warnings) == 1 and directory in warnings[0] and "No space left" in warnings[0], warnings
    assert figures["cache_items"] == 3 and figures["cache_full"]
    monkeypatch.setattr(os, "pwritev", real)  # room again: the next run stores the rest
    with kerasfeed.to_loader(source, batch_size=4, executor="threads", cache=directory) as again:
        list(again)
        assert kerasfeed.stats(again)["cache_items"] == 24


# ---------------------------------------------------------------- figures after close()
def test_stats_after_close_report_the_store_as_it_was():
    with kerasfeed.to_loader(Numbered(), cache="memory") as loader:
        list(loader)
        list(loader)
        before = _cache_figures(loader)
    after = _cache_figures(loader)
    assert before["cache_items"] == N and before["cache_fill"] == 1.0
    assert after == before


def test_a_closed_cached_dataset_s_next_pass_says_to_create_it_again():
    # "kerasfeed cache: the item store is closed (its pipeline was closed)" named no remedy (helper).
    import tensorflow as tf

    ds = kerasfeed.to_dataset(Numbered(8), executor="threads", cache="memory")
    assert len(list(ds)) == 8
    kerasfeed.executor_of(ds).close()
    with pytest.raises(tf.errors.OpError, match=r"item store \(memory\) is closed.*create the dataset \(or loader\) again"):
        list(ds)


def test_cache_fill_before_the_first_pass_counts_the_items_that_pass_reads(tmp_path):
    # A warm kept shard (every item this process reads stored) read 20/41 = 0.49 until its first pass ended:
    # before any pass, the fill divided by the source's length (helper, 2 of 2).
    directory = str(tmp_path / "kept")
    for run in range(2):
        order = kerasfeed.IndexOrder(41, shuffle=True, seed=0, num_shards=2, shard_index=1, fixed_shards=True)
        with kerasfeed.to_loader(Numbered(41), batch_size=4, order=order, executor="threads",
                                 cache=directory) as loader:
            before = kerasfeed.stats(loader)["cache_fill"]
            list(loader)
            assert kerasfeed.stats(loader)["cache_fill"] == 1.0
    assert before == 1.0
