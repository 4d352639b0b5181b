"""A loader's passes as Python iterators, and Keras' model-build replay.

Every ``iter(loader)`` gives a ``PassIterator``; the pass it reads starts
(epoch hooks, the executor's plan) on its first ``next``. Keras builds an
unbuilt model under JAX and PyTorch from one batch of a throwaway iterator,
then resets its epoch iterator: the pass that iterator opened is then taken
over by the next one, which yields the batches read so far again, so epoch
``k`` of ``fit`` reads pass ``k`` (``Passes.hand_over`` decides when, from
the loader's ``on_epoch_end`` called by Keras' ``EpochIterator.reset``; called
at an epoch's end, ``Passes.release``: a call of 1-2 steps read its pass).

An iterator may read ahead of what its consumer took: Keras' JAX trainer
reads one batch ahead on an accelerator (a build then reads two), and a
device prefetch (``device.py``) reads its depth ahead. Each iterator says how
many batches it may have read when a build gives it up (``keep``): the pass
keeps that many, and is taken over only while nothing it read was dropped.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.loading.begins import pass_of

# What ``read`` returns when a pass ends on items left out (batch_size=None, max_skipped).
END = object()


class Pass:
    """One pass being read: its order, how far it was read, its first batches (kept while
    at most ``keep``, to replay a pass Keras opened only to build the model). ``lock`` is
    held while a batch is read: an iterator taking the pass over waits for a read still
    under way in the one it replaces.
    """

    __slots__ = ("epoch", "ticket", "skip", "indices", "batches", "position", "skipped", "kept", "keep", "reader",
                 "lock", "first")

    def __init__(self, ticket: int, indices: np.ndarray, batches: int, reader: int, keep: int = 1, skip: int = 0,
                 first: bool = False):
        # The pipeline's begin of the pass, which its loads pass back (NOTE [ A pass begun again ]).
        self.ticket, self.epoch = ticket, pass_of(ticket)
        self.skip = skip  # items of the pass before its first batch (a resumed pass)
        # The loader's first pass: one resumed by initial_state is shorter for Keras too; any other
        # (a model build's resumed pass: Keras' epoch iterator starts at its batch) counts whole.
        self.first = first
        self.indices = indices
        self.batches = batches
        self.position = 0  # batches of this pass read
        self.skipped = 0  # items left out before the next one (batch_size=None, max_skipped)
        self.kept: Optional[list] = []  # the batches read, while at most `keep`; None after
        self.keep = keep
        self.reader = reader  # id of the iterator reading it
        self.lock = threading.Lock()


class Passes:
    """Which pass each iterator of one loader reads.

    Args:
        begin: ``PassPipeline.begin``: starts the next pass, returns
            ``(indices, ticket)``.
        read: ``BatchReader.read``: batch ``p.position`` of pass ``p``.
        per_pass: batches in a whole pass.
        first_pass: batches in the first pass (fewer when resumed inside it).
        items: items in a whole pass.
        count: batches that a pass of this many items makes.
        takes_over: ``PassPipeline.takes_over``: whether a pass begun as
            ``(pass, items skipped)`` is the one a running ``fit`` reads next.
    """

    def __init__(self, begin: Callable[[], tuple], read: Callable[[Pass], Any], per_pass: int, first_pass: int,
                 items: int, count: Callable[[int], int], takes_over: Callable[[int, int], bool]):
        self._begin_pass = begin
        self.read = read
        self.per_pass = per_pass
        self._first_pass = first_pass
        self._items = items
        self._count = count
        self._takes_over = takes_over
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._newest = 0  # id of the newest iterator
        self._open: Optional[Pass] = None  # the pass begun last
        self._peek: Optional[Pass] = None  # a pass the next iterator takes over
        self._begun = False

    def iterator(self, keep: int = 1) -> "PassIterator":
        """A new iterator; it takes over the pass ``hand_over`` kept, if any. ``keep``: batches it
        may have read beyond what its consumer took when a model build gives it up, plus one (1: it
        reads only what is asked for)."""
        with self._lock:
            ident = next(self._ids)
            self._newest = ident
            adopted, self._peek = self._peek, None
            if adopted is not None:
                adopted.reader = ident
        return PassIterator(self, ident, adopted, keep)

    def begin(self, reader: int, keep: int = 1) -> Pass:
        """Starts the next pass for iterator ``reader``."""
        with self._lock:
            if self._open is not None and self._open is not self._peek:
                self._open.kept = None  # no longer replayable: release it
            indices, ticket = self._begin_pass()
            # A pass begun under fit may start anywhere (its epoch; a pinned resume): counted from its items.
            batches = self._count(len(indices))
            first, self._begun = not self._begun, True
            self._open = Pass(int(ticket), indices, batches, reader, keep, self._items - len(indices), first)
            return self._open

    def current(self, p: Pass) -> bool:
        """Whether ``p`` is the pass a running ``fit`` reads next (True outside ``fit``):
        a pass a model build read before a restored epoch is not."""
        return self._takes_over(p.epoch, p.skip)

    def carry_on(self, p: Pass) -> None:
        """The reader went on with its own iterator (Keras with
        ``steps_per_epoch``): the pass is no longer one to take over."""
        if self._peek is p:
            with self._lock:
                if self._peek is p:
                    self._peek = None

    def _replayable(self) -> Optional[Pass]:
        p = self._open
        kept = None if p is None or p.reader != self._newest else p.kept  # read once: a reader may drop it
        return p if kept is not None and 1 <= p.position == len(kept) else None

    @property
    def next_batches(self) -> int:
        """Batches in the pass read next."""
        with self._lock:
            p = self._peek or self._replayable()
            if p is not None:
                return self._first_pass if p.first else self.per_pass
            return self.per_pass if self._begun else self._first_pass

    def next_batches_of(self, skip: int) -> int:
        """Batches in the pass read next by another pipeline (a loader's dataset under TensorFlow), which
        says how many of its items were read already (``PassPipeline.next_skip``)."""
        return self._first_pass if skip else self.per_pass

    def release(self) -> None:
        """A Keras call's epoch ended (not a model build's reset): its pass is read, never taken over,
        even when it read no more batches than a build (``fit``/``evaluate``/``predict`` of 1-2 steps)."""
        with self._lock:
            self._peek = None
            if self._open is not None:
                self._open.kept = None

    def hand_over(self) -> None:
        """After a model build took one batch (and its iterator read at most
        ``keep`` batches), the next iterator takes over that pass."""
        with self._lock:
            p = self._replayable()
            if p is not None:
                self._peek = p


class PassIterator:
    """Iterates one pass; the pass starts (hooks, executor plan) on the first ``next``."""

    def __init__(self, passes: Passes, ident: int, adopted: Optional[Pass], keep: int = 1):
        self._passes = passes
        self._id = ident
        self._pass = adopted
        self._keep = keep
        self._replay: Optional[list] = None  # an adopted pass's kept batches, taken on the first next
        self._done = False
        # True when a device prefetch thread calls ``next``: its reads are not the consumer's
        # (NOTE [ A prefetch thread is not the consumer ] in device.py).
        self.prefetched = False

    def carry_on(self) -> None:
        """The consumer took a batch of this iterator (``Passes.carry_on``)."""
        p = self._pass
        if p is not None and p.reader == self._id:
            self._passes.carry_on(p)

    def __iter__(self) -> "PassIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        passes = self._passes
        p = self._pass
        if p is not None and self._replay is None:
            with p.lock:  # waits for a read still under way in the iterator given up
                if p.reader == self._id and (p.kept is None or len(p.kept) != p.position or not passes.current(p)):
                    # it read more than it kept, or fit reads another pass (a restored epoch): begin that
                    p = self._pass = None
        if p is None:
            p = self._pass = passes.begin(self._id, self._keep)
        with p.lock:
            if p.reader != self._id:
                raise RuntimeError(
                    "kerasfeed: this loader iterator was superseded: a newer iterator took over its pass "
                    f"(pass {p.epoch}). Iterate the newest one. Received: a call to next() on the older iterator."
                )
            if not self.prefetched:
                passes.carry_on(p)
            if self._replay is None:  # first next: an adopted pass replays what it kept
                self._replay = list(p.kept or ())
                p.keep = max(p.keep, self._keep)
            if self._replay:
                return self._replay.pop(0)
            batch = passes.read(p) if p.position < p.batches else END
            if batch is END:  # read to its end, or it ended on items left out (max_skipped)
                self._done = True
                p.kept = None  # never taken over (a one-batch pass included)
                raise StopIteration
            p.position += 1
            if p.kept is not None:
                if p.position <= p.keep:
                    p.kept.append(batch)
                else:
                    p.kept = None
            return batch


__all__ = ["END", "Pass", "PassIterator", "Passes"]
