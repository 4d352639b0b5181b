"""Options of a worker pool: built once from the public keywords, checked, passed whole.

``to_dataset`` (and ``ProcessExecutor``) build one ``PoolOptions`` from their
flat keyword arguments; the executor factory, ``executor="auto"``, the
executor and the pool take that object as it is (Grain's options style).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from kerasfeed import _validation as _v


def default_workers() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """Options of a ``WorkerPool``, checked when built.

    Args:
        workers: number of worker processes; None = the usable CPU count
            (see ``resolved``).
        worker_init: run once in each worker after the source arrives.
        seed: base seed; worker ``k`` seeds ``random`` and ``numpy.random``
            with ``seed + k``. None draws one from the OS (see ``resolved``).
        in_flight_per_worker: items requested from one worker at a time (one
            being made, the next ones queued); bounds memory and latency.
        timeout: seconds one item may take before the pass fails with a
            ``WorkerError``; None waits as long as the worker is alive.

    Raises:
        TypeError, ValueError: a bad value (see ``kerasfeed._validation``).

    Example:

    ```python
    opts = PoolOptions(workers=2, seed=0)
    opts.resolved().workers  # 2; PoolOptions().resolved().workers is the CPU count
    ```
    """

    workers: Optional[int] = None
    worker_init: Optional[Callable[[], None]] = None
    seed: Optional[int] = None
    in_flight_per_worker: int = 2
    timeout: Optional[float] = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("workers", _v.positive_int("workers", self.workers, allow_none=True))
        _v.optional_callable("worker_init", self.worker_init)
        put("seed", _v.seed("seed", self.seed))
        put("in_flight_per_worker", _v.positive_int("in_flight_per_worker", self.in_flight_per_worker))
        put("timeout", _v.seconds("timeout", self.timeout))

    @property
    def given(self) -> bool:
        """Whether process-only options (``workers``, ``worker_init``) were set."""
        return self.workers is not None or self.worker_init is not None

    def resolved(self) -> "PoolOptions":
        """These options with ``workers`` and ``seed`` made concrete (a pool's own copy)."""
        workers = default_workers() if self.workers is None else self.workers
        seed = int.from_bytes(os.urandom(7), "little") if self.seed is None else self.seed
        return dataclasses.replace(self, workers=workers, seed=seed)
