"""How a worker away from the consumer calls ``source[index]`` (light: numpy and the standard library).

A worker process (``processes/worker.py``) and a Ray actor (``ray/actor.py``)
each keep their copy of the source, the pass they were last told (``epoch``),
the error of a source state they could not apply (``state_error``: every
later item fails with it), the item seeds (``seeds``) and, with ``cache=``,
the ``cached_items.ItemCache`` their items go through (``cache``, else None).
``call_source`` turns those into an item, so both make the same bits.
"""

from __future__ import annotations

import time
from typing import Any

from kerasfeed.sources import item_random
from kerasfeed.sources.base import set_epoch


def call_source(worker: Any, index: int, epoch: int) -> tuple[Any, float]:
    """``(source[index], seconds it took)`` for pass ``epoch`` on ``worker``.

    Raises:
        RuntimeError: the state sent at the start of this pass could not be
            applied (chained to that error).
        Exception: whatever ``source[index]`` raised.
    """
    if worker.state_error is not None:
        raise RuntimeError(
            "the source's state sent at the start of this pass could not be applied in the worker: "
            f"{type(worker.state_error).__name__}: {worker.state_error}"
        ) from worker.state_error
    if epoch != worker.epoch:
        set_epoch(worker.source, epoch)
        worker.epoch = epoch
    seeds = worker.seeds
    if seeds.given and not getattr(worker, "threaded", False):  # threads share the globals (worker_threads.py)
        seeds.seed_globals(epoch, index)
    t0 = time.perf_counter()
    previous = item_random.enter(seeds, epoch, index)
    cache = worker.cache  # cache=: NOTE [ An item with cache= ] (cached_items.py)
    try:
        item = worker.source[index] if cache is None else cache.make(worker.source, index)
    finally:
        item_random.leave(previous)
    return item, time.perf_counter() - t0


__all__ = ["call_source"]
