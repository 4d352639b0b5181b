"""What kerasfeed's callbacks read of Keras' ``Callback`` and ``BackupAndRestore`` beyond their public API,
with its check (TF-free, Keras-free). Part of NOTE [ Keras' private structure ] in ``kerasfeed/_keras_fit.py``
(item 7): a Keras that differs is reported by name, never a bare ``AttributeError``.
"""

from __future__ import annotations

from typing import Any

from kerasfeed._keras_fit import report

# Keras' BackupAndRestore's files; kept under Keras' names, with Keras' meaning (its own tests read them).
BACKUP_PATHS = ("_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path")


def callback_model(callback: Any) -> Any:
    """The model ``set_model`` gave ``callback``: Keras' ``_model`` (its ``model`` property syncs a JAX
    model's state at every read), else the public ``model``, reported once."""
    try:
        return callback._model
    except AttributeError:
        report("its Callback keeps no `_model`", "kerasfeed's callbacks read the public `model` instead (under "
               "JAX, Keras then syncs the model's state at each read); the data and backups are the same.")
        return getattr(callback, "model", None)


def backup_paths(callback: Any) -> tuple:
    """Keras' ``BackupAndRestore`` paths of ``callback`` (None for each it lacks, reported once)."""
    missing = [name for name in BACKUP_PATHS if not hasattr(callback, name)]
    if missing:
        report(f"its BackupAndRestore has no {', '.join(f'`{name}`' for name in missing)}",
               "kerasfeed.BackupAndRestore keeps its files under those names anyway; its backups and resumes are "
               "the same, only code that reads Keras' own attributes may differ.")
    return tuple(getattr(callback, name, None) for name in BACKUP_PATHS)


__all__ = ["BACKUP_PATHS", "backup_paths", "callback_model"]
