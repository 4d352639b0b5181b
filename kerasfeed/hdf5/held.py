"""``HeldFiles``: the local files one HDF5 sequence holds open in one process, at most a bounded number.

NOTE [ How many HDF5 files a sequence keeps open ]
A file read once stays open (its metadata and chunk cache make the next read cheap), but a dataset of one
file per scene has thousands of them, and every open file costs a descriptor and up to 1 MB of chunk cache
per dataset read: a sequence that kept them all failed past ``RLIMIT_NOFILE`` (1024 on many machines) with
EMFILE, in every worker. So a sequence holds at most ``max_open_files`` files and closes the least recently
read one past that; reopening costs about a millisecond (the file's metadata), against a read of a batch.
A file is never closed while one of the sequence's threads reads it (``begin``/``end``): under the threads
executor 64 reads may be in flight, so the bound can be passed by the files being read at that moment.
The handles themselves live in the process's ``FileRegistry`` (``handles.py``), which closes a file when
the last sequence holding it lets it go.
"""

from __future__ import annotations

import collections
import resource
import threading
from typing import Callable, Optional

from kerasfeed.hdf5.handles import REGISTRY

# Share of the soft RLIMIT_NOFILE one sequence may hold by default: sockets, pipes, shared memory and other
# sequences need the rest.
_SHARE_OF_LIMIT = 4
_AT_LEAST = 16


def default_max_open_files() -> int:
    """A quarter of this process's soft ``RLIMIT_NOFILE`` (256 under the usual 1024), at least 16."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1 << 16
    return max(_AT_LEAST, soft // _SHARE_OF_LIMIT)


class HeldFiles:
    """The files (registry identities) and datasets one sequence reads in this process, least recently read
    first; at most ``limit`` held while none is being read (NOTE above).

    Args:
        limit: the most files held; None: ``default_max_open_files()`` when a file opens (the limit then).
    """

    def __init__(self, limit: Optional[int] = None):
        self._limit = limit
        self.lock = threading.Lock()
        self._held: collections.OrderedDict = collections.OrderedDict()  # file index -> identity
        self._datasets: dict = {}  # (file index, key) -> h5py.Dataset
        self._keys: dict = {}  # file index -> its keys in _datasets
        self._reading: dict = {}  # file index -> reads in progress
        self._closing: dict = {}  # file index -> identities released while read: let go when its reads end

    def begin(self, file_index: int, key: str, hold: Callable[[int], tuple]):
        """The dataset ``key`` of file ``file_index``, opened if needed and kept open until ``end``.

        ``hold(file index)`` acquires the file in ``REGISTRY`` and returns its identity (passed per call: a
        bound method kept here would make a cycle, and a dropped sequence would close its files only at the
        next garbage collection).
        """
        with self.lock:  # the path of every read but a file's first: a few dict operations
            ds = self._datasets.get((file_index, key))
            if ds is not None:
                self._held.move_to_end(file_index)
                self._reading[file_index] = self._reading.get(file_index, 0) + 1
                return ds
        return self._begin_first(file_index, key, hold)

    def _begin_first(self, file_index: int, key: str, hold: Callable[[int], tuple]):
        with self.lock:
            ident = self._held.get(file_index)
            opened = ident is None
            if opened:
                ident = self._held[file_index] = hold(file_index)
            else:
                self._held.move_to_end(file_index)
            self._reading[file_index] = self._reading.get(file_index, 0) + 1
            try:
                ds = self._datasets.get((file_index, key))
                if ds is None:
                    ds = self._datasets[(file_index, key)] = REGISTRY.dataset(ident, key)
                    self._keys.setdefault(file_index, []).append(key)
            except BaseException:
                self._done(file_index)
                raise
            closing = self._over_limit() if opened and len(self._held) > self.limit else []
        for old in closing:
            REGISTRY.release(old)
        return ds

    def end(self, file_index: int) -> None:
        """Ends a read that ``begin`` started."""
        with self.lock:
            self._done(file_index)
            closing = self._closing.pop(file_index, ()) if file_index not in self._reading else ()
        for ident in closing:
            REGISTRY.release(ident)

    def release_all(self) -> list:
        """Forgets every file; returns the identities of those no read is using, for the caller to release.
        A file being read is let go when its reads end (``end``): ``close()`` while a threads pipeline reads
        closed it under those reads ("identifier is not of specified type"). A later read reopens it."""
        with self.lock:
            now = []
            for f, ident in self._held.items():
                if self._reading.get(f):
                    self._closing.setdefault(f, []).append(ident)
                else:
                    now.append(ident)
            self._held, self._datasets, self._keys = collections.OrderedDict(), {}, {}
        return now

    @property
    def limit(self) -> int:
        return default_max_open_files() if self._limit is None else self._limit

    def open_files(self) -> int:
        """Files held now (for tests and ``repr``)."""
        return len(self._held)

    def _done(self, file_index: int) -> None:
        left = self._reading[file_index] - 1
        if left:
            self._reading[file_index] = left
        else:
            del self._reading[file_index]

    def _over_limit(self) -> list:
        """Drops the least recently read files no read is using until ``limit`` are held; returns them."""
        closing = []
        for f in list(self._held):
            if len(self._held) <= self.limit:
                break
            if self._reading.get(f):
                continue
            closing.append(self._held.pop(f))
            for key in self._keys.pop(f, ()):
                del self._datasets[(f, key)]
        return closing


__all__ = ["HeldFiles", "default_max_open_files"]
