"""Where a dataset's bytes lie in the file, read once with h5py; rows decoded from those bytes without h5py.

NOTE [ The fast path and the fallback ]
=======================================

``Layout.of(dataset)`` reads, on the metadata-only open at construction,
where every stored chunk of a dataset lies (``DatasetID.chunk_iter``: byte
offset, stored size, filter mask) or where a contiguous dataset starts
(``DatasetID.get_offset``). A batch then needs only byte ranges: they are
fetched concurrently (``fetch.py``) and decoded here, on the calling
thread, outside h5py and its lock (zlib-ng, or zlib without the remote
extra, releases the GIL while it inflates; the shuffle filter is undone by
a numpy transpose).

Fast path (``Layout.fast``):
  - **chunked** datasets whose filters are only **gzip/deflate** and
    **shuffle** (h5py's ``compression="gzip"``, ``shuffle=True``), or none;
    chunks never written read as the fill value, as h5py does; partial
    edge chunks stored unfiltered (``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``,
    which their filter mask does not show) are read as stored, the chunk
    options read through ctypes (``hdf5lib.py``); where they cannot be read,
    a filtered dataset with partial edge chunks goes to the fallback;
  - **contiguous** datasets (one byte range per run of rows; never written,
    that is without storage, the fill value);
  - dtypes of fixed size: bool, integers, floats, complex, either byte order.

Fallback (h5py reads the dataset through a file object that fetches
blocks of ``RemoteOptions.block_size``, one process-wide h5py call at a
time, as over any fsspec file): **compact** datasets (stored inside the
object header), **virtual** datasets whose sources are in the same file,
the filters **szip**, **lzf**, **scale-offset**, **n-bit**, **fletcher32**
and any plugin (blosc, zstd, ...), and **variable-length**, string,
compound, opaque and reference dtypes. Refused at construction
(``unreachable``): data in other files (external storage, a virtual
dataset's sources elsewhere; an external link, ``files.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.remote.hdf5lib import DONT_FILTER_PARTIAL_CHUNKS, chunk_opts

FILTER_DEFLATE, FILTER_SHUFFLE = 1, 2
_FILTER_NAMES = {3: "fletcher32", 4: "szip", 5: "nbit", 6: "scaleoffset", 32000: "lzf", 32001: "blosc",
                 32015: "zstd"}
LAYOUT_COMPACT, LAYOUT_CONTIGUOUS, LAYOUT_CHUNKED = 0, 1, 2
FILL_TIME_NEVER = 1  # h5py.h5d.FILL_TIME_NEVER


@dataclasses.dataclass
class Layout:
    """How one dataset is stored (picklable: no h5py object), and how rows come out of its bytes."""

    key: str
    shape: tuple
    dtype: np.dtype
    fill: Any
    kind: str  # "chunked", "contiguous", or "fallback"
    why: str = ""  # the reason for "fallback"
    chunks: tuple = ()
    filters: tuple = ()  # ((code, element size), ...) in the order they were applied when writing
    grid: Optional[np.ndarray] = None  # chunk grid cell (C order) -> row of addr/size/mask, -1: never written
    addr: Optional[np.ndarray] = None
    size: Optional[np.ndarray] = None
    mask: Optional[np.ndarray] = None
    offset: Optional[int] = None  # contiguous: the data's first byte (None: never written)
    raw_edges: bool = False  # partial edge chunks stored unfiltered (H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS)

    @property
    def fast(self) -> bool:
        return self.kind != "fallback"

    @property
    def stored_bytes(self) -> int:
        """Bytes the dataset's data takes in the file (what reading all of it fetches)."""
        if self.kind == "chunked":
            return int(self.size.sum())
        if self.kind == "contiguous" and self.offset is not None:
            return self.shape[0] * self._row_bytes()
        return 0

    @classmethod
    def of(cls, key: str, ds) -> "Layout":
        """The layout of the h5py dataset ``ds`` (one metadata read of its chunk index)."""
        dtype, shape = ds.dtype, tuple(ds.shape)
        try:
            fill = ds.fillvalue
        except Exception:  # noqa: BLE001 - undefined (H5Pset_fill_value(..., NULL)), or a dtype refused below
            fill = None
        dcpl = ds.id.get_create_plist()
        if dcpl.get_fill_time() == FILL_TIME_NEVER:  # HDF5 leaves what was never written as read: zeros in h5py
            fill = np.zeros((), dtype)[()]
        base = dict(key=key, shape=shape, dtype=dtype, fill=0 if fill is None else fill)  # chunks: zeros, as h5py
        why = _dtype_refused(ds)
        layout = dcpl.get_layout()
        if not why:
            if ds.is_virtual:  # its sources in this same file (``unreachable`` refuses the others)
                why = "a virtual dataset"
            elif layout == LAYOUT_COMPACT:
                why = "compact layout (stored in the object header)"
        filters = tuple(dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())) if layout == LAYOUT_CHUNKED else ()
        refused = [_FILTER_NAMES.get(code, f"filter {code}") for code, _, _ in filters
                   if code not in (FILTER_DEFLATE, FILTER_SHUFFLE)]
        if not why and refused:
            why = f"the {', '.join(refused)} filter"
        chunks = tuple(ds.chunks) if layout == LAYOUT_CHUNKED else ()
        raw_edges = False
        if not why and filters and any(n % c for n, c in zip(shape, chunks)):  # partial edge chunks: filtered?
            opts = chunk_opts(dcpl)
            if opts is None:
                why = "partial edge chunks that may be stored unfiltered (HDF5's chunk options could not be read)"
            raw_edges = bool(opts and opts & DONT_FILTER_PARTIAL_CHUNKS)
        if why:
            return cls(**base, kind="fallback", why=why)
        if layout == LAYOUT_CONTIGUOUS:
            # Never written: no storage. Not get_offset(), which in a file with a userblock gives the userblock's
            # last byte for an unallocated dataset, not None.
            offset = ds.id.get_offset() if ds.id.get_storage_size() else None
            if offset is None and fill is None:  # HDF5 refuses to read it: h5py's error, not made-up zeros
                return cls(**base, kind="fallback", why="never written and without a fill value")
            return cls(**base, kind="contiguous", offset=offset)
        steps = tuple((code, int(values[0]) if values else dtype.itemsize) for code, _, values in filters)
        grid_shape = tuple(math.ceil(n / c) for n, c in zip(shape, chunks))
        found: list = []
        if math.prod(shape):
            ds.id.chunk_iter(lambda info: found.append(info))
        if not found and fill is None and math.prod(shape):  # never written, no fill value: h5py's error
            return cls(**base, kind="fallback", why="never written and without a fill value")
        grid = np.full(math.prod(grid_shape), -1, np.int64)
        addr = np.empty(len(found), np.int64)
        size = np.empty(len(found), np.int64)
        mask = np.empty(len(found), np.uint32)
        for j, info in enumerate(found):
            cell = np.ravel_multi_index(tuple(o // c for o, c in zip(info.chunk_offset, chunks)), grid_shape)
            grid[cell], addr[j], size[j], mask[j] = j, info.byte_offset, info.size, info.filter_mask
        return cls(**base, kind="chunked", chunks=chunks, filters=steps, grid=grid, addr=addr, size=size, mask=mask,
                   raw_edges=raw_edges)

    # ---- planning: which byte ranges a set of row runs needs ---------------

    def _row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def _cells(self, runs: list) -> np.ndarray:
        """The chunk grid cells the runs of rows touch, sorted, without repeats."""
        c0 = self.chunks[0]
        inner = math.prod(math.ceil(n / c) for n, c in zip(self.shape[1:], self.chunks[1:]))
        rows = np.unique(np.concatenate([np.arange(a // c0, (b - 1) // c0 + 1) for a, b in runs]))
        return (rows[:, None] * inner + np.arange(inner)[None, :]).reshape(-1)

    def ranges(self, runs: list) -> list:
        """The byte ranges ``(start, end)`` the runs of rows ``[(a, b), ...]`` need (no repeats)."""
        if self.kind == "contiguous":
            if self.offset is None:
                return []
            rb = self._row_bytes()
            return sorted({(self.offset + a * rb, self.offset + b * rb) for a, b in runs if b > a})
        entries = self.grid[self._cells(runs)]
        entries = entries[entries >= 0]
        return sorted({(int(self.addr[e]), int(self.addr[e] + self.size[e])) for e in entries})

    # ---- decoding ------------------------------------------------------------

    def assemble(self, runs: list, fetched: dict) -> np.ndarray:
        """Rows of the runs, concatenated, from ``fetched[(start, end)] = bytes`` (``ranges``' ranges)."""
        n = sum(b - a for a, b in runs)
        out = np.empty((n, *self.shape[1:]), self.dtype)
        if self.kind == "contiguous":
            rb, pos = self._row_bytes(), 0
            for a, b in runs:
                if self.offset is None:
                    out[pos : pos + b - a] = self.fill
                else:
                    start = self.offset + a * rb
                    data = _within(fetched, start, start + (b - a) * rb)
                    out[pos : pos + b - a] = np.frombuffer(data, self.dtype).reshape(b - a, *self.shape[1:])
                pos += b - a
            return out
        decoded: dict = {}
        pos = 0
        for a, b in runs:
            self._fill_run(out[pos : pos + b - a], a, b, fetched, decoded)
            pos += b - a
        return out

    def _fill_run(self, dst: np.ndarray, a: int, b: int, fetched: dict, decoded: dict) -> None:
        chunks, shape = self.chunks, self.shape
        grid_shape = tuple(math.ceil(n / c) for n, c in zip(shape, chunks))
        for cell in self._cells([(a, b)]):
            coords = np.unravel_index(int(cell), grid_shape)
            origin = [int(i) * c for i, c in zip(coords, chunks)]
            lo, hi = max(a, origin[0]), min(b, origin[0] + chunks[0])
            where = (slice(lo - a, hi - a),) + tuple(
                slice(o, min(o + c, n)) for o, c, n in zip(origin[1:], chunks[1:], shape[1:])
            )
            entry = int(self.grid[cell])
            if entry < 0:
                dst[where] = self.fill
                continue
            chunk = decoded.get(entry)
            if chunk is None:
                raw = self.raw_edges and any(o + c > n for o, c, n in zip(origin, chunks, shape))
                chunk = decoded[entry] = self._decode(entry, fetched, raw)
            src = (slice(lo - origin[0], hi - origin[0]),) + tuple(slice(0, s.stop - s.start) for s in where[1:])
            dst[where] = chunk[src]

    def _decode(self, entry: int, fetched: dict, raw: bool = False) -> np.ndarray:
        """Chunk ``entry``, its filters undone (``raw``: a partial edge chunk stored unfiltered)."""
        start = int(self.addr[entry])
        data: Any = fetched[(start, start + int(self.size[entry]))]
        nbytes = math.prod(self.chunks) * self.dtype.itemsize
        skip = -1 if raw else int(self.mask[entry])  # the mask says 0 for those: every filter skipped
        for j in reversed(range(len(self.filters))):
            if skip & (1 << j):
                continue  # this filter was not applied to this chunk
            code, element = self.filters[j]
            data = _inflate(data, bufsize=nbytes) if code == FILTER_DEFLATE else unshuffle(data, element)
        if len(data) != nbytes:
            raise ValueError(f"chunk {entry} of dataset '{self.key}' decoded to {len(data)} bytes, expected {nbytes}")
        return np.frombuffer(data, self.dtype).reshape(self.chunks)


def _pick_inflate() -> Callable:
    """zlib-ng's inflate where installed (the ``remote`` extra: about 1.5x zlib's rate on gzip chunks,
    the same bytes), else zlib's; ``KERASFEED_INFLATE=zlib`` picks zlib's (to compare)."""
    if os.environ.get("KERASFEED_INFLATE", "") != "zlib":
        try:
            from zlib_ng import zlib_ng

            return zlib_ng.decompress
        except ImportError:
            pass
    return zlib.decompress


_inflate = _pick_inflate()


def _within(fetched: dict, start: int, end: int) -> Any:
    """Bytes ``[start, end)`` from the fetched ranges (the range itself, or one holding it: a kept dataset)."""
    data = fetched.get((start, end))
    if data is not None:
        return data
    for (s, e), data in fetched.items():
        if s <= start and end <= e:
            return memoryview(data)[start - s : end - s]
    raise KeyError((start, end))


def unshuffle(data: Any, element: int) -> bytes:
    """Undoes HDF5's shuffle filter: byte ``k`` of every element was stored together."""
    if element <= 1:
        return data
    raw = np.frombuffer(data, np.uint8)
    n = len(raw) // element
    body = raw[: n * element].reshape(element, n).T.tobytes()
    return body + raw[n * element :].tobytes()  # trailing bytes (not a whole element) are stored as they are


def unreachable(ds) -> str:
    """Why ``ds`` cannot be read through its file's URL at all, or ``""``: data kept in other files
    (a virtual dataset's sources, external storage) is named by a path HDF5 opens on this machine,
    where a file of that name is another file or none (a virtual dataset then reads as its fill value)."""
    dcpl = ds.id.get_create_plist()
    if ds.is_virtual:
        others = sorted({dcpl.get_virtual_filename(i) for i in range(dcpl.get_virtual_count())} - {"."})
        if others:
            return f"a virtual dataset whose sources are in other files ({', '.join(others[:3])})"
    elif dcpl.get_external_count():
        return f"external storage (its data in {dcpl.get_external(0)[0].decode(errors='replace')})"
    return ""


def _dtype_refused(ds) -> str:
    """Why the dtype keeps a dataset off the fast path ('' if it does not)."""
    import h5py

    dtype = ds.dtype
    if h5py.check_dtype(vlen=dtype) is not None:
        return f"a variable-length dtype ({dtype})"
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufc":
        return f"dtype {dtype} (only bool, integers, floats and complex take the fast path)"
    # The raw bytes are decoded as `dtype`: the stored type must be exactly its HDF5 type. h5py converts other
    # types on read (a 16-bit float with bfloat16's layout, a 24-bit float, an integer of 20 bits or at a bit
    # offset), which only its fallback decodes.
    if not ds.id.get_type().equal(h5py.h5t.py_create(dtype)):
        return f"a stored type that h5py converts to {dtype} on read (not {dtype}'s own layout)"
    return ""


# A request may read this share of its useful bytes in gaps between them (chunk-index nodes, other datasets'
# chunks), beyond `merge_gap`: bytes read stay within 1/16 of bytes needed.
WASTE = 1 / 16


def merge(ranges: list, gap: int, limit: int) -> list:
    """Sorted byte ranges merged into requests: ``[(start, end, [member ranges]), ...]``.

    Two ranges share a request when the bytes between them are at most
    ``gap``, or when the request's skipped bytes stay within ``WASTE`` of
    its useful ones; a request grows no larger than ``limit`` bytes (a single
    larger range stays whole here: ``pieces`` cuts it into requests).
    """
    out: list = []
    useful = waste = 0  # of the last request
    for start, end in sorted(set(ranges)):
        if out:
            first, last, members = out[-1]
            between = max(0, start - last)
            fits = max(end, last) - first <= limit
            if fits and (between <= gap or waste + between <= WASTE * (useful + end - start)):
                out[-1] = (first, max(last, end), members + [(start, end)])
                useful, waste = useful + end - start, waste + between
                continue
        out.append((start, end, [(start, end)]))
        useful, waste = end - start, 0
    return out


def pieces(start: int, end: int, limit: int) -> list:
    """``[start, end)`` cut into ``[(start, end), ...]`` of at most ``limit`` bytes each, of even sizes (sent
    concurrently, each within its own timeout: ``RemoteOptions.max_request``); one piece when it fits."""
    n = -(-(end - start) // limit)
    if n <= 1:
        return [(start, end)]
    step = -(-(end - start) // n)
    return [(s, min(s + step, end)) for s in range(start, end, step)]


def concat(arrays: list) -> np.ndarray:
    """The arrays end to end (one uncopied), in their dtype: numpy's would make big-endian rows native, and a
    batch's byte order would then depend on whether its rows came from one run of one file."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, dtype=arrays[0].dtype)


__all__ = ["WASTE", "Layout", "concat", "merge", "pieces", "unreachable", "unshuffle"]
