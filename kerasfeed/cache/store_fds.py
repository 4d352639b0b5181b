"""What an item store owns outside itself: its fds, closed (and a kept one marked clean) by a finalizer that
holds no reference to the store, and the duplicate fd its writers hold while they write; a kept index's blocks."""

from __future__ import annotations

import errno
import os
import threading


def allocate(fd: int, size: int, directory: str) -> None:
    """Gives a kept store's index (``fd``, ``size`` bytes) its disk blocks now. It is written through a shared
    mapping, where a block the file system cannot give (a full disk) is a SIGBUS that kills the process at any
    item; records are written with ``pwritev`` (ENOSPC: one warning, and the run goes on without storing).

    Raises:
        OSError: no room for it (ENOSPC, EDQUOT), naming the directory.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return  # a file system that cannot allocate ahead: as before
        raise OSError(e.errno, (
            f"kerasfeed cache: no room on the disk of {directory} for the cache's index ({size:,} bytes, "
            f"{e.strerror}). Free space there, give the cache another directory, or pass cache='memory'. "
            f"Received: cache directory {directory!r}")) from None


class Owned:
    """What an ``ItemStore`` (``store.py``) owns, apart from it: its finalizer (a store dropped without ``close``,
    or still open at interpreter exit) must hold no reference to the store. ``closed`` is the
    store's state (its writers check it under ``lock``); ``clean``: a kept store, written back
    and marked clean before its fds close; ``then``: run last (the directory's lock)."""

    __slots__ = ("fds", "lock", "clean_at", "closed", "clean", "then")

    def __init__(self, fds: tuple, lock: threading.Lock, clean_at: int):
        self.fds, self.lock, self.clean_at = fds, lock, clean_at  # clean_at: the clean mark's byte in the index
        self.closed, self.clean, self.then = False, False, None

    def release(self) -> None:
        with self.lock:  # a writer publishing now finishes first; later ones find the store closed
            self.closed = True
            fds, self.fds = self.fds, ()
        then, self.then = self.then, None
        try:
            if fds and self.clean:
                index_fd, data_fd = fds
                # Every process's records reach the disk before the mark (workers wrote them
                # through their own fds: one fdatasync of the file covers them all).
                os.fdatasync(data_fd)
                os.pwrite(index_fd, (1).to_bytes(8, "little"), self.clean_at)  # the mapping's page: one page cache
                os.fdatasync(index_fd)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if then is not None:
                then()


class WriteFd:
    """A duplicate of the data file's fd for writers (``records.write_record``). A writer
    holds this object while it writes, so a store closed meanwhile never leaves it
    writing into a closed fd number that another file may have taken; the fd closes
    when the last holder lets go."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = os.dup(fd)  # not inheritable

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):  # AttributeError, TypeError: at interpreter exit
            pass


__all__ = ["Owned", "WriteFd", "allocate"]
