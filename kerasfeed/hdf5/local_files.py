"""``LocalFiles``: the local HDF5 files of an ``H5Base``, held per process (a base class of it).

The file at a path now (its identity, inode included), held in the process's ``REGISTRY`` while it is read
(``held.py``: at most ``max_open_files`` at once), refused once replaced or changed since construction, and a
read of its rows with its errors named. Remote files are read through ``remote/`` (``H5Base._read_many``).
"""

from __future__ import annotations

import os
import stat

from kerasfeed.errors import FileChangedError
from kerasfeed.hdf5.handles import REGISTRY
from kerasfeed.hdf5.held import HeldFiles
from kerasfeed.hdf5.inspection import open_local


class LocalFiles:
    """What ``H5Base`` does with its local files (a base class of it). Its attributes, set by ``H5Base``:
    ``_paths``, ``_stamps`` (each file's ``(st_dev, st_ino)`` at construction), ``_lengths``, ``swmr``,
    ``_open_kwargs`` and ``_max_open_files``."""

    def _reset_handles(self) -> None:
        self._h5 = HeldFiles(getattr(self, "_max_open_files", None))  # held.py's NOTE
        self._h5_pid = os.getpid()
        self._window_cache = {}  # slices.py's windows, per process as the handles

    def _check_process(self) -> None:
        if self._h5_pid != os.getpid():
            # A forked child: forget the parent's handles without closing them (docs/field_notes.md, *h5py
            # lock*); the lock may have been held by a parent thread.
            self._reset_handles()

    def _identity(self, path: str) -> tuple:
        """The registry key of the file now at ``path``, inode included (``[1:3]`` is the file's stamp): a
        file renamed over the old one gets an entry of its own (see ``FileRegistry``)."""
        cls = type(self).__name__
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{cls}: HDF5 file not found. Received: path='{path}'") from None
        if not stat.S_ISREG(st.st_mode):  # a pipe or a device: h5py's open would wait on it for ever
            got = "a directory" if stat.S_ISDIR(st.st_mode) else "a path that is not a regular file (a pipe, device)"
            raise (IsADirectoryError if stat.S_ISDIR(st.st_mode) else OSError)(
                f"{cls}: expected an HDF5 file but got {got}. Received: path='{path}'")
        kwargs = repr(sorted(self._open_kwargs.items()))
        return (os.path.realpath(path), st.st_dev, st.st_ino, self.swmr, kwargs)

    def _acquire(self, path: str):
        """``(identity, h5py.File)`` of the file now at ``path``, held in the registry."""
        for _ in range(3):
            ident = self._identity(path)
            f = REGISTRY.acquire(ident, lambda: self._open(path))
            # Replaced between the stat and the open: the handle may be of
            # another file than the identity says. Rare; try again.
            if self._identity(path) == ident:
                return ident, f
            REGISTRY.release(ident)
        raise FileChangedError(
            f"{type(self).__name__}: file '{path}' was replaced on disk every time it was opened (3 tries)."
        )

    def _hold(self, file_index: int) -> tuple:
        """Acquires, in this process, the file that construction inspected; returns its identity."""
        path, stamp = self._paths[file_index], self._stamps[file_index]
        try:
            ident = self._identity(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e} (it had {self._lengths[file_index]} rows when the sequence was built: "
                                    "removed since)") from None
        if ident[1:3] != stamp:
            # Replaced since construction: keep reading the inspected file
            # while this process has it open, else refuse (a fresh process
            # or a reopen would otherwise read another file in silence).
            held = ident[:1] + stamp + ident[3:]
            if REGISTRY.share(held):
                return held
            raise FileChangedError(
                f"{type(self).__name__}: file '{path}' was replaced after the sequence was built: the path "
                f"now names another file (one written elsewhere and renamed over it, say), and the one the "
                f"sequence inspected ({self._lengths[file_index]} rows) is no longer open in this process. "
                "Build a new sequence to read the new file."
            )
        ident, _ = self._acquire(path)
        if ident[1:3] != stamp:  # replaced while opening: check again
            REGISTRY.release(ident)
            return self._hold(file_index)
        return ident

    def _begin_read(self, file_index: int, key: str):
        """The dataset ``key`` of a local file, kept open until ``self._h5.end(file_index)``."""
        self._check_process()
        return self._h5.begin(file_index, key, self._hold)

    def _open(self, path: str):
        return open_local(path, self.swmr, self._open_kwargs, type(self).__name__)

    def _read_local(self, file_index: int, key: str, asked: str, stop: int, n: int, read, raised: tuple = ()):
        """``read(dataset)``: ``n`` rows of a local file's ``key``, the last before ``stop`` (refreshed under SWMR),
        the file held open meanwhile; errors but ``FileChangedError`` (and ``raised`` at the open) named."""
        try:
            ds = self._begin_read(file_index, key)
        except (FileChangedError, *raised):
            raise
        except Exception as e:
            raise self._read_failed(file_index, key, asked, e) from e
        try:
            if self.swmr and stop > ds.shape[0]:
                ds.refresh()  # rows appended since this process last looked
            out = read(ds)
            if len(out) != n:  # h5py clips a slice at the end, as numpy does: the dataset shrank
                raise FileChangedError(
                    f"{type(self).__name__}: dataset '{key}' in file '{self._paths[file_index]}' has {ds.shape[0]} "
                    f"rows now, {self._lengths[file_index]} when the sequence was built, so {asked} cannot be read: "
                    "the file changed since (rewritten or truncated in place). Build a new sequence to read it as it "
                    "is now.")
        except FileChangedError:
            raise
        except Exception as e:
            raise self._read_failed(file_index, key, asked, e) from e
        finally:
            self._h5.end(file_index)
        return out

    def _read_failed(self, file_index: int, key: str, rows: str, e: BaseException) -> OSError:
        return OSError(f"{type(self).__name__}: reading {rows} of dataset '{key}' in file "
                       f"'{self._paths[file_index]}' failed: {type(e).__name__}: {e}")


__all__ = ["LocalFiles"]
