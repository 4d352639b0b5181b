"""The file object h5py reads a remote file through: blocks fetched pinned to the object's version, and kept.

NOTE [ h5py over a remote file, and the collector ]
===================================================

h5py reads a Python file object under its process-wide lock, one ``read``
at a time (h5py#2001). kerasfeed lets it do so only for what needs h5py:
the file's metadata, read once at construction (superblock, object headers,
chunk indexes), and the datasets outside the fast path (``chunks.py``).
``BlockFile`` serves those reads from blocks of ``block_size`` bytes, each
fetched once (several missing blocks of one read in one wave), so the
~10 small reads of an open cost a few requests, not ten.

NOTE [ A chunk index read one level at a time ]
===============================================

A chunked dataset's index (the version-1 B-tree h5py's files use by
default) has a leaf node per ~32-64 chunks, written between the chunks and
so scattered over the file: h5py's ``chunk_iter`` reads them one after the
other, a round trip each (282 round trips for a file of 8,192 chunks a key:
6.3 s at 20 ms; 7 and 0.44 s so). While ``BlockFile.chunk_index(rank)`` is on (the
layout reads, ``files.py``), a node h5py reads (signature ``TREE``, raw-data
chunks, level >= 1) has its children parsed and fetched at once, exact
spans of the node's size, the next level's from those, one wave per level;
h5py's reads of them are then served from memory. Whatever is fetched is
the pinned object's bytes at that address, so a misparsed node costs
requests, never wrong data. A node's addresses count from the end of the
file's userblock (``BlockFile.base``), as all of HDF5's do. Indexes of files written with
``libver="latest"`` (version-2 B-trees, extensible and fixed arrays) are
read as before, node by node.

While h5py waits on the network it holds its lock, and the fetch runs on
fsspec's event-loop thread: if the cyclic collector ran there and freed an
h5py object, that object's finalizer would wait for the lock forever
(h5py#2019, and h5py's docs on file-like objects). ``collector_held``
keeps the collector off while any thread of the process is inside such an
h5py call (counted, so overlapping calls re-enable it once, at the end). A
child forked meanwhile (Keras' ``use_multiprocessing=True``) has none of
those threads: it starts with a fresh count and lock and the collector as
the parent had it before (``_after_fork``), never off for good.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import threading
from collections import OrderedDict
from typing import Optional

from kerasfeed.remote.fetch import ObjectStat, Store, gather_ranges, run

_GC_LOCK = threading.Lock()
# A version-1 B-tree node (NOTE [ A chunk index read one level at a time ]): "TREE", node type (1: raw-data
# chunks), level, entries used (2 bytes), left and right siblings; then keys and child addresses alternate.
_TREE, _RAW_DATA_NODES, _NODE_HEADER, _ADDRESS = b"TREE", 1, 24, 8
MAX_NODES_AHEAD_BYTES = 64 << 20  # nodes fetched ahead and not yet read, at most (~20,000 nodes of 3 KB)
_GC_STATE = {"depth": 0, "was_enabled": False}


def _after_fork() -> None:
    global _GC_LOCK
    _GC_LOCK = threading.Lock()  # a thread gone with the fork may have held it
    if _GC_STATE["depth"] and _GC_STATE["was_enabled"]:
        gc.enable()  # the calls that turned it off ran on threads the child does not have
    _GC_STATE["depth"] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@contextlib.contextmanager
def collector_held():
    """Keeps the cyclic garbage collector off for the block (see the NOTE); nests across threads."""
    with _GC_LOCK:
        if _GC_STATE["depth"] == 0:
            _GC_STATE["was_enabled"] = gc.isenabled()
            gc.disable()
        _GC_STATE["depth"] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_STATE["depth"] -= 1
            if _GC_STATE["depth"] == 0 and _GC_STATE["was_enabled"]:
                gc.enable()


class BlockFile(io.RawIOBase):
    """A read-only, seekable file of one object version, in blocks (for h5py only).

    Args:
        store: the object's ``Store``.
        pin: the version every block is read from.
        block_size: bytes per block.
        max_blocks: blocks kept (least recently used dropped).
    """

    def __init__(self, store: Store, pin: ObjectStat, block_size: int, max_blocks: int = 64,
                 head: Optional[bytes] = None):
        super().__init__()
        self._store, self._pin = store, pin
        self._block, self._max = block_size, max_blocks
        self._blocks: OrderedDict = OrderedDict()
        if head is not None and len(head) == min(block_size, pin.size):  # block 0, fetched already
            self._blocks[0] = head
        self._pos = 0
        self.error = None  # the last fetch error: h5py reports its own error in its place
        self._rank: Optional[int] = None  # set while a chunk index is read: its nodes' children are fetched ahead
        self._nodes: dict = {}  # address -> a node fetched ahead, until h5py reads it
        self.base = 0  # where the HDF5 file starts in the object (its userblock's size): addresses count from it

    @contextlib.contextmanager
    def chunk_index(self, rank: int):
        """Within: the chunk index of a dataset of ``rank`` dimensions is read a level at a time (NOTE above)."""
        self._rank = rank
        try:
            yield
        finally:
            self._rank, self._nodes = None, {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._pin.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._pin.size)
        if end <= self._pos:
            return 0
        node = self._nodes.pop(self._pos, None)
        if node is not None and len(node) >= end - self._pos:
            n = end - self._pos
            view[:n] = node[:n]
            self._pos = end
            self._fetch_below(node)
            return n
        first, last = self._pos // self._block, (end - 1) // self._block
        missing = [b for b in range(first, last + 1) if b not in self._blocks]
        if missing:
            size = self._pin.size
            spans = [(b * self._block, min((b + 1) * self._block, size)) for b in missing]
            try:
                got = run(gather_ranges, [(self._store, s, e, self._pin) for s, e in spans])
            except BaseException as e:
                self.error = e
                raise
            for b, data in zip(missing, got):
                self._blocks[b] = data
        n = 0
        for b in range(first, last + 1):
            data = self._blocks[b]
            self._blocks.move_to_end(b)
            lo = max(self._pos, b * self._block) - b * self._block
            hi = min(end, (b + 1) * self._block) - b * self._block
            view[n : n + hi - lo] = data[lo:hi]
            n += hi - lo
        while len(self._blocks) > max(self._max, last - first + 1):
            self._blocks.popitem(last=False)
        self._pos += n
        if self._rank is not None and view[:4] == _TREE:  # a chunk-index node (most reads are not)
            self._fetch_below(bytes(view[:n]))
        return n

    def _fetch_below(self, node: bytes) -> None:
        """The nodes under ``node`` (a chunk-index node h5py read), fetched a level at a time, one wave each."""
        level = [node]
        while level and self._rank is not None:
            held = sum(len(v) for v in self._nodes.values())
            want = [a for nd in level for a in tree_children(nd, self._rank, self._pin.size, self.base)
                    if a not in self._nodes]
            want = list(dict.fromkeys(want))[: max(0, (MAX_NODES_AHEAD_BYTES - held) // len(node))]
            if not want:
                return
            try:
                got = run(gather_ranges, [(self._store, a, a + len(node), self._pin) for a in want])
            except BaseException as e:
                self.error = e
                raise
            self._nodes.update(zip(want, got))
            level = got


def tree_children(node: bytes, rank: int, size: int, base: int = 0) -> list:
    """The child offsets in the object of a version-1 B-tree node of raw-data chunks (a dataset of ``rank``
    dimensions) whose level is >= 1, each holding a whole node of ``len(node)`` bytes within ``size``;
    ``[]`` for a leaf, another kind of node, or bytes that do not parse as one. ``base``: the userblock's
    size, which the node's addresses do not count."""
    n = len(node)
    if n < _NODE_HEADER or node[:4] != _TREE or node[4] != _RAW_DATA_NODES or node[5] == 0:
        return []
    entries = int.from_bytes(node[6:8], "little")
    key = 8 + _ADDRESS * (rank + 1)  # chunk size, filter mask, an offset per dimension plus the element's
    two_k, rest = divmod(n - _NODE_HEADER - key, key + _ADDRESS)  # 2K children and 2K + 1 keys fill a node
    if rest or not 0 < entries <= two_k:
        return []
    at = [_NODE_HEADER + key * (i + 1) + _ADDRESS * i for i in range(entries)]
    children = [base + int.from_bytes(node[p : p + _ADDRESS], "little") for p in at]
    return children if all(c + n <= size for c in children) else []


def open_h5(store: Store, pin: ObjectStat, block_size: int, open_kwargs: dict, head: Optional[bytes] = None) -> tuple:
    """``(h5py.File, BlockFile)`` of ``pin`` (``head``: its first block, if fetched already); call it, and use
    the file, under ``collector_held``."""
    import h5py

    raw = BlockFile(store, pin, block_size, head=head)
    try:
        f = h5py.File(raw, "r", **open_kwargs)
        raw.base = f.userblock_size  # HDF5's addresses start after the userblock (the superblock's place)
        return f, raw
    except Exception:
        if raw.error is not None:  # h5py's "unable to open" hides why the read failed
            raise raw.error from None
        raise


def fetch_error(raw: BlockFile, err: BaseException) -> BaseException:
    """The fetch error behind an error h5py raised while reading ``raw`` (else ``err``)."""
    found, raw.error = raw.error, None
    return found if found is not None else err


__all__ = ["BlockFile", "collector_held", "fetch_error", "open_h5", "tree_children"]
