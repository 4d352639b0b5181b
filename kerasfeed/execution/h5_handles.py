"""Open h5py handles in a source travel to worker processes: each worker reopens them read-only, lazily.

NOTE [ HDF5 handles travel to workers ]
=======================================

``self.f = h5py.File(path, "r")`` in ``__init__`` is the most common HDF5
habit, and h5py objects cannot be pickled. The pickler that sends the source
(``pickling.py``) reduces every h5py ``File``, ``Group`` and ``Dataset`` it
meets with ``reduce``; what travels, how a worker reopens it and what is
refused: docs/your_sequence.md, *HDF5 handles*. Beyond that page:

- the file's stamp (``(st_dev, st_ino)``, plus size and mtime unless opened
  for SWMR reading) comes from ``fstat`` of the parent's descriptor where the
  driver has one; the parent's handles are only read (name, mode, property
  lists): they stay open and usable;
- a worker unpickles a ``LazyH5`` proxy and keeps one ``File`` per file and
  open arguments, shared by its proxies (HDF5 keeps one state per file in a
  process: see ``kerasfeed/hdf5/handles.py``); a file changed since raises
  ``FileChangedError`` (an ``OSError``, as the HDF5 readers raise);
- a handle open for writing reads back as mode ``'r+'`` (``w``, ``a``, ``r+``
  alike); anonymous objects are refused too; a refusal is a ``TypeError``
  that ``pickling`` turns into the message naming the attribute (a file replaced on disk since the
  handle opened it: ``FileChangedError``, which ``state_sync`` raises as such between passes).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Optional

from kerasfeed.errors import FileChangedError

_DRIVERS = ("sec2", "stdio", "core")  # a plain file on disk that a worker can reopen


def is_h5(obj: Any) -> bool:
    h5py = sys.modules.get("h5py")
    return h5py is not None and isinstance(obj, (h5py.Group, h5py.Dataset))


def _stamp(fid: Any, filename: str, swmr: bool, driver: str) -> tuple:
    st = os.stat(filename)
    if driver == "sec2":
        try:
            opened = os.fstat(fid.get_vfd_handle())
        except (OSError, ValueError, TypeError):
            opened = st
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise FileChangedError(
                f"the HDF5 file '{filename}' was replaced on disk after this handle opened it: a worker would "
                "open the new file at that path, not the one this process reads"
            )
        st = opened
    return (st.st_dev, st.st_ino) if swmr else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _open_kwargs(fid: Any, swmr: bool, libver: Any) -> dict:
    kwargs: dict = {"swmr": swmr, "libver": tuple(libver) if libver else None}
    try:
        fapl = fid.get_access_plist()
        _, kwargs["rdcc_nslots"], kwargs["rdcc_nbytes"], kwargs["rdcc_w0"] = fapl.get_cache()
        use, ignore_when_disabled = fapl.get_file_locking()
        kwargs["locking"] = False if not use else ("best-effort" if ignore_when_disabled else True)
    except Exception:  # noqa: BLE001 - an older h5py/HDF5: its defaults
        pass
    return kwargs


def reduce(obj: Any) -> Optional[tuple]:
    """The pickler's reduction of an h5py object, ``(LazyH5, (kind, filename, path, stamp, open kwargs))``; None
    for anything else; TypeError says why one cannot travel."""
    if not is_h5(obj):
        return None
    h5py = sys.modules["h5py"]
    kind = "File" if isinstance(obj, h5py.File) else "Dataset" if isinstance(obj, h5py.Dataset) else "Group"
    if not obj:
        raise TypeError(f"a closed h5py {kind}: workers cannot reopen it (its file name is gone)")
    f = obj.file
    name, mode, driver = f.filename, f.mode, f.driver
    what = f"an h5py {kind} of '{name}'"
    if mode != "r":
        raise TypeError(
            f"{what} is open for writing (mode '{mode}'): workers reopen HDF5 handles read-only, and only handles "
            "opened with mode 'r' travel (`h5py.File(path, 'r')`)"
        )
    if driver not in _DRIVERS:
        raise TypeError(f"{what} uses driver '{driver}': only files on disk (sec2, stdio, core) travel")
    if driver == "core":
        try:
            backing = f.id.get_access_plist().get_fapl_core()[1]
        except Exception:  # noqa: BLE001
            backing = False
        if not backing or not os.path.isfile(name):
            raise TypeError(f"{what} is an in-memory file (driver='core' without backing store)")
    path = obj.name
    if path is None:
        raise TypeError(f"{what} is anonymous (no path in the file)")
    swmr = bool(getattr(f, "swmr_mode", False))
    filename = os.path.abspath(name)
    stamp = _stamp(f.id, filename, swmr, driver)
    return (LazyH5, (kind, filename, path, stamp, tuple(sorted(_open_kwargs(f.id, swmr, f.libver).items()))))


class _Files:
    """A worker's reopened files: one ``h5py.File`` per (file, stamp, open arguments)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._files: dict = {}

    def get(self, filename: str, stamp: tuple, kwargs: tuple) -> Any:
        import h5py

        key = (filename, stamp, kwargs)
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's handles are not ours
                self._files, self._pid = {}, os.getpid()
            f = self._files.get(key)
            if f is None or not f:
                _check(filename, stamp)
                f = h5py.File(filename, "r", **dict(kwargs))
                _check(filename, stamp)  # replaced while it opened
                self._files[key] = f
            return f


def _check(filename: str, stamp: tuple) -> None:
    try:
        st = os.stat(filename)
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)[: len(stamp)]
    except FileNotFoundError:
        now = None
    if now != stamp:
        raise FileChangedError(
            f"kerasfeed: the HDF5 file '{filename}' changed on disk after the source was sent to the worker "
            "processes (replaced, rewritten, or removed): this worker would read another file than the source's "
            "handle in the consumer process. Build the source again to read the new file. "
            f"Received: stamp={stamp} (device, inode[, size, mtime]), now={now}"
        )


_FILES = _Files()


class LazyH5:
    """A worker's stand-in for an h5py object of the consumer's source: opened on first use, then forwarded to."""

    __slots__ = ("_kf_ref", "_kf_obj", "__weakref__")

    def __init__(self, kind: str, filename: str, path: str, stamp: tuple, kwargs: tuple):
        self._kf_ref = (kind, filename, path, stamp, kwargs)
        self._kf_obj = None

    def _kf_open(self) -> Any:
        obj = self._kf_obj
        if obj is None:
            kind, filename, path, stamp, kwargs = self._kf_ref
            f = _FILES.get(filename, stamp, kwargs)
            obj = self._kf_obj = f if kind == "File" else f[path]
        return obj

    @property
    def __class__(self):  # isinstance(proxy, h5py.File) holds, as for the consumer's object
        import h5py

        return getattr(h5py, self._kf_ref[0])

    def __reduce__(self):
        return (LazyH5, self._kf_ref)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kf_open(), name)

    def __getitem__(self, key: Any) -> Any:
        return self._kf_open()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._kf_open()[key] = value  # h5py refuses: the file is read-only

    def __len__(self) -> int:
        return len(self._kf_open())

    def __iter__(self):
        return iter(self._kf_open())

    def __contains__(self, key: Any) -> bool:
        return key in self._kf_open()

    def __bool__(self) -> bool:
        return bool(self._kf_open())

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        import numpy as np

        return np.asarray(self._kf_open(), dtype=dtype)

    def __enter__(self) -> Any:
        return self._kf_open().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._kf_open().__exit__(*exc)

    def __eq__(self, other: Any) -> bool:
        other = other._kf_open() if type(other) is LazyH5 else other
        return self._kf_open() == other

    def __hash__(self) -> int:
        return hash(self._kf_open())

    def __repr__(self) -> str:
        kind, filename, path, _, _ = self._kf_ref
        state = "open" if self._kf_obj is not None else "opened on first use"
        return f"<HDF5 {kind} {path!r} of '{filename}' (reopened read-only in this worker: {state})>"


__all__ = ["FileChangedError", "LazyH5", "is_h5", "reduce"]
