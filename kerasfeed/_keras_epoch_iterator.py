"""Keras' ``EpochIterator``: what kerasfeed reads and patches of it, each with its check (TF-free,
Keras-free). Part of NOTE [ Keras' private structure ] in ``kerasfeed/_keras_fit.py`` (2. and 3.)."""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import weakref
from typing import Any, Callable, Optional

from kerasfeed._keras_fit import FitView, keras_minor, refuse, report

logger = logging.getLogger("kerasfeed")

_QUIET_RUN_OUT = (3, 16)  # the first Keras that warns "ran out of data" only under steps_per_epoch (NOTE below)


def start_epoch_at(view: FitView, skip: int, *, owner: str, length_checked: bool = False) -> None:
    """Makes the fit's next epoch number its steps from ``skip`` and stop at its usual end.

    ``length_checked``: the fit reads a kerasfeed ``tf.data`` pass whose length tf.data checks
    (``FollowsFit.length_checked``); a resumed pass that Keras would read past its end
    (``_past_the_end``) is read without that check (NOTE [ A resumed pass read past its end ]), or
    refused where Keras does not read the kerasfeed dataset itself.

    NOTE [ Resuming inside an epoch ] (``integrations/fit_data.py``): Keras'
    ``EpochIterator._enumerate_iterator`` (a generator of ``(step, iterator)``,
    ``(begin, end, iterator)`` since 3.11) is replaced on the instance for that
    one epoch; after it, ``_current_iterator``/``_steps_seen`` are set as after
    a pass read to its end and the adapter's ``on_epoch_end`` is called.

    Raises:
        KerasStructureError: any of these is missing or of another shape (the
            epoch would train other batches than the interrupted run's).
        ValueError: Keras would read past the end of the resumed pass of a dataset
            derived from kerasfeed's, where tf.data's length check fails (``_past_the_end``).
    """
    iterator = view.epoch_iterator
    then = (f"{owner} cannot resume inside an epoch with it: refused rather than train other batches. Delete the "
            "backup to start the epoch again, or use a Keras release listed in docs/keras_versions.md.")
    if iterator is None:
        raise refuse(f"its `fit` has no {', '.join(view.missing) or '`epoch_iterator`'}", then)
    absent = [f"`{n}`" for n in ("_current_iterator", "_steps_seen", "data_adapter") if not hasattr(iterator, n)]
    if not inspect.isgeneratorfunction(getattr(type(iterator), "_enumerate_iterator", None)):
        absent.insert(0, "`_enumerate_iterator` (a generator)")
    if absent:
        raise refuse(f"its EpochIterator ({type(iterator).__qualname__}) has no {', '.join(absent)}", then)
    steps = iterator.num_batches
    if not isinstance(steps, int) or steps <= skip:
        raise refuse(f"its epoch iterator counts {steps!r} steps an epoch, and the epoch resumes after {skip}", then)
    why = _past_the_end(iterator, steps - skip) if length_checked else None
    unchecked = _unchecked_epoch(iterator) if why else None
    if why and unchecked is None:
        raise _past_the_end_refused(owner, iterator, skip, steps, why)
    original = iterator._enumerate_iterator  # the class's, bound

    def resumed(*args: Any, **kwargs: Any):  # whatever a later Keras passes (steps_per_execution, say) goes on
        del iterator._enumerate_iterator  # the next epochs are whole
        restore = unchecked() if unchecked is not None else None
        inner = original(*args, **kwargs)
        try:
            first = next(inner, None)
            if first is not None and not (isinstance(first, tuple) and len(first) in (2, 3)
                                          and all(type(n) is int for n in first[:-1])):
                raise refuse(f"its EpochIterator._enumerate_iterator yields {first!r}, not (step, ..., iterator)",
                             then)
            for item in itertools.chain((first,) if first is not None else (), inner):
                *numbers, it = item
                if numbers[0] + skip >= steps:
                    break
                yield (*(n + skip for n in numbers), it)
        finally:
            inner.close()
            if restore is not None:
                restore()
        # As after a pass read to its end: the next epoch reads a new iterator.
        iterator._current_iterator = None
        iterator._steps_seen = 0
        iterator.data_adapter.on_epoch_end()

    iterator._enumerate_iterator = resumed


_STEPS = "Keras reads steps_per_execution"


def _past_the_end(iterator: Any, left: int) -> Optional[str]:
    """Why Keras would read a batch past the ``left`` of a resumed pass, or None (``_STEPS`` begins
    the reason that ``steps_per_execution`` gives). A pass that ends
    early fails tf.data's length check when read past its end (``assert_cardinality``: a resumed
    pass is shorter than the whole one it was made for). Keras reads ``steps_per_execution`` batches
    a step (the last step of an epoch until the data ends), and its JAX trainer off the CPU without a
    ``keras.distribution`` reads one batch ahead (``_one_batch_ahead_iterator``)."""
    spe = getattr(iterator, "steps_per_execution", 1)
    if isinstance(spe, int) and spe > 1 and left % spe:
        return f"{_STEPS}={spe} batches a step"
    jax, keras = sys.modules.get("jax"), sys.modules.get("keras")
    if type(iterator).__module__.startswith("keras.src.backend.jax.") and jax is not None:
        device = jax.default_backend()
        distributed = keras is not None and keras.distribution.distribution() is not None  # reads one at a time
        if device != "cpu" and not distributed:
            return f"Keras' JAX trainer on {device} reads one batch ahead"
    return None


def _unchecked_epoch(iterator: Any) -> Optional[Callable[[], Callable[[], None]]]:
    """NOTE [ A resumed pass read past its end ]: Keras reads the epoch resumed inside a kerasfeed
    ``tf.data`` pass past the pass's end (``_past_the_end``), where the length check of a whole pass
    would fail; the dataset's own variant without that check (``tfdata/adapter._unchecked_passes``:
    the same pipeline) ends there as Keras expects of data that runs out (its multi-step loop and
    its read-ahead stop at the end). For that one epoch, Keras' data adapter and the TensorFlow
    epoch iterator's distributed dataset read that variant; the returned callable swaps them in and
    returns the callable that puts them back (after the epoch: every later epoch is a whole pass,
    checked). None where Keras does not read the kerasfeed dataset itself from an adapter kerasfeed
    knows (a dataset derived from it, a zip, a distributed dataset given to fit): refused then."""
    adapter = getattr(iterator, "data_adapter", None)
    held = next((a for a in ("_dataset", "_tf_dataset") if callable(getattr(getattr(adapter, a, None),
                                                                            "_kerasfeed_unchecked", None))), None)
    strategy = getattr(iterator, "_distribute_strategy", None)
    distributed = hasattr(iterator, "_distributed_dataset")  # the TensorFlow trainer's, made from the adapter's
    if held is None or (distributed and not callable(getattr(strategy, "experimental_distribute_dataset", None))):
        return None

    def swap() -> Callable[[], None]:
        checked = getattr(adapter, held)
        before = getattr(iterator, "_distributed_dataset", None)
        unchecked = checked._kerasfeed_unchecked()
        setattr(adapter, held, unchecked)
        if distributed:
            iterator._distributed_dataset = strategy.experimental_distribute_dataset(unchecked)

        def restore() -> None:
            setattr(adapter, held, checked)
            if distributed:
                iterator._distributed_dataset = before

        return restore

    return swap


def _past_the_end_refused(owner: str, iterator: Any, skip: int, steps: int, why: str) -> ValueError:
    left, spe = steps - skip, getattr(iterator, "steps_per_execution", 1)
    fewer = "" if not why.startswith(_STEPS) else (
        "resume this run with steps_per_execution dividing the batches left (1 always does; later epochs may use "
        "another), ")
    return ValueError(
        f"{owner}: the interrupted epoch resumes after batch {skip} of {steps}, and {why}, so it would read past the "
        f"{left} batches left of the pass, where tf.data's check of a whole pass's length ({steps}) fails in the "
        "dataset fit reads, made from the kerasfeed dataset (derived, zipped or distributed). Give fit the kerasfeed "
        f"dataset itself (its resumed pass is then read without that check), {fewer}"
        "read the data through kerasfeed.to_loader under the JAX or torch backend (its passes end without that "
        f"check), or delete the backup to start the epoch again. Received: steps_per_execution={spe}, {left} batches "
        f"left, {type(iterator).__module__}.{type(iterator).__qualname__}"
    )


# NOTE [ An epoch shortened by items left out ]
# With batch_size=None each item is a batch, so a pass that left k items out (max_skipped) has k
# batches fewer than the len() Keras was told. Keras ends such an epoch when the data ends, rightly (the
# next epoch starts on time with the next pass), but Keras 3.7 to 3.15 then always call
# ``_interrupted_warning`` ("Your input ran out of data ... use .repeat()", wrong advice here); from
# 3.16 (keras#23360, ``_QUIET_RUN_OUT``) only when steps_per_epoch was set. Where Keras warns, the
# pipeline replaces that method on the running fit's epoch iterator (the instance only, once): when the
# pass just read ended complete and short by exactly its items left out, the explanation is logged
# instead (each skip was already a warning); any other run-out still gets Keras' warning. Where the
# method is missing, Keras' warning (if any) stays, reported once; tests/test_skip_budget.py trains
# through it with warnings as errors.
_EXPLAINED = "_kerasfeed_explains_short_epochs"


def explain_short_epochs(view: FitView, explain: Callable[[], Optional[str]]) -> None:
    """Has the fit's epoch iterator log ``explain()`` in place of Keras' "ran out of data"
    warning whenever ``explain()`` returns a text (where this Keras warns at all)."""
    iterator = view.epoch_iterator
    if iterator is None or getattr(iterator, _EXPLAINED, False):
        return
    if keras_minor() >= _QUIET_RUN_OUT and not view.steps_per_epoch:
        return  # Keras says nothing when an epoch of unknown or known length ends early
    original = getattr(iterator, "_interrupted_warning", None)
    if not callable(original):
        report(f"its EpochIterator ({type(iterator).__qualname__}) has no `_interrupted_warning`",
               "An epoch shortened by items left out (max_skipped) may get Keras' 'ran out of data' warning "
               "instead of kerasfeed's explanation; the data trained is the same.")
        return

    def interrupted_warning(*args: Any, **kwargs: Any):  # what a later Keras passes goes on to its own
        text = explain()
        if text is None:
            return original(*args, **kwargs)
        logger.info(text)
        return None

    iterator._interrupted_warning = interrupted_warning
    setattr(iterator, _EXPLAINED, True)


_EPOCH_ITERATOR_MODULE = "keras.src.trainers.epoch_iterator"
_DROPPED = ("y", "sample_weight", "class_weight")


def _epoch_iterator_method(frame: Any) -> bool:
    """Whether ``frame`` runs a method of Keras' ``EpochIterator`` itself (not of a subclass): told by its
    module, or where that moved by the class that defines the running code (reported once)."""
    module = frame.f_globals.get("__name__") or ""
    if module == _EPOCH_ITERATOR_MODULE:
        return True
    if not module.startswith("keras.") or frame.f_code.co_name not in ("__init__", "reset"):
        return False
    owner = frame.f_locals.get("self")
    for cls in type(owner).__mro__ if owner is not None else ():
        method = cls.__dict__.get(frame.f_code.co_name) if cls.__name__ == "EpochIterator" else None
        if getattr(method, "__code__", None) is frame.f_code:
            report(f"its EpochIterator is in {module}, not {_EPOCH_ITERATOR_MODULE}", "kerasfeed reads it there.")
            return True
    return False


def epoch_iterator_arguments(frame: Any) -> Optional[dict]:
    """``{"y": ..., "sample_weight": ..., "class_weight": ...}`` when ``frame`` is Keras'
    ``EpochIterator.__init__`` reading a data adapter's ``num_batches``, else None."""
    if frame is None or not _epoch_iterator_method(frame):
        return None
    code = frame.f_code
    if code.co_name != "__init__":
        if code.co_name != "reset":  # reset reads it again, after __init__ did
            report(f"its epoch iterator reads a data adapter's `num_batches` in `{code.co_name}`, not `__init__`",
                   "`y`, `sample_weight` or `class_weight` given to fit beside a kerasfeed.to_loader loader may be "
                   "ignored by Keras without the error kerasfeed gives.")
        return None
    absent = [n for n in _DROPPED if n not in code.co_varnames]
    if absent:
        report(f"its EpochIterator.__init__ has no {', '.join(absent)}", "Those arguments given to fit beside a "
               "kerasfeed.to_loader loader may be ignored by Keras without the error kerasfeed gives.")
    local = frame.f_locals
    return {n: local.get(n) for n in _DROPPED}


def called_by_epoch_iterator_reset(frame: Any) -> bool:
    """Whether ``frame`` (or one of the 8 frames above it) is Keras' ``EpochIterator.reset``
    (which calls the data's ``on_epoch_end`` before the first epoch of every fit)."""
    module = sys.modules.get(_EPOCH_ITERATOR_MODULE)
    if module is not None and not callable(getattr(getattr(module, "EpochIterator", None), "reset", None)):
        report("its EpochIterator has no `reset`", "Under model.fit(seq) a SceneSequence may count the "
               "on_epoch_end Keras calls before the first epoch as a pass where the fit frame cannot say the epoch.")
    return _epoch_iterator_frame(frame, "reset") is not None


def beginning_epoch_iterator(frame: Any) -> Optional[Any]:
    """Keras' ``EpochIterator`` whose ``_enumerate_iterator`` (an epoch's beginning, where it calls the data
    adapter's ``on_epoch_begin``) is ``frame`` or one of the 8 frames above it, else None (NOTE [ Keras' own
    iterators at exit ], _keras_iterators_at_exit.py: elsewhere the exit retires nothing of Keras', as before)."""
    found = _epoch_iterator_frame(frame, "_enumerate_iterator")
    return None if found is None else found.f_locals.get("self")


def _epoch_iterator_frame(frame: Any, method: str) -> Any:
    """``frame`` or the first of the 8 frames above it that runs Keras' ``EpochIterator.<method>``, else None."""
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == method and _epoch_iterator_method(frame):
            return frame
        frame = frame.f_back
    return None


# -- 3. the length Keras takes of a resumed dataset ---------------------------------------------------


def check_epoch_length(view: FitView, per_pass: int) -> None:
    """Refuses a pass that Keras would cut short: after a resumed (shorter) first pass, Keras
    counts the steps of every epoch from what it was told (``tfdata/adapter.tell_keras_the_whole_pass``).

    Raises:
        KerasStructureError: the fit's epoch iterator counts fewer steps than a pass has.
    """
    iterator = view.epoch_iterator
    if view.steps_per_epoch or iterator is None or getattr(iterator, "steps_per_epoch", None):
        return  # epochs of a length given (or capped by keras.config.set_max_steps_per_epoch)
    steps = iterator.num_batches
    if isinstance(steps, int) and steps < per_pass:
        raise refuse(f"its epoch iterator counts {steps} steps an epoch where a pass has {per_pass} batches: it did "
                     "not take a resumed dataset's length from its `cardinality()`",
                     f"Every later epoch of this fit would read {steps} of a pass's {per_pass} batches: refused. "
                     "Finish the resumed epoch in a fit call of its own (docs/resume.md).")


def epoch_steps(view: FitView) -> Optional[int]:
    """The steps the fit's epoch iterator counts an epoch (its data's ``cardinality()``, or what
    ``steps_per_epoch`` or ``keras.config.set_max_steps_per_epoch`` give); None where it does not know."""
    iterator = view.epoch_iterator
    steps = getattr(iterator, "num_batches", None) if iterator is not None else None
    return steps if isinstance(steps, int) and steps > 0 else None


def same_iterator(ref: Optional[Callable[[], Any]], view: FitView) -> bool:
    """Whether ``ref`` (a weak reference made by ``iterator_ref``) is ``view``'s epoch iterator."""
    return ref is not None and view.epoch_iterator is not None and ref() is view.epoch_iterator


def iterator_ref(view: Optional[FitView]) -> Optional[Callable[[], Any]]:
    """A weak reference to ``view``'s epoch iterator (one per ``fit`` call), or None."""
    if view is None or view.epoch_iterator is None:
        return None
    try:
        return weakref.ref(view.epoch_iterator)
    except TypeError:  # an iterator without weak references: identity not kept
        return None


__all__ = [
    "called_by_epoch_iterator_reset",
    "check_epoch_length",
    "epoch_iterator_arguments",
    "epoch_steps",
    "explain_short_epochs",
    "iterator_ref",
    "same_iterator",
    "start_epoch_at",
]
