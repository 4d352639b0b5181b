"""HDF5 sources: contiguous row slices, time windows, and PointNet-style block sampling.

Three public classes:

- ``H5SliceSequence``: batch ``i`` is a contiguous slice of rows (axis 0) of
  one or more HDF5 datasets; several files form one index space.
- ``H5WindowSequence``: each sample is a window of ``window`` consecutive
  rows (time steps) of a dataset, windows start every ``stride`` rows.
- ``ScenePointSampler``: a ``transform`` for ``H5SliceSequence`` that cuts
  each scene into blocks on the ground plane and samples a fixed number of
  points per block (PointNet's training recipe), with per-point labels.

How files are opened (why it matters: docs/field_notes.md, *h5py lock*):
  h5py serialises every call in a process behind one lock and its handles
  must not cross a fork or pickling. These sequences therefore open their
  files lazily, in the process that reads, on the first read there, and
  remember that process id. Pickling drops the handles (the copy reopens on
  its first read); a forked child sees a different pid and opens its own
  handles, leaving the inherited ones untouched. The constructor opens each
  file briefly to check keys and shapes and closes it again. Within a
  process, sequences reading the same file share one handle per file and
  dataset (see ``_FileRegistry`` for why). ``close()``, a ``with`` block and
  garbage collection release it; the file closes when no sequence of the
  process uses it any more, and a later read simply reopens it. h5py's lock
  serialises threads, so parallel reads come from worker processes
  (``to_dataset(seq, executor="processes")`` or ``model.fit`` with
  ``use_multiprocessing=True``), not from threads.

Files that grow while training (SWMR):
  The sequence takes a snapshot of every dataset's length at construction:
  ``len(seq)`` is fixed, as Keras and tf.data require within an epoch, and
  rows appended later are not read. To read a file that another process is
  appending to, the writer must use HDF5's single-writer/multiple-reader
  mode (``h5py.File(..., "a", libver="latest")`` then
  ``f.swmr_mode = True``, and ``flush()`` after appending) and the reader
  must pass ``swmr=True``, which opens files with ``swmr=True``: the rows of
  the snapshot then read correctly while the writer appends. Without SWMR,
  HDF5 gives no guarantee: opening fails while a writer holds the file
  ("file is already open for write" or "unable to lock file"), and a file
  changed under an open reader may read inconsistent metadata. To train on
  the new rows, build a new sequence (cheap: it only reads shapes), e.g.
  once per epoch; in one process both share handles, which HDF5 needs to
  read appended chunks correctly (see ``_FileRegistry``).
"""

from __future__ import annotations

import bisect
import math
import os
import pathlib
import threading
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.sources.sequence import SceneSequence

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
KeysLike = Union[str, Sequence[Any], Mapping[str, Any]]

# Distinct streams of the seeded generators, so that the batch order, the
# sample order and the transform's randomness never share draws.
_ORDER_STREAM, _WINDOW_STREAM, _TRANSFORM_STREAM = 0, 1, 2


class _H5Base(SceneSequence):
    """Shared machinery: paths, keys, inspection, lazy per-process handles."""

    def __init__(
        self,
        paths: PathsLike,
        keys: KeysLike,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: Optional[int] = None,
        drop_remainder: bool = False,
        transform: Optional[Callable[[Any, np.random.Generator], Any]] = None,
        swmr: bool = False,
        open_kwargs: Optional[Mapping[str, Any]] = None,
        workers: int = 1,
        use_multiprocessing: bool = False,
        max_queue_size: int = 10,
    ):
        super().__init__(
            workers=workers,
            use_multiprocessing=use_multiprocessing,
            max_queue_size=max_queue_size,
        )
        cls = type(self).__name__
        self._paths = _check_paths(paths, cls)
        self._keys_structure, self._leaves = _parse_keys(keys, cls)
        self.batch_size = _v.positive_int("batch_size", batch_size, owner=cls)
        self.shuffle = _v.flag("shuffle", shuffle, owner=cls)
        self.drop_remainder = _v.flag("drop_remainder", drop_remainder, owner=cls)
        self.swmr = _v.flag("swmr", swmr, owner=cls)
        seed = _v.seed("seed", seed, owner=cls)
        if seed is None:
            # Drawn once here, so pickled copies in workers agree on every order.
            seed = int(np.random.SeedSequence().entropy % (2**63))
        self.seed = seed
        if transform is not None and not callable(transform):
            raise TypeError(
                f"{cls}: `transform` must be a callable `transform(batch, rng)` or None. "
                f"Received: transform={transform!r}"
            )
        self.transform = transform
        if open_kwargs is not None and not isinstance(open_kwargs, Mapping):
            raise TypeError(f"{cls}: `open_kwargs` must be a dict or None. Received: open_kwargs={open_kwargs!r}")
        self._open_kwargs = dict(open_kwargs or {})
        for reserved in ("name", "mode", "swmr"):
            if reserved in self._open_kwargs:
                raise ValueError(
                    f"{cls}: `open_kwargs` may not set {reserved!r}: files are opened read-only "
                    f"(use `swmr=` for SWMR). Received: open_kwargs={dict(open_kwargs)!r}"
                )
        self._reset_handles()
        # lengths[f] = rows of file f; specs[key] = (trailing shape, dtype).
        self._lengths, self._specs, self._chunk_rows = self._inspect()
        self._row_offsets = [0, *np.cumsum(self._lengths).tolist()]

    # ---- public ------------------------------------------------------------

    @property
    def paths(self) -> tuple:
        """The files, in index order."""
        return self._paths

    @property
    def keys(self) -> Any:
        """The output structure of dataset names, as given."""
        return self._keys_structure

    @property
    def file_lengths(self) -> tuple:
        """Rows (axis 0) of each file, as seen at construction."""
        return tuple(int(n) for n in self._lengths)

    @property
    def num_rows(self) -> int:
        """Total rows over all files."""
        return self._row_offsets[-1]

    def close(self) -> None:
        """Releases this object's files in the current process.

        Handles are shared by every sequence of the process that reads the
        same file (see ``_FileRegistry``); a file closes when the last of
        them releases it. A later read reopens it.
        """
        if getattr(self, "_h5_pid", None) != os.getpid():
            return  # state inherited through fork belongs to the parent
        with self._h5_lock:
            held, self._h5_held, self._h5_datasets = self._h5_held, {}, {}
            self._window_cache = {}
        for ident in held.values():
            _REGISTRY.release(ident)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - during interpreter shutdown, say
            pass

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_h5_held", "_h5_datasets", "_h5_lock", "_h5_pid", "_window_cache"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_handles()

    def __repr__(self) -> str:
        files = self._paths[0] if len(self._paths) == 1 else f"{len(self._paths)} files"
        return (
            f"<{type(self).__name__} {files!s}, keys={self._keys_structure!r}, "
            f"batch_size={self.batch_size}, batches={len(self)}>"
        )

    # ---- handles -----------------------------------------------------------

    def _reset_handles(self) -> None:
        self._h5_held = {}  # file index -> registry identity
        self._h5_datasets = {}  # (file index, key) -> h5py.Dataset
        self._h5_lock = threading.Lock()
        self._h5_pid = os.getpid()
        self._window_cache = {}

    def _check_process(self) -> None:
        if self._h5_pid != os.getpid():
            # A forked child: forget the parent's handles without closing them
            # (docs/field_notes.md, *h5py lock*); the lock may have been held by a
            # parent thread.
            self._reset_handles()

    def _identity(self, path: str) -> tuple:
        return (os.path.realpath(path), self.swmr, repr(sorted(self._open_kwargs.items())))

    def _dataset(self, file_index: int, key: str):
        self._check_process()
        ds = self._h5_datasets.get((file_index, key))
        if ds is not None:
            return ds
        with self._h5_lock:
            ident = self._h5_held.get(file_index)
            if ident is None:
                ident = self._identity(self._paths[file_index])
                _REGISTRY.acquire(ident, lambda: self._open(self._paths[file_index]))
                self._h5_held[file_index] = ident
            ds = self._h5_datasets[(file_index, key)] = _REGISTRY.dataset(ident, key)
            return ds

    def _open(self, path: str):
        import h5py  # lazily: `import kerasfeed` and light workers skip it

        cls = type(self).__name__
        p = pathlib.Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{cls}: HDF5 file not found. Received: path='{path}'")
        if p.is_dir():
            raise IsADirectoryError(
                f"{cls}: expected an HDF5 file but got a directory. Received: path='{path}'"
            )
        try:
            return h5py.File(path, "r", swmr=self.swmr, **self._open_kwargs)
        except Exception as e:
            try:
                is_hdf5 = h5py.is_hdf5(path)
            except Exception:  # noqa: BLE001 - only refines the message of the error raised below
                is_hdf5 = False
            what = (
                "could not be opened as HDF5 (corrupt or truncated, held open for writing "
                "by another process without SWMR, or not written for SWMR while swmr=True)"
                if is_hdf5
                else "is not an HDF5 file (no HDF5 signature)"
            )
            raise OSError(f"{cls}: file '{path}' {what}: {type(e).__name__}: {e}") from e

    def _inspect(self):
        """Opens each file briefly: checks keys and shapes, returns the layout."""
        cls = type(self).__name__
        lengths, specs, first_file, chunk_rows = [], {}, {}, None
        for path in self._paths:
            ident = self._identity(path)
            f = _REGISTRY.acquire(ident, lambda: self._open(path))
            try:
                shapes = {}
                for key in self._leaves:
                    ds = f.get(key)
                    if ds is None or not hasattr(ds, "shape"):
                        kind = "no dataset" if ds is None else "a group, not a dataset, at"
                        raise ValueError(
                            f"{cls}: file '{path}' has {kind} key '{key}'. "
                            f"Datasets in the file: {_list_datasets(f)}. Received: keys={self._keys_structure!r}"
                        )
                    ds = _REGISTRY.dataset(ident, key)
                    if self.swmr:
                        ds.refresh()
                    if ds.ndim == 0:
                        raise ValueError(
                            f"{cls}: dataset '{key}' in file '{path}' is a scalar; rows need at least "
                            f"one axis. Received: shape={ds.shape}"
                        )
                    shapes[key] = ds.shape
                    spec = (tuple(ds.shape[1:]), ds.dtype)
                    if key not in specs:
                        specs[key], first_file[key] = spec, path
                    elif specs[key] != spec:
                        raise ValueError(
                            f"{cls}: dataset '{key}' differs between files: '{first_file[key]}' has rows "
                            f"of shape {specs[key][0]} and dtype {specs[key][1]}, but '{path}' has "
                            f"rows of shape {spec[0]} and dtype {spec[1]}."
                        )
                    if chunk_rows is None:
                        chunk_rows = ds.chunks[0] if ds.chunks else None
                lens = {key: s[0] for key, s in shapes.items()}
                if len(set(lens.values())) > 1:
                    detail = ", ".join(f"'{k}': {n}" for k, n in lens.items())
                    raise ValueError(
                        f"{cls}: the datasets in file '{path}' have different lengths along "
                        f"axis 0; every key must have the same number of rows. Received: {detail}"
                    )
                lengths.append(next(iter(lens.values())))
            finally:
                _REGISTRY.release(ident)
        return np.asarray(lengths, dtype=np.int64), specs, chunk_rows

    # ---- reading -----------------------------------------------------------

    def _read_rows(self, file_index: int, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of ``key`` in one file."""
        try:
            ds = self._dataset(file_index, key)
            if self.swmr and stop > ds.shape[0]:
                ds.refresh()  # rows appended since this process last looked
            # Plain slicing takes h5py's fast path (read_direct costs ~10x more
            # per call on small datasets).
            return ds[start:stop]
        except (FileNotFoundError, IsADirectoryError):
            raise
        except Exception as e:
            raise OSError(
                f"{type(self).__name__}: reading rows {start}:{stop} of dataset '{key}' in file "
                f"'{self._paths[file_index]}' failed: {type(e).__name__}: {e}"
            ) from e

    def _read_global_rows(self, start: int, stop: int) -> dict:
        """Rows [start, stop) of the concatenated index space, for every key."""
        offsets = self._row_offsets
        # (file, first row, stop row) of every file the range touches.
        parts = []
        f = bisect.bisect_right(offsets, start) - 1
        pos = start
        while pos < stop:
            f_stop = min(stop, offsets[f + 1])
            if f_stop > pos:
                parts.append((f, pos - offsets[f], f_stop - offsets[f]))
            pos = f_stop
            f += 1
        out = {}
        for key in self._leaves:
            arrays = [self._read_rows(f, key, a, b) for f, a, b in parts]
            out[key] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return out

    def _finish(self, index: int, arrays: dict) -> Any:
        batch = _build(self._keys_structure, arrays)
        if self.transform is not None:
            batch = self.transform(batch, self.rng(index))
        return batch

    def rng(self, index: int) -> np.random.Generator:
        """The generator passed to ``transform`` for batch ``index`` of this epoch.

        A pure function of ``(seed, epoch, index)``: the same in every
        process and on every run.
        """
        return np.random.default_rng([self.seed, self.epoch, _TRANSFORM_STREAM, int(index)])

    def _check_index(self, index: Any) -> int:
        n = len(self)
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(
                f"{type(self).__name__} indices must be integers. Received: index={index!r}"
            )
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(
                f"{type(self).__name__}: batch index {int(index)} is out of range for {n} batches."
            )
        return i

    def _batch_order(self, n: int) -> np.ndarray:
        """The permutation of ``n`` batches (or windows) of this epoch."""
        cached = getattr(self, "_order_cache", None)
        epoch = self.epoch
        if cached is not None and cached[0] == (epoch, n):
            return cached[1]
        order = np.random.default_rng([self.seed, epoch, _ORDER_STREAM]).permutation(n)
        self._order_cache = ((epoch, n), order)  # one tuple: safe to swap under threads
        return order


class H5SliceSequence(_H5Base):
    """Batches of contiguous rows of HDF5 datasets, for ``model.fit`` and ``to_dataset``.

    Batch ``i`` holds rows ``[i * batch_size, (i + 1) * batch_size)`` of every
    dataset named in ``keys``. Several files are concatenated into one index
    space in the order given (a batch may straddle two files); within one
    file all keys must have the same number of rows, and a key must have the
    same row shape and dtype in every file.

    The output structure follows ``keys``: a dataset name gives an array, a
    tuple or list gives a tuple (``("points", "labels")`` -> ``(x, y)``), a
    dict ``{output_name: dataset_name}`` gives a dict, and these nest
    (``({"points": "points"}, "labels")``).

    Shuffling, all of it a pure function of ``(seed, epoch)`` so that every
    worker and every run agrees:

    - ``shuffle=True`` permutes the batch order each epoch. Reads stay
      contiguous (fast with chunked, compressed files), but the same rows
      always travel together.
    - ``shuffle_window_chunks=k`` also shuffles samples: rows are grouped into
      windows of ``k`` HDF5 chunks (rounded up to whole batches), and each
      epoch every window's rows are permuted and cut into batches; with
      ``shuffle=True`` the window order is permuted too (the last window,
      if partial, stays last). A window is read whole, with whole chunks, and
      kept in a small per-process cache, so the batches of one window cost
      about one read. The trade-off: samples only mix within a window (a
      bigger window mixes more), each process holds up to two windows in
      memory, and processes that read batches of the same window each read
      the whole window (up to ``workers`` times the I/O and decompression).

    The epoch is ``self.epoch``: ``to_dataset`` sets it in every process;
    under ``model.fit(seq)`` it advances at every epoch end.

    Args:
        paths: one HDF5 file or a sequence of files.
        keys: dataset names, as described above.
        batch_size: rows per batch.
        shuffle: permute the batch (or window) order every epoch.
        seed: seed of every shuffle and of ``transform``'s generator; None
            draws one at construction.
        drop_remainder: drop the last batch if it is short.
        transform: optional ``transform(batch, rng) -> batch`` applied to
            every batch, with ``rng`` a ``numpy.random.Generator`` seeded by
            ``(seed, epoch, index)`` (see ``rng``).
        shuffle_window_chunks: shuffle samples within windows of this many
            chunks (see above); None reads plain contiguous batches.
        swmr: open files in SWMR read mode (see the module docs).
        open_kwargs: extra ``h5py.File`` arguments, e.g. ``rdcc_nbytes``.
        workers, use_multiprocessing, max_queue_size: passed to
            ``keras.utils.PyDataset`` for ``model.fit(seq)``.

    Raises:
        FileNotFoundError, IsADirectoryError, OSError: a path is missing, a
            directory, or not a readable HDF5 file.
        ValueError: a key is missing or not a dataset, lengths differ, or
            arguments are invalid. Messages name the file and the key.

    Example:

    ```python
    import kerasfeed
    from kerasfeed.datasets import make_synthetic_scenes

    path = make_synthetic_scenes("/tmp/scenes.h5", num_scenes=256)
    seq = kerasfeed.H5SliceSequence(path, ("points", "labels"), batch_size=16,
                                    shuffle=True, seed=0)
    x, y = seq[0]          # (16, 1024, 6) float32, (16,) int64
    model.fit(seq, epochs=2)
    model.fit(kerasfeed.to_dataset(seq, executor="processes"), epochs=2)
    ```
    """

    def __init__(
        self,
        paths: PathsLike,
        keys: KeysLike,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: Optional[int] = None,
        drop_remainder: bool = False,
        transform: Optional[Callable[[Any, np.random.Generator], Any]] = None,
        shuffle_window_chunks: Optional[int] = None,
        swmr: bool = False,
        open_kwargs: Optional[Mapping[str, Any]] = None,
        workers: int = 1,
        use_multiprocessing: bool = False,
        max_queue_size: int = 10,
    ):
        super().__init__(
            paths, keys, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
            transform=transform, swmr=swmr, open_kwargs=open_kwargs, workers=workers,
            use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size,
        )
        cls = type(self).__name__
        n = self.num_rows
        if shuffle_window_chunks is not None:
            k = _v.positive_int("shuffle_window_chunks", shuffle_window_chunks, owner=cls)
            chunk = self._chunk_rows or self.batch_size  # contiguous layout: no chunks
            self.window_rows = math.ceil(k * chunk / self.batch_size) * self.batch_size
        else:
            self.window_rows = None
        self.shuffle_window_chunks = shuffle_window_chunks
        self._len = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        if self._len == 0:
            raise ValueError(
                f"{cls}: no batches: the files hold {n} rows in total, fewer than batch_size="
                f"{self.batch_size} with drop_remainder=True. Received: paths={list(self._paths)}"
            )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        if self.window_rows is None:
            b = int(self._batch_order(self._len)[i]) if self.shuffle else i
            start = b * self.batch_size
            arrays = self._read_global_rows(start, min(start + self.batch_size, self.num_rows))
        else:
            arrays = self._windowed_batch(i)
        return self._finish(i, arrays)

    def batch_rows(self, index: int) -> np.ndarray:
        """The global row numbers that batch ``index`` of this epoch holds, in order."""
        i = self._check_index(index)
        if self.window_rows is None:
            b = int(self._batch_order(self._len)[i]) if self.shuffle else i
            start = b * self.batch_size
            return np.arange(start, min(start + self.batch_size, self.num_rows))
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
        perm = np.random.default_rng([self.seed, self.epoch, _WINDOW_STREAM, w]).permutation(
            rows_in_window
        )
        return w, perm[j * bs : (j + 1) * bs]

    def _windowed_batch(self, i: int) -> dict:
        w, rows = self._window_plan(i)
        self._check_process()  # a forked child starts with an empty cache
        with self._h5_lock:
            cached = self._window_cache.get(w)
        if cached is None:
            start = w * self.window_rows
            cached = self._read_global_rows(start, min(start + self.window_rows, self.num_rows))
            with self._h5_lock:
                self._window_cache[w] = cached
                while len(self._window_cache) > 2:  # keep the two most recent
                    self._window_cache.pop(next(iter(self._window_cache)))
        return {key: arr[rows] for key, arr in cached.items()}


class H5WindowSequence(_H5Base):
    """Batches of time windows over axis 0 of HDF5 datasets (sequence data).

    Axis 0 of every dataset in ``keys`` is time. A sample is ``window``
    consecutive rows starting at ``0, stride, 2 * stride, ...`` in each file;
    windows never cross a file boundary (each file is one recording), and a
    file shorter than ``window`` contributes none. All keys are windowed the
    same way, so a batch of a key shaped ``(T, *f)`` is ``(batch_size,
    window, *f)``. A batch of consecutive windows is read as one contiguous
    slice and cut in memory. To derive per-window targets (the next value,
    the last label), use ``transform``.

    ``shuffle=True`` permutes the batch order per epoch (seeded by
    ``(seed, epoch)``); samples within a batch stay consecutive windows.

    Args:
        paths: one HDF5 file or a sequence of files.
        keys: dataset names (a name, tuple/list, dict, or a nest of them).
        batch_size: windows per batch.
        window: rows (time steps) per window.
        stride: rows between the starts of consecutive windows.
        shuffle, seed, drop_remainder, transform, swmr, open_kwargs,
        workers, use_multiprocessing, max_queue_size: as for
            ``H5SliceSequence``.

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
        shuffle: bool = False,
        seed: Optional[int] = None,
        drop_remainder: bool = False,
        transform: Optional[Callable[[Any, np.random.Generator], Any]] = None,
        swmr: bool = False,
        open_kwargs: Optional[Mapping[str, Any]] = None,
        workers: int = 1,
        use_multiprocessing: bool = False,
        max_queue_size: int = 10,
    ):
        cls = type(self).__name__
        self.window = _v.positive_int("window", window, owner=cls)
        self.stride = _v.positive_int("stride", stride, owner=cls)
        super().__init__(
            paths, keys, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder,
            transform=transform, swmr=swmr, open_kwargs=open_kwargs, workers=workers,
            use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size,
        )
        counts = np.maximum(0, (self._lengths - self.window) // self.stride + 1)
        counts[self._lengths < self.window] = 0
        self._window_counts = counts
        self._window_offsets = np.concatenate([[0], np.cumsum(counts)])
        self.num_windows = int(counts.sum())
        n = self.num_windows
        self._len = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        if self._len == 0:
            raise ValueError(
                f"{cls}: no batches: the files have {self.file_lengths} rows, giving {n} windows of "
                f"window={self.window}, stride={self.stride}; batch_size={self.batch_size}, "
                f"drop_remainder={self.drop_remainder}. Received: paths={list(self._paths)}"
            )

    def __len__(self) -> int:
        return self._len

    def window_starts(self, index: int) -> list:
        """``(file_index, start_row)`` of each window of batch ``index`` this epoch."""
        s0, s1 = self._sample_range(self._check_index(index))
        out = []
        for s in range(s0, s1):
            f = int(np.searchsorted(self._window_offsets, s, side="right")) - 1
            out.append((f, int(s - self._window_offsets[f]) * self.stride))
        return out

    def _sample_range(self, i: int):
        b = int(self._batch_order(self._len)[i]) if self.shuffle else i
        s0 = b * self.batch_size
        return s0, min(s0 + self.batch_size, self.num_windows)

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        s0, s1 = self._sample_range(i)
        offsets = self._window_offsets
        out = {}
        for key in self._leaves:
            trailing, dtype = self._specs[key]
            arr = np.empty((s1 - s0, self.window, *trailing), dtype=dtype)
            s = s0
            f = int(np.searchsorted(offsets, s, side="right")) - 1
            while s < s1:
                f_stop = min(s1, int(offsets[f + 1]))
                if f_stop > s:
                    first = int(s - offsets[f]) * self.stride
                    last = int(f_stop - 1 - offsets[f]) * self.stride
                    rows = self._read_rows(f, key, first, last + self.window)
                    # (n, *trailing, window) view -> (n, window, *trailing) copy
                    view = np.lib.stride_tricks.sliding_window_view(rows, self.window, axis=0)
                    arr[s - s0 : f_stop - s0] = np.moveaxis(view[:: self.stride], -1, 1)
                s = f_stop
                f += 1
            out[key] = arr
        return self._finish(i, out)


class ScenePointSampler:
    """A ``transform`` that samples ``num_points`` points per block of each scene.

    PointNet's recipe for large scenes: cut each scene into square blocks
    on the ground (x, y) plane and train on a fixed number of points per
    block. Use it as ``H5SliceSequence(..., keys=("points", "point_labels"),
    transform=ScenePointSampler(...))``: each batch of scenes becomes
    ``(x, y)`` with ``x`` of shape ``(blocks, num_points, channels)`` and
    ``y`` the per-point labels ``(blocks, num_points)``. The sampling uses
    the sequence's generator, so it is a pure function of ``(seed, epoch,
    index)``: reproducible, and different every epoch.

    Blocks lie on a grid of ``block_size`` metres starting at each scene's
    minimum x and y, with origins every ``stride`` metres (``stride <
    block_size`` overlaps them). Blocks with fewer than ``min_block_points``
    points are skipped. A block with at least ``num_points`` points is
    sampled without replacement, a smaller one with replacement.

    Args:
        num_points: points sampled per block.
        block_size: block side in the units of x, y.
        stride: distance between block origins; defaults to ``block_size``.
        blocks_per_scene: if set, sample exactly this many blocks per scene
            (without replacement when there are enough), so every batch has
            ``scenes * blocks_per_scene`` blocks, a fixed shape that
            ``tf.data`` and XLA prefer; None keeps every block (the number
            varies by scene).
        min_block_points: minimum points for a block to count.
        center: subtract each block's centre from x and y (channels 0 and 1)
            so the model sees positions relative to the block.

    Example:

    ```python
    seq = kerasfeed.H5SliceSequence(
        "scenes.h5", ("points", "point_labels"), batch_size=2, seed=0,
        transform=kerasfeed.ScenePointSampler(num_points=256, block_size=1.0,
                                              blocks_per_scene=8))
    x, y = seq[0]  # (16, 256, 6) float32, (16, 256) int32
    ```
    """

    def __init__(
        self,
        num_points: int,
        *,
        block_size: float = 1.0,
        stride: Optional[float] = None,
        blocks_per_scene: Optional[int] = None,
        min_block_points: int = 1,
        center: bool = True,
    ):
        cls = type(self).__name__
        self.num_points = _v.positive_int("num_points", num_points, owner=cls)
        self.block_size = _v.positive_float("block_size", block_size, owner=cls)
        self.stride = self.block_size if stride is None else _v.positive_float("stride", stride, owner=cls)
        self.blocks_per_scene = (
            None if blocks_per_scene is None else _v.positive_int("blocks_per_scene", blocks_per_scene, owner=cls)
        )
        self.min_block_points = _v.positive_int("min_block_points", min_block_points, owner=cls)
        self.center = bool(center)

    def blocks(self, xy: np.ndarray) -> list:
        """The blocks of one scene.

        Args:
            xy: ``(P, 2)`` x and y of the scene's points.

        Returns:
            A list of ``(point_indices, (centre_x, centre_y))``, one per block
            with at least ``min_block_points`` points.
        """
        lo, hi = xy.min(axis=0), xy.max(axis=0)
        masks = []
        for axis in (0, 1):
            extent = float(hi[axis] - lo[axis])
            count = 1 if extent <= self.block_size else math.ceil((extent - self.block_size) / self.stride) + 1
            v = xy[:, axis]
            axis_masks = []
            for k in range(count):
                a = lo[axis] + k * self.stride
                # Half-open blocks; the last one also takes the scene's edge.
                upper = v <= a + self.block_size if k == count - 1 else v < a + self.block_size
                axis_masks.append(((v >= a) & upper, a + self.block_size / 2))
            masks.append(axis_masks)
        out = []
        for mx, cx in masks[0]:
            for my, cy in masks[1]:
                idx = np.flatnonzero(mx & my)
                if idx.size >= self.min_block_points:
                    out.append((idx, (cx, cy)))
        return out

    def __call__(self, batch: Any, rng: np.random.Generator):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                "ScenePointSampler expects batches (points, point_labels), e.g. from "
                "keys=('points', 'point_labels'). Received: a batch of type "
                f"{type(batch).__name__}"
            )
        points, labels = (np.asarray(a) for a in batch)
        if points.ndim != 3 or points.shape[-1] < 2 or labels.shape != points.shape[:2]:
            raise ValueError(
                "ScenePointSampler expects points (scenes, points, channels>=2) and point_labels "
                f"(scenes, points). Received: points.shape={points.shape}, "
                f"point_labels.shape={labels.shape}"
            )
        xs, ys = [], []
        for s in range(points.shape[0]):
            blocks = self.blocks(points[s, :, :2])
            if not blocks:
                raise ValueError(
                    f"ScenePointSampler: scene {s} of the batch has no block with at least "
                    f"min_block_points={self.min_block_points} points. Received: "
                    f"{points.shape[1]} points"
                )
            if self.blocks_per_scene is not None:
                pick = rng.choice(
                    len(blocks), self.blocks_per_scene, replace=len(blocks) < self.blocks_per_scene
                )
                blocks = [blocks[k] for k in pick]
            for idx, (cx, cy) in blocks:
                take = idx[rng.choice(idx.size, self.num_points, replace=idx.size < self.num_points)]
                x = points[s, take].astype(np.float32, copy=True)
                if self.center:
                    x[:, 0] -= cx
                    x[:, 1] -= cy
                xs.append(x)
                ys.append(labels[s, take])
        return np.stack(xs), np.stack(ys)

    def __repr__(self) -> str:
        return (
            f"ScenePointSampler(num_points={self.num_points}, block_size={self.block_size}, "
            f"stride={self.stride}, blocks_per_scene={self.blocks_per_scene})"
        )


class _FileRegistry:
    """The h5py handles of one process: one File and one Dataset per file and key.

    Why shared: HDF5 shares one internal state per file within a process, and
    with SWMR a second open of a file that is being appended to can read
    stale chunk locations, i.e. wrong data, silently (seen with HDF5 1.14).
    One handle per file and dataset, refreshed when a read goes past the
    rows it knows, avoids that; it also keeps one file descriptor and one
    chunk cache per file however many sequences (train/validation splits)
    read it. Entries are reference-counted by the sequences holding them.
    """

    def __init__(self):
        self._reset()

    def _reset(self):
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._entries: dict = {}  # identity -> [h5py.File, refcount, {key: Dataset}]

    def _check_process(self):
        if self._pid != os.getpid():
            # Forked: keep the parent's handles referenced so that the child
            # never closes (or otherwise touches) them.
            _INHERITED.append(self._entries)
            self._reset()

    def acquire(self, ident, opener):
        self._check_process()
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None:
                entry = self._entries[ident] = [opener(), 0, {}]
            entry[1] += 1
            return entry[0]

    def dataset(self, ident, key):
        with self._lock:
            entry = self._entries[ident]
            ds = entry[2].get(key)
            if ds is None:
                ds = entry[2][key] = entry[0][key]
            return ds

    def release(self, ident):
        self._check_process()
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._entries[ident]
        try:
            entry[0].close()
        except Exception:  # noqa: BLE001 - closing during interpreter shutdown, say
            pass

    def open_count(self) -> int:
        """Files this process holds open (for tests and debugging)."""
        self._check_process()
        with self._lock:
            return len(self._entries)


_INHERITED: list = []
_REGISTRY = _FileRegistry()


def _check_paths(paths, cls) -> tuple:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if isinstance(paths, (bytes, Mapping)) or not isinstance(paths, Sequence) or not len(paths):
        raise ValueError(
            f"{cls}: `paths` must be a path or a non-empty sequence of paths. Received: paths={paths!r}"
        )
    out = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"{cls}: every path must be a str or os.PathLike. Received: {p!r} in paths")
        out.append(os.fspath(p))
    return tuple(out)


def _parse_keys(keys, cls):
    """Validates a nest of dataset names; returns (structure, unique leaves)."""
    leaves: list = []

    def walk(node, where):
        if isinstance(node, str):
            if not node:
                raise ValueError(f"{cls}: dataset names must be non-empty. Received: keys{where}={node!r}")
            if node not in leaves:
                leaves.append(node)
            return node
        if isinstance(node, Mapping):
            if not node:
                raise ValueError(f"{cls}: `keys` has an empty dict at keys{where}. Received: keys={keys!r}")
            return {k: walk(v, f"{where}[{k!r}]") for k, v in node.items()}
        if isinstance(node, (tuple, list)):
            if not node:
                raise ValueError(f"{cls}: `keys` has an empty sequence at keys{where}. Received: keys={keys!r}")
            return tuple(walk(v, f"{where}[{j}]") for j, v in enumerate(node))
        raise TypeError(
            f"{cls}: `keys` must be a dataset name, a tuple/list or a dict of them; found "
            f"{type(node).__name__} at keys{where}. Received: keys={keys!r}"
        )

    structure = walk(keys, "")
    return structure, tuple(leaves)


def _build(structure, arrays):
    if isinstance(structure, str):
        return arrays[structure]
    if isinstance(structure, dict):
        return {k: _build(v, arrays) for k, v in structure.items()}
    return tuple(_build(v, arrays) for v in structure)


def _list_datasets(f, limit: int = 20) -> list:
    names: list = []

    def visit(name, obj):
        if hasattr(obj, "shape"):
            names.append(name)
        return None if len(names) < limit else True

    f.visititems(visit)
    return names

