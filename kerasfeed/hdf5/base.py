"""``H5Base``: what the HDF5 sequences share (paths, keys, inspection, lazy per-process handles, seeded orders).

See the package docstring (``kerasfeed/hdf5/__init__.py``) for how files are opened.
"""

from __future__ import annotations

import bisect
import collections
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.errors import FileChangedError, short_repr
from kerasfeed.hdf5.handles import REGISTRY, check_not_written, written_stamp
from kerasfeed.hdf5.inspection import check_file
from kerasfeed.hdf5.keys import KeysLike, PathsLike, build_structure, check_paths, parse_keys
from kerasfeed.hdf5.local_files import LocalFiles
from kerasfeed.hdf5.options import H5Keywords, H5Options
from kerasfeed.remote.chunks import concat
from kerasfeed.remote.options import RemoteOptions
from kerasfeed.remote.urls import Credentials, check_url, has_scheme, options_per_scheme, protocol, redact
from kerasfeed.sources import stage
from kerasfeed.sources.sequence import SceneSequence

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Distinct streams of the seeded generators, so that the batch order, the
# sample order and the transform's randomness never share draws.
ORDER_STREAM, WINDOW_STREAM, TRANSFORM_STREAM = 0, 1, 2


# Loads a worker process runs at once for files in an object store (the threads executor keeps 64 in flight);
# 16 drained a 20 ms store at 403-453 batches/s on 2 workers and 2 cores, 8 at 347-374 (docs/remote.md).
REMOTE_WORKER_THREADS = 16

_CACHE_FIX = ("With cache=, shuffle the items in to_loader/to_dataset (shuffle=True there) and build the reader with "
              "shuffle=False (an unshuffled IndexOrder for H5RowSequence; no shuffle_window_chunks or transform)")


class H5Base(LocalFiles, SceneSequence):
    """Shared machinery: paths, keys, inspection, reads (local files' handles: ``LocalFiles``)."""

    # Shared keyword arguments a subclass does not take, with why (for the message).
    _REFUSED: Mapping[str, str] = {}
    # cache=: a seed drawn per run is not part of a kept cache's key (NOTE [ When a kept cache is stale ]); the
    # orders it seeds read `epoch`, which a stored stage may not (NOTE [ What a cached stage may not read ]).
    cache_ignores = ("seed",)

    def __init__(self, paths: PathsLike, keys: KeysLike, batch_size: int, **options: Unpack[H5Keywords]):
        """Args: ``paths``, ``keys``, ``batch_size`` and the ``H5Options`` keywords (checked there)."""
        cls = type(self).__name__
        opts = H5Options.build(cls, options, self._REFUSED)
        super().__init__(
            workers=opts.workers,
            use_multiprocessing=opts.use_multiprocessing,
            max_queue_size=opts.max_queue_size,
        )
        self._paths = check_paths(paths, cls)
        self._keys_structure, self._leaves = parse_keys(keys, cls)
        self.batch_size = _v.positive_int("batch_size", batch_size, owner=cls)
        self.shuffle = opts.shuffle
        self.drop_remainder = opts.drop_remainder
        self.swmr = opts.swmr
        # None: drawn once here, so that pickled copies in workers agree on every order.
        self.seed = opts.seed if opts.seed is not None else int(np.random.SeedSequence().entropy % (2**63))
        self._seed_drawn = opts.seed is None
        self.transform = opts.transform
        self._open_kwargs = dict(opts.open_kwargs or {})
        self._remote = self._remote_files(opts, cls)  # file index -> RemoteFile (filled by _inspect)
        self._max_open_files = opts.max_open_files  # not public: no part of a kept cache's key
        self._reset_handles()
        # lengths[f] = rows of file f; specs[key] = (trailing shape, dtype);
        # stamps[f] = (st_dev, st_ino) of the file inspected at that path; written[f] = its (size, mtime_ns).
        self._lengths, self._specs, self._chunk_rows, self._stamps, self._written = self._inspect()
        self._row_offsets = [0, *np.cumsum(self._lengths).tolist()]

    # ---- public ------------------------------------------------------------

    def kerasfeed_unshardable(self) -> Optional[str]:
        """Why each worker's own copy would not read disjoint shards (None: they would; ``sources.base``)."""
        if self._seed_drawn and (self.shuffle or getattr(self, "shuffle_window_chunks", None)):
            return ("it shuffles with a seed drawn when it was made, so every worker's copy orders its rows "
                    "differently and their shards overlap. Pass the same seed= on every worker. Received: seed=None")
        return None

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

    @property
    def worker_threads(self) -> Optional[int]:
        """Items one worker process makes at once: several when the files are in an object store (a call
        waits on the network and inflates chunks outside the GIL: NOTE [ A worker that makes several items
        at once ], ``execution/processes/worker_threads.py``); None (one) for local files, which h5py serialises."""
        return REMOTE_WORKER_THREADS if getattr(self, "_remote", None) else None

    def kerasfeed_settings(self) -> dict:
        """What decides the items besides the public attributes, for cache keys: the files' order, the keys,
        and the rows each file had at construction (a file a SWMR writer grew since keeps its size and mtime
        of now in ``kerasfeed_identity``, while the sequence reads the rows it saw)."""
        return {"paths": self._shown_paths(), "keys": repr(self._keys_structure), "rows": repr(self.file_lengths)}

    def kerasfeed_identity(self) -> dict:
        """What each file is now: ``{path or URL: identity}``, for caches keyed by the data they hold.

        A local file's identity is ``"size=...,mtime_ns=..."`` (``os.stat`` now); a remote object's is the
        version and size the sequence reads (``"etag=...,size=..."``; ``generation=`` on GCS), checked against
        the store's now, one request per object. A changed file has another identity. A URL is keyed without
        its query string (a presigned URL's signature is no name to keep in a cache's index); URLs that differ
        only there (``/get?f=a.h5``, ``/get?f=b.h5``) are keyed with their place in the list as well, and an
        object without an ETag or generation has a digest of its query in its identity.

        Raises:
            FileNotFoundError, PermissionError, OSError: a file is gone or cannot be read; the message names it.
            FileChangedError: an object was replaced since construction (the sequence reads the old version,
                partly from memory: its items are no data of the new one).
        """
        out = {}
        shown_as = {j: self._shown(j) for j in self._remote}  # redacted once: the loop below asks for twins
        twins = collections.Counter(shown_as.values())
        for j, path in enumerate(self._paths):
            if j in self._remote:
                rf = self._remote[j]
                now = rf.stat_now()
                if not rf.pin.same_version(now):
                    raise FileChangedError(
                        f"{type(self).__name__}: the object '{self._shown(j)}' was replaced after the sequence was "
                        f"built, which reads the version it inspected. Build a new sequence to read the new object. "
                        f"Received: {now.identity()} now, {rf.pin.identity()} at construction"
                    )
                shown = shown_as[j]
                out[shown if twins[shown] == 1 else f"{shown} (file {j})"] = rf.pin.keyed_identity(path)
                continue
            self._identity(path)  # FileNotFoundError naming the file
            out[path] = "size={},mtime_ns={}".format(*written_stamp(path))
        return out

    def close(self) -> None:
        """Releases this object's files in the current process: a file closes when the last sequence of the
        process sharing it (``FileRegistry``) releases it. A later read reopens it."""
        if getattr(self, "_h5_pid", None) != os.getpid():
            return  # state inherited through fork belongs to the parent
        for rf in getattr(self, "_remote", {}).values():
            rf.close()
        self._window_cache = {}
        for ident in self._h5.release_all():
            REGISTRY.release(ident)

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
        for name in ("_h5", "_h5_pid", "_window_cache"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_remote", {})  # pickled before URLs were read
        self.__dict__.setdefault("_written", [None] * len(self._paths))  # or before writes were checked
        self._reset_handles()

    def __repr__(self) -> str:
        files = self._shown(0) if len(self._paths) == 1 else f"{len(self._paths)} files"
        return (
            f"<{type(self).__name__} {files!s}, keys={short_repr(self._keys_structure, 200)}, "
            f"batch_size={self.batch_size}, batches={len(self)}>"
        )

    # ---- remote files ------------------------------------------------------

    def _shown(self, file_index: int) -> str:
        """The path of a file fit for messages (a URL without its query string: ``urls.redact``)."""
        path = self._paths[file_index]
        return redact(path) if file_index in self._remote else path

    def _shown_paths(self) -> list:
        return [self._shown(j) for j in range(len(self._paths))]

    def _remote_files(self, opts: H5Options, cls: str) -> dict:
        """A ``RemoteFile`` (not yet inspected) per URL among the paths; checks the remote arguments."""
        urls = {j: check_url(p, cls) for j, p in enumerate(self._paths) if has_scheme(p)}  # check_url refuses others
        if not urls:
            if opts.storage_options is not None:
                raise ValueError(
                    f"{cls}: `storage_options` apply to s3://, gs:// and http(s):// paths, and no path is one. "
                    f"Received: paths={list(self._paths)} and storage_options with keys {sorted(opts.storage_options)}"
                )
            return {}
        if opts.swmr:
            raise ValueError(f"{cls}: `swmr=True` reads files being appended to on this machine; a URL cannot be "
                             f"one. Received: swmr=True, path='{redact(self._paths[min(urls)])}'")
        from kerasfeed.remote.files import RemoteFile, pin_all

        per_scheme = options_per_scheme(opts.storage_options, {protocol(u) for u in urls.values()}, cls)
        credentials = {scheme: Credentials(o) for scheme, o in per_scheme.items()}
        remote_options = opts.remote_options or RemoteOptions()
        return pin_all({j: RemoteFile(url, credentials[protocol(url)], remote_options, cls, self._open_kwargs)
                        for j, url in urls.items()})

    def _read_many(self, parts: list, local=None) -> list:
        """``[(file index, key, [(a, b), ...]), ...]`` -> each part's rows, the runs concatenated.

        The remote parts go out together, in one wave (``remote.files.read_parts``);
        ``local(file index, key, runs)`` reads the others (default: ``_read_rows`` per run).
        """
        remote = [j for j, (f, _, _) in enumerate(parts) if f in self._remote]
        got = {}
        if remote:
            from kerasfeed.remote.files import read_parts

            got = dict(zip(remote, read_parts([(self._remote[parts[j][0]], *parts[j][1:]) for j in remote])))
        read = local or (lambda f, key, runs: concat([self._read_rows(f, key, a, b) for a, b in runs]))
        out = [got[j] if j in got else read(*part) for j, part in enumerate(parts)]
        # Once per local file, after all its reads: not written in place since construction (handles.py).
        for f, key, runs in {p[0]: p for p in parts if p[0] not in self._remote}.values():
            n, (a, b) = sum(y - x for x, y in runs), runs[0]
            rows = f"rows {a}:{b}" if len(runs) == 1 else f"{n} rows ({a}..{runs[-1][1] - 1})"
            check_not_written(self._paths[f], self._stamps[f], self._written[f], type(self).__name__,
                              f"{rows} of '{key}'")
        return out

    def _read_keys(self, parts: list, local=None) -> dict:
        """``[(file index, runs), ...]`` -> ``{key: [each part's rows]}``: every (key, part) read at once, so
        that the remote ones go out in one wave (``_read_many``)."""
        reads = self._read_many([(f, key, runs) for key in self._leaves for f, runs in parts], local)
        return {key: reads[k * len(parts) : (k + 1) * len(parts)] for k, key in enumerate(self._leaves)}

    def _inspect(self):
        """Opens each file briefly: checks keys and shapes, returns the layout."""
        lengths, specs, first_file, stamps, written = [], {}, {}, [], []
        chunk_rows: list = []
        for j, path in enumerate(self._paths):
            if j in self._remote:
                rf = self._remote[j]
                length = rf.inspect(lambda f: (self._leaves, check_file(
                    self, rf.name, f, lambda key: f[key], specs, first_file, chunk_rows)))
                lengths.append(length)
                stamps.append(("remote", rf.pin.identity()))
                written.append(None)
                continue
            ident, f = self._acquire(path)
            stamps.append(ident[1:3])
            written.append(None if self.swmr else written_stamp(path))  # SWMR: appended to while read
            try:
                lengths.append(check_file(
                    self, path, f, lambda key: REGISTRY.dataset(ident, key), specs, first_file, chunk_rows))
            finally:
                REGISTRY.release(ident)
        return np.asarray(lengths, dtype=np.int64), specs, (chunk_rows or [None])[0], stamps, written

    # ---- reading -----------------------------------------------------------

    def _read_rows(self, file_index: int, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of ``key`` in one file."""
        if file_index in self._remote:
            return self._read_many([(file_index, key, [(start, stop)])])[0]
        # Plain slicing takes h5py's fast path (read_direct costs ~10x more per call on small datasets).
        return self._read_local(file_index, key, f"rows {start}:{stop}", stop, stop - start,
                                lambda ds: ds[start:stop], raised=(FileNotFoundError, IsADirectoryError))

    def _read_global_rows(self, start: int, stop: int) -> dict:
        """Rows [start, stop) of the concatenated index space, for every key."""
        offsets = self._row_offsets
        # (file, its rows) of every file the range touches.
        parts, f, pos = [], bisect.bisect_right(offsets, start) - 1, start
        while pos < stop:
            f_stop = min(stop, offsets[f + 1])
            if f_stop > pos:
                parts.append((f, [(pos - offsets[f], f_stop - offsets[f])]))
            pos = f_stop
            f += 1
        return {key: concat(arrays) for key, arrays in self._read_keys(parts).items()}

    def _finish(self, index: int, arrays: dict) -> Any:
        batch = build_structure(self._keys_structure, arrays)
        if self.transform is not None:
            batch = self.transform(batch, self.rng(index))
        return batch

    @property
    def epoch(self) -> int:
        """The pass being read; refused inside the stage cache= stores, naming a fix a reader allows (no augment)."""
        refused = stage.refusal(f"{type(self).__name__}.epoch", remedy=_CACHE_FIX)
        if refused is not None:
            raise refused
        return getattr(self, "_kf_epoch", 0)

    def rng(self, index: int) -> np.random.Generator:
        """The generator passed to ``transform`` for batch ``index`` of this epoch: a pure function of
        ``(seed, epoch, index)``, the same in every process and on every run."""
        return np.random.default_rng([self.seed, self.epoch, TRANSFORM_STREAM, int(index)])

    def _check_index(self, index: Any) -> int:
        n, cls = len(self), type(self).__name__
        return _v.sequence_index(index, n, cls,
                                 lambda: f"{cls}: batch index {int(index)} is out of range for {n} batches.")

    def _batch_span(self, i: int, total: int) -> tuple:
        """Items ``[start, stop)`` (of ``total``) of batch ``i`` this epoch; with ``shuffle``, of the batch
        the epoch's order puts there."""
        b = int(self._batch_order(len(self))[i]) if self.shuffle else i
        start = b * self.batch_size
        return start, min(start + self.batch_size, total)

    def _batch_order(self, n: int) -> np.ndarray:
        """The permutation of ``n`` batches (or windows) of this epoch."""
        cached = getattr(self, "_order_cache", None)
        epoch = self.epoch
        if cached is not None and cached[0] == (epoch, n):
            return cached[1]
        order = np.random.default_rng([self.seed, epoch, ORDER_STREAM]).permutation(n)
        self._order_cache = ((epoch, n), order)  # one tuple: safe to swap under threads
        return order


__all__ = ["H5Base", "FileChangedError", "ORDER_STREAM", "WINDOW_STREAM", "TRANSFORM_STREAM"]
