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

import struct
from typing import Any, NamedTuple, Optional

import numpy as np

from kerasfeed._layout import ALIGN, dumps_spec, encode, loads_spec, rebuild, round_up

MAGIC = b"KFI1"
HEADER = struct.Struct("<4sIQQQ")  # magic, spec length, index, record length, arrays start
HEADER_SIZE = 64


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


def write_record(buf: Any, offset: int, index: int, record: Encoded) -> None:
    """Writes ``record`` (item ``index``) at ``offset`` of the writable buffer ``buf``."""
    HEADER.pack_into(buf, offset, MAGIC, len(record.spec), index, record.length, record.arrays_at)
    start = offset + HEADER_SIZE
    buf[start : start + len(record.spec)] = record.spec
    base = offset + record.arrays_at
    for at, a in record.arrays:
        dst = np.ndarray(a.shape, a.dtype, buffer=buf, offset=base + at)
        np.copyto(dst, a, casting="no")  # releases the GIL for large arrays
        del dst


def read_record(buf: Any, offset: int, index: int, length: int) -> Optional[Any]:
    """Item ``index`` from its record at ``offset`` of ``buf``: arrays that view
    ``buf`` (read-only when ``buf`` is), no copy; None when the record there is
    not item ``index``'s (see NOTE [ A cached item's record ]). Each array
    keeps ``buf`` alive (its ``base``): a mapping read this way must be left
    to the garbage collector, never closed, while views of it may live."""
    magic, spec_length, found, found_length, arrays_at = HEADER.unpack_from(buf, offset)
    if magic != MAGIC or found != index or found_length != length:
        return None
    start = offset + HEADER_SIZE
    spec = loads_spec(buf[start : start + spec_length])
    base = offset + arrays_at
    return rebuild(spec, lambda dtype, shape, at: np.ndarray(shape, dtype, buffer=buf, offset=base + at))


__all__ = ["Encoded", "HEADER_SIZE", "encode_record", "read_record", "write_record"]
