"""``H5SliceSequence``: batch ``i`` is a contiguous slice of rows of one or more HDF5 datasets."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.hdf5.base import WINDOW_STREAM, H5Base
from kerasfeed.hdf5.keys import KeysLike, PathsLike
from kerasfeed.hdf5.options import H5Keywords

if TYPE_CHECKING:
    from typing_extensions import Unpack


class H5SliceSequence(H5Base):
    """Batches of contiguous rows of HDF5 datasets, for ``model.fit`` and ``to_dataset``.

    Batch ``i`` holds rows ``[i * batch_size, (i + 1) * batch_size)`` of every dataset named in ``keys``.
    Several files form one index space, in the order given (a batch may straddle two files); within a
    file all keys must have the same number of rows, and a key must have the same row shape and dtype in
    every file.

    The output structure follows ``keys``: a dataset name gives an array, a tuple or list a tuple
    (``("points", "labels")`` -> ``(x, y)``), a dict ``{output_name: dataset_name}`` a dict, and these
    nest (``({"points": "points"}, "labels")``).

    Shuffling, all of it a pure function of ``(seed, epoch)`` so that every worker and every run agrees:

    - ``shuffle=True`` permutes the batch order each epoch. Reads stay contiguous (fast with chunked,
      compressed files), but the same rows always travel together.
    - ``shuffle_window_chunks=k`` also shuffles samples: rows are grouped into windows of ``k`` HDF5
      chunks (rounded up to whole batches), and each epoch every window's rows are permuted and cut into
      batches; with ``shuffle=True`` the window order is permuted too (a partial last window stays last).
      A window is read whole, with whole chunks, and kept in a small per-process cache, so the batches of
      one window cost about one read. The trade-off: samples only mix within a window (a bigger window
      mixes more), each process holds up to two windows in memory, and processes that read batches of
      the same window each read all of it (up to ``workers`` times the I/O and decompression).

    The epoch is ``self.epoch``: ``to_dataset`` sets it in every process; under ``model.fit(seq)`` it
    advances at every epoch end.

    Args:
        paths: one HDF5 file or a sequence of files.
        keys: dataset names, as described above.
        batch_size: rows per batch.
        shuffle: permute the batch (or window) order every epoch.
        seed: seed of every shuffle and of ``transform``'s generator; None draws one at construction.
        drop_remainder: drop the last batch if it is short.
        transform: optional ``transform(batch, rng) -> batch`` applied to every batch, with ``rng`` a
            ``numpy.random.Generator`` seeded by ``(seed, epoch, index)`` (see ``rng``).
        shuffle_window_chunks: shuffle samples within windows of this many chunks (see above); None reads
            plain contiguous batches.
        swmr: open files in SWMR read mode (see the package docs, ``kerasfeed.hdf5``).
        open_kwargs: extra ``h5py.File`` arguments, e.g. ``rdcc_nbytes``.
        storage_options, remote_options: for paths in object stores (``H5Options``, docs/remote.md).
        workers, use_multiprocessing, max_queue_size: passed to ``keras.utils.PyDataset`` for
            ``model.fit(seq)``.

    Raises:
        FileNotFoundError, IsADirectoryError, OSError: a path is missing, a directory, or not a readable
            HDF5 file.
        ValueError: a key is missing or not a dataset, lengths differ, or arguments are invalid. Messages
            name the file and the key.

    Example:

    ```python
    import kerasfeed
    from kerasfeed.datasets import make_synthetic_scenes

    path = make_synthetic_scenes("/tmp/scenes.h5", num_scenes=256)
    seq = kerasfeed.H5SliceSequence(path, ("points", "labels"), batch_size=16,
                                    shuffle=True, seed=0)
    x, y = seq[0]          # (16, 1024, 6) float32, (16,) int64
    model.fit(seq, epochs=2)
    model.fit(kerasfeed.to_dataset(seq, executor="processes"), epochs=2, shuffle=False)
    ```
    """

    def __init__(
        self,
        paths: PathsLike,
        keys: KeysLike,
        batch_size: int,
        *,
        shuffle_window_chunks: Optional[int] = None,
        **options: Unpack[H5Keywords],
    ):
        super().__init__(paths, keys, batch_size, **options)
        cls = type(self).__name__
        n = self.num_rows
        self.window_rows = None
        if shuffle_window_chunks is not None:
            k = _v.positive_int("shuffle_window_chunks", shuffle_window_chunks, owner=cls)
            chunk = self._chunk_rows or self.batch_size  # contiguous layout: no chunks
            self.window_rows = math.ceil(k * chunk / self.batch_size) * self.batch_size
        self.shuffle_window_chunks = shuffle_window_chunks
        self._len = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        if self._len == 0:
            why = (
                f"the datasets {list(self._leaves)} have 0 rows in every file"
                if n == 0
                else f"the files hold {n} rows in total, fewer than batch_size={self.batch_size} "
                "with drop_remainder=True"
            )
            raise ValueError(
                f"{cls}: no batches: {why}. Received: paths={self._shown_paths()}, rows per file={self.file_lengths}"
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        if self.window_rows is None:
            arrays = self._read_global_rows(*self._batch_span(i, self.num_rows))
        else:
            arrays = self._windowed_batch(i)
        return self._finish(i, arrays)

    def batch_rows(self, index: int) -> np.ndarray:
        """The global row numbers that batch ``index`` of this epoch holds, in order."""
        i = self._check_index(index)
        if self.window_rows is None:
            return np.arange(*self._batch_span(i, self.num_rows))
        w, rows = self._window_plan(i)
        return w * self.window_rows + rows

    # Sample shuffling within windows ------------------------------------------

    def _window_plan(self, i: int):
        """(window, row positions within it) of batch ``i`` this epoch."""
        n, wr, bs = self.num_rows, self.window_rows, self.batch_size
        per_window = wr // bs
        num_windows = math.ceil(n / wr)
        full = n // wr  # windows with wr rows; a partial one stays last
        slot, j = divmod(i, per_window)
        if self.shuffle and full > 0:
            w = int(self._batch_order(full)[slot]) if slot < full else slot
        else:
            w = slot
        assert w < num_windows
        rows_in_window = min(wr, n - w * wr)
        perm = np.random.default_rng([self.seed, self.epoch, WINDOW_STREAM, w]).permutation(rows_in_window)
        return w, perm[j * bs : (j + 1) * bs]

    def _windowed_batch(self, i: int) -> dict:
        w, rows = self._window_plan(i)
        self._check_process()  # a forked child starts with an empty cache
        with self._h5.lock:
            cached = self._window_cache.get(w)
        if cached is None:
            start = w * self.window_rows
            cached = self._read_global_rows(start, min(start + self.window_rows, self.num_rows))
            with self._h5.lock:
                self._window_cache[w] = cached
                while len(self._window_cache) > 2:  # keep the two most recent
                    self._window_cache.pop(next(iter(self._window_cache)))
        return {key: arr[rows] for key, arr in cached.items()}


__all__ = ["H5SliceSequence"]
