"""Retries of failed items: one item's attempts, and the counts an executor reports.

NOTE [ Retries happen in the load that waits for the item ]
============================================================

``retries=N`` (``PoolOptions.retries``) lets an item whose call raised
(``ItemError``), ran past ``timeout=``, or whose worker process died be made
again, up to N more times, by the ``load`` that asks for the item, not by
whoever saw the failure (a reader thread, a pool thread):

- **Order for free.** Loads come in the pass's order; the items made ahead
  after the failed one stay where they are, and the retried item is made
  once more before its load returns (what that guarantees: docs/reliability.md,
  *What each option guarantees*).
- **Attempts are the item's own.** ``Attempts`` lives in the load's frame:
  no table keyed by index that a second pass over the same item (an
  iterator abandoned and started again) could mix up.
- **Only real attempts count.** When a worker dies, every request queued on
  it fails, but only the oldest one (the item it was making) was tried: the
  others fail with a ``WorkerError`` naming another index (or none: a worker
  that died starting), are sent again and keep their retries. A pool that
  failed or closed refuses the new request: that error ends the load.

After the last attempt the load raises the last error with its attempts
(``ItemError.with_attempts``); ``retries=0`` raises the first failure as is.
"""

from __future__ import annotations

import threading
from typing import Optional

from kerasfeed.errors import ItemError, WorkerError, short_cause


def cause_of(err: BaseException) -> str:
    """One short line saying why an attempt failed."""
    if isinstance(err, ItemError) and err.exc_type != "TimeoutError":
        where = "" if err.worker_id is None else f" (worker {err.worker_id}, pid {err.pid})"
        return short_cause(f"{err.exc_type}: {err.exc_message}{where}")
    return short_cause(str(err))


class Attempts:
    """The failed attempts of item ``index``, kept by the load that asks for it; ``retries``: further
    attempts allowed after the first."""

    __slots__ = ("index", "retries", "causes")

    def __init__(self, index: int, retries: int):
        self.index = index
        self.retries = retries
        self.causes: list[str] = []

    def counts(self, err: BaseException) -> bool:
        """Whether ``err`` is a failed attempt of this item, not a request whose worker died making
        another item or none (``index`` None: it died starting, or the pool closed)."""
        return not (isinstance(err, WorkerError) and err.index != self.index)

    def again(self, err: BaseException) -> bool:
        """Records ``err``; True if the item is to be made again (a retry, or
        a request that only shared a dying worker), False if ``err`` is final."""
        if not isinstance(err, (ItemError, WorkerError)):
            return False  # a closed pool, Ctrl-C, a bug: never retried
        if not self.counts(err):
            return True
        self.causes.append(cause_of(err))
        return len(self.causes) <= self.retries

    def final(self, err: BaseException) -> BaseException:
        """The error to raise after the last attempt (``err`` itself after one)."""
        if len(self.causes) <= 1 or not isinstance(err, (ItemError, WorkerError)):
            return err
        return err.with_attempts(self.causes)


class RetryCounts:
    """What retries and worker replacement did over an executor's life (its pools), for ``stats()`` and gauges.

    Attributes:
        retried_items: attempts made again after a failed one.
        requeued_items: requests sent again because their worker died while
            making another item (not an attempt of theirs).
        failed_items: items whose last attempt failed (raised to the consumer).
        replaced_workers: worker processes that died or hung and were replaced.
        recycled_workers: worker processes replaced at ``worker_max_items``
            or ``worker_max_rss``.
        abandoned_threads: threads left running a timed-out call (threads
            executor); a new thread took each one's place.
    """

    FIELDS = (
        "retried_items",
        "requeued_items",
        "failed_items",
        "replaced_workers",
        "recycled_workers",
        "abandoned_threads",
    )

    def __init__(self):
        self._lock = threading.Lock()
        for name in self.FIELDS:
            setattr(self, name, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self, only: Optional[tuple] = None) -> dict:
        return {name: getattr(self, name) for name in (only or self.FIELDS)}


__all__ = ["Attempts", "RetryCounts", "cause_of"]
