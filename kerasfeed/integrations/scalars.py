"""TensorBoard scalars for the callbacks (``InputStats``, ``WorkerSummaries``).

NOTE [ Scalars without TensorFlow ]: under the JAX and PyTorch backends
TensorFlow is often not installed (the TF-free path of ``to_loader``), and
where it is, importing it for a summary writer costs seconds and, on a GPU,
lets TensorFlow reserve the GPU's memory beside the backend's. So under those
backends the callbacks write the event files here: TFRecord frames of
``Event`` messages, each scalar byte for byte as ``tf.summary.scalar`` writes
it (a float32 scalar tensor with the ``scalars`` plugin's metadata), which
TensorBoard, tbparse and ``EventAccumulator`` read alike (tests compare the
bytes with TensorFlow's). Under the TensorFlow backend ``tf.summary`` writes;
it also reaches ``gs://`` and TensorFlow's other file systems, so a
``log_dir`` with a scheme uses it under any backend (TensorFlow then must be
installed).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import socket
import struct
import time
from typing import Any, Mapping, Optional, Union

from kerasfeed import _records
from kerasfeed._validation import nearest_existing

_FILE_VERSION = b"brain.Event:2"
_PLUGIN = b"scalars"
_DT_FLOAT = 1
_COUNTER = itertools.count()


def _tensorflow_backend() -> bool:
    import keras

    return keras.backend.backend() == "tensorflow"


def check_log_dir(log_dir: Any, *, owner: str) -> str:
    """``log_dir`` as a str once it can hold run directories; else a clear error.

    Refused: not a path; an existing file at the path or at any directory
    above it (TensorBoard's writer would fail at the first scalar, in the
    middle of ``fit``); a URL under a non-TensorFlow backend without
    TensorFlow installed.
    """
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"{owner}: `log_dir` must be a directory path. Received: log_dir={log_dir!r}")
    path = os.fspath(log_dir)
    if isinstance(path, bytes) or not path:
        raise TypeError(f"{owner}: `log_dir` must be a non-empty str path. Received: log_dir={log_dir!r}")
    if "://" in path:
        if not _tensorflow_backend() and importlib.util.find_spec("tensorflow") is None:
            raise ValueError(
                f"{owner}: `log_dir` {path!r} is a URL; kerasfeed writes TensorBoard scalars to it through "
                "TensorFlow's file systems, and TensorFlow is not installed. Give a local directory (and copy it "
                f"later), or install TensorFlow. Received: log_dir={path!r}"
            )
        return path
    probe = nearest_existing(path)
    if os.path.exists(probe) and not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"is under {probe!r}, which is a file"
        raise ValueError(
            f"{owner}: `log_dir` must be a directory (TensorBoard run directories are made in it), "
            f"but {path!r} {where}. Received: log_dir={path!r}"
        )
    return path

def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: infinite, as TensorFlow casts it
        return struct.pack("<f", value * float("inf"))


def _scalar_event(wall_time: float, step: int, tag: str, value: float) -> list:
    name = tag.encode("utf-8")
    tensor = [b"\x08" + _records.varint(_DT_FLOAT), _records.field(2, 0),  # dtype, scalar tensor_shape {}
              _records.field(4, 4), _float32(value)]  # tensor_content: the float32, little-endian
    metadata = _records.message(1, [_records.field(1, len(_PLUGIN)), _PLUGIN])  # plugin_data.plugin_name
    entry = [_records.field(1, len(name)), name] + _records.message(8, tensor) + _records.message(9, metadata)
    summary = _records.message(1, entry)  # Summary.value
    head = [b"\x09" + struct.pack("<d", wall_time)]  # wall_time (a double)
    if step:
        head.append(b"\x10" + _records.varint(step % 2**64))  # step (int64; 0 is the default, not written)
    return head + _records.message(5, summary)


class EventFile:
    """One TensorBoard event file in ``run_dir`` (made if missing), written without TensorFlow."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_COUNTER)}.v2")
        self.path = os.path.join(run_dir, name)
        self._file: Optional[Any] = open(self.path, "ab")
        self._put([b"\x09" + struct.pack("<d", time.time()), _records.field(3, len(_FILE_VERSION)), _FILE_VERSION])
        self.flush()

    def _put(self, pieces: list) -> None:
        header, footer, _ = _records.frame(pieces)
        self._file.write(b"".join([header, *pieces, footer]))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Writes every ``tag: value`` at ``step`` and flushes, so TensorBoard sees them during training."""
        if self._file is None:
            raise ValueError(f"the event file {self.path!r} is closed. Received: {len(values)} scalars")
        now = time.time()
        for tag, value in values.items():
            self._put(_scalar_event(now, int(step), tag, float(value)))
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TFSummary:
    """The same interface over ``tf.summary`` (the TensorFlow backend, URLs)."""

    def __init__(self, run_dir: str):
        import tensorflow as tf

        self._tf = tf
        self._writer = tf.summary.create_file_writer(run_dir)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        with self._writer.as_default():
            for tag, value in values.items():
                self._tf.summary.scalar(tag, float(value), step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def scalar_writer(run_dir: str) -> Union[EventFile, TFSummary]:
    """The writer for ``run_dir``: ``tf.summary`` under the TensorFlow backend
    or for a URL, an ``EventFile`` otherwise (NOTE above)."""
    if "://" in run_dir or _tensorflow_backend():
        return TFSummary(run_dir)
    return EventFile(run_dir)


__all__ = ["EventFile", "TFSummary", "check_log_dir", "scalar_writer"]
