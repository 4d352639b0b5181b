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

import os
import re
import threading
import weakref
from typing import Any, Optional

import numpy as np

from kerasfeed.errors import FileChangedError
from kerasfeed.remote.chunks import Layout, concat, merge, pieces, unreachable
from kerasfeed.remote.fetch import STORES, ObjectStat, Store, gather_ranges, gather_settled, run
from kerasfeed.remote.h5file import collector_held, fetch_error, open_h5
from kerasfeed.remote.options import RemoteOptions
from kerasfeed.remote.urls import Credentials, redact


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
        self._head: Optional[bytes] = None  # the first block, fetched with the other files' (``pin_all``)
        self._reset()

    def _reset(self) -> None:
        self._forget_h5()
        self.kept: dict = {}  # key -> {(start, end): bytes}: small datasets fetched whole in this process

    def _forget_h5(self) -> None:
        self._lock = threading.Lock()
        self._h5 = None  # this process's h5py file, for datasets off the fast path
        self._datasets: dict = {}
        self._store: Optional[Store] = None  # this process's, held here: ``STORES`` keeps it only while held
        self._pid = os.getpid()
        # key -> True: a small dataset being fetched whole by a thread of this process (``_KeptBytes.claim``);
        # a forked child starts without its parent's (their threads are not in it).
        self.fetching: dict = {}

    def _check_process(self) -> None:
        """In a forked child, drops (never closes) the parent's h5py file: it reads through the parent's event
        loop and session, and the lock may have been held by a parent thread. The kept bytes stay valid."""
        if self._pid != os.getpid():
            self._forget_h5()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_lock", "_h5", "_datasets", "_store", "kept", "_pid", "_head", "fetching"):
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
        self._check_process()
        store = self._store
        if store is None:
            store = self._store = STORES.get(self.url, self.credentials, self.options, self.owner)
        return store

    def stat_now(self) -> ObjectStat:
        """The object's size and version as the store reports them now (one request)."""
        return run(self.store().stat)

    # ---- construction --------------------------------------------------------

    def inspect(self, check) -> Any:
        """Pins the version, opens the file through h5py and returns ``check(h5py.File)``.

        ``check`` returns the keys to describe (``Layout.of``) with the
        result it wants back: ``(keys, result)``.
        """
        head, self._head = self._head, None
        if head is None:
            self.pin = self.stat_now()
        with collector_held():
            try:
                f, raw = open_h5(self.store(), self.pin, self.options.block_size, self.open_kwargs, head)
            except (OSError, ValueError) as e:
                if isinstance(e, (FileNotFoundError, PermissionError, TimeoutError, FileChangedError)):
                    raise
                raise OSError(
                    f"{self.owner}: object '{self.name}' could not be opened as HDF5 (not an HDF5 file, or "
                    f"truncated): {type(e).__name__}: {e}"
                ) from e
            try:
                try:
                    keys, result = check(f)
                except ValueError as e:  # a key missing: an external link, which HDF5 cannot follow here?
                    try:
                        link = _external_link(f, str(e))
                    except Exception:  # noqa: BLE001 - only refines the message of the error raised here
                        link = None
                    if link is None:
                        raise
                    key, target = link
                    raise ValueError(
                        f"{self.owner}: key '{key}' of '{self.name}' is {target}: HDF5 cannot follow external "
                        "links through a URL (the file a link names is a path on this machine, not an object of "
                        "the store). Read it from a local copy of both files, or store the data in this file. "
                        f"Received: key='{key}', path='{self.name}'"
                    ) from None
                for key in keys:
                    why = unreachable(f[key])
                    if why:
                        raise ValueError(
                            f"{self.owner}: key '{key}' of '{self.name}' is {why}: through a URL those paths "
                            "are not the store's objects. Read it from a local copy of every file, or store "
                            f"the data in the file itself. Received: key='{key}', path='{self.name}'"
                        )
                    with raw.chunk_index(len(f[key].shape)):  # NOTE [ A chunk index read one level at a time ]
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
        self._check_process()
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
        return concat(parts)

    def close(self) -> None:
        """Closes this process's h5py file of the object, if any, and lets go of its store (its connections
        close once no other reader holds it); a later read reopens both."""
        self._check_process()
        with self._lock:
            h5, self._h5, self._datasets, self._store = self._h5, None, {}, None
        if h5 is not None:
            with collector_held():
                try:
                    h5[0].close()
                except Exception:  # noqa: BLE001 - closing during interpreter shutdown, say
                    pass


def _external_link(f, message: str) -> Optional[tuple]:
    """``(key, what it is)`` when the key ``message`` names (quoted) is, or lies under, an external link of ``f``;
    else None. Only looked for once a key failed: it walks every link of the file."""
    import h5py

    links: list = []

    def visit(name: bytes, info) -> None:
        if info.type == h5py.h5l.TYPE_EXTERNAL:
            links.append(name.decode())

    f.id.links.visit(visit, info=True)
    for name in links:
        found = re.search(r"'(/?%s(?:/[^']*)?)'" % re.escape(name), message)
        if found:
            key, link = found.group(1), f.get(name, getlink=True)
            target = f"'{link.filename}':{link.path}"
            if key.strip("/") == name:
                return key, f"an external link to {target}"
            return key, f"under the external link '{name}' (to {target})"
    return None


# Bytes of small datasets this process keeps whole (``read_parts``), all its files together: past it a small
# dataset is fetched per batch, as a large one is (docs/remote.md).
KEPT_BUDGET = 64 << 20


class _KeptBytes:
    """The bytes each ``RemoteFile`` of this process keeps, against ``KEPT_BUDGET``; given back when it goes."""

    def __init__(self):
        self._lock = threading.RLock()  # re-entrant: a file's finalizer may run on a collection inside `keep`
        self.used = 0
        self._by_file: dict = {}  # id(RemoteFile) -> bytes it keeps

    def room(self, nbytes: int) -> bool:
        return self.used + nbytes <= KEPT_BUDGET

    def claim(self, rf: RemoteFile, key: str) -> str:
        """``"mine"``: the caller fetches ``key`` whole, then ``release``s it; ``"kept"``: it is kept now;
        ``"busy"``: another thread of this process is fetching it (the caller fetches its own rows: waiting
        would make it wait for that thread's whole batch, a slow request for another key included). Without
        it, the items of a run over a partly filled cache, started at once, each fetched the whole dataset."""
        rf._check_process()
        with self._lock:
            if key in rf.kept:  # kept since the caller looked (outside the lock): not fetched twice
                return "kept"
            if key in rf.fetching:
                return "busy"
            rf.fetching[key] = True
            return "mine"

    def release(self, rf: RemoteFile, key: str) -> None:
        with self._lock:
            rf.fetching.pop(key, None)

    def keep(self, rf: RemoteFile, key: str, data: dict) -> None:
        """``rf`` keeps ``data`` for ``key`` if the budget has room (else its rows are fetched per batch)."""
        nbytes = sum(len(v) for v in data.values())
        with self._lock:
            if key in rf.kept or self.used + nbytes > KEPT_BUDGET:
                return
            if id(rf) not in self._by_file:
                self._by_file[id(rf)] = 0
                weakref.finalize(rf, self._give_back, id(rf)).atexit = False
            rf.kept[key] = data
            self._by_file[id(rf)] += nbytes
            self.used += nbytes

    def _give_back(self, ident: int) -> None:
        with self._lock:
            self.used -= self._by_file.pop(ident, 0)


_KEPT = _KeptBytes()


def _after_fork() -> None:
    _KEPT._lock = threading.RLock()  # a parent thread gone with the fork may have held it: the child's would hang


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def pin_all(files: dict) -> dict:
    """Pins the version of every file of ``{index: RemoteFile}`` and fetches its first block, one wave for
    all the files each, so that ``inspect`` opens each with a request fewer per file: for many files the
    round trips of construction were two per file before h5py's own (48 for 16 small files, 18 so).
    A failed size and version raises as ``inspect``'s would (the first file in order); a failed first
    block is left to ``inspect`` to fetch again and report. Returns ``files``."""
    group = [files[j] for j in sorted(files)]
    if len(group) < 2:
        return files  # one file: inspect reads it as before
    stats = run(gather_settled, [(rf.store().stat, ()) for rf in group])
    for rf, st in zip(group, stats):
        if isinstance(st, BaseException):
            raise st
        rf.pin = st
    sized = [rf for rf in group if rf.pin.size]  # an empty object has no block to fetch
    heads = run(gather_settled, [(rf.store().get, (0, min(rf.options.block_size, rf.pin.size), rf.pin))
                                 for rf in sized])
    for rf, head in zip(sized, heads):
        if isinstance(head, bytes):
            rf._head = head
    return files


def read_parts(parts: list) -> list:
    """``[(RemoteFile, key, [(a, b), ...]), ...]`` -> the rows of each part's runs, concatenated.

    Every byte range of every fast-path part (across files and keys) goes
    out in one wave (``fetch.run``): per file, ranges are merged
    (``RemoteOptions.merge_gap``/``max_request``) and fetched concurrently;
    the chunks are then decoded on this thread. A small dataset
    (``RemoteOptions.small_dataset``) is fetched whole the first time and
    kept by the ``RemoteFile`` in this process, while the process keeps at
    most ``KEPT_BUDGET`` bytes so. A range larger than ``max_request`` is
    fetched in concurrent pieces. Parts off the fast path are read through
    h5py after.
    """
    wanted: dict = {}  # id(file) -> (file, set of byte ranges)
    plans, keep = [], []
    try:
        for rf, key, runs in parts:
            layout = rf.layouts[key]
            if not layout.fast:
                plans.append(None)
                continue
            ranges = _whole_once(rf, key, layout, keep)
            if ranges == ():
                plans.append(())
                continue
            ranges = ranges or layout.ranges(runs)
            wanted.setdefault(id(rf), (rf, set()))[1].update(ranges)
            plans.append(ranges)
        fetched = _fetch(wanted)
        for rf, key, ranges in keep:
            table = fetched.get(id(rf), {})
            _KEPT.keep(rf, key, {r: bytes(table[r]) for r in ranges})  # a copy: the response it came in can go
    finally:
        for rf, key, _ in keep:  # fetched (kept) or failed: another call may fetch it whole
            _KEPT.release(rf, key)
    return _assemble(parts, plans, fetched)


def _whole_once(rf: RemoteFile, key: str, layout: Any, keep: list) -> Any:
    """A small dataset (``RemoteOptions.small_dataset``) is fetched whole once per process and kept: ``()``
    when it is kept, its whole ranges when this call fetches it (``keep`` says so), None when its rows are
    fetched as asked (while another thread fetches it whole, say)."""
    if key in rf.kept:
        return ()
    if layout.stored_bytes > rf.options.small_dataset or not _KEPT.room(layout.stored_bytes):
        return None
    whole = layout.ranges([(0, layout.shape[0])])
    if any(k == key and f is rf for f, k, _ in keep):
        return whole  # this call fetches it already (a second part of the same dataset)
    claimed = _KEPT.claim(rf, key)
    if claimed == "mine":
        keep.append((rf, key, whole))
        return whole
    return () if claimed == "kept" else None


def _fetch(wanted: dict) -> dict:
    """``{id(file): {(start, end): bytes view}}`` for the byte ranges ``wanted`` names, in one wave."""
    requests, members = [], []  # members: (file, first byte, member ranges, requests it was cut into)
    for rf, ranges in wanted.values():
        store, limit = rf.store(), rf.options.max_request
        for start, end, inside in merge(list(ranges), rf.options.merge_gap, limit):
            if end - start <= limit:
                requests.append((store, start, end, rf.pin))
                members.append((rf, start, inside, 1))
                continue
            cut = pieces(start, end, limit)  # one range larger than a request (a big chunk, a long run)
            requests.extend((store, s, e, rf.pin) for s, e in cut)
            members.append((rf, start, inside, len(cut)))
    got = run(gather_ranges, requests) if requests else []
    fetched: dict = {}  # id(file) -> {(start, end): bytes}
    at = 0
    for rf, start, inside, n in members:
        view = memoryview(got[at] if n == 1 else b"".join(got[at : at + n]))
        at += n
        table = fetched.setdefault(id(rf), {})
        for s, e in inside:
            table[(s, e)] = view[s - start : e - start]
    return fetched


def _assemble(parts: list, plans: list, fetched: dict) -> list:
    """Each part's rows: decoded from ``fetched`` or the kept bytes, or read through h5py (off the fast path)."""
    out = []
    for (rf, key, runs), plan in zip(parts, plans):
        if plan is None:
            try:
                out.append(rf.read_fallback(key, runs))
            except Exception as e:
                if rf.name in str(e):  # a failed request's error (replaced object, timeout...): it names the URL
                    raise
                raise OSError(  # h5py's own error names no file: named as on the fast path
                    f"{rf.owner}: reading rows {runs[0][0]}..{runs[-1][1]} of dataset '{key}' in '{rf.name}' "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
            continue
        try:
            out.append(rf.layouts[key].assemble(runs, rf.kept[key] if plan == () else fetched.get(id(rf), {})))
        except (ValueError, Exception) as e:
            raise OSError(
                f"{rf.owner}: decoding rows {runs[0][0]}..{runs[-1][1]} of dataset '{key}' in '{rf.name}' "
                f"failed: {type(e).__name__}: {e}"
            ) from e
    return out


__all__ = ["RemoteFile", "RemoteOptions", "pin_all", "read_parts"]
