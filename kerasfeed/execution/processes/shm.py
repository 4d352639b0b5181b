"""Shared-memory transport of nested numpy structures between processes.

An item (an array, or tuples/lists/dicts of arrays, scalars and strings) is
split in two:

- a small picklable *spec*: the structure, and for every array leaf its dtype,
  shape and byte offset;
- the array bytes, written at 64-byte aligned offsets into a shared-memory
  *segment*.

Segments are anonymous (``memfd_create`` on Linux, else a POSIX ``shm_open``
name unlinked right after creation) and mode 0600, shared by passing their fd
over a Unix socket (``SCM_RIGHTS``): nothing ever stays in ``/dev/shm``, and the
kernel frees the memory when the last process holding a mapping exits or
closes it, even after ``SIGKILL``.

The consumer gets an item in one of two ways:

- ``lend``: zero copies. The arrays are views of the segment; TensorFlow wraps
  64-byte aligned arrays returned by a ``numpy_function`` without copying, so
  the bytes a worker wrote are the tensor's. The segment stays out of use until
  the last view (and the tensor wrapping it) is gone; a finalizer then hands it
  back. This avoids a copy and, costlier for the consumer, the page faults of
  touching freshly allocated memory for every item.
- ``decode``: one copy into fresh arrays, and the segment is free at once
  (used when too much is lent already, and for streams).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import weakref
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed._layout import (  # noqa: F401 - the item layout, importable from here as before
    _SPEC_CACHE,
    _SPEC_CACHE_MAX,
    ALIGN,
    dumps_spec,
    encode,
    loads_spec,
    rebuild,
    round_up,
)

SEGMENT_PREFIX = "kerasfeed"
# Test hook / portability switch: "memfd" (default where available) or "posix".
BACKEND_ENV = "KERASFEED_SHM_BACKEND"


def create_segment(size: int, tag: str = "") -> int:
    """Creates an anonymous shared-memory segment; returns its fd (mode 0600).

    Args:
        size: size in bytes (> 0).
        tag: a short label that shows in ``/proc/<pid>/fd`` (memfd only).

    Returns:
        A non-inheritable file descriptor; the caller closes it.
    """
    use_memfd = hasattr(os, "memfd_create") and os.environ.get(BACKEND_ENV, "memfd") != "posix"
    if use_memfd:
        fd = os.memfd_create(f"{SEGMENT_PREFIX}-{tag}", os.MFD_CLOEXEC)
    else:
        import _posixshmem  # the primitive behind multiprocessing.shared_memory

        name = f"/{SEGMENT_PREFIX}_{os.getpid()}_{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        # Unlink at once: the fd (and later the mappings) keep the memory alive,
        # and no name is left behind if any process dies.
        _posixshmem.shm_unlink(name)
    try:
        os.set_inheritable(fd, False)
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Segment:
    """A mapping of a shared-memory segment.

    Args:
        fd: the segment's file descriptor; closed by the constructor (the
            mapping keeps the memory alive).
        size: the segment's size in bytes.
    """

    def __init__(self, fd: int, size: int):
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A view is still alive somewhere; the mapping goes away with it.
            pass


def new_segment(size: int, tag: str = "") -> tuple[Segment, int]:
    """Creates and maps a segment; returns it and a duplicate fd to send."""
    fd = create_segment(size, tag)
    send_fd = os.dup(fd)
    return Segment(fd, size), send_fd


# A segment this much (and 4x) larger than the item it is to carry is made anew at the item's size.
SHRINK_BYTES = 16 * 2**20


def oversized(size: int, nbytes: int) -> bool:
    """Whether a segment of ``size`` bytes is far too large for an item of ``nbytes``: one outlier item grew
    it. Kept, every slot would end up the size of the largest item ever carried, and a small item lent from
    it would pin all of it (2 workers, 40 MB items among 300 KB ones: 520 MB mapped for nothing held).
    Made anew, the next large item on that slot writes to fresh pages (~0.5 ms a MB): paid for outliers only."""
    return size - nbytes >= SHRINK_BYTES and size > 4 * nbytes


def grown_size(nbytes: int) -> int:
    """Capacity of a new segment for an item of ``nbytes``: a little headroom
    so that items of slightly varying size do not re-create it every time."""
    return round_up(max(nbytes + nbytes // 8, 1), mmap.PAGESIZE)


# ---------------------------------------------------------------- encoding
def write(segment: Segment, arrays: list[tuple[int, np.ndarray]]) -> None:
    """Copies the arrays of an encoded item into ``segment``."""
    for offset, a in arrays:
        dst = np.ndarray(a.shape, a.dtype, buffer=segment.mm, offset=offset)
        np.copyto(dst, a, casting="no")  # releases the GIL for large arrays
        del dst


def aligned_empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is 64-byte aligned."""
    dtype = np.dtype(dtype)
    out = np.empty(shape, dtype)
    if out.ctypes.data % ALIGN == 0:
        # The usual case for large arrays. An array that owns its memory is
        # also cheaper for TensorFlow to wrap than a view into a bigger one
        # (measured: ~300 vs ~600 us per 1.5 MB item through numpy_function).
        return out
    nbytes = out.nbytes
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def lend(spec: Any, segment: Segment, nbytes: int, on_release: Callable[[], None]) -> Any:
    """Rebuilds an item whose arrays are views of ``segment`` (no copy).

    Args:
        spec: the item's spec, as made by ``encode``.
        segment: the segment the item was written into.
        nbytes: the bytes of the segment the item uses (> 0; sent along by the worker).
        on_release: runs once every array of the item, derived view and wrapping tensor is
            gone (only then may the segment be written again), from whichever thread drops
            the last reference; it must be quick and must not block.
    """
    # One buffer object per lent item, not an ndarray: numpy points every
    # derived view's ``base`` at the first non-ndarray owner, so this object
    # lives exactly as long as any view of the item does.
    owner = (ctypes.c_ubyte * nbytes).from_buffer(segment.mm)
    weakref.finalize(owner, on_release)
    return rebuild(spec, lambda dtype, shape, offset: np.ndarray(shape, dtype, buffer=owner, offset=offset))


def decode(spec: Any, segment: Optional[Segment]) -> Any:
    """Rebuilds an item from its spec, copying every array out of ``segment``
    once into a fresh aligned array (never a view of the segment)."""

    def copy_out(dtype, shape, offset):
        src = np.ndarray(shape, dtype, buffer=segment.mm, offset=offset)
        out = aligned_empty(shape, dtype)
        np.copyto(out, src)
        return out

    return rebuild(spec, copy_out)
