"""``kerasfeed.Cache``: where items are kept once made, checked once (TF-free).

``cache=`` on ``to_dataset`` and ``to_loader`` takes ``"memory"``, a directory
path, or a ``Cache``; ``resolve_cache`` turns each into a ``Cache`` (or
None), and ``open_store`` (when the pipeline is built, with its source) opens
the store it describes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import os
import re
import shutil
import weakref
from typing import Any, Callable, Optional

from kerasfeed import _validation as _v
from kerasfeed.cache.kept import close_kept, open_kept
from kerasfeed.cache.keys import source_key
from kerasfeed.cache.store import FIRST_OFFSET, LAYOUT, ItemStore

MIN_BYTES = 128  # the smallest store: a 64-byte header, then room for a record
# What a store may hold when max_bytes is not given: this share of the memory
# available when it is opened ("memory"), or of the free disk at its directory.
MEMORY_SHARE = 0.5
DISK_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Cache:
    """Items kept once made, so that later passes read them instead of making them again.

    Pass it (or ``"memory"``, or a directory path) as ``cache=`` to
    ``kerasfeed.to_dataset`` or ``kerasfeed.to_loader``. The first pass (or
    whichever first reads an item) makes items and stores them; later passes,
    in any order, read them from the store: one copy per host, shared by the
    consumer and every worker process. With a source that defines ``load(i)``
    and ``augment(item)``, only ``load`` is stored and ``augment`` runs every
    pass (fresh random augmentation with ``kerasfeed.item_rng()``). See
    ``docs/cache.md``.

    Args:
        directory: None: the store is in RAM (anonymous memory, freed with
            the pipeline; nothing on disk or in ``/dev/shm``). A path: a
            kept cache on local disk, reused by later runs while the source
            is unchanged (its class, the code of its stored stage, its plain
            attributes, the size and modification time of the files it
            names, and ``version``); a change rebuilds it, with one log line
            saying why. One run at a time uses a directory.
        max_bytes: what the store may hold, at most (at least 128). None: half the memory
            available when the pipeline is made (in RAM: within a
            container's memory limit, less what other open stores in RAM may
            still fill), or half the free disk at ``directory``. Past it, the items stored first stay and
            the rest are made every pass.
        version: anything with a stable ``repr``; a kept cache made under
            another version is rebuilt (for what the key cannot see, such as
            a change in a function the stored stage calls).

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Decoded(kerasfeed.SceneSequence):
        def __len__(self):
            return 8

        def load(self, i):                          # made once, stored
            return np.full((4, 3), i, "float32")

        def augment(self, x):                       # every pass
            return x + kerasfeed.item_rng().normal(size=x.shape).astype("float32")

    loader = kerasfeed.to_loader(Decoded(), cache="memory", shuffle=True, seed=0)
    for epoch in range(2):
        for x in loader:
            pass
    print(kerasfeed.stats(loader)["cache_items"])   # 8: every item made once
    ```
    """

    directory: Optional[str] = None
    max_bytes: Optional[int] = None
    version: Any = None

    def __post_init__(self):
        if isinstance(self.directory, str) and _looks_like_memory(self.directory):
            # Cache("memory", max_bytes=...) meant a RAM budget: it would make and keep a folder ./memory.
            raise ValueError("Cache: `directory` is a folder to keep the items in, and "
                             f"{self.directory!r} looks like 'memory' (in RAM). For a budget in RAM pass "
                             f"Cache(max_bytes=...) (no directory); for a folder, a path such as './cache'. "
                             f"Received: directory={self.directory!r}")
        if self.directory is not None:
            # '~/cache' is the home's: taken as written, it would make a folder named '~' here
            object.__setattr__(self, "directory", os.path.expanduser(_v.path("directory", self.directory,
                                                                              owner="Cache")))
        size = self.max_bytes
        if isinstance(size, float) and size.is_integer():  # written as 8e9: a whole number of bytes
            size = int(size)
        object.__setattr__(self, "max_bytes", _v.positive_int("max_bytes", size, allow_none=True, owner="Cache"))
        if self.max_bytes is not None and self.max_bytes < MIN_BYTES:
            raise ValueError(f"Cache: `max_bytes` must be at least {MIN_BYTES} (the store's header takes 64 bytes, "
                             f"and a smaller store holds no item). Received: max_bytes={self.max_bytes}")
        if self.version is not None and _ADDRESS.search(repr(self.version)):
            # An address differs every run: a kept cache would be rebuilt every time, silently.
            raise ValueError("Cache: `version` must have a repr that stays the same from run to run (a string, a "
                             "number, a tuple of them); this one shows a memory address. "
                             f"Received: version={self.version!r}")


_MEMORY_LOOKALIKES = {"memory", "mem", "ram", "in-memory", "in_memory", "inmemory", "memory:"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _looks_like_memory(value: str) -> bool:
    """'Memory', 'mem', or 'memory' misspelt ('memroy', 'memmory'): not a directory to make and keep. A path
    with a separator, or one that exists, is a directory."""
    word = value.strip().lower()
    if word in _MEMORY_LOOKALIKES:
        return True
    if os.sep in value or "/" in value or os.path.exists(value):
        return False
    return difflib.SequenceMatcher(None, word, "memory").ratio() >= 0.8


def resolve_cache(value: Any, owner: Optional[str] = None) -> Optional[Cache]:
    """``cache=`` as a ``Cache``: None, ``"memory"``, a directory (str or ``os.PathLike``) or a ``Cache``.

    Raises:
        TypeError: anything else, named.
    """
    if value is None or isinstance(value, Cache):
        return value
    if isinstance(value, str) and value == "memory":
        return Cache()
    if isinstance(value, str) and _looks_like_memory(value):
        # Any other string is a directory: './Memory' would be made and kept, where RAM was meant.
        raise ValueError(f"{_v._where(owner)}`cache` is 'memory' (in RAM) or a directory path; {value!r} looks "
                         "like the former misspelt. Pass cache='memory', or a path such as './cache'. "
                         f"Received: cache={value!r}")
    if isinstance(value, (str, os.PathLike)):
        return Cache(directory=_v.path("cache", value, owner=owner))
    raise TypeError(
        f"{_v._where(owner)}`cache` must be None, 'memory', a directory path or a kerasfeed.Cache. "
        f"Received: cache={value!r} of type {type(value).__name__}"
    )


# A container's memory limit and use (cgroup v2, then v1): /proc/meminfo shows the host's.
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory() -> int:
    """Memory available to this process: the host's available memory, or less where a
    container's memory limit leaves less."""
    import psutil

    available = int(psutil.virtual_memory().available)
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or v1's near-2**63: no limit
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


# Open stores in RAM: what they may still fill is not available to the next one (a training and a
# validation pipeline made one after the other would otherwise each take half of the same memory).
_IN_MEMORY: "weakref.WeakSet[ItemStore]" = weakref.WeakSet()


def _unfilled() -> int:
    total = 0
    for store in list(_IN_MEMORY):
        figures = store.figures()
        total += max(int(figures["capacity"]) - int(figures["used"]), 0)
    return total


def _capacity(cache: Cache, directory: Optional[str]) -> int:
    if cache.max_bytes is not None:
        size = cache.max_bytes
    elif directory is None:
        size = int(max(available_memory() - _unfilled(), 0) * MEMORY_SHARE)
    else:
        size = int(shutil.disk_usage(directory).free * DISK_SHARE)
    # The data file's first 64 bytes hold no record: the file is that much longer than the budget, so
    # that ``max_bytes`` of records fit (the sum a full run's ``cache_bytes`` reports).
    return max(size, MIN_BYTES) + FIRST_OFFSET


def open_store(
    cache: Cache, source: Any, n: int, shard: tuple[int, int] = (0, 1), process: Optional[tuple[int, int]] = None
) -> tuple[ItemStore, Callable[[], None]]:
    """Opens the store ``cache`` describes for ``source`` (``n`` items).

    Args:
        shard: ``(index, count)`` of this process's shard when several
            processes read one source (multi-host): a kept cache then uses
            ``directory/shard-{index}-of-{count}``, each process its own.
        process: ``(index, count)`` of this process when processes share a
            shard: ``.../process-{index}-of-{count}`` (one process per
            kept directory).

    Returns:
        The store and the function that closes it (a kept directory's is
        written back, marked closed cleanly and unlocked).

    Raises:
        RuntimeError: the directory is in use by another run.
        ValueError: the directory's path is a file.
    """
    if cache.directory is None:
        capacity = _capacity(cache, None)
        with _sized(cache, capacity, "in RAM"):
            store = ItemStore.memory(n, capacity)
        _IN_MEMORY.add(store)

        def close() -> None:
            _IN_MEMORY.discard(store)
            store.close()

        return store, close
    directory = cache.directory
    if shard[1] > 1:
        directory = os.path.join(directory, f"shard-{shard[0]}-of-{shard[1]}")
    if process is not None:
        directory = os.path.join(directory, f"process-{process[0]}-of-{process[1]}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(
            f"`cache` names a directory to keep the items in, and '{directory}' is a file. Pass a directory "
            f"path (made if missing), or cache='memory'. Received: cache={cache.directory!r}"
        )
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # a file in the way further up, no permission
        near = _v.nearest_existing(directory)
        why = f"'{near}' is a file" if os.path.isfile(near) else f"{e.strerror}, under '{near}'"
        raise type(e)(e.errno, f"`cache` names a directory to keep the items in, and '{directory}' cannot be "
                               f"made ({why}). Pass a directory you may write, or cache='memory'. "
                               f"Received: cache={cache.directory!r}") from None
    key = source_key(source, n, cache.version, LAYOUT)
    capacity = _capacity(cache, directory)
    # Only a budget given trims what the directory holds: the default shrinks as the cache fills the disk.
    with _sized(cache, capacity, f"in '{directory}'"):
        store, kept = open_kept(directory, key, n, capacity, trim=cache.max_bytes is not None)
    return store, lambda: close_kept(store, kept)


@contextlib.contextmanager
def _sized(cache: Cache, capacity: int, where: str):
    """A store the system cannot make at ``max_bytes`` is refused naming it (not a bare OSError)."""
    try:
        yield
    except (OSError, OverflowError) as e:  # OverflowError: a size past what a C off_t holds (2**63)
        if cache.max_bytes is None or (isinstance(e, OSError) and e.errno not in (
                errno.EFBIG, errno.ENOMEM, errno.EINVAL, errno.EOVERFLOW)):
            raise
        why = e.strerror if isinstance(e, OSError) else "past the largest file size"
        raise ValueError(
            f"Cache: no store of max_bytes={capacity - FIRST_OFFSET:,} bytes can be made {where} ({why}). "
            f"Pass a max_bytes the memory or the file system can hold, or None (half of what is available). "
            f"Received: max_bytes={cache.max_bytes}") from None


__all__ = ["Cache", "open_store", "resolve_cache"]
