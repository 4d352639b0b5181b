"""``RemoteFile``: one HDF5 object in a store, as an HDF5 reader holds it; ``read_parts``: a batch's reads at once.

A ``RemoteFile`` is made at construction: it reads the object's size and
version (a missing object or refused credentials fail there, naming the
URL), opens the file once through h5py for the reader's checks, and keeps
each key's ``Layout``. It pickles with the layouts, the version and the
public options (``urls.Credentials``), so a worker process or Ray actor
reads chunks at once, with no metadata request; only datasets off the
fast path open the file through h5py again, once per process.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from kerasfeed.errors import FileChangedError
from kerasfeed.hdf5.remote.chunks import Layout, merge, unreachable
from kerasfeed.hdf5.remote.fetch import STORES, ObjectStat, Store, gather_ranges, run
from kerasfeed.hdf5.remote.h5file import collector_held, fetch_error, open_h5
from kerasfeed.hdf5.remote.options import RemoteOptions
from kerasfeed.hdf5.remote.urls import Credentials, redact


class RemoteFile:
    """An HDF5 file at a URL, pinned to the version seen at construction.

    Args:
        url: ``s3://``, ``gs://`` or ``http(s)://`` URL of the object.
        credentials: the reader's ``storage_options``.
        options: the reader's ``RemoteOptions``.
        owner: the public class, for messages.
        open_kwargs: ``h5py.File`` arguments for the h5py opens.
    """

    def __init__(self, url: str, credentials: Credentials, options: RemoteOptions, owner: str, open_kwargs: dict):
        self.url, self.credentials, self.options, self.owner = url, credentials, options, owner
        self.open_kwargs = dict(open_kwargs)
        self.layouts: dict = {}
        self.pin: Optional[ObjectStat] = None
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._h5 = None  # this process's h5py file, for datasets off the fast path
        self._datasets: dict = {}
        self.kept: dict = {}  # key -> {(start, end): bytes}: small datasets fetched whole in this process

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_lock", "_h5", "_datasets", "kept"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def name(self) -> str:
        """The URL fit for messages (``urls.redact``)."""
        return redact(self.url)

    def store(self) -> Store:
        return STORES.get(self.url, self.credentials, self.options, self.owner)

    def stat_now(self) -> ObjectStat:
        """The object's size and version as the store reports them now (one request)."""
        return run(self.store().stat)

    # ---- construction --------------------------------------------------------

    def inspect(self, check) -> Any:
        """Pins the version, opens the file through h5py and returns ``check(h5py.File)``.

        ``check`` returns the keys to describe (``Layout.of``) with the
        result it wants back: ``(keys, result)``.
        """
        self.pin = self.stat_now()
        with collector_held():
            try:
                f, raw = open_h5(self.store(), self.pin, self.options.block_size, self.open_kwargs)
            except (OSError, ValueError) as e:
                if isinstance(e, (FileNotFoundError, PermissionError, TimeoutError, FileChangedError)):
                    raise
                raise OSError(
                    f"{self.owner}: object '{self.name}' could not be opened as HDF5 (not an HDF5 file, or "
                    f"truncated): {type(e).__name__}: {e}"
                ) from e
            try:
                keys, result = check(f)
                for key in keys:
                    why = unreachable(f[key])
                    if why:
                        raise ValueError(
                            f"{self.owner}: key '{key}' of '{self.name}' is {why}: through a URL those paths "
                            "are not the store's objects. Read it from a local copy of every file, or store "
                            f"the data in the file itself. Received: key='{key}', path='{self.name}'"
                        )
                    self.layouts[key] = Layout.of(key, f[key])
            except Exception as e:
                cause = fetch_error(raw, e)
                if cause is e:
                    raise
                raise cause from None
            finally:
                f.close()
        return result

    # ---- reading -------------------------------------------------------------

    def read_fallback(self, key: str, runs: list) -> np.ndarray:
        """Rows of the runs through h5py (datasets off the fast path), one call at a time in this process."""
        with self._lock, collector_held():
            ds = self._datasets.get(key)
            if ds is None:
                if self._h5 is None:
                    self._h5 = open_h5(self.store(), self.pin, self.options.block_size, self.open_kwargs)
                ds = self._datasets[key] = self._h5[0][key]
            try:
                parts = [ds[a:b] for a, b in runs]
            except Exception as e:
                cause = fetch_error(self._h5[1], e)
                if cause is e:
                    raise
                raise cause from None
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        """Closes this process's h5py file of the object, if any (a later read reopens it)."""
        with self._lock:
            h5, self._h5, self._datasets = self._h5, None, {}
        if h5 is not None:
            with collector_held():
                try:
                    h5[0].close()
                except Exception:  # noqa: BLE001 - closing during interpreter shutdown, say
                    pass


def read_parts(parts: list) -> list:
    """``[(RemoteFile, key, [(a, b), ...]), ...]`` -> the rows of each part's runs, concatenated.

    Every byte range of every fast-path part (across files and keys) goes
    out in one wave (``fetch.run``): per file, ranges are merged
    (``RemoteOptions.merge_gap``/``max_request``) and fetched concurrently;
    the chunks are then decoded on this thread. A small dataset
    (``RemoteOptions.small_dataset``) is fetched whole the first time and
    kept by the ``RemoteFile`` in this process. Parts off the fast path are
    read through h5py after.
    """
    wanted: dict = {}  # id(file) -> (file, set of byte ranges)
    plans, keep = [], []
    for rf, key, runs in parts:
        layout = rf.layouts[key]
        if not layout.fast:
            plans.append(None)
            continue
        if key in rf.kept:
            plans.append(())
            continue
        if layout.stored_bytes <= rf.options.small_dataset:  # fetched whole once, then kept
            ranges = layout.ranges([(0, layout.shape[0])])
            keep.append((rf, key, ranges))
        else:
            ranges = layout.ranges(runs)
        wanted.setdefault(id(rf), (rf, set()))[1].update(ranges)
        plans.append(ranges)
    requests, members = [], []
    for rf, ranges in wanted.values():
        store = rf.store()
        for start, end, inside in merge(list(ranges), rf.options.merge_gap, rf.options.max_request):
            requests.append((store, start, end, rf.pin))
            members.append((rf, start, inside))
    got = run(gather_ranges, requests) if requests else []
    fetched: dict = {}  # id(file) -> {(start, end): bytes}
    for (rf, start, inside), data in zip(members, got):
        view = memoryview(data)
        table = fetched.setdefault(id(rf), {})
        for s, e in inside:
            table[(s, e)] = view[s - start : e - start]
    for rf, key, ranges in keep:
        table = fetched.get(id(rf), {})
        rf.kept[key] = {r: bytes(table[r]) for r in ranges}  # a copy: the response it came in can go
    out = []
    for (rf, key, runs), plan in zip(parts, plans):
        if plan is None:
            out.append(rf.read_fallback(key, runs))
            continue
        try:
            out.append(rf.layouts[key].assemble(runs, rf.kept[key] if plan == () else fetched.get(id(rf), {})))
        except (ValueError, Exception) as e:
            raise OSError(
                f"{rf.owner}: decoding rows {runs[0][0]}..{runs[-1][1]} of dataset '{key}' in '{rf.name}' "
                f"failed: {type(e).__name__}: {e}"
            ) from e
    return out


__all__ = ["RemoteFile", "read_parts", "RemoteOptions"]
