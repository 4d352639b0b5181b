"""The item store: one copy of every cached item per host, read and written by every process of a pipeline.

NOTE [ The item store ]
Two files: an *index* and a *data* file. For ``cache="memory"`` both are
memfds (RAM, no name anywhere, nothing in ``/dev/shm``; the kernel frees them
when the last process holding one ends, SIGKILL included); a kept directory
holds them as ``index.bin`` and ``data.bin`` (``kept.py``). Worker processes
get the two fds with their first message and map them; pool threads and the
consumer use the owner's mappings. So there is one copy per host, whatever
the number of workers.

- The index: a 4 KiB header (the counters below), then three u64 per source
  index: ``(offset, length, stamp)``; offset 0 means "not cached".
- The data: records (NOTE [ A cached item's record ], ``records.py``) laid
  one after another by a bump allocator, up to ``capacity`` bytes (the file
  is that long but sparse: only written pages take memory or disk).

Writers (pool threads, worker processes, the consumer) take one lock twice
per item: to allocate the record's bytes, then, once the record is written
outside the lock, to publish its entry if no other writer published that
index meanwhile. The lock is a ``threading.Lock`` for the threads of a
process plus a POSIX record lock on the index's first 8 bytes for the
processes (the kernel drops it with a dead holder). A record is published
only once written whole and never changes afterwards, so a reader that
follows an entry always finds a whole record; a process killed while
writing leaves bytes that no entry points at. (POSIX record locks belong to
a process and go when *any* fd of the file is closed in it: the owner never
closes a duplicate of the index fd while the store is open; fds are sent to
workers as they are.)

Stamps: ``new_cut()`` (the consumer, when a pass starts) raises the header's
stamp; each entry keeps the stamp current when it was published. An entry
whose stamp is below a pass's cut was cached before that pass began:
the consumer serves those items itself and asks the executor for the rest
(``missing``), and the two sides agree on which is which however the
workers race.

A store dropped without ``close`` (a pipeline never closed, or still open at
interpreter exit) is released by a ``weakref.finalize`` all the same: its
fds are closed (a memfd's RAM goes back) and a kept one is written back and
marked clean, then its directory unlocked (``store_fds.Owned``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.cache.records import encode_record, read_record, write_record
from kerasfeed.cache.store_fds import Owned, WriteFd

logger = logging.getLogger("kerasfeed")

_CLOSED = ("kerasfeed cache: the item store ({where}) is closed: its dataset or loader was closed, so its next pass "
           "is refused; create the dataset (or loader) again")
HEADER_BYTES = 4096
_Q = HEADER_BYTES // 8  # index entries start at this u64
# Header u64 slots.
# H_FAILED: a write failed (a full disk): nothing more is stored in this run.
H_MAGIC, H_LAYOUT, H_ITEMS_N, H_CAPACITY, H_BUMP, H_STAMP, H_HELD, H_HELD_BYTES, H_FULL, H_CLEAN, H_BOOT, H_FAILED = \
    range(12)
MAGIC = int.from_bytes(b"KFCACHE1", "little")
LAYOUT = 1  # bump when the file layout changes: a kept cache of another layout is rebuilt
FIRST_OFFSET = 64  # offset 0 marks an empty entry
EVER = (1 << 64) - 1  # a cut after every stored item: ``cached_mask(EVER)`` is every entry, whenever published
# Positions per chunk when a pass's misses are worked out (``missing``).
_CHUNK = 1 << 20


def index_bytes(n: int) -> int:
    """Length of the index file for ``n`` items."""
    return HEADER_BYTES + 24 * n


class ItemStore:
    """The index and data files of one cache, mapped in this process.

    Made by ``memory`` (fresh memfds), ``kept.open_kept`` (a directory's files)
    or ``attach`` (a worker process, from the fds its pool sent).

    Args:
        index_fd, data_fd: the files (this object owns and closes them, when closed or collected).
        n: the number of source items.
        capacity: the data file's length (mapped).
        limit: what new records may fill the file up to (default: ``capacity``); less in a
            reused kept file longer than this run's ``max_bytes`` (records past it were trimmed
            when it was opened if the run gave ``max_bytes``, else they stay: ``kept.py``).
    """

    def __init__(self, index_fd: int, data_fd: int, n: int, capacity: int, limit: Optional[int] = None):
        self.n, self.capacity = n, capacity
        self.limit = capacity if limit is None else min(limit, capacity)
        self.where = "memory"  # the cache's name in a log line (a kept store's directory)
        self._index_fd, self._data_fd = index_fd, data_fd
        self._index = mmap.mmap(index_fd, index_bytes(n))
        self._q = memoryview(self._index).cast("Q")
        self._rw: Optional[WriteFd] = None  # the data file's own fd for writers, made on the first write
        self._ro = mmap.mmap(data_fd, capacity, prot=mmap.PROT_READ)
        self._ro_at = np.frombuffer(self._ro, np.uint8, count=1).__array_interface__["data"][0]  # its address
        self._lock = threading.Lock()
        self._last: Optional[dict] = None  # the figures when closed
        self._on_close: list = []
        # Made last: a failed __init__ leaves the fds to its caller. Holds no reference to ``self``.
        self._owned = Owned((index_fd, data_fd), self._lock, 8 * H_CLEAN)
        self._finalizer = weakref.finalize(self, self._owned.release)

    # ------------------------------------------------------------ making
    @classmethod
    def memory(cls, n: int, capacity: int) -> "ItemStore":
        """A fresh store in RAM (two memfds, mode 0600)."""
        fds = []
        try:
            for name, size in (("index", index_bytes(n)), ("data", capacity)):
                fd = os.memfd_create(f"kerasfeed-cache-{name}", os.MFD_CLOEXEC)
                fds.append(fd)
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, size)
            store = cls(fds[0], fds[1], n, capacity)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        store.format()
        return store

    @classmethod
    def attach(cls, described: dict, fds: list) -> "ItemStore":
        """A worker's view of the store its pool sent (``described()`` and ``fds()``)."""
        if len(fds) != 2:
            raise RuntimeError(f"kerasfeed cache: a worker got {len(fds)} fds for the item store, not 2")
        store = cls(fds[0], fds[1], described["n"], described["capacity"], described.get("limit"))
        store.where = described.get("where", store.where)
        return store  # its finalizer closes the worker's fds only (never marks a kept store clean)

    def described(self) -> dict:
        """What a worker needs besides the fds to ``attach``."""
        return {"n": self.n, "capacity": self.capacity, "limit": self.limit, "where": self.where}

    def kept_by(self, release: Callable[[], None]) -> None:
        """Makes this a kept directory's store: once closed or collected it is written back and
        marked clean, then ``release`` runs (the directory's lock: held until then)."""
        self._owned.clean, self._owned.then = True, release

    def on_close(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` when the store closes (what holds a mapping of its own drops it)."""
        with self._lock:
            if not self._owned.closed:
                self._on_close.append(callback)
                return
        callback()

    def fds(self) -> tuple[int, int]:
        """The index and data fds, to send to a worker as they are (see the NOTE)."""
        return self._index_fd, self._data_fd

    def format(self, boot: int = 0) -> None:
        """Writes a fresh header (owner only, before any other process uses
        the store; the entries of fresh or truncated files are zero already)."""
        q = self._q
        for slot, value in ((H_MAGIC, MAGIC), (H_LAYOUT, LAYOUT), (H_ITEMS_N, self.n), (H_CAPACITY, self.limit),
                            (H_BUMP, FIRST_OFFSET), (H_STAMP, 1), (H_HELD, 0), (H_HELD_BYTES, 0), (H_FULL, 0),
                            (H_CLEAN, 0), (H_BOOT, boot), (H_FAILED, 0)):
            q[slot] = value

    def header(self, slot: int) -> int:
        return self._q[slot]

    def set_header(self, slot: int, value: int) -> None:
        self._q[slot] = value

    # ------------------------------------------------------------ lock
    def _acquire(self) -> bool:
        """Takes the lock (threads, then processes); False (and not held) once the store is closed."""
        self._lock.acquire()
        if self._owned.closed:
            self._lock.release()
            return False
        try:
            fcntl.lockf(self._index_fd, fcntl.LOCK_EX, 8, 0, 0)
        except BaseException:
            self._lock.release()
            raise
        return True

    def _release(self) -> None:
        try:
            fcntl.lockf(self._index_fd, fcntl.LOCK_UN, 8, 0, 0)
        finally:
            self._lock.release()

    # ------------------------------------------------------------ items
    def put(self, index: int, item: Any) -> bool:
        """Stores item ``index`` (no-op if it is stored already); False when
        it does not fit in what is left of ``limit``, or writing it failed
        (a full disk: storing stops, logged once).

        Raises:
            TypeError: a leaf that cannot be stored (``records.encode_record``).
        """
        q, e = self._q, _Q + 3 * index
        if q is None:
            return False  # closed: a late thread of a closed pipeline
        if q[e]:
            return True
        if q[H_FAILED]:
            return False
        record = encode_record(index, item)
        if not self._acquire():
            return False
        try:
            if q[e]:
                return True
            offset = q[H_BUMP]
            if offset + record.length > self.limit:
                q[H_FULL] = 1
                return False
            q[H_BUMP] = offset + record.length
        finally:
            self._release()
        data = self._writable()
        if data is None:
            return False
        try:  # ``data`` keeps its fd open even if the store closes meanwhile
            write_record(data.fd, offset, index, record)
        except OSError as e:
            if e.errno is None:  # ``_write_all``'s no-progress guard: not the disk's doing
                raise
            self._write_failed(index, e)  # ENOSPC, EIO...: the item is served as made; these bytes stay unused
            return False
        if not self._acquire():
            return False
        try:
            if not q[e]:  # else another writer published it meanwhile: these bytes stay unused
                q[e + 1], q[e + 2] = record.length, q[H_STAMP]
                q[e] = offset  # last: the entry is whole once it has an offset
                q[H_HELD] += 1
                q[H_HELD_BYTES] += record.length
        finally:
            self._release()
        return True

    def get(self, index: int, before: Optional[int] = None) -> Optional[Any]:
        """Item ``index`` as read-only views of the store (no copy), or None
        when it is not cached (with ``before``: not cached before that cut)."""
        q, ro, e = self._q, self._ro, _Q + 3 * index
        if q is None or ro is None:
            return None
        offset = q[e]
        if not offset or (before is not None and q[e + 2] >= before):
            return None
        item = read_record(ro, offset, index, q[e + 1])
        if item is None:
            self._forget(index, offset)
        return item

    def _forget(self, index: int, offset: int) -> None:
        """Drops item ``index``'s entry, whose record at ``offset`` failed its check (pages a crash lost in a
        kept directory): the next ``put`` stores the item again, so it is made once more, not every pass."""
        q, e = self._q, _Q + 3 * index
        if q is None or not self._acquire():
            return
        try:
            if q[e] != offset:
                return  # another reader dropped it first
            q[e] = 0
            q[H_HELD] -= 1
            q[H_HELD_BYTES] -= q[e + 1]
        finally:
            self._release()
        logger.warning("kerasfeed cache: the stored record of item %d failed its check (its bytes are not the "
                       "record written); the item is made and stored again.", index)

    def drop_past(self, end: int) -> int:
        """Drops the entries whose records end past byte ``end`` (a kept data file cut short: their bytes
        would read as zeros); returns how many. Before any reader or writer (``kept._reuse``)."""
        q = np.frombuffer(self._index, np.uint64)
        entries = q[_Q:_Q + 3 * self.n].reshape(self.n, 3)
        offset, length = entries[:, 0], entries[:, 1]
        # Each part checked alone first: a damaged length could wrap the uint64 sum.
        lost = (offset != 0) & ((offset > end) | (length > end) | (offset + length > end))
        count = int(lost.sum())
        entries[lost] = 0  # no entry written when none is lost
        held = offset != 0
        if count:  # counted again from the entries kept, not decremented by a damaged entry's length
            q[H_HELD], q[H_HELD_BYTES] = int(held.sum()), int(length[held].sum())
        top = int((offset[held] + length[held]).max()) if held.any() else FIRST_OFFSET
        if q[H_BUMP] < top:  # a damaged bump pointer: new records would overwrite items already served
            q[H_BUMP] = top
        return count

    def has(self, index: int, before: Optional[int] = None) -> bool:
        """Whether ``get(index, before)`` would find the item (cheap)."""
        q, e = self._q, _Q + 3 * index
        return q is not None and bool(q[e]) and (before is None or q[e + 2] < before)

    def locate(self, array: np.ndarray) -> Optional[int]:
        """Where in the data file ``array``'s bytes start, if it is a C-contiguous
        view of this process's data mapping (an item ``get`` returned); else None."""
        if self._ro is None or not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        at = array.__array_interface__["data"][0] - self._ro_at
        return at if 0 <= at and at + array.nbytes <= self.capacity else None

    def graph_view(self, length: int) -> np.ndarray:
        """The data file's first ``length`` bytes (a multiple of 64, within the capacity) as a
        writable uint8 array of a private (copy-on-write) mapping, for TensorFlow to read records
        in place (``tfdata/stored_items.py``): nothing written through it reaches the file. Left
        to the garbage collector, as the store's own mappings (``close``).

        Raises:
            OSError: the kernel refused the mapping (a private writable mapping is charged
                against memory: one larger than RAM is refused under the default overcommit).
        """
        if self._owned.closed:
            raise RuntimeError(_CLOSED.format(where=self.where))
        view = mmap.mmap(self._data_fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(view, np.uint8)

    def new_cut(self) -> int:
        """A new stamp: entries published before this call are below it, later ones are not."""
        if not self._acquire():
            raise RuntimeError(_CLOSED.format(where=self.where))
        try:
            self._q[H_STAMP] += 1
            return self._q[H_STAMP]
        finally:
            self._release()

    def cached_mask(self, before: int) -> np.ndarray:
        """One bool per source index: cached before the cut ``before``."""
        index = self._index
        if index is None:  # closed
            return np.zeros(self.n, bool)
        entries = np.frombuffer(index, np.uint64, count=3 * self.n, offset=HEADER_BYTES).reshape(self.n, 3)
        try:
            return (entries[:, 0] != 0) & (entries[:, 2] < before)
        finally:
            del entries  # the mapping must not stay exported (close)

    def missing(self, indices: Any, before: int) -> Any:
        """``indices`` (a pass's order: a lazy view or an array) without those
        cached before the cut ``before``: the view itself when none is cached,
        else an int64 array of the rest (empty when every one is)."""
        q = self._q
        held = 0 if q is None else q[H_HELD]
        if held == 0:
            return indices
        mask = self.cached_mask(before)
        if held >= self.n and mask.all():
            return np.empty(0, np.int64)
        parts = [chunk[~mask[chunk]] for chunk in index_chunks(indices)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def holds_all(self, indices: Any) -> bool:
        """Whether every one of ``indices`` (a pass's order: a lazy view or an array) is stored."""
        return len(indices) > 0 and len(self.missing(indices, EVER)) == 0

    def figures(self) -> dict:
        """Items and bytes held, the budget (``limit``), and whether a put did not fit (as
        they were at ``close`` once closed)."""
        q = self._q
        if q is None:  # closed
            return self._last or {"items": 0, "bytes": 0, "capacity": self.limit, "full": False, "n": self.n,
                                  "used": 0}
        return {"items": q[H_HELD], "bytes": q[H_HELD_BYTES], "capacity": self.limit, "full": bool(q[H_FULL]),
                "n": self.n, "used": q[H_BUMP]}

    def _write_failed(self, index: int, error: OSError) -> None:
        """Stops storing (every process: the header says so) and says why, once."""
        if not self._acquire():
            return
        try:
            first = not self._q[H_FAILED]
            self._q[H_FAILED] = self._q[H_FULL] = 1
        finally:
            self._release()
        if first:
            logger.warning("kerasfeed: cache %s: storing stopped: writing item %d failed (%s); items not stored "
                           "are made every pass.", self.where, index, error)

    def _writable(self) -> Optional[WriteFd]:
        with self._lock:
            if self._owned.closed:
                return None
            if self._rw is None:
                self._rw = WriteFd(self._data_fd)
            return self._rw

    # ------------------------------------------------------------ end
    def flush(self) -> None:
        """Writes the mappings back to their files (a kept directory's, once formatted)."""
        with self._lock:
            if not self._owned.closed:
                if self._rw is not None:
                    os.fdatasync(self._rw.fd)
                self._index.flush()

    def close(self, mark_clean: bool = False) -> None:
        """Closes the store. Idempotent.

        Nothing is published after it (writers take the same lock, and find
        it closed). With ``mark_clean``, or for a kept directory's store
        (``kept_by``), the files are written back and the header says so
        (``Owned.release``). The mappings are not unmapped
        here but dropped: every item handed out (numpy keeps a mapping as an
        array's base, but holds no buffer export that would stop an unmap)
        keeps it mapped until it is gone, as a writer still writing keeps its
        fd (``WriteFd``). The figures stay as they were (``figures``).
        """
        with self._lock:
            if self._owned.closed:
                return
            self._owned.closed = True
            self._owned.clean = self._owned.clean or mark_clean
            self._last = self.figures()
            self._q = self._index = self._rw = self._ro = None  # type: ignore[assignment]
            callbacks, self._on_close = self._on_close, []
        try:
            for callback in callbacks:
                callback()
        finally:
            self._finalizer()  # the fds (after the clean mark), then a kept directory's lock

    @property
    def closed(self) -> bool:
        return self._owned.closed


def index_chunks(indices: Any) -> Any:
    """A pass's order (a lazy view or an array), as int64 arrays of at most ``_CHUNK`` indices."""
    for start in range(0, len(indices), _CHUNK):
        stop = start + _CHUNK
        yield np.asarray(indices.window(start, stop) if hasattr(indices, "window") else indices[start:stop], np.int64)


__all__ = ["EVER", "ItemStore", "index_bytes"]
