"""The shard task: makes one shard's items and writes them, with one writer of its own.

``export`` runs ``ShardTask`` as the source of a kerasfeed executor: item
``k`` is "write shard k", in the thread or worker process that makes its
items (why: docs/export.md, *Where things run*). The task writes
``<shard>.tmp``, fsyncs it and reports ``(count, bytes, crc32c)``; the main
process renames it and records it in the manifest. ``Progress``
(``.kerasfeed-progress``, memory-mapped) carries each shard's item count to
the progress bar and a stop flag back to the tasks.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import struct
import threading
import zlib
from typing import Any, Optional

from kerasfeed.errors import ItemError, SignatureError
from kerasfeed.execution.interpreter_races import get_item
from kerasfeed.exporting import encoding
from kerasfeed.exporting.manifest import PROGRESS, TMP, ExportError, shard_name
from kerasfeed.exporting.spec import ExportSpec
from kerasfeed.sources.base import set_epoch
from kerasfeed.sources.item_random import ItemSeeds, item_scope

_WBITS = {"GZIP": 31, "ZLIB": 15}  # what TFRecordDataset's compression_type expects


class TFRecordFile:
    """Writes TFRecord frames to ``path``; counts bytes and the CRC32C of the file as stored."""

    def __init__(self, path: pathlib.Path, compression: Optional[str]):
        self.path = path
        self._file = open(path, "wb")
        self._zip = zlib.compressobj(6, zlib.DEFLATED, _WBITS[compression]) if compression else None
        self.size = 0
        self.crc = 0

    def _out(self, data: Any) -> None:
        if self._zip is not None:
            data = self._zip.compress(data)
            if not data:
                return
        self._file.write(data)
        self.crc = encoding.crc32c(data, self.crc)
        self.size += memoryview(data).nbytes

    def write(self, spec: ExportSpec, arrays: list) -> None:
        pieces = encoding.encode_pieces(spec, arrays)
        header, footer, _ = encoding.frame(pieces)
        self._out(header)
        for p in pieces:
            self._out(p)
        self._out(footer)

    def close(self) -> tuple[int, str]:
        """Flushes, fsyncs and closes; returns ``(bytes, crc32c hex)``."""
        if self._zip is not None:
            tail, self._zip = self._zip.flush(), None
            self._out(tail)  # as it is, now that _zip is None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.size, f"{self.crc:08x}"

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass


def open_writer(file_format: str, path: pathlib.Path, compression: Optional[str]) -> Any:
    if file_format == "arrayrecord":
        from kerasfeed.exporting.arrayrecord import ArrayRecordFile

        return ArrayRecordFile(path, compression)
    return TFRecordFile(path, compression)


class Progress:
    """The shared progress file: a stop flag, then one item count per shard (int64 each)."""

    def __init__(self, path: pathlib.Path, num_shards: int, create: bool = False):
        size = 8 * (num_shards + 1)
        if create:
            with open(path, "wb") as f:
                f.write(b"\0" * size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)  # keeps its own duplicate of the descriptor
        finally:
            os.close(fd)

    def set_count(self, k: int, n: int) -> None:
        struct.pack_into("<q", self._map, 8 * (k + 1), n)

    def counts(self) -> list[int]:
        return list(struct.unpack_from(f"<{len(self._map) // 8 - 1}q", self._map, 8))

    @property
    def stopped(self) -> bool:
        return self._map[0] != 0

    def stop(self) -> None:
        self._map[0] = 1

    def close(self) -> None:
        self._map.close()


class _Stopped(Exception):
    pass


class ShardTask:
    """An indexable "source" whose item ``k`` writes shard ``k``; returns a small report dict.

    Failures come back as values (``{"shard": k, "error": exc}``) so that the
    caller gets the original exception with the item index, not the shard.
    """

    def __init__(self, source: Any, directory: pathlib.Path, spec: ExportSpec, *, num_items: int, num_shards: int,
                 file_format: str, compression: Optional[str], source_name: str, hint: str,
                 retries: int = 0):  # fmt: skip
        self.source = source
        self.retries = retries  # more calls of source[i] after one that raised (export's `retries=`)
        self.directory = str(directory)
        self.spec = spec
        self.num_items = num_items
        self.num_shards = num_shards
        self.file_format = file_format
        self.compression = compression
        self.source_name = source_name
        self.kerasfeed_name = f"export({source_name}) shard"  # in the executors' messages: "... shard[3]"
        self.hint = hint
        self.item_seeds = ItemSeeds(None)  # kerasfeed.item_rng(): drawn once per export, the same in every worker
        self._local: Optional[tuple] = None  # (pid, Progress), per process
        self.active = 0  # tasks running in this process (threads executor): export waits for them
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "active")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=None, active=0, _lock=threading.Lock())

    def __len__(self) -> int:
        return self.num_shards

    def _progress(self) -> Progress:
        with self._lock:
            if self._local is None or self._local[0] != os.getpid():
                set_epoch(self.source, 0)  # items are pass 0's, as to_dataset's first pass
                self._local = (os.getpid(), Progress(pathlib.Path(self.directory) / PROGRESS, self.num_shards))
            return self._local[1]

    def __getitem__(self, k: int) -> dict:
        k = int(k)
        with self._lock:
            self.active += 1
        try:
            return self._write(k)
        finally:
            with self._lock:
                self.active -= 1

    def _item(self, index: int) -> Any:
        """``source[index]``, called again up to ``retries`` times after one that raised
        (the same item seeds: a deterministic source makes the same item); the final
        failure is an ``ItemError`` listing every attempt."""
        causes: list = []
        while True:
            try:
                with item_scope(index, 0, self.item_seeds):
                    return get_item(self.source, index, self.source_name)
            except Exception as e:
                error = ItemError.from_exception(index, e, source_name=self.source_name)
                causes.append(error.causes[-1])
                if len(causes) > self.retries:
                    raise (error.with_attempts(causes) if len(causes) > 1 else error) from e

    def _write(self, k: int) -> dict:
        progress = self._progress()
        name = shard_name(k, self.num_shards, self.file_format)
        tmp = pathlib.Path(self.directory) / (name + TMP)
        writer, n, index, done = None, 0, None, False
        try:
            if progress.stopped:
                raise _Stopped
            writer = open_writer(self.file_format, tmp, self.compression)
            for index in range(k, self.num_items, self.num_shards):
                if progress.stopped:
                    raise _Stopped
                item = self._item(index)
                writer.write(self.spec, self.spec.arrays(index, item, self.hint))
                n += 1
                progress.set_count(k, n)
            size, crc = writer.close()
            writer, done = None, True
            return {"shard": k, "file": name, "count": n, "bytes": size, "crc32c": crc}
        except _Stopped:
            return {"shard": k, "stopped": True}
        except (ItemError, SignatureError) as e:
            return {"shard": k, "error": e}
        except (OSError, TypeError, ValueError) as e:
            what = f"while writing item {index}" if index is not None else "while creating it"
            return {"shard": k, "error": ExportError(
                f"kerasfeed.export: writing shard {k} ('{tmp}') failed {what}: {type(e).__name__}: {e}. "
                f"Its temporary file was removed; finished shards are kept (resume=True goes on from them). "
                f"Received: directory='{self.directory}'"
            )}  # fmt: skip
        finally:
            if writer is not None:
                writer.abort()
            if not done:
                tmp.unlink(missing_ok=True)
