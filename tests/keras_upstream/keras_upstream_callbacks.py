"""What Keras' vendored tests import as ``callbacks``: Keras' own callbacks
module, with ``BackupAndRestore`` being ``kerasfeed.BackupAndRestore``."""

from __future__ import annotations

import types

from keras.src import callbacks as keras_callbacks

import kerasfeed


class _Callbacks(types.ModuleType):
    BackupAndRestore = kerasfeed.BackupAndRestore

    def __getattr__(self, name: str):
        return getattr(keras_callbacks, name)


callbacks = _Callbacks("callbacks", keras_callbacks.__doc__)
