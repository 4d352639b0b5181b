"""The files of a backup directory, committed atomically (Keras-free).

NOTE [ One commit per backup ]: Keras' own callback overwrites
``latest.weights.h5`` and then ``training_metadata.json``: a crash between
the two (or inside either) leaves weights and epoch that disagree. Here each
backup is a new directory ``ckpt-<n>/`` (the weights, written and fsynced),
and the backup becomes the current one only when ``latest.json`` (epoch,
batch, data position and the directory's name) replaces the previous one
with ``os.replace``, an atomic rename. A crash at any point before that
leaves the previous ``latest.json`` and its directory whole; a crash after
it leaves only an old directory behind, which the next commit removes. Each
directory also holds its own record (``record.json``, written before the
commit), so that with ``keep_previous`` a latest backup whose weights cannot
be read falls back on the previous one, position included (``fall_back``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Optional

LATEST = "latest.json"
FORMAT = "kerasfeed-backup-1"
WEIGHTS = "model.weights.h5"
RECORD = "record.json"  # a backup's own copy of its record, in its directory
_CKPT = re.compile(r"^ckpt-(\d+)$")


class BackupFiles:
    """The committed backups under ``directory``: read the latest, commit a new one.

    Args:
        directory: the backup directory (made on the first commit).
        keep_previous: keep the previous committed backup too (Keras'
            ``double_checkpoint``), to fall back on when the latest cannot be read.
    """

    def __init__(self, directory: str, keep_previous: bool = False):
        self.directory = directory
        self.keep_previous = keep_previous

    def latest(self) -> Optional[dict]:
        """The committed record (``latest.json``), or None before the first commit.

        Raises:
            ValueError: ``latest.json`` is not a record this class wrote.
        """
        path = os.path.join(self.directory, LATEST)
        if not os.path.exists(path):
            _refuse_keras_backup(self.directory)
            return None
        with open(path) as f:
            text = f.read()
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(
                f"kerasfeed.BackupAndRestore: {path!r} is not a backup record written by kerasfeed (format "
                f"{FORMAT!r}); is the directory another tool's? Delete it to start over. Received: {text[:120]!r}"
            )
        return record

    def weights_of(self, record: dict, previous: bool = False) -> Optional[str]:
        """The weights file of ``record`` (or of the backup committed before it)."""
        name = record.get("previous") if previous else record.get("checkpoint")
        return None if not name else os.path.join(self.directory, name, WEIGHTS)

    def record_path(self, record: dict, previous: bool = False) -> Optional[str]:
        """Where ``record`` is kept: ``latest.json`` (the commit), or the previous backup's own record file."""
        if not previous:
            return os.path.join(self.directory, LATEST)
        name = record.get("previous")
        return None if not name else os.path.join(self.directory, name, RECORD)

    def previous_of(self, record: dict) -> Optional[dict]:
        """The record of the backup committed before ``record`` (kept with ``keep_previous``), or
        None: none was kept, or it was written before backups kept their own record."""
        path = self.record_path(record, previous=True)
        if path is None or not os.path.exists(path):
            return None
        with open(path) as f:
            try:
                previous = json.load(f)
            except ValueError:
                return None
        ok = isinstance(previous, dict) and previous.get("format") == FORMAT
        return previous if ok and previous.get("checkpoint") == record["previous"] else None

    def fall_back(self, previous: dict) -> dict:
        """Makes the backup ``previous`` the current one again (the latest could not be read), atomically;
        the unreadable one is removed. Returns ``previous`` as now committed (it has no previous of its own)."""
        full = {k: v for k, v in previous.items() if k != "previous"}
        self._replace_latest(full)
        self._remove_stale(keep={full["checkpoint"]})
        return full

    def commit(self, record: dict, write_weights: Callable[[str], None]) -> dict:
        """Writes a new backup: ``write_weights(path)``, then ``record`` as the latest, atomically.

        Args:
            record: JSON-able fields (epoch, batch, data position); the
                format and the directory names are added here.
            write_weights: writes the model's weights to the given path.

        Returns:
            The record as committed (with the format and the directory names).
        """
        os.makedirs(self.directory, exist_ok=True)
        current = self.latest()
        name = f"ckpt-{self._next_number()}"
        folder = os.path.join(self.directory, name)
        os.makedirs(folder)
        path = os.path.join(folder, WEIGHTS)
        write_weights(path)
        _fsync_file(path)
        full = dict(record, format=FORMAT, checkpoint=name)
        if self.keep_previous and current is not None:
            full["previous"] = current["checkpoint"]
        _write_json(os.path.join(folder, RECORD), full)
        _fsync_dir(folder)
        self._replace_latest(full)
        self._remove_stale(keep={name, full.get("previous")})
        return full

    def _replace_latest(self, full: dict) -> None:
        tmp = os.path.join(self.directory, f"{LATEST}.{os.getpid()}.tmp")
        _write_json(tmp, full)
        os.replace(tmp, os.path.join(self.directory, LATEST))  # the commit
        _fsync_dir(self.directory)

    def _next_number(self) -> int:
        numbers = [int(m.group(1)) for m in map(_CKPT.match, os.listdir(self.directory)) if m]
        return max(numbers, default=0) + 1

    def _remove_stale(self, keep: set) -> None:
        for entry in os.listdir(self.directory):
            if (_CKPT.match(entry) and entry not in keep) or entry.endswith(".tmp"):
                target = os.path.join(self.directory, entry)
                if os.path.isdir(target):
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    _remove(target)

    def delete(self) -> None:
        """Removes the whole backup directory (a finished ``fit``): the record
        first, so that a crash half-way leaves no record pointing at removed files."""
        _remove(os.path.join(self.directory, LATEST))
        shutil.rmtree(self.directory, ignore_errors=True)


# What keras.callbacks.BackupAndRestore leaves in its directory (Keras 3.12-3.15.1).
_KERAS_FILES = ("training_metadata.json", "latest.weights.h5")


def _refuse_keras_backup(directory: str) -> None:
    """A directory holding Keras' own backup and no record of ours: training from epoch 0 would go on, and
    the end of the ``fit`` would delete that backup with the directory. Refused, naming the files."""
    found = [name for name in _KERAS_FILES if os.path.exists(os.path.join(directory, name))]
    if found:
        raise ValueError(
            f"kerasfeed.BackupAndRestore: {directory!r} holds a backup of Keras' own BackupAndRestore "
            f"({', '.join(found)}) and none of this callback's (latest.json): it would train from the first epoch, "
            "and delete that backup "
            "when the fit ends. Finish that run with keras.callbacks.BackupAndRestore, or give this callback another "
            f"directory (or delete it to start over). Received: backup_dir={directory!r}"
        )


def _write_json(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:  # a file system without directory fsync
        pass


def _remove(path: Any) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


__all__ = ["BackupFiles", "FORMAT", "LATEST", "RECORD", "WEIGHTS"]
