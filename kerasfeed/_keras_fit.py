"""Every read and patch of Keras' private structure, each with its check (TF-free, Keras-free).

NOTE [ Keras' private structure ]: kerasfeed goes through Keras' public API
where there is one (callbacks' ``on_epoch_begin(epoch)``, ``params["steps"]``,
a data adapter's ``on_epoch_begin``/``num_batches``). What has none is read or
patched here and only here; ``docs/resume.md`` tabulates each read, its user
and what a Keras that differs gets:

1. the running ``fit``'s frame (``find_fit``): ``FIT_NAMES``, and
   ``model._initial_epoch`` (where Keras' ``BackupAndRestore`` sets the epoch
   a ``fit`` starts at); its module, for the trainers that build the model
   from a throwaway iterator (``_BUILDING_TRAINERS``: NOTE [ A model build's
   pass ends later ], loading/pipeline.py), and their ``evaluate`` under
   ``Trainer._symbolic_build`` (``kerasfeed/_keras_build.py``), as the
   TensorFlow trainer's ``fit`` and ``evaluate`` under ``_maybe_symbolic_build``
   (a strategy's peek);
2. Keras' ``EpochIterator`` (``kerasfeed/_keras_epoch_iterator.py``): its
   ``_enumerate_iterator`` (``start_epoch_at``), ``_interrupted_warning``
   (``explain_short_epochs``), ``num_batches``, ``__init__``'s arguments
   (``epoch_iterator_arguments``), ``reset`` (``called_by_epoch_iterator_reset``), and
   the ``self`` of its ``_enumerate_iterator`` with its ``_current_iterator``
   (``beginning_epoch_iterator``: retired at exit, _keras_iterators_at_exit.py);
3. the ``cardinality`` Keras reads of a resumed dataset (``tfdata/adapter.py``;
   ``check_epoch_length``);
4. modules imported from ``keras.src``: ``DataAdapter``
   (``loader/keras_adapter.py``), the torch backend's ``get_device``
   (``loader/device.py``), ``orbax_util`` (``integrations/orbax_callback.py``);
5. that the trainer's ``fit`` calls its callbacks' ``on_epoch_begin`` and
   ``on_train_batch_begin`` itself (``fit_calls``, for
   ``execution/interrupts.py``: NOTE [ A Ctrl-C taken inside fit ]);
6. the module, name and instance attributes of ``keras.utils.PyDataset``,
   which the light stand-in in workers copies (``light_modules.stand_ins_fit``:
   moved or changed, workers unpickle without stand-ins: heavier, the same
   items), and ``keras.src.backend.config`` for an error's text, a name only
   (``_backend_errors.py``);
7. a callback's ``_model`` and Keras' ``BackupAndRestore`` paths, read by
   kerasfeed's callbacks (``kerasfeed/_keras_callback.py``).

A mismatch is a ``KerasStructureWarning`` once (``report``), naming the Keras
version and what follows; where reading on would train other passes than the
run it continues it is a ``KerasStructureError`` (``refuse``). The names are
the same in every backend's trainer from Keras 3.7 to 3.16 (``make
keras-matrix``, ``docs/keras_versions.md``; ``tests/test_keras_private.py``
trains through a Keras whose names differ).

NOTE [ The pass follows Keras' epoch ]: Keras hands a data adapter no epoch
number, and a ``fit`` that starts at ``initial_epoch=e`` (given, or restored
by a ``BackupAndRestore``) must read pass ``e``, not the pipeline's own first
pass. The one place that always knows is the trainer's ``fit`` frame (1.
above). ``find_fit`` looks for it once per pass, on the calling thread and,
since tf.data runs a pass's first call on one of its own threads while ``fit``
waits, on the fit's thread (NOTE [ Another thread's frames ], in
``_keras_fit_frames.py``), and only accepts a frame whose ``x`` holds this
very pipeline, so the validation data and other models' data keep their own
numbering. A kerasfeed callback also
says the epoch through ``on_epoch_begin`` (``PassPipeline.expect``): the two
must agree, and the callback's serves where the frame has no ``epoch``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import re
import sys
import warnings
from typing import Any, Callable, Optional

from kerasfeed import _keras_fit_frames as fit_frames
from kerasfeed.errors import KerasStructureError, KerasStructureWarning

# The modules whose ``fit`` is Keras' training loop (one per backend); a ``fit``
# elsewhere in Keras is looked at too, and reported if it holds the pipeline.
_TRAINER = re.compile(r"^keras\.src\.backend\.[a-z_]+\.trainer$")
FIT_NAMES = ("self", "x", "initial_epoch", "steps_per_epoch", "epoch", "epoch_iterator")
# The trainers that build the model from a batch of a throwaway iterator before the loop (``_symbolic_build``).
_BUILDING_TRAINERS = ("keras.src.backend.jax.trainer", "keras.src.backend.torch.trainer")
_REPORTED: set = set()


def keras_version() -> str:
    keras = sys.modules.get("keras")
    try:
        return str(keras.version())
    except AttributeError:  # not imported (or not Keras 3)
        from importlib import metadata

        return metadata.version("keras")


def keras_minor() -> tuple:
    """``(major, minor)`` of the Keras in use."""
    found = re.match(r"(\d+)\.(\d+)", keras_version())
    return tuple(int(p) for p in found.groups()) if found else (0, 0)


def batch_end_offset(model: Any) -> int:
    """What to add to the ``batch`` a callback's ``on_train_batch_end`` gets for the batches of the
    epoch trained through it: Keras 3.11 on passes an execution's last step (1), Keras 3.7 to 3.10
    its first (keras#21422), so ``model.steps_per_execution`` there (public: ``compile``'s argument)."""
    if keras_minor() >= (3, 11):
        return 1
    steps = getattr(model, "steps_per_execution", 1)
    return steps if isinstance(steps, int) and steps > 0 else 1


def _text(what: str, then: str) -> str:
    return (f"kerasfeed reads Keras' private structure where Keras has no public route (NOTE [ Keras' private "
            f"structure ] in kerasfeed/_keras_fit.py), and this Keras differs: {what}. {then} Please report it "
            f"with this Keras version. Received: keras {keras_version()}")


def report(what: str, then: str) -> None:
    """A ``KerasStructureWarning`` the first time ``what`` is found (``then``: what follows from it)."""
    if what not in _REPORTED:
        _REPORTED.add(what)
        warnings.warn(KerasStructureWarning(_text(what, then)), stacklevel=3)


def refuse(what: str, then: str) -> KerasStructureError:
    """The error to raise where reading on would train other passes."""
    return KerasStructureError(_text(what, then))


def fit_calls(frame: Any) -> tuple:
    """Of ``FIT_CALLS``, the callback methods the ``fit`` running in ``frame`` calls itself
    (NOTE item 5); one its code does not name is reported once."""
    missing = [name for name in FIT_CALLS if name not in frame.f_code.co_names]
    if missing:
        report(f"{frame.f_globals.get('__name__')}.fit calls no {' or '.join(missing)} of its own",
               "A Ctrl-C taken inside fit by C code that clears errors is not raised again (NOTE [ A Ctrl-C "
               "taken inside fit ]); the data trained is not affected.")
    return tuple(name for name in FIT_CALLS if name not in missing)


FIT_CALLS = ("on_epoch_begin", "on_train_batch_begin")  # called by fit only as it trains on


# -- 1. the fit frame -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitView:
    """What a running ``model.fit`` says about where it stands.

    Attributes:
        epoch: the epoch its loop is in; None before the loop (the model
            build reads a batch then) or where not readable (``missing``).
        initial_epoch: the first epoch of the call (the model's restored
            ``_initial_epoch`` where set, else the argument).
        steps_per_epoch: as given to ``fit`` (None: a whole pass).
        model: the model being fitted.
        epoch_iterator: Keras' epoch iterator of the call (None: not readable).
        missing: the names of ``FIT_NAMES`` this Keras' ``fit`` does not
            have (or holds of another shape), and where the ``fit`` is.
        x: what the ``fit`` reads (its first argument after ``self``).
        callbacks: the ``callbacks`` argument of the call, before the loop
            (None in it): a kerasfeed callback there can say before its
            ``on_train_begin`` which pass a restore will start at
            (NOTE [ The model build's pass under a resume ], loading/fit_follow.py).
        builds: before the loop of a trainer that builds the model from a
            throwaway iterator (Keras' JAX and torch trainers): a pass begun
            now is begun again by the loop, or handed over to it.
    """

    epoch: Optional[int]
    initial_epoch: int
    steps_per_epoch: Optional[int]
    model: Any
    epoch_iterator: Any
    missing: tuple = ()
    x: Any = None
    callbacks: Any = None
    builds: bool = False

    @property
    def current(self) -> int:
        """The epoch a pass begun now belongs to (the first one before the loop)."""
        return self.initial_epoch if self.epoch is None else self.epoch

    def unreadable(self, *, resuming: bool = False, said: bool = False) -> None:
        """A ``fit`` whose frame lacks names kerasfeed reads (``missing``): passes are counted by
        the pipeline itself, or follow a kerasfeed callback's ``on_epoch_begin`` (``said``).
        Reported once; refused where counting would read other passes.

        Raises:
            KerasStructureError: the fit starts at a later epoch (given or restored), or a backup
                resumes inside an epoch (``resuming``), and no callback says the epoch.
        """
        what = f"its `fit` has no {', '.join(self.missing)}"
        if said:
            report(what, "A kerasfeed callback's on_epoch_begin says the epoch to the data instead (Keras' public "
                         "route); without such a callback the passes are counted by the data itself.")
            return
        if resuming or self.initial_epoch:
            why = "a resume inside an epoch" if resuming else f"a fit that starts at epoch {self.initial_epoch}"
            raise refuse(what, f"The data's passes could not follow the fit's epochs, so {why} would train "
                               "other passes than the run it continues: refused. Start the fit at epoch 0, "
                               "or use a Keras release listed in docs/keras_versions.md.")
        report(what, "The data's passes are counted by the dataset or loader itself: a fit that starts at epoch 0 "
                     "on new data reads them in order (a to_dataset under JAX or PyTorch from pass 1: the model "
                     "build's batch began pass 0); a fit that starts at a later epoch or resumes is refused.")


def find_fit(holds: Callable[[Any], bool], model: Any = None, *, others: bool = True) -> Optional[FitView]:
    """The running Keras ``fit`` whose ``x`` holds the caller's pipeline, or None.

    Args:
        holds: whether a ``fit``'s ``x`` is (or wraps) the caller's pipeline.
        model: only a ``fit`` of this model (None: any).
        others: whether to walk the other threads' stacks where no kept frame answers.

    The calling thread's stack is searched first, then the ``fit`` frames seen
    on their own threads, then the other threads (NOTE [ Another thread's frames ],
    ``_keras_fit_frames.py``).
    """

    def look(frame: Any) -> Optional[FitView]:
        return _view(frame, holds, model)

    view = fit_frames.on_this_thread(sys._getframe(1), look)
    if view is not None:
        return view
    for fit in fit_frames.seen_elsewhere():
        view = look(fit)
        if view is not None:
            return view
    return fit_frames.walk_other_threads(look) if others else None


def remember_fit() -> None:
    """Keeps the ``fit`` running on this thread (Keras' calls of kerasfeed run there), if any, for a
    later ``find_fit`` from another thread (NOTE [ Another thread's frames ])."""
    fit_frames.on_this_thread(sys._getframe(1), lambda frame: _view(frame, lambda x: False, None))


@functools.lru_cache(maxsize=64)
def _missing(code: Any, module: str) -> tuple:
    """``FIT_NAMES`` that the ``fit`` code object ``code`` does not have (a check made once per code)."""
    names = set(code.co_varnames) | set(code.co_cellvars)
    missing = tuple(f"`{n}`" for n in FIT_NAMES if n not in names)
    if missing and not _TRAINER.match(module):
        missing += (f"(and it is in {module}, not keras.src.backend.<backend>.trainer)",)
    return missing


def _view(frame: Any, holds: Callable[[Any], bool], wanted: Any) -> Optional[FitView]:
    code, local = frame.f_code, frame.f_locals
    missing = list(_missing(code, frame.f_globals.get("__name__", "")))
    if missing and code.co_flags & inspect.CO_VARKEYWORDS:  # a fit that passes its arguments on: read them there
        given = local.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount
                                           + bool(code.co_flags & inspect.CO_VARARGS)])
        local = {**given, **local} if isinstance(given, dict) else local
    params = code.co_varnames[: code.co_argcount]
    # `self` and `x` are fit's first two parameters (public API: model.fit(data)), whatever their names.
    model = local.get("self", local.get(params[0]) if params else None)
    x = local.get("x", local.get(params[1]) if len(params) > 1 else None)
    if wanted is not None and model is not wanted:
        return None
    if x is None:  # Keras let go of its data, or passes it on unnamed: this fit may read the pipeline
        missing.append("`x` (None)")
    elif not holds(x):
        if not _reads_through(local.get("epoch_iterator"), holds):
            return None
        report(f"its `fit` holds a {type(x).__name__} as `x`, not the data its epoch iterator reads", "The data's "
               "passes follow the fit's epochs as before (the fit is told by the data its epoch iterator holds).")
    epoch = _int_or_none(local, "epoch", missing)
    steps = _int_or_none(local, "steps_per_epoch", missing)
    initial = _int_or_none(local, "initial_epoch", missing) or 0
    if epoch is None:  # before the loop: the trainer takes the model's restored epoch after on_train_begin
        initial = restored_epoch(model) or initial
    iterator = local.get("epoch_iterator")
    if iterator is not None and not hasattr(iterator, "num_batches"):
        missing.append("`epoch_iterator.num_batches`")
    # fit's public argument; read only before the loop, where the trainer has not wrapped it yet
    callbacks = local.get("callbacks") if epoch is None else None
    return FitView(epoch=epoch, initial_epoch=initial, steps_per_epoch=steps, model=model,
                   epoch_iterator=iterator, missing=tuple(missing), x=x,
                   callbacks=callbacks if isinstance(callbacks, (list, tuple)) else None,
                   builds=epoch is None and _builds(frame.f_globals.get("__name__") or ""))


def _builds(module: str) -> bool:
    """Whether the trainer whose ``fit`` runs in ``module`` builds the model from a throwaway iterator (one moved
    elsewhere: as its backend's does, reported once; taken for one that does not, a hook ran twice)."""
    if module in _BUILDING_TRAINERS or module == "keras.src.backend.tensorflow.trainer":
        return module in _BUILDING_TRAINERS
    name = getattr(getattr(sys.modules.get("keras"), "backend", None), "backend", lambda: "")()
    if module.startswith("keras."):
        report(f"its `fit` is in {module}, not keras.src.backend.{name}.trainer", "kerasfeed takes the model "
               f"build's pass as the {name} backend's trainer makes it (JAX's and torch's build from a batch).")
    return f"keras.src.backend.{name}.trainer" in _BUILDING_TRAINERS


def _reads_through(iterator: Any, holds: Callable[[Any], bool]) -> bool:
    """Whether a fit's epoch iterator reads the pipeline (its data adapter, or the dataset or PyDataset Keras'
    adapter holds) where the fit's ``x`` was rebound to another object: without this, that fit was not the
    pipeline's, and its passes were counted silently (a fit from epoch 2 read pass 0)."""
    adapter = getattr(iterator, "data_adapter", None)
    held = (adapter, getattr(adapter, "_dataset", None), getattr(adapter, "py_dataset", None))
    return adapter is not None and any(holds(c) for c in held if c is not None)


def _int_or_none(local: dict, name: str, missing: list) -> Optional[int]:
    value = local.get(name)
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return None if value is None else int(value)
    missing.append(f"`{name}` as an int (it is a {type(value).__name__})")
    return None


def restored_epoch(model: Any) -> Optional[int]:
    """``model._initial_epoch``: the epoch a restoring callback made the next ``fit`` start at."""
    if not hasattr(model, "_initial_epoch"):
        report("its model has no `_initial_epoch`", "A fit restored by keras.callbacks.BackupAndRestore may "
               "read another pass in the batch that builds the model; kerasfeed.BackupAndRestore refuses to restore.")
        return None
    value = model._initial_epoch
    return value if isinstance(value, int) else None


def restore_epoch(model: Any, epoch: Optional[int], *, owner: str) -> None:
    """Makes ``model``'s running ``fit`` start at ``epoch`` (None: as told), as Keras' BackupAndRestore does.

    Raises:
        KerasStructureError: the model has no ``_initial_epoch``: the fit would start elsewhere.
    """
    if epoch is not None and not hasattr(model, "_initial_epoch"):
        raise refuse("its model has no `_initial_epoch`, where Keras' BackupAndRestore sets the epoch a fit "
                     "starts at", f"{owner} cannot make this fit start at the backup's epoch {epoch}: refused "
                     "rather than train other epochs.")
    model._initial_epoch = epoch


__all__ = [
    "FIT_NAMES", "FitView", "find_fit", "remember_fit", "batch_end_offset",
    "keras_minor", "keras_version", "refuse", "report", "restore_epoch", "restored_epoch",
]
