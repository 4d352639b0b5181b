"""A pipeline's passes under ``model.fit``: which pass a fit reads next (TF-free, Keras-free).

NOTE [ The pass follows Keras' epoch ] (``kerasfeed/_keras_fit.py``) says why; ``FollowsFit`` is the part of
``PassPipeline`` that does it: the fit a pass begins under, the pins a backup restores, a kerasfeed
callback's word on the epoch, and the model build's pass under a resume.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional

from kerasfeed._keras_epoch_iterator import check_epoch_length, epoch_steps, iterator_ref, same_iterator
from kerasfeed._keras_fit import FitView, find_fit, refuse
from kerasfeed.observe.lookup import PIPELINE_ATTR, find_all_tagged


def keras_pass(epoch: int, steps_per_epoch: Optional[int], per_pass: int, initial_epoch: int, *,
               owner: str = "kerasfeed", derived: bool = False) -> Optional[int]:
    """The pass Keras epoch ``epoch`` reads; a pure function.

    One epoch is one pass (``steps_per_epoch`` None or a whole pass): pass
    ``epoch``. Epochs of another length read the data on across epochs (Keras
    keeps one iterator), so passes are counted on from the pipeline's own
    first one (None), which is right for a call that starts at epoch 0.
    ``derived``: the length is not ``steps_per_epoch`` but the count of a
    dataset derived to read more than a pass an epoch (``repeat(k)``).

    Raises:
        ValueError: a call starting at a later epoch with epochs that are not
            passes: where the data stands is not the epoch.
    """
    if not steps_per_epoch or steps_per_epoch == per_pass:
        return epoch
    if not initial_epoch:
        return None
    told, fix = ((f"epochs of {steps_per_epoch} steps (its dataset derived to read more than a pass an epoch, such "
                  "as repeat())", "Give `fit` the kerasfeed dataset itself (an epoch is then a pass)") if derived else
                 (f"steps_per_epoch={steps_per_epoch}", "Drop steps_per_epoch (an epoch is then a pass) or make it a "
                  "whole pass"))
    raise ValueError(
        f"{owner}: this fit starts at epoch {initial_epoch} with {told}, and a pass has {per_pass} batches: Keras "
        f"reads the passes across its epochs, so epoch {initial_epoch} does not say which pass to read (nor where in "
        f"it). {fix}; or resume with initial_state={{'epoch': ..., 'batches': ...}} from kerasfeed.TrainingProgress. "
        f"Received: initial_epoch={initial_epoch}, {'epoch length' if derived else 'steps_per_epoch'}="
        f"{steps_per_epoch}, batches per pass={per_pass}"
    )


_BUILD_READS = 2  # batches a model build reads at most (``_build_pass``)


class FitTarget(NamedTuple):
    """The pass a begin under a running ``fit`` reads (``FollowsFit.fit_target``)."""

    epoch: Optional[int]  # None: the pipeline's own next pass, begun by a model build (begun again after it)
    skip: int  # items of it already trained on
    build: bool = False  # begun by the model build of a trainer whose loop begins it again (``FitView.builds``)


class FollowsFit:
    """``PassPipeline``'s passes under ``model.fit`` (a base class of it). Its attributes, set by the pipeline:
    ``_follow`` (no ``initial_state``: passes are the fit's epochs), ``_lock``, ``_pins`` (pass -> items of it
    already trained on), ``_expected`` (a kerasfeed callback's ``(epoch iterator ref, epoch)``),
    ``batches_per_pass``, ``items_per_batch``, ``skips``, ``_length`` and ``stats``."""

    _follow: bool
    # Its passes end under tf.data's length check (``assert_cardinality``: a whole pass's batches, set by
    # ``tfdata/adapter.py``): a resumed pass read past its end fails there (``start_epoch_at``).
    length_checked: bool = False
    _lock: threading.Lock
    _pins: dict
    _expected: Optional[tuple]
    _length: Optional[int]
    batches_per_pass: Optional[int]
    items_per_batch: int
    skips: Any
    stats: Any

    def fit_target(self) -> Optional[FitTarget]:
        """``(pass, items skipped, build)`` a pass begun now reads because a running
        ``model.fit`` reads this pipeline; None when none does (or its epochs
        are not passes, or an ``initial_state`` numbers the passes).

        Raises:
            KerasStructureError: the fit's frame cannot say its epoch where that decides
                the pass (``FitView.unreadable``), or says another than a kerasfeed callback's.
        """
        fit = find_fit(self.held_by) if self._follow else None
        if fit is None:
            return None
        with self._lock:
            said = self._expected if self._expected is not None and same_iterator(self._expected[0], fit) else None
        if fit.missing:
            with self._lock:
                resuming = bool(self._pins)
            fit.unreadable(resuming=resuming, said=said is not None)  # raises where counting would read others
            if said is None:
                return None
            epoch = said[1]
        else:
            length = self._epoch_length(fit)
            epoch = keras_pass(fit.current, length, self.batches_per_pass, fit.initial_epoch,
                               derived=bool(length) and not fit.steps_per_epoch)
        if said is not None and fit.epoch is not None and epoch is not None and epoch != said[1]:
            raise refuse(f"its `fit` frame says epoch {fit.epoch} where a kerasfeed callback's on_epoch_begin said "
                         f"{said[1]}", "The pass to read is not known: refused rather than train another one.")
        if self._held_directly(fit):
            check_epoch_length(fit, self.batches_per_pass)
        if epoch is None:
            # Epochs that are not passes: counted on from the pipeline's first. A pass begun before the fit's
            # loop is the model build's batch (JAX, torch; TensorFlow under a strategy), after which Keras makes
            # a new iterator: that pass is begun again by the loop (``_upcoming``), not the next one.
            return FitTarget(None, 0, True) if fit.epoch is None else None
        with self._lock:
            skip = self._pins.get(epoch)
        if skip is not None or fit.epoch is not None:
            return FitTarget(epoch, skip or 0, fit.builds)
        return FitTarget(*self._build_pass(fit, epoch), fit.builds)

    def _epoch_length(self, fit: FitView) -> Optional[int]:
        """The steps of the fit's epochs where they are not this pipeline's passes: ``steps_per_epoch``, or
        the count of a dataset derived from it that reads more than a pass an epoch (``ds.repeat(k)``:
        each epoch's ``k`` passes are then counted on, as under ``steps_per_epoch``), else None."""
        if fit.steps_per_epoch or self._held_directly(fit):
            return fit.steps_per_epoch
        steps = epoch_steps(fit)
        return steps if steps is not None and self.batches_per_pass and steps > self.batches_per_pass else None

    def _build_pass(self, fit: FitView, epoch: int) -> tuple[int, int]:
        """NOTE [ The model build's pass under a resume ]: Keras' JAX and torch trainers build the model
        from a batch of a throwaway iterator before ``on_train_begin``, where a backup restores the epoch
        and pins the position: that pass, which the next iterator takes over, would be the fit's first
        one, not the resumed one, and the executor would make a window of it for nothing. A kerasfeed
        callback among the fit's ``callbacks`` says beforehand where it will restore
        (``kerasfeed_resume_hint``). Only a hint: a pass the restore does not pin is begun again."""
        for callback in fit.callbacks or ():
            hint = getattr(callback, "kerasfeed_resume_hint", None)
            at = hint() if callable(hint) and self.skips is None and fit.steps_per_epoch is None else None
            # The build reads a batch, Keras' JAX trainer off the CPU one more ahead: through tf.data's length check,
            # a resumed pass of fewer fails it (the build's pass is begun again by the loop, without the check).
            room = at is not None and (self.batches_per_pass is None or at[1] + _BUILD_READS <= self.batches_per_pass)
            if room and 0 <= at[1] * self.items_per_batch < (self._length or 0):
                return int(at[0]), int(at[1]) * self.items_per_batch
        return epoch, 0

    def takes_over(self, epoch: int, skip: int) -> bool:
        """Whether the pass begun as ``(epoch, skip)`` (by a model build) is the one a running ``fit``
        reads next (True outside ``fit``); the pin it reads by is then spent, as a ``begin`` spends it."""
        target = self.fit_target()
        if target is not None and target[:2] != (epoch, skip):
            return False
        with self._lock:
            self._pins.pop(epoch, None)
        if self.stats is not None:  # the build's pick-ups are the fit's first epoch's (InputStats)
            self.stats.taken_over(epoch)
        return True

    def expect(self, view: Optional[FitView], epoch: Optional[int]) -> None:
        """A kerasfeed callback's ``on_epoch_begin(epoch)`` (Keras' public route) for the fit ``view``:
        its passes are checked against the frame's epoch, and follow it where the frame has none
        (None: the fit ended)."""
        ref = iterator_ref(view) if epoch is not None else None
        with self._lock:
            self._expected = None if ref is None else (ref, epoch)

    def _held_directly(self, fit: FitView) -> bool:
        return getattr(fit.x, PIPELINE_ATTR, None) is self

    def _check_keras_length(self) -> None:
        """The pass after a resumed one, under fit: Keras must count a whole pass's steps (its
        ``cardinality()``), or it cuts this pass short (``check_epoch_length``)."""
        fit = find_fit(self.held_by)
        if fit is not None and not fit.missing and self._held_directly(fit):
            check_epoch_length(fit, self.batches_per_pass)

    def pin(self, epoch: int, skip: int) -> None:
        """The pass ``epoch``, when it begins under ``fit``, starts after its
        first ``skip`` items (kerasfeed.BackupAndRestore resuming inside it)."""
        with self._lock:
            self._pins = {epoch: skip} if skip else {}

    @property
    def follows_keras(self) -> bool:
        """Whether passes begun under ``model.fit`` are the fit's epochs (no ``initial_state`` given)."""
        return self._follow

    def held_by(self, x: Any) -> bool:
        """Whether ``x`` (what a ``fit`` is given) reads through this pipeline: a
        dataset or loader made with it, one derived from it, or a loader whose
        TensorFlow dataset (under that backend) is."""
        if x is None:
            return False
        for candidate in (x, getattr(x, "_tf_dataset", None)):  # a zip of several kerasfeed datasets: each
            if candidate is not None and any(p is self for p in find_all_tagged(candidate, PIPELINE_ATTR)):
                return True
        return False


__all__ = ["FitTarget", "FollowsFit", "keras_pass"]
