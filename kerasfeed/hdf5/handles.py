"""The h5py handles of one process, shared by every HDF5 sequence that reads the same file."""

from __future__ import annotations

import os
import threading
from typing import Optional

from kerasfeed.errors import FileChangedError


class FileRegistry:
    """The h5py handles of one process: one File and one Dataset per file and key.

    Why shared: HDF5 shares one internal state per file within a process, and with SWMR a second open of
    a file being appended to can read stale chunk locations, i.e. wrong data, silently (seen with HDF5
    1.14). One handle per file and dataset, refreshed when a read goes past the rows it knows, avoids
    that; it also keeps one file descriptor and chunk cache per file however many sequences
    (train/validation splits) read it. Entries are reference-counted by the sequences holding them.

    An identity names the file itself, not only its path (``LocalFiles._identity`` includes the inode): a
    file replaced by a rename must not be read through the old file's handle. SWMR appends keep the
    inode, so the sequences reading a growing file still share one handle.
    """

    def __init__(self):
        self._reset()

    def _reset(self):
        # Re-entrant: opening a file (``acquire``) allocates, a garbage collection then may run a dropped
        # sequence's ``__del__`` on this thread, whose ``close`` releases its files here (with a plain Lock
        # that thread waited for itself: a test hung 300 s in ``H5Base.__del__``).
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._entries: dict = {}  # identity -> [h5py.File, refcount, {key: Dataset}]

    def _check_process(self):
        if self._pid != os.getpid():
            # Forked: keep the parent's handles referenced so that the child never closes (or touches) them.
            _INHERITED.append(self._entries)
            self._reset()

    def acquire(self, ident, opener):
        self._check_process()
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None:
                entry = self._entries[ident] = [opener(), 0, {}]
            entry[1] += 1
            return entry[0]

    def share(self, ident) -> bool:
        """Acquires ``ident`` only if this process has it open; returns whether it did."""
        self._check_process()
        with self._lock:
            entry = self._entries.get(ident)
            if entry is not None:
                entry[1] += 1
            return entry is not None

    def dataset(self, ident, key):
        with self._lock:
            entry = self._entries[ident]
            ds = entry[2].get(key)
            if ds is None:
                ds = entry[2][key] = entry[0][key]
            return ds

    def release(self, ident):
        self._check_process()
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[ident]
        try:
            entry[0].close()
        except Exception:  # noqa: BLE001 - closing during interpreter shutdown, say
            pass

    def open_count(self) -> int:
        """Files this process holds open (for tests and debugging)."""
        self._check_process()
        with self._lock:
            return len(self._entries)


def written_stamp(path: str) -> tuple:
    """``(st_size, st_mtime_ns)`` of the file at ``path``: what a write in place changes."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def check_not_written(path: str, stamp: tuple, written: Optional[tuple], owner: str, rows: str) -> None:
    """Raises ``FileChangedError`` when the file at ``path`` is the one inspected (inode ``stamp``) but was
    written in place since (``written``: its size and mtime then; None: not checked, SWMR).

    Why after each read: HDF5 reads an open file by the layout it cached, and a file rewritten in place
    (``cp``, ``shutil.copyfile``, ``rsync --inplace``: no HDF5 writer, so no HDF5 lock refuses it) reads
    back zeros past its new end, or another file's bytes, silently. A stat costs ~1 us a read. A file
    renamed over the path, or removed, is another inode: the open handle still reads the inspected one.
    """
    if written is None:
        return
    try:
        st = os.stat(path)
    except OSError:
        return
    now = (st.st_size, st.st_mtime_ns)
    if (st.st_dev, st.st_ino) == tuple(stamp) and now != tuple(written):
        raise FileChangedError(
            f"{owner}: file '{path}' was written in place after the sequence was built (size {written[0]} -> "
            f"{now[0]} bytes, mtime_ns {written[1]} -> {now[1]}), so {rows} may not be the rows it had (HDF5 "
            "reads an open file by the layout it cached). Build a new sequence to read the file as it is now, "
            "or write a new file and rename it over the old one (a sequence built before keeps reading the old)."
        )


_INHERITED: list = []
REGISTRY = FileRegistry()


__all__ = ["FileRegistry", "REGISTRY", "check_not_written", "written_stamp"]
