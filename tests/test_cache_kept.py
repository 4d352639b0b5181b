"""A kept directory cache across real runs: reused, rebuilt when its HDF5 file changes, safe after SIGKILL,
refused to a second run at the same time.

Each run is a fresh interpreter (``tests/cache_scripts/kept_run.py``) on worker
processes; loads are counted across every process through a log file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kerasfeed.datasets import make_synthetic_scenes
from tests._util import wait_until

SCRIPT = os.path.join(os.path.dirname(__file__), "cache_scripts", "kept_run.py")
SCENES, BATCH = 48, 4
ITEMS = SCENES // BATCH


def _env() -> dict:
    """The runs feed to_loader only: Keras' numpy backend (a SceneSequence is a Keras PyDataset, so the scripts
    import Keras) spares each run TensorFlow's import, 2-4 s of its 6-9 s."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "numpy"}


def _run(h5, cache, log, *extra, check=True) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, SCRIPT, str(h5), str(cache), str(log), *extra], capture_output=True,
                          text=True, env=_env(), timeout=240)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
    return {}, proc.stderr


def _loads(log) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line.split()[1]) for line in f if line.strip()]


def _locked(path) -> bool:
    """Whether a process holds the directory's flock (kerasfeed/cache/kept_directory.py), read from /proc/locks:
    trying the lock here could make the run that is taking it fail."""
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:  # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:123456 0 EOF"
        return any(len(p) > 5 and p[1] == "FLOCK" and p[5].split(":")[-1] == str(inode)
                   for p in (line.split() for line in f))


@pytest.fixture
def scenes(tmp_path):
    return make_synthetic_scenes(tmp_path / "scenes.h5", num_scenes=SCENES, points_per_scene=64, chunk_scenes=4)


@pytest.fixture(scope="module")
def _first_run(tmp_path_factory):
    """One default run (a fresh interpreter, worker processes) over a scene file nobody changes: its
    directory, copied, is the "first run" of the tests that only reuse it (a run costs 3-6 s)."""
    root = tmp_path_factory.mktemp("first-run")
    scenes = make_synthetic_scenes(root / "scenes.h5", num_scenes=SCENES, points_per_scene=64, chunk_scenes=4)
    first, _ = _run(scenes, root / "cache", root / "loads")
    return scenes, root / "cache", first


@pytest.fixture
def first_run(_first_run, tmp_path):
    """``(scenes, cache, first)``: a copy of the module's first run's directory in this test's own folder. The
    key names the scene file, not the directory; cp keeps data.bin sparse (its size is the default budget,
    tens of GB, of which a few KB are written)."""
    scenes, cache, first = _first_run
    subprocess.run(["cp", "-a", "--sparse=always", str(cache), str(tmp_path / "cache")], check=True)
    return scenes, tmp_path / "cache", first


def test_a_second_run_reads_the_kept_cache_and_a_changed_file_rebuilds_it(tmp_path, scenes):
    cache, log = tmp_path / "cache", tmp_path / "loads"
    first, _ = _run(scenes, cache, log)
    assert sorted(_loads(log)) == list(range(ITEMS)) and first["cache_items"] == ITEMS
    os.remove(log)
    second, err = _run(scenes, cache, log)
    assert _loads(log) == [], "a second run over the same file makes nothing"
    assert second["digest"] == first["digest"] and second["cache_misses"] == 0
    assert second["cache_hits"] == 2 * ITEMS  # every item of its first pass came from the kept store
    # Change the file: same size (a value rewritten), a newer modification time.
    with h5py.File(scenes, "r+") as f:
        f["points"][0, 0, 0] += 1.0
    os.utime(scenes, ns=(time.time_ns(), time.time_ns() + 10**9))
    third, err = _run(scenes, cache, log)
    assert sorted(_loads(log)) == list(range(ITEMS)), "the cache was rebuilt: every item made again"
    assert "rebuilt" in err and str(scenes) in err and "mtime_ns" in err, err[-2000:]
    assert third["digest"] != first["digest"]


def test_a_run_killed_while_filling_leaves_no_half_written_entry(tmp_path, scenes):
    cache, log = tmp_path / "cache", tmp_path / "loads"
    # The reference run (its own directory and log) goes on beside the run killed: it waits on nothing of it.
    ref = subprocess.Popen([sys.executable, SCRIPT, str(scenes), str(tmp_path / "reference-cache"),
                            str(tmp_path / "reference-loads"), "--passes", "1"], env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen([sys.executable, SCRIPT, str(scenes), str(cache), str(log), "--passes", "1",
                             "--slow", "0.15"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert wait_until(lambda: len(_loads(log)) >= ITEMS // 2, timeout=120), "the run did not start loading"
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers, mid-fill
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        out, ref_err = ref.communicate(timeout=240)
    assert ref.returncode == 0, ref_err[-3000:]
    reference = json.loads(out.strip().splitlines()[-1])
    made_before = len(set(_loads(log)))
    assert 0 < made_before < ITEMS
    os.remove(log)
    again, err = _run(scenes, cache, log, "--passes", "1")
    assert again["digest"] == reference["digest"], "items read from the killed run's store are whole and right"
    remade = set(_loads(log))
    assert len(remade) < ITEMS, "what the killed run stored is served"
    assert "rebuilt" not in err  # same boot: the published entries are kept


def test_two_runs_on_one_directory_at_once_refuse_the_second(tmp_path, scenes):
    cache, log = tmp_path / "cache", tmp_path / "loads"
    # 20 s an item: the first run still holds the directory however long the second one takes to start (a
    # loaded machine took longer than 2 s an item gave); it is killed once the second run is refused.
    slow = subprocess.Popen([sys.executable, SCRIPT, str(scenes), str(cache), str(log), "--slow", "20"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_until(lambda: _locked(cache / "lock"), timeout=120)
        _, err = _run(scenes, cache, tmp_path / "other-loads", check=False)
        assert "is in use by another run (pid" in err and str(slow.pid) in err, err[-2000:]
    finally:
        os.killpg(slow.pid, signal.SIGKILL)
        slow.communicate()


def test_a_kept_cache_survives_a_threads_run_and_serves_a_processes_run(tmp_path, scenes):
    cache, log = tmp_path / "cache", tmp_path / "loads"
    first, _ = _run(scenes, cache, log, "--executor", "threads")
    os.remove(log)
    second, _ = _run(scenes, cache, log)
    assert _loads(log) == [] and second["digest"] == first["digest"]
    assert np.isclose(second["cache_items"], ITEMS)


class _Numbered:
    """Items whose values say their index and the source's generation (``offset``)."""

    def __init__(self, offset: float):
        import kerasfeed

        class Source(kerasfeed.SceneSequence):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return np.full((64, 32), i + offset, np.float32)

        self.source = Source()


@pytest.mark.parametrize("api", ["to_loader", "to_dataset"])
def test_a_rebuilt_directory_leaves_a_closed_run_s_items_as_they_were(tmp_path, api):
    """A rebuild (another ``version``) makes new files: items a closed pipeline handed out (views of the
    store's pages) keep their values, in this process as in any other still holding them."""
    import kerasfeed

    directory = str(tmp_path / "kept")

    def passes(offset, version):
        make = kerasfeed.to_loader if api == "to_loader" else kerasfeed.to_dataset
        pipe = make(_Numbered(offset).source, executor="threads", cache=kerasfeed.Cache(directory, version=version))
        try:
            got = [[np.asarray(x) for x in pipe] for _ in range(2)]
        finally:
            kerasfeed.executor_of(pipe).close() if api == "to_dataset" else pipe.close()
        return got[1]  # the second pass: served from the store

    held = passes(0.0, 1)
    assert [float(a[0, 0]) for a in held] == [float(i) for i in range(8)]
    again = passes(1000.0, 2)  # rebuilt: every item made again, with other values, into the directory
    assert [float(a[0, 0]) for a in again] == [1000.0 + i for i in range(8)]
    for i, a in enumerate(held):
        assert np.array_equal(a, np.full((64, 32), float(i), np.float32)), (i, a[0, :4])


def _entries(cache) -> np.ndarray:
    """The kept store's index entries: ``(offset, length, stamp)`` per item (offset 0: not held)."""
    from kerasfeed.cache.store import HEADER_BYTES

    with open(os.path.join(cache, "index.bin"), "rb") as f:
        raw = f.read()
    return np.frombuffer(raw, np.uint64, count=3 * ITEMS, offset=HEADER_BYTES).reshape(ITEMS, 3).copy()


def test_a_directory_reused_with_a_smaller_max_bytes_is_trimmed_to_it(tmp_path, first_run):
    """A run with a smaller budget than the directory holds keeps the records stored first (where they
    were), drops the rest once (one log line), shrinks the data file, and gives the same batches; the next
    run with that budget finds nothing to trim."""
    scenes, cache, first = first_run  # a default run's directory (copied)
    log = tmp_path / "loads"
    before = _entries(cache)
    assert first["cache_items"] == ITEMS and (before[:, 0] > 0).all()
    ends = before[:, 0] + before[:, 1]
    # The first half of the records, by where they were written (max_bytes counts records' bytes: the data
    # file's first 64 hold none).
    budget = int(np.sort(ends)[ITEMS // 2 - 1]) - 64
    kept = ends <= budget + 64
    assert 0 < kept.sum() < ITEMS
    second, err = _run(scenes, cache, log, "--max-bytes", str(budget))
    assert "trimmed" in err and str(cache) in err and f"{kept.sum()} of its {ITEMS} items kept" in err, err[-2000:]
    assert second["digest"] == first["digest"] and second["cache_items"] == kept.sum()
    # the items dropped are made in each of the 2 passes (the budget is full: none is stored again)
    assert sorted(_loads(log)) == sorted(2 * list(np.flatnonzero(~kept))), _loads(log)
    after = _entries(cache)
    assert (after[kept] == before[kept]).all() and (after[~kept] == 0).all()
    assert os.path.getsize(cache / "data.bin") == budget + 64
    os.remove(log)
    third, err = _run(scenes, cache, log, "--max-bytes", str(budget))
    assert "trimmed" not in err and third["digest"] == first["digest"]
    assert sorted(_loads(log)) == sorted(2 * list(np.flatnonzero(~kept)))


def test_a_trimmed_directory_leaves_a_closed_run_s_items_as_they_were(tmp_path):
    """Trimming writes new files: items a closed pipeline handed out keep their values."""
    import kerasfeed

    directory = str(tmp_path / "kept")

    def second_pass(max_bytes):
        with kerasfeed.to_loader(_Numbered(0.0).source, executor="threads",
                                 cache=kerasfeed.Cache(directory, max_bytes=max_bytes)) as loader:
            return [[np.asarray(x) for x in loader] for _ in range(2)][1]

    held = second_pass(None)
    record = os.path.getsize(os.path.join(directory, "data.bin"))  # sparse: the default budget
    small = second_pass(3 * 64 * 32 * 4)  # room for at most 2 of the 8 records (each 8 KB and a header)
    assert os.path.getsize(os.path.join(directory, "data.bin")) < record
    assert [float(a[0, 0]) for a in small] == [float(i) for i in range(8)]
    for i, a in enumerate(held):
        assert np.array_equal(a, np.full((64, 32), float(i), np.float32)), (i, a[0, :4])


@pytest.mark.parametrize("fails", ["before the index", "in the data copy"])
def test_a_trim_the_disk_has_no_room_for_leaves_a_store_that_serves(tmp_path, monkeypatch, caplog, fails):
    """Trimming copies the records kept beside the old file. With no room for that (ENOSPC, injected: a
    real full disk is not made here), the run goes on: before the new index is in place the store is served
    as it is; after it, the entries past the budget are gone and the old data file serves the rest."""
    import errno
    import logging

    import kerasfeed
    from kerasfeed.cache import kept as kept_module

    directory = str(tmp_path / "kept")

    def passes(max_bytes):
        with kerasfeed.to_loader(_Numbered(0.0).source, executor="threads",
                                 cache=kerasfeed.Cache(directory, max_bytes=max_bytes)) as loader:
            got = [[float(np.asarray(x)[0, 0]) for x in loader] for _ in range(2)]
            return got, kerasfeed.stats(loader)

    passes(None)
    full = os.path.getsize(os.path.join(directory, "data.bin"))

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    if fails == "before the index":
        monkeypatch.setattr(kept_module.os, "replace", no_room)
    else:
        monkeypatch.setattr(kept_module.os, "copy_file_range", no_room)
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        got, stats = passes(3 * 64 * 32 * 4)
    monkeypatch.undo()
    assert got == [[float(i) for i in range(8)]] * 2
    assert not [f for f in os.listdir(directory) if f.endswith(".new")]
    assert os.path.getsize(os.path.join(directory, "data.bin")) == full  # not shrunk either way
    if fails == "before the index":
        assert "could not be trimmed" in caplog.text and stats["cache_items"] == 8, (caplog.text, stats)
    else:
        assert "could not be shrunk" in caplog.text and 0 < stats["cache_items"] < 8, (caplog.text, stats)


def test_new_files_a_killed_rebuild_or_trim_left_are_removed_when_the_directory_opens(tmp_path, first_run):
    scenes, cache, first = first_run  # a default run's directory (copied)
    log = tmp_path / "loads"
    for name in ("index.bin.new", "data.bin.new"):  # as a run SIGKILLed between writing and renaming leaves them
        with open(cache / name, "wb") as f:
            f.write(b"\0" * 4096)
    second, err = _run(scenes, cache, log)
    assert second["digest"] == first["digest"] and second["cache_misses"] == 0, (second, err[-2000:])
    assert not [f for f in os.listdir(cache) if f.endswith(".new")]


TRIM_SCRIPT = os.path.join(os.path.dirname(__file__), "cache_scripts", "trim_run.py")


def _trim_run(cache, log, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRIM_SCRIPT, str(cache), str(log), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def test_a_run_killed_while_trimming_leaves_a_directory_the_next_run_serves(tmp_path):
    """SIGKILL while a run copies the records it keeps (its data.bin.new being written; 64 MB kept here):
    the same script again serves every item right, makes only the items past the budget, and leaves no
    *.new file."""
    cache, log = tmp_path / "cache", tmp_path / "loads"
    first = _trim_run(cache, log)
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    want = [[float(i) for i in range(64)]] * 2
    assert json.loads(out.strip().splitlines()[-1])["passes"] == want
    budget = str(32 * (2 << 20) + 32 * 4096)  # about half the records (each 2 MB and a header)
    os.remove(log)
    second = _trim_run(cache, log, budget)
    new_data = cache / "data.bin.new"
    try:
        wait_until(lambda: new_data.exists() or second.poll() is not None, timeout=120, interval=0.0005)
        os.kill(second.pid, signal.SIGKILL)
    finally:
        second.communicate(timeout=60)
    assert new_data.exists(), "the kill did not land while the trim copied (it ended first)"
    assert second.returncode == -signal.SIGKILL
    third = _trim_run(cache, log, budget)
    out, err = third.communicate(timeout=240)
    assert third.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["passes"] == want
    kept = got["cache_items"]
    assert 0 < kept < 64
    made = _loads(log)  # the items past the budget, made in each of the 2 passes (none stored again)
    assert len(set(made)) == 64 - kept and sorted(made) == sorted(2 * sorted(set(made))), made
    assert not [f for f in os.listdir(cache) if f.endswith(".new")]
    assert os.path.getsize(cache / "data.bin") == int(budget) + 64  # the file's first 64 bytes hold no record



def test_the_default_budget_trims_nothing(tmp_path, monkeypatch, caplog):
    """Without max_bytes the budget is half the free disk, which the cache itself shrinks: a run that finds
    less free disk than its directory holds serves all of it (injected: the disk's free space as reported)."""
    import logging
    import shutil

    import kerasfeed
    from kerasfeed.cache import options as cache_options

    directory = str(tmp_path / "kept")

    def second_pass():
        with kerasfeed.to_loader(_Numbered(0.0).source, executor="threads", cache=kerasfeed.Cache(directory)) as loader:
            got = [[float(np.asarray(x)[0, 0]) for x in loader] for _ in range(2)][1]
            return got, kerasfeed.stats(loader)

    second_pass()
    size = os.path.getsize(os.path.join(directory, "data.bin"))
    real = shutil.disk_usage(directory)
    monkeypatch.setattr(cache_options.shutil, "disk_usage", lambda path: real._replace(free=16 * 1024))
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        got, stats = second_pass()
    assert got == [float(i) for i in range(8)] and stats["cache_items"] == 8 and stats["cache_hits"] == 16, stats
    assert "trimmed" not in caplog.text and os.path.getsize(os.path.join(directory, "data.bin")) == size


def test_a_data_file_cut_short_drops_the_records_past_its_end(tmp_path, caplog):
    """A ``data.bin`` cut short since (by hand, or a copy that stopped) while the index still points past
    its end: a record whose header survived the cut was served with its tail read as zeros."""
    import logging

    import kerasfeed

    directory = str(tmp_path / "kept")
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        list(loader)
    entries = np.frombuffer(open(os.path.join(directory, "index.bin"), "rb").read(), np.uint64)[512:512 + 24]
    entries = entries.reshape(8, 3)
    first = entries[entries[:, 0] > 0][np.argmin(entries[entries[:, 0] > 0, 0])]
    cut = int(first[0] + first[1] // 2)  # halfway through the first record: its header stays
    os.truncate(os.path.join(directory, "data.bin"), cut)
    caplog.set_level(logging.WARNING, logger="kerasfeed")
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        got = [np.asarray(x) for x in loader]
    for i, a in enumerate(got):
        assert np.array_equal(a, np.full((64, 32), 1000.0 + i, np.float32)), (i, a[-1, -4:])  # zeros: the cut tail
    assert "its data file is shorter" in caplog.text and "8 of its records" in caplog.text


def test_a_damaged_length_in_the_index_is_dropped_without_upsetting_the_counts(tmp_path, caplog):
    """An index entry whose length reads 2**60 (a damaged index): its item is made again, and the bytes
    held are counted from the entries kept (they were decremented by the damaged length: 1.7e19)."""
    import kerasfeed

    directory = str(tmp_path / "kept")
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        list(loader)
        held = kerasfeed.stats(loader)["cache_bytes"]
    with open(os.path.join(directory, "index.bin"), "r+b") as f:
        f.seek(4096 + 24 * 5 + 8)
        f.write((1 << 60).to_bytes(8, "little"))
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        got = [np.asarray(x) for x in loader]
        stats = kerasfeed.stats(loader)
    assert all(np.array_equal(a, np.full((64, 32), 1000.0 + i, np.float32)) for i, a in enumerate(got))
    assert stats["cache_bytes"] == held and stats["cache_items"] == 8 and stats["cache_misses"] == 1, stats


def test_a_read_only_directory_is_named(tmp_path, monkeypatch):
    """A kept cache needs a writable directory: a read-only one (a file system mounted read-only, injected
    here: this suite may run as root) failed with a bare ``OSError`` from the lock's ``os.open``."""
    import errno

    import kerasfeed
    from kerasfeed.cache import kept

    real_open = kept.os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(directory)) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args)

    directory = tmp_path / "kept"
    directory.mkdir()
    monkeypatch.setattr(kept.os, "open", read_only)
    with pytest.raises(OSError, match=r"kerasfeed cache: cannot use .*kept as a kept cache \(Read-only file system\): "
                                      r"a kept cache needs a writable directory.*cache='memory'.*Received: cache "
                                      r"directory") as e:
        kerasfeed.to_loader(_Numbered(0.0).source, executor="threads", cache=str(directory))
    assert e.value.errno == errno.EROFS


@pytest.mark.parametrize("removed", ["index.bin", "data.bin"])
def test_a_file_removed_from_the_directory_is_a_rebuild_that_says_so(tmp_path, caplog, removed):
    """A directory whose index or data file was removed by hand is rebuilt, with the log line other
    rebuilds give (it was rebuilt without a word)."""
    import logging

    import kerasfeed

    directory = str(tmp_path / "kept")
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        list(loader)
    os.remove(os.path.join(directory, removed))
    caplog.set_level(logging.WARNING, logger="kerasfeed")
    with kerasfeed.to_loader(_Numbered(1000.0).source, executor="threads", cache=directory) as loader:
        got = [np.asarray(x) for x in loader]
    assert all(np.array_equal(a, np.full((64, 32), 1000.0 + i, np.float32)) for i, a in enumerate(got))
    assert f"rebuilt: its {removed} is missing" in caplog.text


def test_a_kept_index_has_its_disk_blocks_and_no_room_for_them_is_named(tmp_path, monkeypatch):
    """The index is written through a shared mapping: on a disk that filled up while the cache filled, the first
    write to a page without a block was a SIGBUS that killed the process, threads or a worker, with no message
    (a helper's report, 3 of 3 on a 16 MB ext4 disk). Its blocks are now taken when the directory is opened."""
    import errno

    import kerasfeed
    from kerasfeed.cache import store_fds

    directory = str(tmp_path / "kept")
    with kerasfeed.to_loader(_Numbered(0.0).source, executor="threads", cache=directory) as loader:
        list(loader)
    index = os.stat(os.path.join(directory, "index.bin"))
    assert index.st_blocks * 512 >= index.st_size, (index.st_blocks, index.st_size)  # not sparse

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_fds.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"kerasfeed cache: no room on the disk of .*other for the cache's index "
                                      r"\([\d,]+ bytes, No space left on device\).*cache='memory'"):
        kerasfeed.to_loader(_Numbered(0.0).source, executor="threads", cache=str(tmp_path / "other"))


def test_a_damaged_bump_pointer_does_not_write_new_records_over_stored_ones(tmp_path):
    """One bit of the index header's bump pointer cleared: a reused cache appended new records from there, over
    published ones, and 16 items already handed out changed their bytes (a helper's report)."""
    import kerasfeed

    class Source(kerasfeed.SceneSequence):
        def __len__(self):
            return 40

        def load(self, i):
            return np.full(4096, i, np.uint8)

    directory = str(tmp_path / "kept")
    with kerasfeed.to_loader(Source(), cache=kerasfeed.Cache(directory, max_bytes=20 * 4352 + 64), batch_size=None) as ld:
        list(ld)
        assert kerasfeed.stats(ld)["cache_items"] == 20
    with open(os.path.join(directory, "index.bin"), "r+b") as f:
        f.seek(32)  # H_BUMP, the header's fifth u64
        f.write((64).to_bytes(8, "little"))  # where the first record begins
    with kerasfeed.to_loader(Source(), cache=kerasfeed.Cache(directory, max_bytes=1 << 20), batch_size=None) as ld:
        kept = list(ld)  # views of the store, kept while the other items are stored
        assert [i for i, x in enumerate(kept) if not (x == i).all()] == []
        assert all((x == i).all() for i, x in enumerate(ld))
