"""Which worker process is running the code: ``get_worker_info()`` (import-free, cheap for ``__getitem__``)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Describes the worker process running the current code.

    Attributes:
        id: the worker's id, ``0 .. num_workers - 1``.
        num_workers: how many worker processes the pool has.
        seed: what this worker seeded the global ``random`` and
            ``numpy.random`` with when it started (before ``worker_init``):
            the pool's base seed plus ``id``. With a pipeline ``seed``, it
            also reseeds them before each item from (seed, pass, index), so
            an item's draws do not depend on the worker (``kerasfeed.item_rng``).
    """

    id: int
    num_workers: int
    seed: int

    def __post_init__(self):
        if not 0 <= self.id < self.num_workers:
            raise ValueError(
                f"WorkerInfo.id must be in [0, num_workers). Received: id={self.id}, "
                f"num_workers={self.num_workers}"
            )


_INFO: Optional[WorkerInfo] = None


def get_worker_info() -> Optional[WorkerInfo]:
    """Returns the current worker's ``WorkerInfo``, or None in the main process.

    Usable in ``__getitem__``, in ``worker_init`` and while the source is
    unpickled in a worker (``__setstate__``).

    Example:

    ```python
    class Shards(kerasfeed.SceneSequence):
        def __getitem__(self, i):
            info = kerasfeed.get_worker_info()
            where = "main process" if info is None else f"worker {info.id}"
            ...
    ```
    """
    return _INFO


def _set_worker_info(info: Optional[WorkerInfo]) -> None:
    global _INFO
    _INFO = info
