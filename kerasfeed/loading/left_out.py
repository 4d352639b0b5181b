"""A pipeline's items left out under ``max_skipped`` (TF-free): ``LeavesOut``, a base class of ``PassPipeline``.

An item whose error the budget allows is left out (``loading/skips.py``: ``SkipBudget``; a running fit hears
why its epoch ends early: NOTE [ An epoch shortened by items left out ]); one that failed only because its
worker died making another is loaded again once the executor restarts without that other; the items left
out before a position are what a resume state keeps.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

from kerasfeed._keras_epoch_iterator import explain_short_epochs
from kerasfeed._keras_fit import find_fit
from kerasfeed.errors import WorkerError
from kerasfeed.loading.begins import pass_of
from kerasfeed.loading.skips import SkipBudget, find_position

# Pool restarts one load waits through (max_skipped without retries: workers dying on other items).
RESTARTS = 8


class LeavesOut:
    """``PassPipeline``'s items left out (a base class of it). Its attributes, set by the pipeline:
    ``executor``, ``skips`` (None without ``max_skipped``), ``stats``, ``batches_per_pass``, ``_begins``,
    ``_lock`` and ``_short`` (the last pass, complete but short: ``(pass, items left out)``); its
    ``_arrays`` loads an item, and ``held_by`` (``FollowsFit``) tells whether a fit reads it."""

    executor: Any
    skips: Optional[SkipBudget]
    stats: Any
    batches_per_pass: Optional[int]
    _begins: Any
    _lock: threading.Lock
    _short: Optional[tuple]

    def _after_death(self, index: int, ticket: int, error: WorkerError) -> Optional[list]:
        """Item ``index`` failed only because its worker died making item ``error.index`` (no
        retries: the pool closed): the executor restarts without that item (``Executor.item_skipped``;
        its own load then fails at once, where it may be left out) and ``index`` is loaded again."""
        epoch = pass_of(ticket)
        for _ in range(RESTARTS):
            self.executor.item_skipped(int(error.index), epoch)
            try:
                arrays = self._arrays(index, ticket)
            except WorkerError as again:
                if again.index is None or int(again.index) == index:
                    raise
                error = again
                continue
            error = None  # a retried error's traceback holds this frame (see _arrays)
            return arrays
        self.executor.pass_failed(epoch)
        raise error

    def _leave_out(self, index: int, ticket: int, error: BaseException) -> Optional[BaseException]:
        """Leaves the failed item out if the budget allows (None), else the error to raise."""
        epoch = pass_of(ticket)
        refused = self.skips.skip(epoch, index, self.position_of(index, ticket), error)
        if refused is not None:
            return refused
        self.executor.item_skipped(index, epoch)
        if self.stats is not None:
            self.stats.skipped(epoch)
        if self.skips.batch_size is None:
            self._explain_under_fit()
        return None

    def _explain_under_fit(self) -> None:
        """Items are batches: a running fit whose epochs are passes hears why its
        epoch ends early (NOTE [ An epoch shortened by items left out ])."""
        fit = find_fit(self.held_by)
        if fit is None or fit.steps_per_epoch not in (None, self.batches_per_pass):
            return
        ref = weakref.ref(self)  # the epoch iterator may outlive this fit's data
        explain_short_epochs(fit, lambda: None if ref() is None else ref().short_epoch_text())

    def short_epoch_text(self) -> Optional[str]:
        """Why the pass just read ended early (once), or None if it did not end complete and short."""
        with self._lock:
            short, self._short = self._short, None
        if short is None:
            return None
        epoch, left = short
        return (f"kerasfeed: pass {epoch} ended {left} batch{'es' if left > 1 else ''} early: its {left} item"
                f"{'s' if left > 1 else ''} left out (max_skipped, batch_size=None) were whole batches; the epoch "
                "ends after the batches it has, and the next starts with the next pass.")

    def position_of(self, index: int, ticket: int) -> Optional[int]:
        """The position in the pass begun as ``ticket`` of item ``index`` being loaded now (None: not
        known). Items are loaded in pass order (a parallel map only a few apart): the search starts at
        the number loaded so far."""
        view, left = self._begins.progress(ticket)
        if view is None:
            return None
        offset, taken = self.skips.taken(pass_of(ticket))
        found = find_position(view, index, len(view) - left, taken)
        return None if found is None else offset + found

    def skipped_before(self, epoch: int, batches: int) -> list:
        """``[[epoch, index], ...]`` left out of pass ``epoch`` before its batch
        ``batches`` (what a resume state keeps; empty without ``max_skipped``)."""
        return [] if self.skips is None else self.skips.before(epoch, batches)

    def resume_skipped(self, epoch: int, indices: Any) -> int:
        """A saved run left ``indices`` out of pass ``epoch`` before its saved position: the budget's
        count continues from them. Returns the items they add to that position (batch_size=None: each
        was a batch)."""
        if self.skips is None:
            return 0
        self.skips.restore(epoch, indices)
        return len(indices) if self.skips.batch_size is None else 0


__all__ = ["LeavesOut", "RESTARTS"]
