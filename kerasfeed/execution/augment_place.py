"""Where a cached source's ``augment`` runs on the threads executor: on the pool, or in the asking thread.

NOTE [ A cheap augment runs where its item is asked for ]
With ``cache=`` and ``augment``, the threads executor's pool reads each
stored item and augments it, and the consumer picks the result up. For a
cheap ``augment`` the hand-over costs more than the work: the pool thread's
wake-up and its turns on the GIL beside Keras' step loop (``fit`` on
``h5aug``, a flip and noise of 0.2-0.4 ms a batch: about 0.52 of the
in-memory rate through the pool; benchmarks/README.md, *A cheap augment run
by the asking thread*). Run in the thread that asks for the item, it costs
its own time and nothing else, but one call at a time: a costly ``augment``
that releases the GIL would lose the pool's parallel calls.

So the cache front (``cache_front.py``) decides per pass, when the pass is
planned, from what the passes before it measured:

- ``AugmentCost``: the thread CPU time an ``augment`` call took (pool threads
  and asking thread alike; CPU time, so a call's waits for the GIL are not
  its own cost);
- the pace of each finished pass: the mean interval between the consumer's
  loads, first to last, for the last pass run each way.

A pass runs on the pool until one has been measured there; then, if an
``augment`` call takes at most ``INLINE_SHARE`` of that pass's interval
between loads, the next pass tries the asking thread. From then on each pass
runs the way whose last pass kept the shorter interval (the chosen way's
pace is measured again every pass, so a way that slows down gives way).
Passes with fewer than ``LEAST_LOADS`` loads, or a tenth of whose items
are made (the first pass, one past a budget), measure no pace. An inline pass
serves its stored items in the front and plans only its misses on the pool;
``augment`` runs there with the pool's item seeds, the default
floating-point environment and the global generators left alone, as a pool
thread runs it, so its items are the same bits. Not with a ``timeout``
(only a pool thread's call can be left behind) or ``copy=``, and not on
worker processes or Ray (their items are made away from the consumer).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

# A pass tries the asking thread when ``augment`` takes at most this share of the interval between loads
# measured on the pool: one thread could then keep the pool's pace, and a trial that loses costs one pass
# at most the augment's own time an item slower.
INLINE_SHARE = 1.0
# The fewest loads (and augment calls) of a pass that decide anything.
LEAST_LOADS = 8


class AugmentCost:
    """The CPU time of its calling thread that ``augment`` took, summed over the calls since the last ``take``.

    Pool threads and the asking thread add to it without a lock: two adds racing lose a sample, no more.
    """

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def take(self, least: int) -> Optional[float]:
        """The mean of the calls since the last ``take`` (None: fewer than ``least``); counts anew."""
        seconds, calls = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return seconds / calls if calls >= least else None


class AugmentPlace:
    """Chooses per pass whether its stored items are augmented by the asking thread (see the NOTE).

    Args:
        cost: what the ``augment`` calls took (``ItemCache.augment_cost``).
    """

    def __init__(self, cost: AugmentCost):
        self._cost = cost
        self._mean: Optional[float] = None  # the last mean CPU time of a call
        self._pace: dict[bool, Optional[float]] = {False: None, True: None}  # interval between loads, by way
        self._passes: dict[int, list] = {}  # epoch -> [first load, last load, loads, inline, stored]
        self._lock = threading.Lock()

    def choose(self, epoch: int, stored: bool) -> bool:
        """Whether pass ``epoch`` augments its stored items in the asking thread; ``stored``: whether its
        items are (nearly) all stored, so that its pace measures the way ``augment`` runs."""
        with self._lock:
            for old in [e for e in self._passes if e != epoch]:
                first, last, loads, inline, measures = self._passes.pop(old)
                if measures and loads >= LEAST_LOADS:
                    self._pace[inline] = (last - first) / (loads - 1)
            mean = self._cost.take(LEAST_LOADS)
            if mean is not None:
                self._mean = mean
            pool, here = self._pace[False], self._pace[True]
            if here is None:
                inline = pool is not None and self._mean is not None and self._mean <= INLINE_SHARE * pool
            else:
                inline = pool is None or here < pool
            self._passes[epoch] = [0.0, 0.0, 0, inline, stored]
            return inline

    def loaded(self, epoch: int) -> None:
        """One load of pass ``epoch`` (any thread; the probe's, outside passes, count nothing)."""
        record = self._passes.get(epoch)
        if record is not None:
            now = time.perf_counter()
            if not record[2]:
                record[0] = now
            record[1] = now
            record[2] += 1

    def figures(self) -> dict:
        """The last measures: ``augment_s``, ``pace_pool_s``, ``pace_inline_s`` (None: not measured)."""
        return {"augment_s": self._mean, "pace_pool_s": self._pace[False], "pace_inline_s": self._pace[True]}


__all__ = ["AugmentCost", "AugmentPlace", "INLINE_SHARE", "LEAST_LOADS"]
