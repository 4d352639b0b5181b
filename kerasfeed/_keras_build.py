"""An evaluation's model build: what kerasfeed reads of it, with its check (TF-free, Keras-free). Part of
NOTE [ Keras' private structure ] in ``kerasfeed/_keras_fit.py`` (item 1).

NOTE [ An evaluation's model build ]: Keras' JAX and torch trainers build a model whose layers, metrics or
loss are not built yet from a batch of a throwaway iterator (``Trainer._symbolic_build``), in ``evaluate``
as in ``fit``, and JAX's ``predict`` so too, by itself. Under ``fit`` the fit's frame says so
(``FitView.builds``); ``evaluate`` and ``predict`` have no epoch to read, so the iterator is told apart where
it is made: on the evaluation's own thread, under ``_symbolic_build`` called by that ``evaluate`` (or in JAX's
``predict`` before its loop). The pass it begins is a model build's (its end waits: NOTE [ A model build's
pass ends later ], loading/pipeline.py), and the evaluation's loop begins that pass again instead of the
next one, as under TensorFlow, where no throwaway iterator is made. So is ``fit``'s for a pipeline made with
``initial_state`` (whose passes do not follow the fit's frame): the resumed pass is the loop's first. A
build that failed leaves its pass to the next one. Under a ``tf.distribute`` strategy the TensorFlow
trainer peeks a batch too (``_maybe_symbolic_build``, in every ``fit`` and ``evaluate``, a fit's validation
included), through a multi-device iterator (``tfdata/consumers.py`` sees it made): told apart the same way.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from kerasfeed._keras_fit import _BUILDING_TRAINERS, report

_TRAINER_MODULE = "keras.src.trainers.trainer"
_BUILD = "_symbolic_build"
_CALLERS = ("evaluate",)  # fit: FitView.builds; predict: below (JAX), from its loop's first batch (torch)
# JAX's predict builds an unbuilt model from a batch of a throwaway iterator itself (not _symbolic_build),
# before it makes its callbacks a CallbackList: an iterator made in it before that is the build's.
_JAX_TRAINER = "keras.src.backend.jax.trainer"
# Under a tf.distribute strategy, Keras' TensorFlow trainer peeks a batch through an iterator of its own in
# ``_maybe_symbolic_build`` at every ``fit`` and ``evaluate`` (validation included), built model or not.
_TF_TRAINER = "keras.src.backend.tensorflow.trainer"
_TF_BUILD = "_maybe_symbolic_build"
_MISSING = object()


def evaluation_builds(frame: Any, depth: int = 16, *, fit: bool = False) -> bool:
    """Whether ``frame`` (or one of the ``depth`` frames above it) runs Keras' model build for an
    ``evaluate`` of a trainer that builds from a throwaway iterator (``_BUILDING_TRAINERS``); ``fit``: or
    for its ``fit`` (a pipeline that does not follow the fit's frame: made with ``initial_state``)."""
    _check_builds()
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "predict" and frame.f_globals.get("__name__") == _JAX_TRAINER:
            callbacks = frame.f_locals.get("callbacks", _MISSING)
            if callbacks is _MISSING:
                report("its JAX trainer's `predict` has no `callbacks`", "A predict on a model not built yet may "
                       "read one pass of a kerasfeed dataset for the build and the next one for the predictions.")
                return False
            return type(callbacks).__name__ != "CallbackList"
        if frame.f_code.co_name == _TF_BUILD and frame.f_globals.get("__name__") == _TF_TRAINER:
            # In fit too: the fit's frame (``FitView.builds``) says so for JAX and torch only.
            caller = _past_decorators(frame.f_back)
            return caller is not None and caller.f_code.co_name in _CALLERS + ("fit",)
        if frame.f_code.co_name == _BUILD and frame.f_globals.get("__name__") == _TRAINER_MODULE:
            caller = _past_decorators(frame.f_back)
            trainer = None if caller is None else caller.f_globals.get("__name__")
            if trainer not in _BUILDING_TRAINERS:
                return False
            if caller.f_code.co_name not in _CALLERS + ("fit",):
                report(f"{trainer}.{caller.f_code.co_name} builds the model from an iterator, not `fit` or `evaluate`",
                       "An evaluation of a model not built yet may read one pass of a kerasfeed.to_dataset for the "
                       "build and the next one for the evaluation.")
            return caller.f_code.co_name in _CALLERS + (("fit",) if fit else ())
        frame = frame.f_back
    return False


def _check_builds() -> None:
    """Reports a Keras whose build methods are gone, or whose names now hold other code (the frames would not
    be recognised: a silent pass too many)."""
    for module_name, cls, name, then in (
        (_TRAINER_MODULE, "Trainer", _BUILD, "Under JAX and torch, `evaluate` of a model not built yet reads one "
         "pass of a kerasfeed.to_dataset for the build and the next one for the evaluation."),
        (_TF_TRAINER, "TensorFlowTrainer", _TF_BUILD, "Under a tf.distribute strategy, `evaluate` (and a fit's "
         "validation) may read one pass of a kerasfeed.to_dataset for the model build and the next one for the "
         "evaluation."),
    ):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        method = getattr(getattr(module, cls, None), name, None)
        code = getattr(inspect.unwrap(method), "__code__", None) if callable(method) else None
        if code is None:
            report(f"its {cls} has no `{name}`", then)
        elif code.co_name != name or not code.co_filename.endswith(module_name.replace(".", os.sep) + ".py"):
            report(f"its {cls}.{name} runs `{code.co_name}` of {code.co_filename}", then)


def _past_decorators(frame: Any) -> Any:
    # Keras' own decorators (``traceback_utils.filter_traceback``) may come between a build and its caller.
    for _ in range(3):
        if frame is None or not frame.f_globals.get("__name__", "").startswith("keras.src.utils."):
            return frame
        frame = frame.f_back
    return frame


__all__ = ["evaluation_builds"]
