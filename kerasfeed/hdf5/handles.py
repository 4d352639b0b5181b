"""The h5py handles of one process, shared by every HDF5 sequence that reads the same file."""

from __future__ import annotations

import os
import threading


class FileRegistry:
    """The h5py handles of one process: one File and one Dataset per file and key.

    Why shared: HDF5 shares one internal state per file within a process, and with SWMR a second open of
    a file being appended to can read stale chunk locations, i.e. wrong data, silently (seen with HDF5
    1.14). One handle per file and dataset, refreshed when a read goes past the rows it knows, avoids
    that; it also keeps one file descriptor and chunk cache per file however many sequences
    (train/validation splits) read it. Entries are reference-counted by the sequences holding them.

    An identity names the file itself, not only its path (``H5Base._identity`` includes the inode): a
    file replaced by a rename must not be read through the old file's handle. SWMR appends keep the
    inode, so the sequences reading a growing file still share one handle.
    """

    def __init__(self):
        self._reset()

    def _reset(self):
        self._lock = threading.Lock()
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


_INHERITED: list = []
REGISTRY = FileRegistry()


__all__ = ["FileRegistry", "REGISTRY"]
