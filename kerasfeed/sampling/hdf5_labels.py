"""The labels ``BalancedOrder.from_hdf5`` reads: one HDF5 label dataset per file, local or at a URL (through
the readers' own requests: ``remote/``), read once and concatenated; never the items."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import numpy as np

from kerasfeed._urls import is_url, options_per_scheme, protocol, redact

OWNER = "BalancedOrder.from_hdf5"


def read_labels(paths: Any, key: str, storage_options: Optional[Mapping], remote_options: Any,
                swmr: bool = False) -> np.ndarray:
    """The labels of dataset ``key`` in ``paths`` (one file, or files concatenated in order), one per row.

    Raises:
        ValueError, TypeError: no paths, paths of another kind, a file without ``key`` or not one label per row.
        FileNotFoundError, PermissionError, TimeoutError, OSError: a file or URL that could not be read (named).
    """
    given = paths
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(_paths(paths))
    if not paths:
        raise ValueError(f"{OWNER}: `paths` is empty: no file to read labels from. Received: paths={given!r}")
    parts = [_read_labels(path, key, storage_options, remote_options, swmr) for path in paths]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _paths(paths: Any) -> list:
    bad = "an open h5py file" if hasattr(paths, "filename") else None
    if bad is None:
        try:
            paths = list(paths)
        except TypeError:
            bad = type(paths).__name__
    bad = bad or next((type(p).__name__ for p in paths if not isinstance(p, (str, os.PathLike))), None)
    if bad is not None:
        raise TypeError(f"{OWNER}: `paths` must be a file's path or URL, or a sequence of them (for an "
                        f"open h5py.File, its .filename). Received: {bad}")
    return paths


def _read_labels(path: Any, key: str, storage_options: Optional[Mapping], remote_options: Any,
                 swmr: bool = False) -> np.ndarray:
    """The labels of one file, a local path or a URL (through the readers' own requests: remote)."""
    import h5py  # lazily: `import kerasfeed` stays light

    if not is_url(path):
        try:
            f = h5py.File(path, "r", **({"swmr": True} if swmr else {}))
        except OSError as e:  # h5py's own names no file
            raise type(e)(
                f"{OWNER}: file '{os.fspath(path)}' could not be opened as HDF5 (missing, corrupt or "
                "truncated; held open for writing by another process: by a SWMR writer, pass swmr=True): "
                f"{type(e).__name__}: {e}. Received: paths item '{os.fspath(path)}'"
            ) from e
        with f:
            return _labels_in(f, path, key)
    from kerasfeed.remote.files import RemoteFile
    from kerasfeed.remote.options import RemoteOptions
    from kerasfeed.remote.urls import Credentials, check_url

    kind = protocol(path)  # storage_options as the readers take them
    options = options_per_scheme(storage_options, {kind}, OWNER)[kind]
    remote_options = RemoteOptions() if remote_options is None else RemoteOptions.build(remote_options, OWNER)
    remote = RemoteFile(check_url(path, OWNER), Credentials(options), remote_options, OWNER, {})
    try:
        return remote.inspect(lambda f: ((), _labels_in(f, path, key)))
    finally:
        remote.close()


def _labels_in(f: Any, path: Any, key: str) -> np.ndarray:
    ds = f.get(key)
    shown = redact(path) if is_url(path) else os.fspath(path)
    if ds is None or not hasattr(ds, "shape"):
        raise ValueError(f"{OWNER}: file '{shown}' has no dataset {key!r}. Received: key={key!r}")
    if not (ds.ndim == 1 or (ds.ndim == 2 and ds.shape[1] == 1)):
        raise ValueError(
            f"{OWNER}: dataset {key!r} in '{shown}' must hold one label per row, "
            f"shape (N,) or (N, 1). Received: shape={ds.shape}"
        )
    import h5py

    string = h5py.check_string_dtype(ds.dtype)
    # HDF5 strings read back as bytes: as str they are the labels written (class_weights={"cat": ...}, and
    # the fingerprint of the same labels held in memory).
    return (ds.asstr(string.encoding)[()] if string is not None else ds[()]).reshape(-1)


__all__ = ["read_labels"]
