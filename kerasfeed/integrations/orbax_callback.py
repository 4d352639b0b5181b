"""``kerasfeed.OrbaxCheckpoint``: Keras' Orbax callback, with the data position in the same checkpoint.

Keras' ``OrbaxCheckpoint`` saves each step's checkpointables (``pytree``: the variables;
``model_config``, ``assets``) through ``self.checkpointer`` and restores nothing itself. This
subclass wraps that checkpointer to add a ``kerasfeed`` checkpointable (``FitData.position``) that
Orbax commits with the step, and ``restore=True`` restores the latest step (``docs/orbax.md``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Optional, Union

import keras

from kerasfeed._keras_callback import callback_model
from kerasfeed._keras_fit import refuse, report, restore_epoch
from kerasfeed.integrations.fit_data import FitData

OWNER = "kerasfeed.OrbaxCheckpoint"
# Keras' step counters, set after a restore (the Orbax step of a batch save is the batches trained).
_COUNTERS = ("_total_batches_seen", "_last_batch_seen", "_batches_seen_since_last_saving")
ITEM = "kerasfeed"  # the checkpointable holding the record
FORMAT = "kerasfeed-orbax-1"
# A Keras without it still imports this module (`from kerasfeed import *`); the class then refuses to be made.
_KerasOrbaxCheckpoint = getattr(keras.callbacks, "OrbaxCheckpoint", keras.callbacks.Callback)


class OrbaxCheckpoint(_KerasOrbaxCheckpoint):
    """Keras' ``OrbaxCheckpoint``, with the data position in every checkpoint; ``restore=True`` resumes exactly.

    The same arguments and checkpoints as ``keras.callbacks.OrbaxCheckpoint``
    (``model.load_weights(directory)`` and ``keras.saving.load_model`` read
    them), plus one item per step, ``kerasfeed``: the epoch and batch
    reached and where the kerasfeed dataset or loader being fitted stands
    (the record ``kerasfeed.BackupAndRestore`` keeps), committed by Orbax
    with the weights, atomically.

    With ``restore=True``, a ``fit`` whose ``directory`` holds a checkpoint
    starts from its latest step (variables, epoch, and the interrupted
    epoch's first batch not trained yet), by ``BackupAndRestore``'s data
    rules (``docs/orbax.md``). A finished run's last checkpoint leaves no
    epoch to train: use a new ``directory`` to train again from scratch.

    Args:
        directory, monitor, verbose, save_best_only, mode, save_freq,
        initial_value_threshold, max_to_keep, save_on_background,
        save_weights_only: Keras' (``save_freq``: ``"epoch"`` or batches
            between saves; the Orbax step is the epoch, or the batches
            trained since the optimizer's first step).
        restore: restore the latest checkpoint at the start of ``fit``.
            It needs the optimizer's variables: not with
            ``save_weights_only=True``.

    Example:

    ```python
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=0, executor="processes")
    model.fit(loader, epochs=10,
              callbacks=[kerasfeed.OrbaxCheckpoint("run/ckpt", save_freq=500, restore=True)])
    # killed? run the same script again: it goes on at the next unseen batch
    ```
    """

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        mode: str = "auto",
        save_freq: Union[str, int] = "epoch",
        initial_value_threshold: Optional[float] = None,
        max_to_keep: Optional[int] = 1,
        save_on_background: bool = True,
        save_weights_only: bool = False,
        *,
        restore: bool = False,
    ):
        if _KerasOrbaxCheckpoint is keras.callbacks.Callback:
            raise RuntimeError(
                f"{OWNER} extends keras.callbacks.OrbaxCheckpoint, which this Keras does not have: upgrade Keras "
                f"(pip install -U keras), or use kerasfeed.BackupAndRestore. Received: keras {keras.version()}"
            )
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"{OWNER}: `directory` must be a non-empty path. Received: directory={directory!r}")
        if "://" not in directory:
            directory = os.path.abspath(directory)  # Orbax's array writes fail on a relative path (in the background)
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                f"{OWNER}: `save_freq` must be 'epoch' or a positive int (batches between saves). "
                f"Received: save_freq={save_freq!r}"
            )
        if not isinstance(restore, bool):
            raise TypeError(f"{OWNER}: `restore` must be True or False. Received: restore={restore!r}")
        if restore and save_weights_only:
            raise ValueError(
                f"{OWNER}: restore=True resumes training, which needs the optimizer's variables, and "
                "save_weights_only=True leaves them out of the checkpoints. Drop one of the two. "
                f"Received: restore={restore}, save_weights_only={save_weights_only}"
            )
        super().__init__(directory, monitor=monitor, verbose=verbose, save_best_only=save_best_only, mode=mode,
                         save_freq=save_freq, initial_value_threshold=initial_value_threshold,
                         max_to_keep=max_to_keep, save_on_background=save_on_background,
                         save_weights_only=save_weights_only)
        self.restore = restore
        checkpointer = vars(self).get("checkpointer")
        if not callable(getattr(checkpointer, "save_checkpointables", None)):
            raise refuse("its OrbaxCheckpoint keeps no `checkpointer` with `save_checkpointables`",
                         f"{OWNER} adds the data position to each step it saves there: refused rather than save "
                         "checkpoints without it. Use kerasfeed.BackupAndRestore, or a Keras release listed in "
                         "docs/keras_versions.md.")
        self.checkpointer = _WithRecord(checkpointer, self._record)
        self._data = FitData(None, [])
        self._epoch = 0  # the epoch being trained
        self._next = (0, 0)  # (epoch, batch) a save now resumes at
        self._steps: Optional[int] = None  # steps in an epoch (Keras' params)

    # -- restore ---------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        super().on_train_begin(logs)
        model = callback_model(self)
        self._data = FitData.of(model)
        self._steps = (self.params or {}).get("steps")
        if self._data.known:
            self._data.check_fit(self._steps, owner=OWNER)
        if self.restore:
            self._restore_latest()

    def _restore_latest(self) -> None:
        latest = self.checkpointer.latest
        if latest is None:
            return
        step, model = latest.step, callback_model(self)
        where = os.path.join(self.directory, str(step))
        if not model.built:
            raise ValueError(
                f"{OWNER}: the model must be built before fit() restores it (call it on a batch, or give it an "
                f"Input). Received: the unbuilt model {model.name!r}"
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its variables must exist to be loaded
        saved = set(self.checkpointer.checkpointables_metadata(step).metadata)
        if ITEM not in saved or "pytree" not in saved:
            raise ValueError(
                f"{OWNER}: the latest checkpoint, {where!r}, has no {ITEM!r} record of the epoch and data "
                "position (keras.callbacks.OrbaxCheckpoint or another tool wrote it?): load it with "
                "model.load_weights, or use a new directory. "
                f"Received: the checkpointables {sorted(saved)}"
            )
        loaded = self.checkpointer.load_checkpointables(step, {"pytree": _abstract(where, model), ITEM: None})
        record = _record_of(loaded[ITEM])
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(
                f"{OWNER}: the {ITEM!r} item of {where!r} is not a record written by {OWNER} (format "
                f"{FORMAT!r}). Received: {str(record)[:200]}"
            )
        _check_paths(model, loaded["pytree"], where)
        model.set_state_tree(loaded["pytree"])
        exact = self._data.restore(model, record, where, owner=OWNER)
        if not exact:
            warnings.warn(
                f"{OWNER}: restored model and epoch from {where!r}; the data position is not restored (the epoch "
                "starts again from its first batch): fit a kerasfeed.to_dataset or kerasfeed.to_loader to resume "
                "exactly.",
                stacklevel=3,
            )
        self._epoch = int(record["epoch"])
        batch = int(record["batch"]) if exact else 0
        if record.get("best") is not None:
            self.best = record["best"]
        # Keras' own counters: the Orbax step of a batch save is the batches trained (the optimizer's
        # steps, read by set_model before this restore), and the first batch of a resumed epoch is
        # numbered `batch` (fit_data.py), not 0.
        missing = [f"`{name}`" for name in _COUNTERS if not hasattr(self, name)]
        if missing:
            raise refuse(f"its OrbaxCheckpoint has no {', '.join(missing)}", f"{OWNER} restored {where!r} but "
                         "cannot set Keras' step counters: the resumed run's steps would be numbered from 0 again, "
                         "its saves discarded or refused by Orbax. Refused; use kerasfeed.BackupAndRestore, or a "
                         "Keras release listed in docs/keras_versions.md.")
        if model.optimizer is not None:
            self._total_batches_seen = int(model.optimizer.iterations)
        self._last_batch_seen = batch - 1 if batch else None
        self._batches_seen_since_last_saving = 0

    # -- save ------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._data.epoch_begins(epoch, owner=OWNER)  # Keras' public route (fit_data.py)
        self._epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._next = (self._epoch, batch + 1)  # `batch` counts from the resumed batch (fit_data.py)
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._next = (epoch + 1, 0)
        super().on_epoch_end(epoch, logs)

    def _record(self) -> dict:
        """The ``kerasfeed`` item of the step being saved."""
        record = dict(self._data.position(*self._next, self._steps), format=FORMAT, keras=keras.version())
        best = None if self.best is None else float(self.best)
        if best is not None and math.isfinite(best):
            record["best"] = best  # save_best_only goes on comparing with it
        return record

    def on_train_end(self, logs: Any = None) -> None:
        super().on_train_end(logs)
        restore_epoch(callback_model(self), None, owner=OWNER)  # a later fit of this model starts where it is told
        self._data.epoch_begins(None)


class _WithRecord:
    """Keras' checkpointer, saving ``record()`` as the ``kerasfeed`` item of every step."""

    def __init__(self, checkpointer: Any, record: Any):
        self._checkpointer = checkpointer
        self._add = record

    def save_checkpointables(self, step: int, checkpointables: dict, *args: Any, **kwargs: Any) -> Any:
        return self._checkpointer.save_checkpointables(step, self._with(checkpointables), *args, **kwargs)

    def save_checkpointables_async(self, step: int, checkpointables: dict, *args: Any, **kwargs: Any) -> Any:
        return self._checkpointer.save_checkpointables_async(step, self._with(checkpointables), *args, **kwargs)

    def _with(self, checkpointables: dict) -> dict:
        # As one JSON text: Orbax's metadata reader refuses bool leaves (the order's `shuffle`), and every
        # restore logged "Failed to get metadata for checkpointable: kerasfeed ... Unsupported dtype: bool".
        return {**checkpointables, ITEM: {"json": json.dumps(self._add())}}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("save"):  # a Keras that saves another way: a step without the record, silently
            raise refuse(f"its OrbaxCheckpoint saves through `checkpointer.{name}`, not `save_checkpointables`",
                         f"{OWNER} adds the data position to what `save_checkpointables` saves: refused rather "
                         "than save a checkpoint without it. Use kerasfeed.BackupAndRestore, or a Keras release "
                         "listed in docs/keras_versions.md.")
        return getattr(self._checkpointer, name)


def _record_of(item: Any) -> Any:
    """The record a step's ``kerasfeed`` item holds: one JSON text, or (kerasfeed before 2026-11-28) the dict."""
    if isinstance(item, dict) and set(item) == {"json"} and isinstance(item["json"], str):
        try:
            return json.loads(item["json"])
        except ValueError:
            return item
    return item


def _check_paths(model: Any, tree: dict, where: str) -> None:
    """Refuses a checkpoint whose variables are not the model's, by path: Keras' ``set_state_tree``
    assigns by variable path and passes over the paths it does not find, in silence.

    Raises:
        ValueError: the trainable, non-trainable or optimizer variables' paths differ.
    """
    groups = {"trainable_variables": model.trainable_variables,
              "non_trainable_variables": model.non_trainable_variables}
    if model.optimizer is not None:
        groups["optimizer_variables"] = model.optimizer.variables
    for key, variables in groups.items():
        saved, have = set(_paths(tree.get(key) or {})), {v.path for v in variables}
        if saved != have:
            raise ValueError(
                f"{OWNER}: the {key} of {where!r} are not this model's: Keras restores an Orbax checkpoint by "
                "variable path, so the model, its layers and its optimizer must be named as in the run that saved "
                "it (Keras numbers unnamed ones per process: dense_1, sgd_1, ...). Name them (name=...), or make "
                "the model first thing in a fresh process, as the saving run did. Received: only in the "
                f"checkpoint {sorted(saved - have)[:4]}, only in the model {sorted(have - saved)[:4]}"
            )


def _paths(tree: dict, prefix: str = "") -> Any:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _paths(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}"


def _abstract(where: str, model: Any) -> Any:
    """Keras' target shardings for the arrays (None: those saved), as ``model.load_weights`` builds them."""
    try:
        from keras.src.saving.orbax_util import build_orbax_abstract_pytree
    except ImportError:  # a Keras that moved it: the saved shardings (the same topology)
        report("it has no keras.src.saving.orbax_util.build_orbax_abstract_pytree", "OrbaxCheckpoint restores "
               "the arrays with the shardings they were saved with (right on the same device topology).")
        return None
    return build_orbax_abstract_pytree(where, model.get_state_tree())


__all__ = ["OrbaxCheckpoint"]
