"""Items as ``tf.train.Example`` bytes and TFRecord frames, without TensorFlow.

One record per item, one feature per leaf (``ExportSpec.keys``) plus
``<key>:shape`` for arrays of rank >= 1, so shapes may vary per item
(docs/export.md, *Record format*). The ``Example`` wire format is small and
stable, so it is written and parsed here directly (tests check it against
``tf.train.Example``): workers then need neither TensorFlow nor protobuf.
A TFRecord frame is ``uint64 length, uint32 masked_crc32c(length), data,
uint32 masked_crc32c(data)``, all little-endian.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kerasfeed._nest import pack
from kerasfeed._records import crc32c, crc32c_implementation, frame  # noqa: F401 - crc32c, frame: the writer's
from kerasfeed._records import field as _field
from kerasfeed._records import message as _message
from kerasfeed._records import varint as _varint
from kerasfeed.exporting.spec import STRING, ExportSpec


def require_crc32c() -> None:
    if crc32c_implementation() != "c":
        raise ImportError(
            "kerasfeed exports need the `google-crc32c` package (with its C extension) for TFRecord "
            "checksums: pip install 'kerasfeed[export]' (or google-crc32c). Received: "
            f"google_crc32c={crc32c_implementation()}"
        )


def encode_pieces(spec: ExportSpec, arrays: Sequence[np.ndarray]) -> list:
    """The serialized Example as a list of bytes pieces (joined only by ``encode``)."""
    entries: list = []
    for key, dtype, a in zip(spec.keys, spec.dtypes, arrays):
        if dtype == STRING:
            values = list(a.reshape(-1))
            bad = [v for v in values if not isinstance(v, bytes)]
            if bad:
                raise TypeError(
                    f"field {key!r} holds strings and {type(bad[0]).__name__} objects. Received: {bad[0]!r}"
                )
        else:
            values = [a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()]  # google_crc32c takes bytes only
        blist = [piece for v in values for piece in (_field(1, memoryview(v).nbytes), v)]
        entries.append((key, _message(1, blist)))  # Feature.bytes_list
        if a.ndim:
            packed = b"".join(_varint(int(d)) for d in a.shape)
            entries.append((key + ":shape", _message(3, _message(1, [packed]))))  # Feature.int64_list
    features: list = []
    for key, feature in entries:
        name = key.encode("utf-8")
        features += _message(1, [_field(1, len(name)), name] + _message(2, feature))
    return _message(1, features)  # Example.features


def encode(spec: ExportSpec, arrays: Sequence[np.ndarray]) -> bytes:
    """The serialized ``tf.train.Example`` of one item's leaves."""
    return b"".join(encode_pieces(spec, arrays))


# -- parsing (ExportSource, tests) ----------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """Yields ``(field number, wire type, value)``; value is ``(start, end)`` for length-delimited fields."""
    pos = start
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value = (pos, pos + n)
            pos += n
        elif wire in (1, 5):
            value, pos = None, pos + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"malformed Example record: wire type {wire} at byte {pos}")
        yield number, wire, value
    if pos != end:
        raise ValueError(f"malformed Example record: a field runs past its message (byte {pos} > {end})")


def parse_example(record: bytes) -> dict:
    """``{key: ("bytes", [memoryview, ...]) or ("int64", [int, ...])}`` of a serialized Example."""
    buf = memoryview(record)
    out: dict = {}
    for number, _, span in _fields(buf, 0, len(buf)):
        if number != 1:
            continue
        for fnum, _, entry in _fields(buf, *span):
            if fnum != 1:
                continue
            key, feature = None, None
            for enum, _, v in _fields(buf, *entry):
                if enum == 1:
                    key = bytes(buf[v[0] : v[1]]).decode("utf-8")
                elif enum == 2:
                    feature = v
            kind, values = "bytes", []
            if feature is not None:
                for knum, _, lst in _fields(buf, *feature):
                    if knum == 1:
                        values = [buf[s:e] for vnum, _, (s, e) in _fields(buf, *lst) if vnum == 1]
                    elif knum == 3:
                        kind = "int64"
                        for vnum, wire, v in _fields(buf, *lst):
                            if wire == 2:  # packed
                                pos, stop = v
                                while pos < stop:
                                    d, pos = _read_varint(buf, pos)
                                    values.append(d)
                            else:
                                values.append(v)
                    elif knum == 2:
                        raise ValueError(f"feature {key!r} is a FloatList; kerasfeed exports store bytes")
            out[key] = (kind, values)
    return out


def decode(spec: ExportSpec, record: bytes) -> Any:
    """The item (a nest of numpy arrays; strings as object arrays of bytes) of one record."""
    features = parse_example(record)
    leaves = []
    for key, dtype, shape in zip(spec.keys, spec.dtypes, spec.shapes):
        try:
            _, values = features[key]
            dims = tuple(features[key + ":shape"][1]) if shape else ()
        except KeyError as e:
            raise ValueError(f"record has no feature {e.args[0]!r}. Received: features {sorted(features)}") from None
        if dtype == STRING:
            a = np.empty(len(values), dtype=object)
            a[:] = [bytes(v) for v in values]
            leaves.append(a.reshape(dims))
        else:
            leaves.append(np.frombuffer(values[0], dtype=np.dtype(dtype).newbyteorder("<")).reshape(dims))
    return pack(spec.skeleton, leaves)
