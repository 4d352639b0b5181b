"""``kerasfeed.BackupAndRestore``: Keras' callback, with the data position in the same commit."""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from typing import Any, Union

import keras

from kerasfeed import _validation as _v
from kerasfeed._keras_callback import backup_paths, callback_model
from kerasfeed._keras_fit import batch_end_offset, refuse, restore_epoch
from kerasfeed.integrations.backup_files import BackupFiles
from kerasfeed.integrations.fit_data import FitData
from kerasfeed.integrations.steps import step_offset
from kerasfeed.loading import hosts


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up model, optimizer *and* data position; a killed ``fit`` resumes exactly.

    A drop-in for ``keras.callbacks.BackupAndRestore`` (same arguments and
    meaning). Every backup holds the model's and the optimizer's variables,
    the epoch and batch reached, and where the kerasfeed dataset or loader
    being fitted stands, in one atomic commit: a crash during a save leaves
    the previous backup whole. Started again, the same ``model.fit`` call
    restores all of it and goes on inside the interrupted epoch at its first
    batch not trained yet; the epochs after it are whole passes, so the final
    weights are those of a run never interrupted (with deterministic ops).

    It finds the data by itself: the ``to_dataset`` dataset or ``to_loader``
    loader ``fit`` was given (or one derived from it with ``.map`` etc.),
    made without ``initial_state`` (under ``fit``, pass ``e`` is epoch ``e``).
    With other data it restores model and epoch as Keras' own callback does,
    and warns once that the data position is not restored. Epochs that are
    not passes (``steps_per_epoch``) are refused with the reason. The data
    may come back on another executor or worker count; another order, seed,
    batch size or pass length is refused, naming what changed.

    Args:
        backup_dir: where the backups are kept (one directory per run).
        save_freq: ``"epoch"`` (at the end of every epoch) or an int: every
            that many batches.
        double_checkpoint: keep the previous backup too and fall back on it
            when the latest cannot be read.
        delete_checkpoint: delete ``backup_dir`` when ``fit`` finishes.

    Example:

    ```python
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=0, executor="processes")
    model.fit(loader, epochs=10,
              callbacks=[kerasfeed.BackupAndRestore("run/backup", save_freq=500)])
    # killed? run the same script again: it goes on at the next unseen batch
    ```
    """

    def __init__(
        self,
        backup_dir: Union[str, os.PathLike],
        save_freq: Union[str, int] = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        _check_keras(keras.version())
        # Keras' own texts lead its messages (code that matches them keeps working): Keras refuses any
        # falsy value (None, "") as "Empty" with a ValueError, and its own tests check that.
        if not isinstance(backup_dir, os.PathLike) and not backup_dir:
            raise ValueError(
                "BackupAndRestore: Empty `backup_dir` argument passed; it must be a non-empty path. "
                f"Received: backup_dir={backup_dir!r}"
            )
        # Another type is not "empty": say which type it is, and which it must be.
        backup_dir = _v.path("backup_dir", backup_dir, owner="BackupAndRestore")
        # Keras takes any truthy value; the rest of kerasfeed refuses a non-bool flag ("yes", 0) rather than guess.
        double_checkpoint = _v.flag("double_checkpoint", double_checkpoint, owner="BackupAndRestore")
        delete_checkpoint = _v.flag("delete_checkpoint", delete_checkpoint, owner="BackupAndRestore")
        if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):  # fit failed later: bare FileExistsError
            raise ValueError(
                "BackupAndRestore: `backup_dir` is an existing file, not a directory; backups go into a directory "
                f"of that name. Received: backup_dir={backup_dir!r}"
            )
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                "BackupAndRestore: Invalid value for argument `save_freq`. Expected either 'epoch' or an integer "
                f"value (a positive number of batches between backups). Received: save_freq={save_freq!r}"
            )
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        # Keras' attributes keep Keras' meaning (its tests read them): `_current_epoch` the epoch a
        # backup now would resume at, `_last_batch_seen` (save_freq=n) the last batch trained, the four
        # paths the current and the previous backup's files (`_point_at`; Keras' names until a backup is).
        self._keras_paths = backup_paths(self)
        self._files = BackupFiles(backup_dir, keep_previous=bool(double_checkpoint))
        self._data = FitData(None, [])
        self._steps = None  # steps in an epoch (Keras' params)
        self._step_end = 1  # on_train_batch_end's batch + this = the epoch's batches trained (batch_end_offset)
        self._first_end = False  # the epoch's first on_train_batch_end is yet to come (``_convention``)
        self._done = 0  # batches of the current epoch trained (a resumed epoch's first ones included)
        self._resumed = (0, 0)  # (epoch, batch) the restored fit starts at
        self._warned = False
        self._writer = True  # this process commits the backups (one of several: the first)

    # -- restore ---------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        model = callback_model(self)
        self._data = FitData.of(model)
        self._steps = (self.params or {}).get("steps")
        self._step_end = batch_end_offset(model)
        vars(self).pop("on_train_batch_end", None)  # what an earlier fit chose
        if self._step_end != 1:  # Keras < 3.11 under steps_per_execution: the execution's first step
            self.on_train_batch_end = self._on_first_step_end
        if self._data.known:
            self._data.check_fit(self._steps)
        self._batches_seen_since_last_saving = 0
        self._writer = _writes_backups()
        record = self._files.latest()
        _same_backup_everywhere(record, self.backup_dir)
        if record is None:
            return
        if not model.built:
            raise ValueError(
                "BackupAndRestore: To use the BackupAndRestore callback, you model must be built before you call "
                "`fit()` (call it on a batch, or give it an Input) to restore it. "
                f"Received: the unbuilt model {model.name!r}"
            )
        record = self._load_weights(record)
        self._point_at(record)
        if not self._data.restore(model, record, self.backup_dir) and not self._warned:
            self._warned = True
            warnings.warn(
                "kerasfeed.BackupAndRestore: restored model and epoch from a backup of data without a position to "
                "restore (not a kerasfeed.to_dataset or to_loader: another dataset, or a stream such as "
                "from_generators, from_files or from_queue); the epoch starts again from its first batch. Fit a "
                "kerasfeed.to_dataset or kerasfeed.to_loader of an indexable source to resume exactly.",
                stacklevel=2,
            )
        self._current_epoch = int(record["epoch"])
        if record.get("data") is not None and self._data.known:
            self._resumed = (self._current_epoch, int(record["batch"]))

    def kerasfeed_resume_hint(self) -> Any:
        """``(epoch, batch)`` that ``on_train_begin`` will resume the data at, read before it for the pass
        Keras' model build reads (NOTE [ The model build's pass under a resume ], loading/fit_follow.py);
        None: no backup with a data position. A hint: the restore itself checks the backup."""
        try:
            record = self._files.latest()
        except ValueError:
            return None  # on_train_begin says why
        if record is None or record.get("data") is None:
            return None
        return int(record["epoch"]), int(record["batch"])

    def _load_weights(self, record: dict) -> dict:
        """Loads ``record``'s weights, or with ``double_checkpoint`` the previous backup's when
        they cannot be read (Keras' fallback): returns the record whose weights were loaded."""
        model = callback_model(self)
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its variables must exist to be loaded
        try:
            model.load_weights(self._files.weights_of(record))
            return record
        except OSError as error:
            if not record.get("previous"):
                raise
            previous = self._files.previous_of(record)
            if previous is None:
                raise RuntimeError(
                    f"BackupAndRestore: the latest backup in {self.backup_dir!r} could not be read, and the previous "
                    f"one ({record['previous']}) has no record of its own of where training stood (written by an "
                    f"older kerasfeed). Delete the directory to start over. Received: {error}"
                ) from error
            model.load_weights(self._files.weights_of(previous))
            warnings.warn(
                f"kerasfeed.BackupAndRestore: the latest backup in {self.backup_dir!r} could not be read ({error}); "
                f"restored the previous one (epoch {previous['epoch']}, batch {previous['batch']}) instead.",
                stacklevel=3,
            )
            return self._files.fall_back(previous) if self._writer else previous

    def _point_at(self, record: dict) -> None:
        """Keras' four path attributes name the files of the committed ``record`` (and its previous)."""
        files = self._files
        found = (files.weights_of(record), files.record_path(record), files.weights_of(record, previous=True),
                 files.record_path(record, previous=True))
        (self._weights_path, self._training_metadata_path, self._prev_weights_path,
         self._prev_training_metadata_path) = (f or k for f, k in zip(found, self._keras_paths))

    # -- save ------------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._data.epoch_begins(epoch)  # Keras' public route: the restored epoch began, the passes follow it
        self._current_epoch = epoch
        self._done = self._resumed[1] if epoch == self._resumed[0] else 0
        self._first_end = True  # the epoch's first on_train_batch_end says which step Keras gives (step_offset)

    def _convention(self, batch: int) -> bool:
        """At the epoch's first ``on_train_batch_end``: whether Keras gives the other step of an execution than
        ``_step_end`` says (``step_offset``, reported); then the callback counts by that one from now on."""
        if not getattr(self, "_first_end", False):
            return False
        self._first_end = False
        offset = step_offset(callback_model(self), self._done, batch, self._steps, self._step_end)
        if offset == self._step_end:
            return False
        self._step_end = offset
        if offset == 1:
            vars(self).pop("on_train_batch_end", None)
        else:
            self.on_train_batch_end = self._on_first_step_end
        return True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # `batch` is the last step of the execution (steps_per_execution), counted
        # from the resumed batch in a resumed epoch (fit_data.py).
        if self._convention(batch) and self._step_end != 1:
            return self._on_first_step_end(batch, logs)
        trained, self._done = batch + 1 - self._done, batch + 1
        if trained <= 0:  # the resumed epoch's steps counted from 0: Keras did not run the replaced enumeration
            raise refuse(f"its fit numbered a step of the resumed epoch {self._current_epoch} as batch {batch}, "
                         f"after {self._done - trained} batches (its EpochIterator did not enumerate the epoch "
                         "through `_enumerate_iterator`)", "kerasfeed.BackupAndRestore would save backups that "
                         "point before what was trained: refused. Delete the backup to start the epoch again, or "
                         "use a Keras release listed in docs/keras_versions.md.")
        if self.save_freq == "epoch":
            return
        self._batches_seen_since_last_saving += trained
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._save(self._current_epoch, self._done)

    def _on_first_step_end(self, batch: int, logs: Any = None) -> None:
        """``on_train_batch_end`` where ``batch`` is an execution's first step (Keras < 3.11): a
        backup past the epoch's steps (its short last execution) is the next epoch's start."""
        if self._convention(batch) and self._step_end == 1:
            return type(self).on_train_batch_end(self, batch, logs)
        self._first_end = False  # the class's method gets the last step: checked here already
        type(self).on_train_batch_end(self, batch + self._step_end - 1, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._current_epoch, self._done = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def _save(self, epoch: int, batch: int) -> None:
        self._batches_seen_since_last_saving = 0
        if not self._writer:
            # The first process commits for all (same weights, same position); the
            # others still take part in gathering the variables (a collective under JAX).
            with tempfile.TemporaryDirectory() as scratch:
                self.model.save_weights(os.path.join(scratch, "discard.weights.h5"))
            return
        record = dict(self._data.position(epoch, batch, self._steps), keras=keras.version())
        model = self.model  # syncs the JAX state into the model's variables
        self._point_at(self._files.commit(record, lambda path: model.save_weights(path, overwrite=True)))

    def on_train_end(self, logs: Any = None) -> None:
        restore_epoch(callback_model(self), None, owner="kerasfeed.BackupAndRestore")  # a later fit starts where told
        self._data.epoch_begins(None)
        if self.delete_checkpoint and self._writer:
            self._files.delete()

    @property
    def _last_batch_seen(self) -> int:
        """Keras' attribute: the last batch trained in this epoch with ``save_freq=n`` (0 at an epoch's
        end, and with ``save_freq="epoch"``); read from ``_done``, so a step stores nothing more."""
        return 0 if self.save_freq == "epoch" else max(getattr(self, "_done", 0) - 1, 0)

    @_last_batch_seen.setter
    def _last_batch_seen(self, value: int) -> None:
        pass  # Keras' __init__ sets 0: it follows _done instead

    # Keras' own save and load: the same commit and restore as above.
    def _save_model(self) -> None:
        self._save(self._current_epoch, self._done)

    def _load_model(self) -> None:
        self.on_train_begin()


# The first Keras whose epoch iterator has the step enumeration a resumed epoch starts inside
# (EpochIterator._enumerate_iterator; fit_data.py), and whose fit takes to_loader's data adapter.
MIN_KERAS = (3, 7)


def _check_keras(version: str) -> None:
    """Refuses a Keras older than ``MIN_KERAS``, naming it."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    if parts is None or tuple(int(p) for p in parts.groups()) < MIN_KERAS:
        raise RuntimeError(
            f"kerasfeed.BackupAndRestore needs Keras >= {'.'.join(map(str, MIN_KERAS))}: older Keras enumerates "
            "an epoch's steps where a resumed epoch cannot start inside it (pip install -U keras). "
            f"Received: keras {version}"
        )


def _same_backup_everywhere(record: Any, backup_dir: str) -> None:
    """Refuses, on every process of a multi-process Keras distribution (JAX), backups that differ between them:
    one resuming at epoch 0 batch 3 and the other from the start ran other steps, and the first collective
    crashed one (gloo: "Received data size doesn't match") and left the others waiting for ever."""
    processes = hosts.current_processes()
    if processes is None or processes.num_processes < 2:
        return
    import numpy as np

    row = np.array([-1, -1] if record is None else [int(record["epoch"]), int(record["batch"])], np.int64)
    table = hosts.exchange(processes, row).tolist()
    if all(r == table[0] for r in table):
        return
    found = ", ".join(f"process {k}: " + ("no backup" if e < 0 else f"epoch {e} batch {b}")
                      for k, (e, b) in enumerate(table))
    raise ValueError(
        f"BackupAndRestore: the processes found different backups ({found}): every process must restore the same "
        "one, or they run other steps and the first collective fails (a crash on one, a hang on the others). Give "
        "every process the same backup_dir on storage all of them see (process 0 writes it). "
        f"Received: backup_dir={os.fspath(backup_dir)!r} on process {processes.process_index}"
    )


def _writes_backups() -> bool:
    """Whether this process commits backups: the only one, or the first of a
    multi-process Keras distribution (JAX) or a tf.distribute cluster. Every
    process restores from the same directory, which they must all see."""
    processes = hosts.current_processes()
    if processes is not None:
        return processes.process_index == 0
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        extended = tf.distribute.get_strategy().extended
        return bool(getattr(extended, "should_checkpoint", True))
    return True


__all__ = ["BackupAndRestore"]
