"""The random-access format (ArrayRecord) and ``ExportSource``, an export read back by index.

Why ArrayRecord (it indexes its records; with ``group_size:1`` any item is
one seek) and what it stores (the same ``tf.train.Example`` bytes as
TFRecord): docs/export.md, *format="arrayrecord"*.
"""

from __future__ import annotations

import os
import pathlib
import threading
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed.exporting import encoding
from kerasfeed.exporting.manifest import MANIFEST, ExportError, bad_shards, file_crc32c, fsync, read_manifest
from kerasfeed.exporting.spec import ExportSpec

_COMPRESSION = {None: "uncompressed", "ZSTD": "zstd:3", "SNAPPY": "snappy", "BROTLI": "brotli:6"}
_READ_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # tuned for random access


def _module():
    try:
        from array_record.python import array_record_module
    except ImportError as e:  # pragma: no cover - the `export` extra installs it
        raise ImportError(
            "format='arrayrecord' needs the `array-record` package: pip install 'kerasfeed[export]'. "
            f"Received: ImportError: {e}"
        ) from e
    return array_record_module


class ArrayRecordFile:
    """Writes one ArrayRecord shard (same interface as ``writer.TFRecordFile``)."""

    def __init__(self, path: pathlib.Path, compression: Optional[str]):
        self.path = path
        options = f"group_size:1,max_parallelism:1,{_COMPRESSION[compression]}"
        self._writer = _module().ArrayRecordWriter(str(path), options)

    def write(self, spec: ExportSpec, arrays: list) -> None:
        self._writer.write(encoding.encode(spec, arrays))

    def close(self) -> tuple[int, str]:
        self._writer.close()
        fsync(self.path)
        return file_crc32c(self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - the file is removed anyway
            pass


def _stamp(path: str) -> Optional[tuple]:
    """What tells a file from another put in its place, as an export puts its shards (a rename): ``(device,
    inode)``; None: no file. Not alone: a replaced shard's inode is free again and the next file written often
    gets it (seen in CI), hence the manifest's entry as well (``ExportSource._entry_now``). A file changed in
    place keeps both: Riegeli's checks find what changed, and the error says so."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _manifest_stamp(directory: pathlib.Path) -> Optional[tuple]:
    try:
        st = os.stat(directory / MANIFEST)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class ExportSource:
    """A ``format="arrayrecord"`` export as an indexable source: ``src[i]`` is item ``i``.

    Use it with ``kerasfeed.to_dataset`` (shuffled, sharded, on threads or
    worker processes) or anything that takes a random-access source. Items
    are nests of numpy arrays (strings as object arrays of bytes), equal to
    what was exported. It pickles small: each process opens the shard files
    lazily, on first use.

    Args:
        directory: the export directory.
        verify: ``"size"`` (default) checks every shard's size against the
            manifest when the source is built; ``"checksum"`` also reads every
            file and checks its CRC32C; ``False`` checks nothing.

    Raises:
        kerasfeed.ExportError: not a finished ArrayRecord export, or a shard
            is missing or damaged (named).

    Example:

    ```python
    src = kerasfeed.ExportSource("/tmp/scenes_ar")   # kerasfeed.export(..., format="arrayrecord")
    x, y = src[3]
    ds = kerasfeed.to_dataset(src, shuffle=True, seed=0, executor="threads")
    ```
    """

    def __init__(self, directory: Any, *, verify: Any = "size"):
        self.directory, manifest = read_manifest(_v.path("directory", directory, owner="ExportSource"))
        if manifest["file_format"] != "arrayrecord":
            raise ExportError(
                "ExportSource reads exports written with format='arrayrecord' (random access); "
                f"'{self.directory}' holds "
                f"{manifest['file_format']} files: read it with kerasfeed.load_export, or export again with "
                f"format='arrayrecord'. Received: file_format={manifest['file_format']!r}"
            )
        check_verify(verify)
        if verify:
            raise_bad(self.directory, bad_shards(self.directory, manifest, checksum=verify == "checksum"))
        self.spec = ExportSpec.from_json(manifest["element_spec"])
        self.num_items = manifest["num_items"]
        self.num_shards = manifest["num_shards"]
        self.files = [str(self.directory / s["file"]) for s in manifest["shards"]]
        # Each shard file as it is now: one replaced later (an export again into the directory) is refused
        # when first opened, rather than mixed with the shards already open (which read the old files).
        self._stamps = [_stamp(f) for f in self.files]
        self._entries = manifest["shards"]  # with each file's crc32c: an export again writes its own
        self._manifest_stamp = _manifest_stamp(self.directory)  # unchanged: no need to read it again
        self._readers: Optional[tuple] = None  # (pid, {shard: reader}): readers are thread-safe
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_items

    def __getitem__(self, index: int) -> Any:
        n = self.num_items
        i = _v.sequence_index(
            index, n, "ExportSource",
            lambda: f"ExportSource index out of range: the export holds {n} items. Received: index={index}",
        )  # fmt: skip
        k, position = i % self.num_shards, i // self.num_shards
        try:
            # Riegeli's errors (a bad chunk, a short or missing file) name no file.
            record = self._reader(k).read([position])[0]
            return encoding.decode(self.spec, record)
        except ExportError:
            raise
        except (RuntimeError, OSError, ValueError) as e:
            raise ExportError(
                f"Record {position} of shard file '{self.files[k]}' (item {i}) cannot be read: {type(e).__name__}: "
                f"{e}. The file was changed or removed after the export: kerasfeed.verify_export(directory) checks "
                f"every shard of {self.directory}; kerasfeed.export(..., resume=True) rewrites the damaged ones. "
                f"Received: index={index}"
            ) from e

    def _reader(self, k: int) -> Any:
        with self._lock:
            if self._readers is None or self._readers[0] != os.getpid():
                self._readers = (os.getpid(), {})
            readers = self._readers[1]
            reader = readers.get(k)
            if reader is None:
                if _stamp(self.files[k]) != self._stamps[k] or self._entry_now(k) != self._entries[k]:
                    raise ExportError(
                        f"Shard file '{self.files[k]}' was replaced after this ExportSource was made (exported "
                        "again into its directory?): its items would mix with the old files' of the shards already "
                        f"open. Make the ExportSource again. Received: shard {k}"
                    )
                reader = readers[k] = _module().ArrayRecordReader(self.files[k], _READ_OPTIONS)
            return reader

    def _entry_now(self, k: int) -> Any:
        """Shard ``k``'s manifest entry as the directory holds it now (None: no finished manifest). Read only
        if the manifest file changed: parsing it at each shard's first open cost 1.4 ms a shard for 1,024
        shards (0.39 ms for 256), in every process (helper's review, 2026-11-29)."""
        if _manifest_stamp(self.directory) == self._manifest_stamp:
            return self._entries[k]
        try:
            return read_manifest(self.directory, need_complete=False)[1]["shards"][k]
        except (ExportError, IndexError):
            return None

    def close(self) -> None:
        readers, self._readers = self._readers, None
        if readers is None or readers[0] != os.getpid():
            return
        failed = None
        for k, reader in readers[1].items():
            try:
                reader.close()
            except (RuntimeError, OSError, ValueError) as e:  # Riegeli checks the file again and names none
                failed = failed or ExportError(
                    f"Shard file '{self.files[k]}' was found damaged when closed: {type(e).__name__}: {e}. "
                    f"kerasfeed.verify_export(directory) checks every shard of {self.directory}; "
                    f"kerasfeed.export(..., resume=True) rewrites the damaged ones. Received: shard {k}"
                )
        if failed is not None:
            raise failed

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _readers=None, _lock=threading.Lock())

    def __repr__(self) -> str:
        return f"ExportSource('{self.directory}', items={self.num_items}, shards={self.num_shards}, spec={self.spec})"


def check_verify(verify: Any) -> None:
    if not (verify is False or (isinstance(verify, str) and verify in ("size", "checksum"))):  # not 0 for False
        raise ValueError(f"`verify` must be 'size', 'checksum' or False. Received: verify={verify!r}")


def raise_bad(directory: pathlib.Path, bad: list) -> None:
    if bad:
        listing = "; ".join(f"{name}: {problem}" for name, problem in bad)
        raise ExportError(
            f"The export in '{directory}' is damaged: {len(bad)} shard(s) fail their check: {listing}. "
            f"Re-export those shards with kerasfeed.export(..., resume=True) (it keeps the good ones). "
            f"Received: directory='{directory}'"
        )
