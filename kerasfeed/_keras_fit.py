"""Which Keras epoch a pipeline's next pass belongs to (TF-free, Keras-free).

NOTE [ The pass follows Keras' epoch ]: Keras hands a data adapter no epoch
number (``on_epoch_begin()`` takes none), and a ``fit`` that starts at
``initial_epoch=e`` (given, or set by ``keras.callbacks.BackupAndRestore``
through ``model._initial_epoch``) must read pass ``e``, not the pipeline's
own first pass. The one place that always knows is the trainer's ``fit``
frame: its locals ``x`` (what is being fitted), ``epoch`` (the loop's epoch,
once the loop runs), ``initial_epoch``, ``steps_per_epoch`` and ``self`` (the
model). ``find_fit`` walks every thread's stack for that frame (tf.data runs
a pass's first call on one of its own threads while ``fit`` waits), once per
pass, and only accepts a frame whose ``x`` holds this very pipeline, so the
validation data and other models' data keep their own numbering. The frame
layout is private Keras structure, the same in every backend's trainer since
Keras 3.0; ``tests/test_crash_resume.py`` trains through it on every backend.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import sys
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger("kerasfeed")

# The modules whose ``fit`` is Keras' training loop (one per backend).
_TRAINER = re.compile(r"^keras\.src\.backend\.[a-z_]+\.trainer$")


@dataclasses.dataclass(frozen=True)
class FitView:
    """What a running ``model.fit`` says about where it stands.

    Attributes:
        epoch: the epoch its loop is in; None before the loop (the model
            build reads a batch then).
        initial_epoch: the first epoch of the call (the model's restored
            ``_initial_epoch`` where set, else the argument).
        steps_per_epoch: as given to ``fit`` (None: a whole pass).
        model: the model being fitted.
        epoch_iterator: Keras' epoch iterator of the call.
    """

    epoch: Optional[int]
    initial_epoch: int
    steps_per_epoch: Optional[int]
    model: Any
    epoch_iterator: Any

    @property
    def current(self) -> int:
        """The epoch a pass begun now belongs to (the first one before the loop)."""
        return self.initial_epoch if self.epoch is None else self.epoch


def keras_pass(epoch: int, steps_per_epoch: Optional[int], per_pass: int, initial_epoch: int, *,
               owner: str = "kerasfeed") -> Optional[int]:
    """The pass Keras epoch ``epoch`` reads; a pure function.

    One epoch is one pass (``steps_per_epoch`` None or a whole pass): pass
    ``epoch``. Epochs of another length read the data on across epochs (Keras
    keeps one iterator), so passes are counted on from the pipeline's own
    first one (None), which is right for a call that starts at epoch 0.

    Raises:
        ValueError: a call starting at a later epoch with epochs that are not
            passes: where the data stands is not the epoch.
    """
    if not steps_per_epoch or steps_per_epoch == per_pass:
        return epoch
    if not initial_epoch:
        return None
    raise ValueError(
        f"{owner}: this fit starts at epoch {initial_epoch} with steps_per_epoch={steps_per_epoch}, and a pass has "
        f"{per_pass} batches: Keras reads the passes across its epochs, so epoch {initial_epoch} does not say which "
        "pass to read (nor where in it). Drop steps_per_epoch (an epoch is then a pass) or make it a whole pass; "
        "or resume with initial_state={'epoch': ..., 'batches': ...} from kerasfeed.TrainingProgress. "
        f"Received: initial_epoch={initial_epoch}, steps_per_epoch={steps_per_epoch}, batches per pass={per_pass}"
    )


def current_frames() -> dict:
    """``sys._current_frames()`` with the garbage collector held off.

    NOTE [ sys._current_frames and the garbage collector ]: in CPython up to
    3.11, ``sys._current_frames()`` holds the runtime's thread-list lock while
    it makes frame objects; an allocation there may start a collection, and a
    collected object whose deallocation takes that lock again (a
    ``threading.local``, a thread state) deadlocks the process inside C, where
    no signal handler runs (cpython#106883, fixed in 3.12 by the same means:
    no collection during the call). Found in a fresh-clone run of this suite
    on the 2-core machine: a pass begun while a thread pool's threads came and
    went hung there for good (and, it seems, the CI run that never finished).
    The collector is switched back on only if it was on.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def find_fit(holds: Callable[[Any], bool], model: Any = None) -> Optional[FitView]:
    """The running Keras ``fit`` whose ``x`` holds the caller's pipeline, or None.

    Args:
        holds: whether a ``fit``'s ``x`` is (or wraps) the caller's pipeline.
        model: only a ``fit`` of this model (None: any).

    The calling thread is searched first, then the others (see the NOTE above).
    """
    frames = current_frames()
    frames.pop(threading.get_ident(), None)  # this very frame: a reference cycle with `frames` otherwise
    tops = [sys._getframe(1), *frames.values()]
    frames.clear()
    try:
        for frame in tops:
            while frame is not None:
                if frame.f_code.co_name == "fit" and _TRAINER.match(frame.f_globals.get("__name__", "")):
                    view = _view(frame.f_locals, holds, model)
                    if view is not None:
                        return view
                frame = frame.f_back
        return None
    finally:
        # Frames hold their locals (batches among them): none is kept past this call.
        del tops, frame


def _view(local: dict, holds: Callable[[Any], bool], wanted: Any) -> Optional[FitView]:
    model = local.get("self")
    if (wanted is not None and model is not wanted) or not holds(local.get("x")):
        return None
    initial = local.get("initial_epoch") or 0
    epoch = local.get("epoch")
    if epoch is None:  # before the loop: the trainer takes the model's restored epoch after on_train_begin
        initial = getattr(model, "_initial_epoch", None) or initial
    return FitView(
        epoch=None if epoch is None else int(epoch),
        initial_epoch=int(initial),
        steps_per_epoch=local.get("steps_per_epoch"),
        model=model,
        epoch_iterator=local.get("epoch_iterator"),
    )


# NOTE [ An epoch shortened by items left out ]
# With batch_size=None each item is a batch, so a pass that left k items out
# (max_skipped) has k batches fewer than the len() Keras was told. Keras' epoch
# iterator ends such an epoch when the data ends, rightly (the next epoch
# starts on time with the next pass), and calls its ``_interrupted_warning``:
# "Your input ran out of data ... use .repeat()", advice that is wrong here.
# The pipeline replaces that method on the running fit's epoch iterator (the
# instance only, once): when the pass just read ended complete and short by
# exactly its items left out, the explanation is logged instead (each skip was
# already a warning); any other run-out still gets Keras' own warning. Private
# Keras structure (in Keras 3.7 to 3.15; where it is missing, Keras' warning
# stays); tests/test_skip_budget.py trains through it with warnings as errors.
_EXPLAINED = "_kerasfeed_explains_short_epochs"


def explain_short_epochs(epoch_iterator: Any, explain: Callable[[], Optional[str]]) -> None:
    """Has ``epoch_iterator`` (a running fit's) log ``explain()`` in place of
    Keras' "ran out of data" warning whenever ``explain()`` returns a text."""
    original = getattr(epoch_iterator, "_interrupted_warning", None)
    if original is None or getattr(epoch_iterator, _EXPLAINED, False):
        return

    def interrupted_warning():
        text = explain()
        if text is None:
            return original()
        logger.info(text)
        return None

    epoch_iterator._interrupted_warning = interrupted_warning
    setattr(epoch_iterator, _EXPLAINED, True)


__all__ = ["FitView", "current_frames", "explain_short_epochs", "find_fit", "keras_pass"]
