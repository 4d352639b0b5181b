"""Options of a worker pool, checked once when built."""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Optional


def default_workers() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """Options of a ``WorkerPool``.

    Args:
        workers: number of worker processes; None = the usable CPU count.
        in_flight_per_worker: items requested from one worker at a time (one
            being made, the next ones queued); bounds memory and latency.
        seed: base seed; worker ``k`` seeds ``random`` and ``numpy.random``
            with ``seed + k``. None draws one from the OS.
        timeout: seconds one item may take before the pass fails with a
            ``WorkerError``; None waits as long as the worker is alive.
    """

    workers: Optional[int] = None
    in_flight_per_worker: int = 2
    seed: Optional[int] = None
    timeout: Optional[float] = None

    def __post_init__(self):
        def positive_int(name, value):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
            object.__setattr__(self, name, int(value))

        if self.workers is None:
            object.__setattr__(self, "workers", default_workers())
        else:
            positive_int("workers", self.workers)
        positive_int("in_flight_per_worker", self.in_flight_per_worker)
        if self.seed is None:
            object.__setattr__(self, "seed", int.from_bytes(os.urandom(7), "little"))
        elif isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None. Received: seed={self.seed!r}")
        else:
            object.__setattr__(self, "seed", int(self.seed))
        if self.timeout is not None and (isinstance(self.timeout, bool) or not self.timeout > 0):
            raise ValueError(
                f"`timeout` must be a positive number of seconds or None. Received: timeout={self.timeout!r}"
            )
