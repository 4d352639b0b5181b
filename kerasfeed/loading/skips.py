"""A budget of skipped items: ``max_skipped=`` of ``to_dataset`` and ``to_loader`` (TF-free).

An item that still fails after its retries (``ItemError``, ``WorkerError``
naming the item, ``SignatureError``) ends the pass by default. With
``max_skipped`` it is left out instead, up to the budget, and counted, logged
once and kept with the resume state (``ResumeState.skipped``).

NOTE [ A skipped item and its batch ]
The rule is positional, so it is the same on every front end, executor and
resumed run:

- with ``batch_size=B`` (items are samples), batch ``k`` of a pass still
  covers the pass positions ``[k*B, (k+1)*B)`` (the dropped remainder, with
  ``drop_remainder``, the positions after the last batch): a skipped item makes
  its batch one sample shorter and moves nothing into it. So a pass keeps its
  number of batches, ``model.fit`` never runs out of data, and a position
  saved as ``batches`` stays ``batches * B`` items. A batch all of whose
  items failed raises (naming it and every item skipped): a batch of no
  samples cannot be trained on.
- with ``batch_size=None`` (each item is a batch), the pass is one batch
  shorter per skipped item. Under ``model.fit`` that epoch ends after the
  batches it has (the next starts on time with the next pass), and kerasfeed
  explains the short epoch in place of Keras' "Your input ran out of data"
  warning (NOTE [ An epoch shortened by items left out ] in
  ``kerasfeed/_keras_epoch_iterator.py``). A saved position counts the skipped items
  before it (``before``).

The budget is per pass: an int count of items, or a float in (0, 1), a
fraction of a pass's items (rounded down). Past it, the item's error is
raised as before, its message naming every item skipped so far.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import threading
from typing import Any, Optional, Union

import numpy as np

from kerasfeed.errors import ItemError, SignatureError, StreamError, WorkerError

logger = logging.getLogger("kerasfeed")

# Passes whose skipped items are kept for messages (a resume needs only its own pass).
KEPT_PASSES = 8
# Items named in an error message at most.
NAMED = 32
# Positions searched around the expected one for a skipped item's position.
SEARCH = 512


def check_max_skipped(value: Any, owner: Optional[str] = None) -> Union[int, float]:
    """``max_skipped`` as given: an int >= 0 (a count per pass) or a float in (0, 1) (a fraction of a pass)."""
    where = f"{owner}: " if owner else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}`max_skipped` must be an int (items a pass may leave out; 0: none) or a float in (0, 1) "
            f"(a fraction of a pass). Received: max_skipped={value!r}"
        )
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ValueError(
                f"{where}`max_skipped` must be a non-negative int (0: no item is left out) or a float in (0, 1). "
                f"Received: max_skipped={value!r}"
            )
        return int(value)
    fraction = float(value)
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"{where}`max_skipped` as a float is a fraction of a pass and must be in (0, 1); give an int for a "
            f"count of items. Received: max_skipped={value!r}"
        )
    return fraction


def skippable(error: BaseException, index: int) -> bool:
    """Whether the failed load of item ``index`` is the item's own failure (it may be left out): not
    a stream's, nor a worker's death while it made another item (its queued items fail with it
    without ``retries``: they did nothing wrong)."""
    if isinstance(error, WorkerError):
        return error.index is not None and int(error.index) == int(index)
    return isinstance(error, (ItemError, SignatureError)) and not isinstance(error, StreamError)


def find_position(view: Any, index: int, guess: int, taken: set) -> Optional[int]:
    """The position of ``index`` in ``view`` nearest ``guess`` and not in ``taken``; None: not there.
    Loads are picked up in pass order, so the search looks near ``guess`` first; an order may hold
    an index twice."""
    n = len(view)
    for lo, hi in ((max(0, guess - SEARCH), min(n, guess + SEARCH)), (0, n)):
        found = [lo + int(k) for k in np.flatnonzero(view.window(lo, hi) == index) if lo + int(k) not in taken]
        if found:
            return min(found, key=lambda p: abs(p - guess))
    return None


class SkipBudget:
    """The items one pipeline left out, per pass, and the budget they count against.

    Thread-safe; touched only when an item failed (and by resume states).

    Args:
        max_skipped: as checked by ``check_max_skipped`` (not 0).
        pass_items: items in a whole pass (None: an endless source, count only).
        batch_size: the front end's (None: items are batches).
        drop_remainder: the last short batch is dropped.
    """

    def __init__(self, max_skipped: Union[int, float], pass_items: Optional[int], batch_size: Optional[int],
                 drop_remainder: bool = False):
        self.max_skipped = max_skipped
        self.pass_items = pass_items
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        self.limit = math.floor(max_skipped * pass_items) if isinstance(max_skipped, float) else int(max_skipped)
        self._lock = threading.Lock()
        # pass -> [(position, index)], in the order skipped; position -1: before a resumed pass's start.
        self._passes: dict[int, list] = {}
        self._offsets: dict[int, int] = {}  # pass -> items before its first one read (a resumed pass)

    # -- a pass ----------------------------------------------------------------
    def begin(self, epoch: int, offset: int) -> None:
        """Pass ``epoch`` is (re)read from position ``offset``: what it skipped from there is forgotten."""
        with self._lock:
            self._offsets[epoch] = offset
            kept = [e for e in self._passes.pop(epoch, []) if e[0] < offset]
            if kept:
                self._passes[epoch] = kept
            for kept_per_pass in (self._passes, self._offsets):
                for old in sorted(kept_per_pass)[:-KEPT_PASSES]:
                    del kept_per_pass[old]

    def taken(self, epoch: int) -> tuple[int, set]:
        """``(offset, positions)``: where pass ``epoch`` was (re)read from; its skipped positions from there."""
        with self._lock:
            offset = self._offsets.get(epoch, 0)
            return offset, {p - offset for p, _ in self._passes.get(epoch, ())}

    def count(self, epoch: int) -> int:
        """Items of pass ``epoch`` left out so far (those before a resumed start included)."""
        with self._lock:
            return len(self._passes.get(epoch, ()))

    def restore(self, epoch: int, indices: Any) -> None:
        """The items a saved run skipped in pass ``epoch`` before its saved position: the budget continues."""
        entries = [(-1, int(i)) for i in indices]
        with self._lock:
            if entries:
                self._passes[epoch] = entries
            else:
                self._passes.pop(epoch, None)

    def skip(self, epoch: int, index: int, position: Optional[int], error: BaseException) -> Optional[BaseException]:
        """Leaves item ``index`` (at ``position`` of pass ``epoch``) out, or says why not.

        Returns:
            None: the item is skipped (logged once). Else the error to raise:
            ``error``'s copy, its message naming every item skipped so far.
        """
        with self._lock:
            entries = self._passes.setdefault(epoch, [])
            if len(entries) >= self.limit:
                why = (f"pass {epoch} already left out {len(entries)} items, its budget ({self._budget_text()}: "
                       f"{self.limit} per pass)")
                return self._refuse(error, epoch, index, position, why)
            entries.append((-1 if position is None else position, index))
            empty = self._emptied_batch(epoch, position)
            if empty is not None:
                entries.pop()
                return self._refuse(error, epoch, index, position, empty)
            count = len(entries)
        logger.warning(
            "kerasfeed: skipped item %d of pass %d%s after %s: %s%s; %d of %d this pass may leave out "
            "(max_skipped=%r).",
            index, epoch, "" if position is None else f" (position {position})", _attempts(error), _cause(error),
            _where(error), count, self.limit, self.max_skipped,
        )
        return None

    # -- resume ----------------------------------------------------------------
    def before(self, epoch: int, batches: int) -> list:
        """``[[epoch, index], ...]``: the items of pass ``epoch`` skipped before its batch ``batches``.

        With ``batch_size`` the batch rule keeps positions: those before
        position ``batches * batch_size``. Without, ``batches`` counts the
        batches delivered, and each skipped one before the next moves it on
        (NOTE [ A skipped item and its batch ]).
        """
        with self._lock:
            entries = sorted(self._passes.get(epoch, ()))
        if self.batch_size is not None:
            return [[epoch, i] for p, i in entries if p < batches * self.batch_size]
        at, out = batches, []
        for p, i in entries:
            if p > at:
                break
            out.append([epoch, i])
            at += 1
        return out

    # -- messages ----------------------------------------------------------------
    def _budget_text(self) -> str:
        if isinstance(self.max_skipped, float):
            return f"max_skipped={self.max_skipped!r} of {self.pass_items} items"
        return f"max_skipped={self.max_skipped!r}"

    def _emptied_batch(self, epoch: int, position: Optional[int]) -> Optional[str]:
        """Why the batch of ``position`` has no item left, or None (a batch with one is fine)."""
        size = self.batch_size
        if size is None or position is None or size > self.limit:
            return None
        k = position // size
        start = k * size
        stop = start + size if self.pass_items is None else min(start + size, self.pass_items)
        if self.drop_remainder and stop - start < size:
            return None  # the dropped remainder: no batch
        skipped = sum(start <= p < stop for p, _ in self._passes[epoch])
        if skipped < stop - start:
            return None
        return (f"every item of batch {k} of pass {epoch} (positions {start} to {stop - 1}) failed, and a batch of "
                "no samples cannot be trained on (use a larger batch_size)")

    def _refuse(self, error: BaseException, epoch: int, index: int, position: Optional[int],
                why: str) -> BaseException:
        named = [(e, i) for e in sorted(self._passes) for _, i in self._passes[e]]
        names = ", ".join(f"item {i} of pass {e}" for e, i in named[:NAMED])
        more = f" and {len(named) - NAMED} more" if len(named) > NAMED else ""
        at = "" if position is None else f" (position {position})"
        text = (f" [not left out: {why}. Items left out so far: {names or 'none'}{more}; this one: item {index} of "
                f"pass {epoch}{at}. Received: max_skipped={self.max_skipped!r}"
                f"{'' if self.batch_size is None else f', batch_size={self.batch_size}'}]")
        return with_note(error, text, skipped=named)


def with_note(error: BaseException, text: str, **attributes: Any) -> BaseException:
    """A copy of ``error`` (same type and attributes) whose message ends with ``text``."""
    new = copy.copy(error)  # by __reduce__: kerasfeed's errors rebuild their message and cause
    new.__dict__.update(error.__dict__)
    new.__dict__.update(attributes)
    message = error.args[0] if error.args else str(error)
    new.args = (f"{message}{text}",) + tuple(error.args[1:])
    if new.__cause__ is None:
        new.__cause__ = error.__cause__
    return new


def _attempts(error: BaseException) -> str:
    attempts = getattr(error, "attempts", None)
    return "1 attempt" if attempts in (None, 1) else f"{attempts} attempts"


def _cause(error: BaseException) -> str:
    if isinstance(error, ItemError):
        return f"{error.exc_type}: {error.exc_message}"
    return f"{type(error).__name__}: {error}"


def _where(error: BaseException) -> str:
    worker, pid = getattr(error, "worker_id", None), getattr(error, "pid", None)
    if worker is not None:
        return f" (worker {worker}, pid {pid})"
    return "" if pid is None else f" (pid {pid})"


__all__ = ["SkipBudget", "check_max_skipped", "find_position", "skippable", "with_note"]
