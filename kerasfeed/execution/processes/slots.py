"""The pool's shared-memory slots and the budget of items lent without a copy.

A *slot* is one of a worker's shared-memory segments, numbered per worker. A
request (or a stream) names a free slot; the worker writes the item there,
growing the segment to the largest item it carried (``WorkerLoop._write``, the
counterpart of ``SlotTable.map_segment``) and sending the new segment's fd with
its answer. The consumer copies the item out (the slot is free at once) or
*lends* it: its arrays are views of the slot handed to TensorFlow, and the slot
comes back when the last view is gone (``shm.lend``).

Lending is bounded so that a consumer that keeps every item never blocks the
workers: items under ``LEND_MIN_BYTES`` are copied (malloc reuses small
blocks: lending would save little and multiply slots), and so is the rest past
``MAX_LENT_PER_WORKER`` items per worker or ``MAX_LENT_BYTES`` of the segments
they pin in all. Shared memory is thus bounded by about ``in_flight_per_worker +
MAX_LENT_PER_WORKER`` segments per worker and a few answers read ahead of the
consumer's order (21 with 2 in flight, a consumer keeping every item), each
about the size of the item it carries last (a segment far larger than its next
item is made anew: ``shm.oversized``).
"""

from __future__ import annotations

import collections
import errno
import os
from typing import Callable, Optional

from kerasfeed.execution.processes import shm

# Enough lent items for tf.data's buffers (the map's results in order, the prefetch) and the consumer.
MAX_LENT_PER_WORKER = 16
MAX_LENT_BYTES = 256 * 2**20
LEND_MIN_BYTES = 256 * 2**10


class SlotTable:
    """Every worker's slots, their segments, and the lending budget.

    Not thread-safe: its owner (the ``Dispatcher``) holds its lock around every
    call, except ``map_segment`` (only that worker's reader thread calls it) and
    the callbacks from ``loan_returned`` (finalizers, any thread, any moment: a
    lock-free append that ``collect_returned`` applies later).

    Args:
        workers: the number of workers.
        initial: slots each worker starts with (free, no segment yet).
    """

    def __init__(self, workers: int, initial: int):
        self._segments: list[dict[int, shm.Segment]] = [{} for _ in range(workers)]
        self._free: list[list[int]] = [list(range(initial)) for _ in range(workers)]
        self._allocated = [initial] * workers
        self._lent = [0] * workers
        self.lent_bytes = 0
        self.lent_items = 0  # items handed over without a copy (the rest were copied)
        # (worker, slot, bytes pinned) of lent items whose last view is gone.
        self._returned: "collections.deque[tuple[int, int, int]]" = collections.deque()

    # ------------------------------------------------------------ slots
    def take(self, worker: int) -> int:
        """A free slot of ``worker``: the lowest (its segment most likely exists), or a new
        one if every slot is in flight or lent (which the lending budget bounds)."""
        free = self._free[worker]
        if not free:
            self.collect_returned()  # a loan whose last view went since the last look: its slot, not a new one
        if free:
            slot = min(free)
            free.remove(slot)
            return slot
        slot = self._allocated[worker]
        self._allocated[worker] += 1
        return slot

    def give_back(self, worker: int, slot: int) -> None:
        self._free[worker].append(slot)

    def give_back_all(self, worker: int, slots: list[int]) -> None:
        self._free[worker].extend(slots)

    # ------------------------------------------------------------ segments
    def map_segment(self, worker: int, slot: int, fds: list[int], size: Optional[int]) -> None:
        """Maps the new segment a worker sent for ``slot`` (its reader thread only).

        Raises:
            FdsDropped: a new segment was announced but its fd did not come
                (the kernel drops passed fds when this process is at its
                file-descriptor limit).
        """
        if not fds:
            if size is not None:
                raise FdsDropped(
                    errno.EMFILE, f"the fd of a new segment for slot {slot} of worker {worker} was dropped"
                )
            return
        for extra in fds[1:]:
            os.close(extra)
        segments = self._segments[worker]
        old = segments.get(slot)
        segments[slot] = shm.Segment(fds[0], size)
        if old is not None:
            old.close()

    def segment(self, worker: int, slot: int) -> Optional[shm.Segment]:
        return self._segments[worker].get(slot)

    def close_segments(self, worker: int) -> None:
        """Unmaps the worker's segments (a lent one stays mapped until its last view is gone)."""
        for seg in self._segments[worker].values():
            seg.close()
        self._segments[worker].clear()

    # ------------------------------------------------------------ lending
    def try_lend(self, worker: int, nbytes: int, pinned: int) -> bool:
        """Books a loan of an item of ``nbytes`` in a segment of ``pinned`` bytes of ``worker``'s slot if the
        budget allows. The budget counts the segment, which the loan keeps whole: a small item in a segment an
        earlier large one grew pins all of it (13 MB items in 51 MB segments pinned 2.6x the budget)."""
        lend = (
            nbytes >= LEND_MIN_BYTES
            and self._lent[worker] < MAX_LENT_PER_WORKER
            and self.lent_bytes + pinned <= MAX_LENT_BYTES
        )
        if lend:
            self._lent[worker] += 1
            self.lent_bytes += pinned
            self.lent_items += 1
        return lend

    def loan_returned(self, worker: int, slot: int, pinned: int) -> Callable[[], None]:
        """The callback to run when the loan's last view is gone (any thread, no lock)."""
        returned = self._returned
        entry = (worker, slot, pinned)
        return lambda: returned.append(entry)

    def collect_returned(self) -> None:
        """Frees the slots of loans whose last view is gone."""
        while self._returned:
            worker, slot, pinned = self._returned.popleft()
            self._lent[worker] -= 1
            self.lent_bytes -= pinned
            self._free[worker].append(slot)

    # ------------------------------------------------------------ queries
    def free_slots(self, worker: int) -> list[int]:
        """``worker``'s slots neither in flight, lent nor streaming, sorted."""
        return sorted(self._free[worker])

    def allocated(self, worker: int) -> int:
        """How many slots ``worker`` has (free or not)."""
        return self._allocated[worker]

    def in_use(self) -> int:
        """Slots of all workers in flight, lent or streaming."""
        return sum(self._allocated) - sum(len(f) for f in self._free)

    def shm_bytes(self) -> int:
        """Bytes of shared memory mapped (every worker's segments)."""
        return sum(s.size for segments in self._segments for s in segments.values())


class FdsDropped(OSError):
    """A segment's fd was dropped on its way to this process (fd limit)."""


def fd_limit_message(what: str) -> str:
    """Explains running out of file descriptors, with the limit and a hint."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = "?"
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    target = 4 * soft if hard == resource.RLIM_INFINITY else min(hard, 4 * soft)
    return (
        f"kerasfeed: this process ran out of file descriptors: {what}. Every shared-memory segment a worker "
        f"sends is an fd (up to in_flight_per_worker + {MAX_LENT_PER_WORKER} per worker while the consumer "
        f"keeps items); {open_fds} are open, and the limit (RLIMIT_NOFILE) is {soft} (hard limit {hard_text}). "
        f"Raise it (`ulimit -n {target}` before starting Python, or resource.setrlimit(resource.RLIMIT_NOFILE, "
        f"({target}, hard)) at start-up), keep fewer items alive, or use fewer workers. "
        f"Received: RLIMIT_NOFILE=({soft}, {hard_text}), open fds={open_fds}"
    )
