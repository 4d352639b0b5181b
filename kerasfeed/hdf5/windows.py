"""``H5WindowSequence``: samples are windows of consecutive rows (time steps) of HDF5 datasets."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.hdf5.base import H5Base
from kerasfeed.hdf5.keys import KeysLike, PathsLike
from kerasfeed.hdf5.options import H5Keywords

if TYPE_CHECKING:
    from typing_extensions import Unpack


class H5WindowSequence(H5Base):
    """Batches of time windows over axis 0 of HDF5 datasets (sequence data).

    Axis 0 of every dataset in ``keys`` is time. A sample is ``window`` consecutive rows starting at
    ``0, stride, 2 * stride, ...`` in each file; windows never cross a file boundary (each file is one
    recording), and a file shorter than ``window`` contributes none. All keys are windowed the same way:
    a batch of a key shaped ``(T, *f)`` is ``(batch_size, window, *f)``. A batch of consecutive windows
    is read as one contiguous slice and cut in memory (windows over twice their length apart: one read
    each, not the rows between them). To derive per-window targets (the next value, the
    last label), use ``transform``.

    ``shuffle=True`` permutes the batch order per epoch (seeded by ``(seed, epoch)``); samples within a
    batch stay consecutive windows.

    Args:
        paths: one HDF5 file or a sequence of files.
        keys: dataset names (a name, tuple/list, dict, or a nest of them).
        batch_size: windows per batch.
        window: rows (time steps) per window.
        stride: rows between the starts of consecutive windows.
        shuffle, seed, drop_remainder, transform, swmr, open_kwargs, workers, use_multiprocessing,
            max_queue_size: as for ``H5SliceSequence``.

    Example:

    ```python
    # "signal": (T, 3) float32, "label": (T,) int64 in each file
    seq = kerasfeed.H5WindowSequence(
        ["day1.h5", "day2.h5"], ("signal", "label"), batch_size=32,
        window=100, stride=10,
        transform=lambda b, rng: (b[0], b[1][:, -1]))  # label at the window end
    x, y = seq[0]  # (32, 100, 3), (32,)
    ```
    """

    def __init__(
        self,
        paths: PathsLike,
        keys: KeysLike,
        batch_size: int,
        *,
        window: int,
        stride: int = 1,
        **options: Unpack[H5Keywords],
    ):
        cls = type(self).__name__
        self.window = _v.positive_int("window", window, owner=cls)
        self.stride = _v.positive_int("stride", stride, owner=cls)
        super().__init__(paths, keys, batch_size, **options)
        counts = np.maximum(0, (self._lengths - self.window) // self.stride + 1)  # 0 for a file < window
        self._window_offsets = np.concatenate([[0], np.cumsum(counts)])
        self.num_windows = n = int(counts.sum())
        self._len = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        if self._len == 0:
            raise ValueError(
                f"{cls}: no batches: the files have {self.file_lengths} rows, giving {n} windows of "
                f"window={self.window}, stride={self.stride}; batch_size={self.batch_size}, "
                f"drop_remainder={self.drop_remainder}. Received: paths={self._shown_paths()}"
            )

    def __len__(self) -> int:
        return self._len

    def window_starts(self, index: int) -> list:
        """``(file_index, start_row)`` of each window of batch ``index`` this epoch."""
        s0, s1 = self._batch_span(self._check_index(index), self.num_windows)
        out = []
        for s in range(s0, s1):
            f = int(np.searchsorted(self._window_offsets, s, side="right")) - 1
            out.append((f, int(s - self._window_offsets[f]) * self.stride))
        return out

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        s0, s1 = self._batch_span(i, self.num_windows)
        offsets = self._window_offsets
        # (file, first window, stop window, first row, stop row) of every file the batch touches.
        spans = []
        s = s0
        f = int(np.searchsorted(offsets, s, side="right")) - 1
        while s < s1:
            f_stop = min(s1, int(offsets[f + 1]))
            if f_stop > s:
                first = int(s - offsets[f]) * self.stride
                last = int(f_stop - 1 - offsets[f]) * self.stride
                spans.append((f, s, f_stop, first, last + self.window))
            s = f_stop
            f += 1
        # Windows far apart (stride > 2 * window) are read one run each: the span between them would read
        # up to stride / window times the rows kept (stride 1e5: 22,000 times).
        apart = self.stride > 2 * self.window
        step = self.window if apart else self.stride  # between window starts in the rows read
        parts = [(f, [(a + j * self.stride, a + j * self.stride + self.window) for j in range(w1 - w0)] if apart
                  else [(a, b)]) for f, w0, w1, a, b in spans]
        out = {}
        for key, reads in self._read_keys(parts).items():
            trailing, dtype = self._specs[key]
            arr = np.empty((s1 - s0, self.window, *trailing), dtype=dtype)
            for (f, w0, w1, _, _), rows in zip(spans, reads):
                # Row k of window j is rows[j * step + k], gathered straight into the batch. Not a
                # sliding_window_view: its as_strided cannot rebuild a dtype carrying h5py's metadata
                # (a compound with a fixed-length string field).
                picks = np.arange(w1 - w0)[:, None] * step + np.arange(self.window)
                np.take(rows, picks, axis=0, out=arr[w0 - s0 : w1 - s0], mode="clip")  # in range: unbuffered
            out[key] = arr
        return self._finish(i, out)


__all__ = ["H5WindowSequence"]
