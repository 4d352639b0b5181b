"""Shared-memory transport of nested numpy structures between processes.

An item (an array, or tuples/lists/dicts of arrays, scalars and strings) is
split in two:

- a small picklable *spec*: the structure, and for every array leaf its dtype,
  shape and byte offset;
- the array bytes, written at 64-byte aligned offsets into a shared-memory
  *segment*.

Segments are anonymous: ``memfd_create`` on Linux, otherwise a POSIX
``shm_open`` name that is unlinked right after creation. A segment is shared
by passing its file descriptor over a Unix socket (``SCM_RIGHTS``), so nothing
ever stays in ``/dev/shm``: the memory is freed by the kernel when the last
process holding a mapping exits or closes it, even after ``SIGKILL``. Segments
are created with mode 0600 (private to the user).

The consumer gets an item in one of two ways:

- ``lend``: zero copies. The arrays are views of the segment; TensorFlow wraps
  64-byte aligned arrays returned by a ``numpy_function`` without copying, so
  the bytes a worker wrote are the tensor's bytes. The segment stays out of use
  until the last view (and the tensor wrapping it) is gone; a finalizer then
  hands it back. This avoids both a copy and, more costly on the consumer
  side, the page faults of touching freshly allocated memory for every item.
- ``decode``: one copy into fresh arrays, and the segment is free at once
  (used when too much is lent already, and for streams).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import secrets
import weakref
from typing import Any, Callable, Optional

import numpy as np

ALIGN = 64  # cache line; also what TensorFlow needs to wrap an array without copying
SEGMENT_PREFIX = "kerasfeed"
# Test hook / portability switch: "memfd" (default where available) or "posix".
BACKEND_ENV = "KERASFEED_SHM_BACKEND"


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


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


def grown_size(nbytes: int) -> int:
    """Capacity of a new segment for an item of ``nbytes``: a little headroom
    so that items of slightly varying size do not re-create it every time."""
    return _round_up(max(nbytes + nbytes // 8, 1), mmap.PAGESIZE)


# ---------------------------------------------------------------- encoding
# Spec nodes (tuples, so they pickle small and fast):
#   ("a", dtype, shape, offset)   array leaf stored in the segment
#   ("o", obj)                    anything else, pickled inline (scalars, str,
#                                 object arrays, empty arrays)
#   ("t", [children]) / ("l", [children]) / ("d", [(key, child), ...])
#   ("n", namedtuple_type, [children])


def encode(item: Any) -> tuple[Any, list[tuple[int, np.ndarray]], int]:
    """Splits ``item`` into a spec, the arrays to write and the bytes needed.

    Returns:
        ``(spec, [(offset, array), ...], nbytes)``.
    """
    arrays: list[tuple[int, np.ndarray]] = []
    spec = _encode(item, arrays)
    end = arrays[-1][0] + arrays[-1][1].nbytes if arrays else 0
    return spec, arrays, end


def _encode(obj: Any, arrays: list) -> Any:
    # A module-level function, not a recursive closure: a closure that refers
    # to itself is a reference cycle, and it would keep every item's arrays
    # alive until the cyclic garbage collector happens to run.
    t = type(obj)
    if t is np.ndarray and not obj.dtype.hasobject and obj.nbytes > 0:
        offset = _round_up(arrays[-1][0] + arrays[-1][1].nbytes, ALIGN) if arrays else 0
        arrays.append((offset, obj))
        return ("a", obj.dtype, obj.shape, offset)
    if t is tuple:
        return ("t", [_encode(x, arrays) for x in obj])
    if t is list:
        return ("l", [_encode(x, arrays) for x in obj])
    if t is dict:
        return ("d", [(k, _encode(v, arrays)) for k, v in obj.items()])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("n", t, [_encode(x, arrays) for x in obj])
    return ("o", obj)


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

    ``on_release`` runs once every array of the item, every view derived from
    them and every tensor wrapping them is gone; only then may the segment be
    written again.

    Args:
        spec: the item's spec, as made by ``encode``.
        segment: the segment the item was written into.
        nbytes: the bytes of the segment the item uses (> 0; ``encode``
            returns it to the worker, which sends it along).
        on_release: called without arguments, from whichever thread drops the
            last reference; it must be quick and must not block.
    """
    # One buffer object per lent item, not an ndarray: numpy points every
    # derived view's ``base`` at the first non-ndarray owner, so this object
    # lives exactly as long as any view of the item does.
    owner = (ctypes.c_ubyte * nbytes).from_buffer(segment.mm)
    weakref.finalize(owner, on_release)
    return _rebuild(spec, lambda dtype, shape, offset: np.ndarray(shape, dtype, buffer=owner, offset=offset))


def decode(spec: Any, segment: Optional[Segment]) -> Any:
    """Rebuilds an item from its spec, copying every array out of ``segment``
    once into a fresh aligned array (never a view of the segment)."""

    def copy_out(dtype, shape, offset):
        src = np.ndarray(shape, dtype, buffer=segment.mm, offset=offset)
        out = aligned_empty(shape, dtype)
        np.copyto(out, src)
        return out

    return _rebuild(spec, copy_out)


def _rebuild(spec: Any, array: Callable[[Any, tuple, int], np.ndarray]) -> Any:
    # A module-level function, not a recursive closure (see ``_encode``).
    kind = spec[0]
    if kind == "a":
        _, dtype, shape, offset = spec
        return array(dtype, shape, offset)
    if kind == "o":
        return spec[1]
    if kind == "t":
        return tuple(_rebuild(c, array) for c in spec[1])
    if kind == "l":
        return [_rebuild(c, array) for c in spec[1]]
    if kind == "d":
        return {k: _rebuild(c, array) for k, c in spec[1]}
    if kind == "n":
        return spec[1](*(_rebuild(c, array) for c in spec[2]))
    raise ValueError(f"kerasfeed: corrupt shared-memory spec node. Received: {kind!r}")


def dumps_spec(spec: Any) -> bytes:
    """Pickles a spec; falls back to cloudpickle for inline objects of classes
    that only exist by value in this process (e.g. defined in a notebook)."""
    try:
        return pickle.dumps(spec, protocol=5)
    except Exception:  # noqa: BLE001 - whatever pickle refuses, cloudpickle tries
        import cloudpickle

        return cloudpickle.dumps(spec, protocol=5)


# Unpickled specs of items made of arrays only, by their bytes. Most sources
# return the same shapes and dtypes every time, so the consumer would unpickle
# the same few hundred bytes (numpy dtypes included: ~4 us) for every item.
# A spec is only read, and ``_rebuild`` makes new containers and arrays, so
# one object can serve every item. Specs holding inline objects ("o" nodes)
# are not cached: those objects must not be shared between items.
_SPEC_CACHE: dict = {}
_SPEC_CACHE_MAX = 64


def _arrays_only(spec: Any) -> bool:
    kind = spec[0]
    if kind == "a":
        return True
    if kind in ("t", "l"):
        return all(_arrays_only(c) for c in spec[1])
    if kind == "d":
        return all(_arrays_only(c) for _, c in spec[1])
    if kind == "n":
        return all(_arrays_only(c) for c in spec[2])
    return False


def loads_spec(raw: bytes) -> Any:
    """Unpickles a spec made by ``dumps_spec`` (cached when it holds arrays only)."""
    spec = _SPEC_CACHE.get(raw)
    if spec is None:
        spec = pickle.loads(raw)
        if _arrays_only(spec):
            if len(_SPEC_CACHE) >= _SPEC_CACHE_MAX:  # shapes that keep changing: start again
                _SPEC_CACHE.clear()
            _SPEC_CACHE[raw] = spec
    return spec
