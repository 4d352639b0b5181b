"""Labels to classes: class codes, counts and the items grouped by class, in bounded memory (TF-free).

What ``BalancedOrder`` holds is the items grouped by class (``members``: 4 bytes per item, 8 past 2^31
items) and one offset per class; building it must not cost more. Integer labels over a range below
65,536 (class ids, whatever their dtype) are encoded by counting, a chunk of labels at a time; items are
grouped by a stable counting sort, a chunk at a time, when there are at most 256 classes. Beyond that,
``numpy.unique`` and a stable ``argsort`` (temporaries of 8 bytes per item).
"""

from __future__ import annotations

import numpy as np

# Labels handled per step of the chunked passes (temporaries of ~8 bytes each).
CHUNK = 1 << 22


def missing_labels(labels: np.ndarray) -> np.ndarray:
    """Where ``labels`` holds no label: NaN (floats) or None (objects); one chunk at a time."""
    if labels.dtype.kind in "fc":
        test = np.isnan
    elif labels.dtype.kind == "O":
        def test(chunk):
            return np.array([x is None or x != x for x in chunk], dtype=bool)  # x != x: NaN
    else:
        return np.empty(0, dtype=np.int64)
    found = [np.flatnonzero(test(labels[s : s + CHUNK])) + s for s in range(0, len(labels), CHUNK)]
    return np.concatenate(found)


def encode_labels(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(classes, codes, counts)``: sorted classes, per-item class numbers in the smallest unsigned dtype,
    items per class (int64)."""
    if labels.dtype.kind == "b":
        classes, codes, counts = _encode_by_counting(labels.view(np.uint8), 0, 1)
        return classes.astype(bool), codes, counts
    if labels.dtype.kind in "iu":
        lo, hi = int(labels.min()), int(labels.max())
        if hi - lo < 65536:
            return _encode_by_counting(labels, lo, hi)
    classes, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    small = np.uint8 if len(classes) <= 256 else np.uint16 if len(classes) <= 65536 else np.int32
    return classes, codes.reshape(-1).astype(small, copy=False), counts.astype(np.int64)


def _encode_by_counting(labels: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = hi - lo + 1
    counts_all = np.zeros(width, dtype=np.int64)
    for start in range(0, len(labels), CHUNK):
        counts_all += np.bincount(_shifted(labels[start : start + CHUNK], lo), minlength=width)
    present = np.flatnonzero(counts_all)
    small = np.uint8 if len(present) <= 256 else np.uint16
    lut = np.zeros(width, dtype=small)
    lut[present] = np.arange(len(present), dtype=small)
    codes = np.empty(len(labels), dtype=small)
    for start in range(0, len(labels), CHUNK):
        codes[start : start + CHUNK] = lut[_shifted(labels[start : start + CHUNK], lo)]
    unsigned = _unsigned(labels.dtype)
    classes = (present.astype(unsigned) + unsigned.type(lo % 2 ** (8 * unsigned.itemsize))).view(labels.dtype)
    return classes, codes, counts_all[present]


def _unsigned(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def _shifted(chunk: np.ndarray, lo: int) -> np.ndarray:
    # ``chunk - lo`` in the labels' own width, wrapping: exact, as every difference is in [0, 65536)
    # (int64 arithmetic overflowed on uint64 labels of 2^63 or more).
    unsigned = _unsigned(chunk.dtype)
    return (chunk.view(unsigned) - unsigned.type(lo % 2 ** (8 * unsigned.itemsize))).astype(np.uint16)


def group_by_class(codes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The items grouped by class, ascending within each class: class ``c``'s items are
    ``members[offsets[c]:offsets[c + 1]]`` (offsets: cumulated ``counts``). int32 below 2^31 items, else int64."""
    n = len(codes)
    dtype = np.int32 if n < 2**31 else np.int64
    if len(counts) > 256:
        return np.argsort(codes, kind="stable").astype(dtype, copy=False)
    members = np.empty(n, dtype=dtype)
    fill = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # next free slot per class
    for start in range(0, n, CHUNK):
        block = codes[start : start + CHUNK]
        order = np.argsort(block, kind="stable")  # a counting (radix) sort for small codes
        per_class = np.bincount(block, minlength=len(counts))
        taken = 0
        for c in np.flatnonzero(per_class).tolist():
            k = int(per_class[c])
            members[fill[c] : fill[c] + k] = order[taken : taken + k] + start
            fill[c] += k
            taken += k
    return members


__all__ = ["encode_labels", "group_by_class"]
