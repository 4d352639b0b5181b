"""A cache kept in a directory: reused by the next run while the source is unchanged.

NOTE [ A kept cache's directory ]
``index.bin`` and ``data.bin`` (the store, NOTE [ The item store ]),
``key.json`` (what it was made from, NOTE [ When a kept cache is stale ]) and
``lock``. Opening it:

1. ``flock`` on ``lock`` (exclusive, not waiting): one run at a time fills
   a directory. The kernel drops the lock with its holder, SIGKILL included,
   so nothing stale is ever left to clean by hand (tf.data's cache leaves
   lock files after a killed run, tensorflow#28798); a second run that finds
   it held is refused at once, naming the holder's pid.
2. The key: when ``key.json`` differs from this source's key, or the files
   are of another layout or length, the store is emptied and one log line
   says why; else every item in it is served from the first pass on.
3. A store left by a run that did not close it cleanly is kept when that
   run was on this boot (a killed process loses nothing its kernel already
   holds: every published entry points at a whole record) and emptied when
   the machine restarted since (pages not yet on disk may be lost, and an
   entry could then point at bytes that never reached it).

4. A store that holds more than this run's ``max_bytes``, given (an earlier
   run's budget was larger; the default, half the free disk, shrinks as the
   cache itself fills the disk, so it trims nothing), is cut down to it: the records stored first stay (as
   within one run, NOTE [ A budget keeps a fixed subset ]), the later ones'
   entries go, with one log line. Records never move, so the trimmed store
   is the old data file's first bytes and the old index without the entries
   past them, written to new files renamed over the old ones (as a rebuild),
   the index first. A run killed in between leaves the new index beside the
   old data file, whose first bytes are the same: every entry still points at
   its record, and the next open, finding bytes on disk past the budget,
   trims again (SIGKILL test in ``tests/test_cache_kept.py``).

``key.json`` is written (atomically: a temporary file renamed) before any
item is stored, so a key always describes the items beside it. A rebuild
writes nothing into the old files: new ones (``*.new``) are renamed over
them, so items a closed pipeline handed out, views of the old pages, keep
their bytes.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import numpy as np

from kerasfeed.cache.kept_directory import DATA, INDEX, KeptDirectory
from kerasfeed.cache.keys import key_change
from kerasfeed.cache.store import (
    FIRST_OFFSET,
    H_BOOT,
    H_BUMP,
    H_CAPACITY,
    H_CLEAN,
    H_FAILED,
    H_FULL,
    H_HELD,
    H_HELD_BYTES,
    H_ITEMS_N,
    H_LAYOUT,
    H_MAGIC,
    HEADER_BYTES,
    LAYOUT,
    MAGIC,
    ItemStore,
    index_bytes,
)
from kerasfeed.cache.store_fds import allocate

logger = logging.getLogger("kerasfeed")

_NEW = ".new"  # a file's next version, renamed over it once written
# Bytes a data file may take on disk past the budget before a reuse shrinks it (``_reuse``).
_SLACK = 1 << 20


def boot_id() -> int:
    """This boot's id (Linux), as an int; 0 where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", ""), 16) & (2**64 - 1)
    except (OSError, ValueError):
        return 0


def _stale_reason(store: ItemStore, n: int, boot: int) -> Optional[str]:
    if store.header(H_MAGIC) != MAGIC or store.header(H_LAYOUT) != LAYOUT:
        return "its files are not a kerasfeed cache of this layout"
    if store.header(H_ITEMS_N) != n:
        return f"it holds {store.header(H_ITEMS_N)} items' entries, the source has {n}"
    if not store.header(H_CLEAN) and store.header(H_BOOT) != boot:
        return "the run that filled it did not finish, and the machine restarted since"
    return None


def open_kept(directory: str, key: dict, n: int, capacity: int,
              trim: bool = True) -> tuple[ItemStore, KeptDirectory]:
    """Opens (or makes, rebuilds or trims) the kept cache in ``directory`` for a source of ``n`` items.

    Args:
        trim: cut a store that holds more than ``capacity`` down to it (step 4 of the NOTE); False
            serves what it holds (new records still stop at ``capacity``).

    Returns:
        The store (new records stop at ``capacity``; with ``trim`` the records past it are
        trimmed, without it they are served; a longer file stays sparse past them) and the
        directory, whose lock is held until ``close_kept``, or until the store is collected (it
        then marks itself clean and frees the lock).

    Raises:
        RuntimeError: another run holds the directory.
    """
    kept = KeptDirectory(directory)
    try:
        store, reused = _open_store(kept, key, n, capacity, trim)
    except BaseException:
        kept.release()
        raise
    store.where = directory
    store.kept_by(kept.hand_over())
    figures = store.figures()
    if reused and figures["items"]:
        logger.info("kerasfeed: cache %s reused: %d of %d items held (%s).", directory, figures["items"], n,
                    _size(figures["bytes"]))
    return store, kept


def _open_store(kept: KeptDirectory, key: dict, n: int, capacity: int, trim: bool) -> tuple[ItemStore, bool]:
    boot = boot_id()
    _remove_new_files(kept)  # a run killed while renaming new files over the old (a rebuild, a trim)
    missing = [name for name in (INDEX, DATA) if not os.path.exists(kept.path(name))]
    existed = not missing
    reason = key_change(kept.read_key(), key) if existed else None
    if missing and (len(missing) == 1 or kept.read_key() is not None):  # removed by hand since
        logger.warning("kerasfeed: cache %s rebuilt: its %s is missing.", kept.directory, " and ".join(missing))
    if existed and reason is None:
        store, reason = _reuse(kept, n, capacity, boot, trim)
        if store is not None:
            return store, True
    fds = _fresh_files(kept, n, capacity)
    try:
        store = ItemStore(fds[0], fds[1], n, capacity)
    except BaseException:
        _close_all(fds)
        raise
    if existed:
        logger.warning("kerasfeed: cache %s rebuilt: %s.", kept.directory, reason)
    kept.write_key(key)
    store.format(boot)
    store.flush()
    return store, False


def _reuse(kept: KeptDirectory, n: int, capacity: int, boot: int,
           trim: bool = True) -> tuple[Optional[ItemStore], Optional[str]]:
    """The directory's store if it can serve this source (with the key already matched), else
    (None, why not). ``trim``: cut it down to ``capacity`` if it holds more (``_trim``)."""
    fds = [os.open(kept.path(name), os.O_RDWR | os.O_CLOEXEC) for name in (INDEX, DATA)]
    try:
        if os.fstat(fds[0]).st_size != index_bytes(n):
            _close_all(fds)
            return None, "its index is not of this source's length"
        allocate(fds[0], index_bytes(n), kept.directory)  # a copy may have left it sparse
        st = os.fstat(fds[1])
        held, allocated = st.st_size, st.st_blocks * 512
        if held < capacity:  # grown to the capacity asked for (it stays sparse)
            os.ftruncate(fds[1], capacity)
        # This run's capacity (its max_bytes) bounds new records; records past it are trimmed below (``trim``).
        store = ItemStore(fds[0], fds[1], n, max(held, capacity), limit=capacity)
    except BaseException:
        _close_all(fds)
        raise
    reason = _stale_reason(store, n, boot)
    lost = store.drop_past(held) if reason is None else 0
    if lost:  # the data file was cut short since (by hand, or a copy that stopped): those records are gone
        logger.warning("kerasfeed cache %s: its data file is shorter (%d bytes) than %d of its records need; "
                       "those items are made and stored again.", kept.directory, held, lost)
    # More than this run's max_bytes: records past it, or bytes on disk past it (a run killed mid-trim;
    # a file system allocates in blocks, and may ahead: _SLACK).
    if reason is None and trim and (store.header(H_BUMP) > capacity or allocated > capacity + _SLACK):
        store.close()
        _trim(kept, n, capacity, boot)
        return _reuse(kept, n, capacity, boot, trim=False)
    if reason is None:
        store.set_header(H_CLEAN, 0)
        store.set_header(H_BOOT, boot)
        # This run's budget: full only if it has no room left (an earlier run's budget or failed write is its own).
        store.set_header(H_CAPACITY, store.limit)
        store.set_header(H_FULL, int(store.header(H_BUMP) >= store.limit))
        store.set_header(H_FAILED, 0)
        store.flush()  # "not clean" on disk before any new record: a crash must not leave the old mark vouching
        return store, None
    store.close()
    return None, reason


def _trim(kept: KeptDirectory, n: int, capacity: int, boot: int) -> None:
    """Cuts the directory's store (closed, matched, not stale) down to ``capacity`` bytes: the entries
    of records ending past it go, and the data file keeps the bytes up to the last record kept (step 4
    of NOTE [ A kept cache's directory ]); new files renamed over the old ones, the index first."""
    with open(kept.path(INDEX), "rb") as f:
        index = bytearray(f.read())
    q = np.frombuffer(index, np.uint64)
    entries = q[HEADER_BYTES // 8:HEADER_BYTES // 8 + 3 * n].reshape(n, 3)
    held, ends = entries[:, 0] != 0, entries[:, 0] + entries[:, 1]
    keep, before = held & (ends <= capacity), (int(held.sum()), int(entries[held, 1].sum()))
    entries[held & ~keep] = 0
    cut = int(ends[keep].max()) if keep.any() else FIRST_OFFSET
    q[H_BUMP], q[H_HELD], q[H_HELD_BYTES] = cut, int(keep.sum()), int(entries[keep, 1].sum())
    # Not clean, on this boot: the new data file is not synced (a restart before this run closes rebuilds it).
    q[H_CLEAN], q[H_BOOT] = 0, boot
    renamed = False
    try:
        _replace_with(kept, INDEX, lambda fd: _write_index(fd, index))
        renamed = True
        _replace_with(kept, DATA, lambda fd: _copy_records(kept, fd, cut, capacity))
    except OSError as e:  # a full disk (the copy needs room beside the old file): served as it is
        _remove_new_files(kept)
        if not renamed:
            logger.warning("kerasfeed: cache %s holds more than this run's max_bytes (%d bytes) and could not be "
                           "trimmed (%s); it is served as it is, and stores nothing more.", kept.directory,
                           capacity - FIRST_OFFSET, e)
            return
        # The new index is in place; it points only at records the old data file holds too: served so.
        logger.warning("kerasfeed: cache %s: its data file could not be shrunk (%s); the entries past this run's "
                       "max_bytes were dropped all the same.", kept.directory, e)
    logger.warning("kerasfeed: cache %s trimmed to this run's max_bytes (%d bytes): %d of its %d items kept "
                   "(%s of %s), the items stored first; the rest are made every pass.", kept.directory,
                   capacity - FIRST_OFFSET, int(keep.sum()), before[0], _size(int(q[H_HELD_BYTES])), _size(before[1]))


def _size(nbytes: int) -> str:
    """``nbytes`` in the unit that shows it: a small store's "0.0 MB" said nothing."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _replace_with(kept: KeptDirectory, name: str, fill: Callable[[int], None]) -> None:
    """Writes file ``name`` anew: ``fill(fd)`` into ``name.new``, then renamed over the old one."""
    fd = _open_new(kept, name)
    try:
        fill(fd)
    finally:
        os.close(fd)
    os.replace(kept.path(name) + _NEW, kept.path(name))


def _write_index(fd: int, index: bytearray) -> None:
    with os.fdopen(os.dup(fd), "wb") as f:
        f.write(index)


def _copy_records(kept: KeptDirectory, fd: int, cut: int, size: int) -> None:
    """The directory's data file's first ``cut`` bytes (the records kept, where they were: entries hold
    file offsets) into ``fd``, then ``fd`` made ``size`` long (sparse past them)."""
    src = os.open(kept.path(DATA), os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < cut:
            step = os.copy_file_range(src, fd, cut - done, done, done)
            if step == 0:
                raise OSError(f"kerasfeed cache: {kept.path(DATA)} ended at {done} bytes, before its records' "
                              f"end ({cut})")
            done += step
    finally:
        os.close(src)
    os.ftruncate(fd, size)


def _fresh_files(kept: KeptDirectory, n: int, capacity: int) -> list[int]:
    """Empty index and data files, each made under a temporary name and renamed over the old one
    (the index first: an old index never points into a new data file). A rebuild must not write
    into the old files: a closed pipeline's items (in this process or another) are views of their
    pages, and keep the old inodes' bytes."""
    fds: list[int] = []
    try:
        # Both sized before either is renamed: a size refused leaves the directory as it was.
        for name, size in ((INDEX, index_bytes(n)), (DATA, capacity)):
            fds.append(_open_new(kept, name))
            os.ftruncate(fds[-1], size)
            if name == INDEX:
                allocate(fds[-1], size, kept.directory)
        for name in (INDEX, DATA):
            os.replace(kept.path(name) + _NEW, kept.path(name))
    except BaseException:
        _close_all(fds)
        _remove_new_files(kept)
        raise
    return fds


def _open_new(kept: KeptDirectory, name: str) -> int:
    """``name.new``, empty: a file written whole before it is renamed over ``name`` (a rebuild, a trim)."""
    return os.open(kept.path(name) + _NEW, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)


def _remove_new_files(kept: KeptDirectory) -> None:
    for name in (INDEX, DATA):
        try:
            os.remove(kept.path(name) + _NEW)
        except OSError:
            pass


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def close_kept(store: ItemStore, kept: KeptDirectory) -> None:
    """Writes the store back, marks it closed cleanly, closes it and frees the directory."""
    try:
        store.close(mark_clean=True)  # sealed first: nothing published after the clean mark
    finally:
        kept.release()


__all__ = ["boot_id", "close_kept", "open_kept"]
