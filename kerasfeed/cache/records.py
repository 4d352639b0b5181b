"""A cached item's record in the store's data file (numpy and the standard library).

NOTE [ A cached item's record ]
One item is one record, at a 64-byte aligned offset of the data file::

    [64-byte header][the item's spec, pickled][padding to 64][its arrays]

The header holds a magic number, the spec's length, the source index, the
record's length and where the arrays start; the spec and the array offsets
are the item layout every kerasfeed transport uses (``kerasfeed/_layout.py``).
A record is written whole before the store's index points at it and is never
written again. A reader checks the header's magic, index and length against
the index entry it followed, so an entry that does not match its record (a
torn read, a file left by another layout) reads as not cached, never as
another item.
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple, Optional

import numpy as np

from kerasfeed._layout import ALIGN, dumps_spec, encode, loads_spec, rebuild, round_up

MAGIC = b"KFI1"
HEADER = struct.Struct("<4sIQQQ")  # magic, spec length, index, record length, arrays start
HEADER_SIZE = 64
_IOV_MAX = 512  # buffers per pwritev call (Linux takes up to 1024)


class Encoded(NamedTuple):
    """An item ready to be written: its pickled spec, its arrays at their
    offsets (from the arrays' start), where the arrays start in the record,
    and the record's length (a multiple of 64)."""

    spec: bytes
    arrays: list
    arrays_at: int
    length: int


def encode_record(index: int, item: Any) -> Encoded:
    """Lays item ``index`` out as a record.

    Raises:
        TypeError: a leaf that cannot be stored (pickled): names the index
            and the leaf's type.
    """
    spec, arrays, nbytes = encode(item)
    try:
        spec_bytes = dumps_spec(spec)
    except Exception as e:  # whatever pickle and cloudpickle refuse
        raise TypeError(
            f"kerasfeed cache: item {index} cannot be cached: a leaf that is not a numpy array of numbers, strings "
            f"or bytes must be picklable, and one is not ({type(e).__name__}: {e}). Return arrays, scalars and "
            f"strings from the cached stage. Received: an item of type {type(item).__name__}"
        ) from e
    arrays_at = round_up(HEADER_SIZE + len(spec_bytes), ALIGN)
    return Encoded(spec_bytes, arrays, arrays_at, round_up(arrays_at + nbytes, ALIGN))


def write_record(fd: int, offset: int, index: int, record: Encoded) -> None:
    """Writes ``record`` (item ``index``) at ``offset`` of the file ``fd``.

    NOTE [ A record is written with pwritev, not through a mapping ]
    The store's pages are fresh when an item is first stored. Copied in
    through a shared mapping, every fresh page costs a fault and the kernel's
    zeroing before the copy overwrites it: 0.72-0.80 ms for a 1.5 MB item on
    the 2-core VM, against 0.42 ms for ``os.pwritev`` of the same bytes into
    the same memfd (whole pages written by ``write`` are not zeroed first; no
    fault in the writer). Readers map the file as before: one page cache.
    """
    head = bytearray(record.arrays_at)
    HEADER.pack_into(head, 0, MAGIC, len(record.spec), index, record.length, record.arrays_at)
    head[HEADER_SIZE : HEADER_SIZE + len(record.spec)] = record.spec
    buffers: list = [head]
    end = record.arrays_at
    for at, a in record.arrays:
        if record.arrays_at + at > end:  # alignment padding between arrays
            buffers.append(bytes(record.arrays_at + at - end))
        whole = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        buffers.append(whole.reshape(-1).view(np.uint8))  # any fixed-size dtype, as bytes
        end = record.arrays_at + at + a.nbytes
    _write_all(fd, buffers, offset)


def _write_all(fd: int, buffers: list, offset: int) -> None:
    """``os.pwritev`` of every byte of ``buffers`` (a short write goes on where it stopped; the GIL is released)."""
    first = 0  # the first buffer not yet written whole
    while first < len(buffers):
        written = os.pwritev(fd, buffers[first : first + _IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"kerasfeed cache: pwritev wrote nothing at offset {offset} of the item store's data file")
        offset += written
        while first < len(buffers) and written >= len(buffers[first]):
            written -= len(buffers[first])
            first += 1
        if written:  # a buffer written in part: the rest of it next
            buffers[first] = memoryview(buffers[first])[written:]


def read_record(buf: Any, offset: int, index: int, length: int) -> Optional[Any]:
    """Item ``index`` from its record at ``offset`` of ``buf``: arrays that view
    ``buf`` (read-only when ``buf`` is), no copy; None when the record there is
    not item ``index``'s (see NOTE [ A cached item's record ]). Each array
    keeps ``buf`` alive (its ``base``): a mapping read this way must be left
    to the garbage collector, never closed, while views of it may live."""
    magic, spec_length, found, found_length, arrays_at = HEADER.unpack_from(buf, offset)
    if (magic != MAGIC or found != index or found_length != length
            or not HEADER_SIZE + spec_length <= arrays_at <= length):  # a header that points past its record
        return None
    start = offset + HEADER_SIZE
    base, room = offset + arrays_at, length - arrays_at

    def view(dtype: Any, shape: Any, at: int) -> np.ndarray:
        a = np.ndarray(shape, dtype, buffer=buf, offset=base + at)
        if at < 0 or at + a.nbytes > room:  # another record's bytes (a damaged spec): never served
            raise ValueError(f"an array past record {index}'s end")
        return a

    try:
        return rebuild(loads_spec(buf[start : start + spec_length]), view)
    except Exception:  # noqa: BLE001 - damaged bytes past a sound header (a disk's, a copy's): made again
        return None


__all__ = ["Encoded", "HEADER_SIZE", "encode_record", "read_record", "write_record"]
