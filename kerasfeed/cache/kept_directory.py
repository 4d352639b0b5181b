"""A kept cache's directory while a run uses it: its files' names, its lock (step 1 of NOTE [ A kept cache's
directory ], ``kept.py``: one run at a time, a second refused at once naming the holder) and its ``key.json``."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import time
import weakref
from typing import Callable, Optional

INDEX, DATA, KEY, LOCK = "index.bin", "data.bin", "key.json", "lock"
# How long a directory held by this very process is waited for (a pipeline dropped without close(): its worker
# processes stop first; ~0.5 s on an idle 2-core machine, past 2 s beside a loaded one's test run), and how many
# collections at least: the clock that slows down with the machine (``_take_from_own``).
_OWN_WAIT_S = 6.0
_OWN_COLLECTIONS = 12


class KeptDirectory:
    """The lock and key of one cache directory, held while the store is open.

    Args:
        directory: the cache's directory (made if missing).
    """

    def __init__(self, directory: str):
        self.directory = directory
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:  # read-only, or not a directory: the same class, in kerasfeed's words
            raise type(e)(e.errno, (
                f"kerasfeed cache: cannot use {directory} as a kept cache ({e.strerror}): a kept cache needs a "
                f"writable directory (its lock, and the items a run stores). Copy it somewhere writable, or pass "
                f"cache='memory'. Received: cache directory {directory!r}")) from e
        self._lock = _LockFd(fd)
        # Dropped without ``release`` the lock goes too, unless a store took it over (``hand_over``).
        self._finalizer = weakref.finalize(self, self._lock.close)
        if not _take(fd):
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            own = holder == str(os.getpid())
            if not (own and _take_from_own(fd)):
                self._finalizer()
                what = "another pipeline of this process" if own else "another run"
                other = "; or a process of another container with that pid, sharing the directory" if own else ""
                fix = ("close that pipeline before making another over this directory: `loader.close()` (or a "
                       "`with` block) for a loader, `kerasfeed.executor_of(ds).close()` for a dataset (a notebook "
                       "cell run again makes the new one while the old one is still open)"
                       if own else "wait for that run to end")
                raise RuntimeError(
                    f"kerasfeed cache: the directory {directory} is in use by {what} (pid {holder}{other}): one run "
                    f"at a time fills a kept cache. Give this run its own directory (cache=... or "
                    f"Cache(directory=...)), or {fix}. Received: cache directory {directory!r}"
                )
        try:  # the holder's pid, for the message above: the flock is the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:  # a full disk: the error that matters comes with the index (``allocate``)
            pass

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def read_key(self) -> Optional[dict]:
        try:
            with open(self.path(KEY)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_key(self, key: dict) -> None:
        tmp = self.path(KEY + ".tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(key, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # a full disk: named, as the index's (``store_fds.allocate``)
            raise OSError(e.errno, f"kerasfeed cache: cannot write {tmp} ({e.strerror}). Free space there, give the "
                          f"cache another directory, or pass cache='memory'. Received: cache directory "
                          f"{self.directory!r}") from None
        os.replace(tmp, self.path(KEY))

    def hand_over(self) -> Callable[[], None]:
        """The lock's release, for the store to run once written back and marked clean (``ItemStore.kept_by``):
        the lock is then held as long as the store, however the two objects are dropped."""
        self._finalizer.detach()
        return self._lock.close

    def release(self) -> None:
        self._lock.close()


class _LockFd:
    """The lock file's fd, apart from its owner (finalizers must not hold the owner)."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int):
        self.fd: Optional[int] = fd
        self.pid = os.getpid()

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        # A flock belongs to the open file description, which a child forked meanwhile (an evaluation pool,
        # Keras' own workers) holds too: closing our fd alone would leave the directory locked while that
        # child lives. The owner unlocks first; a forked child only closes its copy (its unlock would free
        # the owner's lock).
        if os.getpid() == self.pid:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
        os.close(fd)


def _take(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take_from_own(fd: int) -> bool:
    """The lock of a pipeline of this process dropped without close(): its store lets it go once
    collected (after its pool threads stop; a reference cycle needs the collector, and one that an
    item error's traceback closes took three collections: the finalizers of each ring free the next).
    Refused only after ``_OWN_COLLECTIONS`` too: that teardown (collections of a heap with TensorFlow
    in it, 0.3 s each idle, 1-2.5 s beside a loaded test run; its threads and worker processes ending)
    slows down with the machine, and took 5 collections, 9-12 s, there (a 6-s deadline alone refused)."""
    deadline, collections = time.monotonic() + _OWN_WAIT_S, 0
    while True:
        gc.collect()
        collections += 1
        if _take(fd):
            return True
        if time.monotonic() >= deadline and collections >= _OWN_COLLECTIONS:
            return False
        time.sleep(0.05)


__all__ = ["DATA", "INDEX", "KEY", "LOCK", "KeptDirectory"]
