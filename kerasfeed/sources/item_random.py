"""Random numbers that belong to an item: a pure function of (seed, pass, index).

NOTE [ Random augmentation is a function of (seed, pass, index) ]
A ``__getitem__`` that draws random numbers (augmentation) should draw the
same numbers for item ``i`` of pass ``e`` however the items are made: with 1
or 8 worker processes, on whichever worker after whatever it made before, on
threads or processes, and in a run resumed mid-pass. Two things give that
(what users read: ``item_rng``'s docstring):

- ``item_rng()``, the calling thread's item's generator. Executors mark every
  ``source[i]`` call they make (``enter``/``leave``: pool and aside threads,
  inline loads in the main thread, worker processes), as do the probe calls of
  ``executor="auto"`` and ``export`` (``item_scope``); outside one it raises,
  except in a ``SceneSequence``'s ``__getitem__``, which marks its own call
  where nothing else did (Keras' own ``fit(seq)``, ``seq[i]``): item ``i`` of
  its pass ``epoch``, seeded by its ``item_seed`` (0 unless set), so that
  ``fit(seq)`` makes the items ``to_loader(seq, seed=item_seed)`` makes.
- Worker processes of a seeded pipeline reseed the global ``random`` and
  ``numpy.random`` before each item (``ItemSeeds.seed_globals``); threads
  share the globals, so nothing reseeds them on the threads executor.

Seeds (``ItemSeeds``; ``seed`` the pipeline's, ``e`` the pass, ``i`` the index):

- ``item_rng()``: ``Generator(PCG64(SeedSequence(seed, spawn_key=(e % 2**32,
  e >> 32, i % 2**32, i >> 32))))``, computed on the item's first call
  (~20 us) and returned again by its later calls (one stream per item).
- ``numpy.random`` (workers only): ``np.random.seed(fmix32((k + i) % 2**32))``
  where ``k`` is 32 bits of a BLAKE2b hash of ``(seed, e)``; ``fmix32`` (the
  MurmurHash3 finalizer) is a bijection, so no two indices of a pass share a
  stream. A 32-bit seed is what makes it cheap: ``np.random.seed`` of an int
  takes ~2 us where a longer key takes ~10 us.
- ``random`` (workers only): ``random.seed(h * 2**64 + i % 2**64)``, ``h``
  96 other bits of that hash (``random.seed`` costs the same for any int).

Without a seed (``seed=None``), an executor draws one from the OS once (on
worker processes the pool's, shared by its workers and the pools that replace
a parked one): ``item_rng()`` is then a function of (pass, index) within one
pipeline and differs between runs. Its workers' globals keep the per-worker
seeding (``seed + worker id``, once at start): their draws depend on which
worker made an item.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import numpy as np

from kerasfeed.sources import stage

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _fmix32(x: int) -> int:
    # MurmurHash3's finalizer: a bijection of 32-bit values that mixes every bit.
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


class ItemSeeds:
    """The seeds of one pipeline's items (NOTE [ Random augmentation is a function of (seed, pass, index) ]).

    Args:
        seed: the pipeline's seed (an int in ``[0, 2**64)``), or None to draw one from the OS.
        given: whether ``seed`` is the user's (default: whether one is passed): only then do worker
            processes reseed the globals.

    Attributes:
        seed: the seed in use (drawn when None was passed); ``given`` as passed.
    """

    __slots__ = ("seed", "given", "_last")

    def __init__(self, seed: Optional[int] = None, *, given: Optional[bool] = None):
        self.given = (seed is not None) if given is None else bool(given)
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._last: tuple = (None, 0)  # (epoch, its pass key): one attribute, so threads read a matching pair

    def pass_key(self, epoch: int) -> int:
        """128 bits of BLAKE2b of ``(seed, epoch)``; the last pass's is kept."""
        last = self._last
        if last[0] == epoch:
            return last[1]
        data = self.seed.to_bytes(16, "little") + int(epoch).to_bytes(16, "little")
        key = int.from_bytes(hashlib.blake2b(data, digest_size=16, person=b"kerasfeed.item").digest(), "little")
        self._last = (epoch, key)
        return key

    def seed_globals(self, epoch: int, index: int) -> None:
        """Reseeds ``random`` and ``numpy.random`` for item ``index`` of pass ``epoch``."""
        key = self.pass_key(epoch)
        np.random.seed(_fmix32(((key & _M32) + index) & _M32))
        random.seed(((key >> 32) << 64) | (index & _M64))

    def generator(self, epoch: int, index: int) -> np.random.Generator:
        """The generator of item ``index`` of pass ``epoch`` (see ``item_rng``)."""
        spawn_key = (epoch & _M32, epoch >> 32, index & _M32, index >> 32)
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=spawn_key)))

    def __repr__(self) -> str:
        return f"ItemSeeds(seed={self.seed}, given={self.given})"


class _Item:
    __slots__ = ("seeds", "epoch", "index", "rng")

    def __init__(self, seeds: ItemSeeds, epoch: int, index: int):
        self.seeds = seeds
        self.epoch = epoch
        self.index = index
        self.rng: Optional[np.random.Generator] = None


class _Current(threading.local):
    item: Optional[_Item] = None


_CURRENT = _Current()


def enter(seeds: ItemSeeds, epoch: int, index: int) -> Optional[_Item]:
    """Marks this thread as making item ``index`` of pass ``epoch``; returns what ``leave`` restores (calls nest)."""
    previous = _CURRENT.item
    _CURRENT.item = _Item(seeds, epoch, index)
    return previous


def leave(previous: Optional[_Item]) -> None:
    """Ends the item ``enter`` started on this thread."""
    _CURRENT.item = previous


def making_item() -> bool:
    """Whether this thread is making an item (``enter`` without its ``leave`` yet)."""
    return _CURRENT.item is not None


@functools.lru_cache(maxsize=None)
def probe_seeds() -> ItemSeeds:
    """Seeds drawn once per process, for item calls made before a pipeline's
    executor exists (``executor="auto"``'s and ``export``'s probes), whose
    items are measured or described and then dropped."""
    return ItemSeeds(None)


@contextmanager
def item_scope(index: int, epoch: int = 0, seeds: Optional[ItemSeeds] = None) -> Iterator[None]:
    """``enter``/``leave`` around a block: item ``index`` of pass ``epoch`` (``seeds`` None: ``probe_seeds()``)."""
    previous = enter(probe_seeds() if seeds is None else seeds, int(epoch), int(index))
    try:
        yield
    finally:
        leave(previous)


def item_rng() -> np.random.Generator:
    """The random generator of the item being made on this thread.

    Call it inside ``__getitem__``: it returns a ``numpy.random.Generator``
    seeded from the pipeline's ``seed``, the pass number and the item's index,
    so item ``i`` of pass ``e`` draws the same numbers on the threads and the
    processes executors, with any number of workers, and in a resumed run.
    Later calls during the same item return the same generator (its draws go
    on). The ``seed`` is the one given to ``to_dataset``/``to_loader``/
    ``ProcessExecutor``/``ThreadExecutor``; without one, the executor draws a
    seed from the OS once, so the draws differ between runs; ``export`` draws
    one per export. A ``SceneSequence`` item made outside kerasfeed (Keras'
    own ``model.fit(seq)``, ``seq[i]``) draws as with ``seed=seq.item_seed``
    (0 unless set) and its pass ``seq.epoch``. Worker processes of a seeded pipeline also reseed the
    global ``random`` and ``numpy.random`` before each item; threads share
    them, so on the threads executor only ``item_rng()`` is exact. The exact
    formula: NOTE [ Random augmentation is a function of (seed, pass, index) ]
    in ``kerasfeed/sources/item_random.py``.

    Returns:
        The item's ``numpy.random.Generator``.

    Raises:
        RuntimeError: called while no item is being made on this thread
            (outside ``__getitem__``, or on a thread the source started; a
            source other than a ``SceneSequence`` called outside kerasfeed).

    Example:

    ```python
    class Noisy(kerasfeed.SceneSequence):
        def __getitem__(self, i):
            rng = kerasfeed.item_rng()
            return self.x[i] + rng.normal(0.0, 0.1, self.x[i].shape).astype("float32")
    ```
    """
    refused = stage.refusal("kerasfeed.item_rng()")
    if refused is not None:
        raise refused
    item = _CURRENT.item
    if item is None:
        raise RuntimeError(
            "kerasfeed.item_rng() works only while kerasfeed makes an item: call it inside the source's "
            "`__getitem__` as called by to_dataset, to_loader, export or an executor's load (not in the epoch "
            "hooks, nor on a thread the source started itself). Keras' own fit(seq) and seq[i] make an item only "
            "of a SceneSequence whose `__getitem__` is a plain function in its class body or a base's (not a "
            "functools.partialmethod, another descriptor, or one set after the class statement). "
            f"Received: a call on thread {threading.current_thread().name!r}, where no item is being made"
        )
    rng = item.rng
    if rng is None:
        rng = item.rng = item.seeds.generator(item.epoch, item.index)
    return rng


__all__ = ["ItemSeeds", "enter", "item_rng", "item_scope", "leave", "making_item", "probe_seeds"]
