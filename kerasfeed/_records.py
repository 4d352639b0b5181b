"""Protobuf wire pieces, CRC32C and TFRecord frames, without TensorFlow or protobuf.

Shared by the exports (``tf.train.Example`` records) and the TensorBoard
scalars the callbacks write where TensorFlow is not used (``Event`` records):
both are TFRecord files, ``uint64 length, uint32 masked_crc32c(length), data,
uint32 masked_crc32c(data)``, all little-endian.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

try:  # C implementation; ~20 GB/s
    import google_crc32c as _crc
except ImportError:  # pragma: no cover - the `export` and `dev` extras install it
    _crc = None


def _table() -> list[int]:
    # CRC-32C (Castagnoli), reflected polynomial 0x82F63B78.
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE: list[int] = []


def crc32c_implementation() -> str:
    """``"c"`` (google-crc32c's C extension), ``"python"`` (its pure-Python
    build) or ``"missing"``; without C, ``crc32c`` runs here, ~100 ms per MB."""
    return "missing" if _crc is None else getattr(_crc, "implementation", "c")


_FAST = crc32c_implementation() == "c"


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of ``data`` (bytes-like), continuing from ``crc``: in C with google-crc32c, else in Python,
    fine for the small records of TensorBoard scalars and nothing else (exports require the C one)."""
    if _FAST:
        return _crc.extend(crc, data)
    if not _TABLE:
        _TABLE.extend(_table())
    c = crc ^ 0xFFFFFFFF
    for b in memoryview(data).cast("B"):
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field."""
    return varint((number << 3) | 2) + varint(length)


def size(pieces: Sequence) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def message(number: int, pieces: list) -> list:
    """Field ``number`` holding the message made of ``pieces``, as a list of pieces."""
    return [field(number, size(pieces))] + pieces


def frame(pieces: Sequence) -> tuple[bytes, bytes, int]:
    """TFRecord header and footer around ``pieces``; returns ``(header, footer, data length)``."""
    crc = 0
    for p in pieces:
        crc = crc32c(p, crc)
    n = size(pieces)
    length = struct.pack("<Q", n)
    return length + struct.pack("<I", masked_crc(crc32c(length))), struct.pack("<I", masked_crc(crc)), n


__all__ = ["crc32c", "crc32c_implementation", "field", "frame", "masked_crc", "message", "size", "varint"]
