"""``manifest.json``: what an export holds, and the checks that it is whole.

Layout of an export directory::

    manifest.json                        written first, rewritten as shards complete
    shard-00000-of-00008.tfrecord        (or .arrayrecord) item i is record i // 8 of shard i % 8
    shard-00003-of-00008.tfrecord.tmp    a shard being written (never read)

Its fields, and how every write of it is made safe (temporary name, fsync,
rename): docs/export.md, *manifest.json*.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import re
from typing import Any, Optional

from kerasfeed._leaves import short_repr
from kerasfeed._version import __version__
from kerasfeed.exporting.spec import NUMERIC, STRING, ExportSpec

MANIFEST = "manifest.json"
PROGRESS = ".kerasfeed-progress"
TMP = ".tmp"
FORMATS = {"tfrecord": "tfrecord", "arrayrecord": "arrayrecord"}
COMPRESSIONS = {"tfrecord": (None, "GZIP", "ZLIB"), "arrayrecord": (None, "ZSTD", "SNAPPY", "BROTLI")}
FORMAT_VERSION = 1
_CHUNK = 8 << 20


class ExportError(RuntimeError):
    """An export could not be written, or one on disk is incomplete or damaged.

    The message names the directory and, when one is to blame, the shard file.
    """


def shard_name(k: int, num_shards: int, file_format: str) -> str:
    return f"shard-{k:05d}-of-{num_shards:05d}.{file_format}"


def shard_count(k: int, num_shards: int, num_items: int) -> int:
    """Items in shard ``k``: item ``i`` goes to shard ``i % num_shards``."""
    return len(range(k, num_items, num_shards))


# A shard's name as ``shard_name`` writes it, or its temporary file: nothing else is an export's.
_SHARD_FILE = re.compile(rf"shard-\d{{5,}}-of-\d{{5,}}\.(?:{'|'.join(FORMATS)})(?:{re.escape(TMP)})?")


@contextlib.contextmanager
def exclusive(directory: pathlib.Path):
    """Holds the target directory's lock (``flock`` of the directory itself: no file to leave behind) while
    an export writes in it; a second export into it at once is refused. Two at once had each deleted the
    other's shards and temporary files and stopped its workers, and both failed, naming neither.

    Raises:
        ValueError: ``directory`` is a file.
        ExportError: another export holds the directory.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"export: `directory` is a file, not a directory. Received: directory='{directory}'")
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(
                f"export: another export is writing in '{directory}' now (it holds the directory's lock); wait "
                f"for it to finish, or export to another directory. Received: directory='{directory}'"
            ) from None
        yield
    finally:
        os.close(fd)  # the lock goes with it


def is_own_file(name: str) -> bool:
    """A file an export writes (and ``overwrite``/``resume`` may delete): a user's
    ``shard-00000-of-00002.tfrecord.bak`` is not one."""
    return name in (MANIFEST, MANIFEST + TMP, PROGRESS) or _SHARD_FILE.fullmatch(name) is not None


def is_export_manifest(directory: pathlib.Path) -> bool:
    """Whether ``directory``'s ``manifest.json`` is an export's (``overwrite`` replaces no other)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "kerasfeed-export"


def new_manifest(
    spec: ExportSpec, *, num_items: int, num_shards: int, file_format: str, compression: Optional[str], source: str
) -> dict:
    return {
        "format": "kerasfeed-export",
        "format_version": FORMAT_VERSION,
        "kerasfeed_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "file_format": file_format,
        "compression": compression,
        "num_items": num_items,
        "num_shards": num_shards,
        "layout": "item i is record i // num_shards of shard i % num_shards",
        "element_spec": spec.to_json(),
        "complete": False,
        "shards": [None] * num_shards,
    }


def fsync(path: pathlib.Path) -> None:
    """fsync of a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    tmp = directory / (MANIFEST + TMP)
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync(directory)


def read_manifest(directory: Any, *, need_complete: bool = True) -> tuple[pathlib.Path, dict]:
    """Returns ``(directory, manifest)``; raises ExportError if it is missing or (optionally) incomplete."""
    directory = pathlib.Path(os.fspath(directory))
    path = directory / MANIFEST
    if not path.is_file():
        why = "the directory does not exist" if not directory.exists() else "no manifest.json in it"
        raise ExportError(f"Not a kerasfeed export: {why}. Received: directory='{directory}'")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"The export's manifest cannot be read ({type(e).__name__}: {e}). Received: '{path}'") from e
    if not isinstance(manifest, dict):
        raise ExportError(
            f"'{path}' is not a kerasfeed export manifest: it holds a JSON {type(manifest).__name__}, not an object. "
            f"Received: {short_repr(manifest)}"
        )
    if manifest.get("format") != "kerasfeed-export" or manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ExportError(
            f"'{path}' is not a kerasfeed export manifest this version ({__version__}) reads. "
            f"Received: format={manifest.get('format')!r}, format_version={manifest.get('format_version')!r}"
        )
    _check_fields(path, manifest)
    if need_complete and not manifest.get("complete"):
        missing = [k for k, s in enumerate(manifest["shards"]) if s is None]
        raise ExportError(
            f"The export in '{directory}' is incomplete: {len(missing)} of {manifest['num_shards']} shards were never "
            f"finished (shards {_ranges(missing)}); run kerasfeed.export(..., resume=True) with the same source to "
            f"finish it. Received: directory='{directory}'"
        )
    return directory, manifest


# What the readers and resume use, by type (a bool is no int here).
_FIELDS = {"file_format": str, "num_items": int, "num_shards": int, "element_spec": dict, "complete": bool,
           "shards": list}  # fmt: skip
_SHARD_FIELDS = {"file": str, "count": int, "bytes": int, "crc32c": str}
_SPEC_FIELDS = {"structure": object, "fields": list}
_FIELD_FIELDS = {"key": str, "path": list, "dtype": str, "shape": list}


def _check_fields(path: pathlib.Path, manifest: dict) -> None:
    """Raises ExportError naming the first entry a hand-edited or foreign manifest lacks or has of a wrong type."""

    def fail(what: str, received: str) -> None:
        raise ExportError(
            f"'{path}' is damaged or not written by kerasfeed.export: {what}; export again with overwrite=True. "
            f"Received: {received}"
        )

    def check(entry: Any, fields: dict, where: str) -> None:
        if not isinstance(entry, dict):
            fail(f"{where} is a {type(entry).__name__}, not an object", short_repr(entry))
        for key, kind in fields.items():
            if key not in entry:
                fail(f"{where} has no {key!r}", f"keys {sorted(entry)}")
            value = entry[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                fail(f"{where}[{key!r}] must be of type {kind.__name__}, not {type(value).__name__}", short_repr(value))

    check(manifest, _FIELDS, "the manifest")
    file_format, compression = manifest["file_format"], manifest.get("compression")
    if file_format not in FORMATS or compression not in COMPRESSIONS[file_format]:
        fail(f"its file_format and compression must be one of {COMPRESSIONS}",
             f"file_format={file_format!r}, compression={compression!r}")  # fmt: skip
    if len(manifest["shards"]) != manifest["num_shards"]:
        fail(f"it lists {len(manifest['shards'])} shards for num_shards={manifest['num_shards']}",
             short_repr(manifest["shards"]))  # fmt: skip
    for k, entry in enumerate(manifest["shards"]):
        if entry is not None:
            check(entry, _SHARD_FIELDS, f"shards[{k}]")
    check(manifest["element_spec"], _SPEC_FIELDS, "element_spec")
    for k, field in enumerate(manifest["element_spec"]["fields"]):
        where = f"element_spec['fields'][{k}]"
        check(field, _FIELD_FIELDS, where)
        if field["dtype"] != STRING and field["dtype"] not in NUMERIC:
            fail(f"{where}['dtype'] must be {STRING!r} or one of {', '.join(NUMERIC)}", repr(field["dtype"]))
        if not all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in field["shape"]):
            fail(f"{where}['shape'] must hold sizes (ints >= 0) or null", short_repr(field["shape"]))


def file_crc32c(path: pathlib.Path) -> tuple[int, str]:
    """``(size, crc32c hex)`` of a file, read in chunks."""
    from kerasfeed.exporting.encoding import crc32c

    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return size, f"{crc:08x}"
            crc = crc32c(chunk, crc)
            size += len(chunk)


def check_shard(directory: pathlib.Path, entry: dict, *, checksum: bool) -> Optional[str]:
    """None when the shard file matches its manifest entry, else what is wrong with it."""
    path = directory / entry["file"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "the file is missing"
    if size != entry["bytes"]:
        return f"the file has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
    if checksum:
        _, crc = file_crc32c(path)
        if crc != entry["crc32c"]:
            return f"its CRC32C is {crc}, the manifest says {entry['crc32c']} (the data changed on disk)"
    return None


def bad_shards(directory: pathlib.Path, manifest: dict, *, checksum: bool) -> list[tuple[str, str]]:
    """``[(file, problem), ...]`` for every finished shard that fails its check."""
    out = []
    for k, entry in enumerate(manifest["shards"]):
        if entry is None:
            continue
        expected = shard_count(k, manifest["num_shards"], manifest["num_items"])
        if entry["count"] != expected:
            out.append((entry["file"], f"it holds {entry['count']} items, the layout needs {expected}"))
            continue
        problem = check_shard(directory, entry, checksum=checksum)
        if problem:
            out.append((entry["file"], problem))
    return out


def _ranges(ks: list) -> str:
    return ", ".join(map(str, ks[:8])) + (f", ... ({len(ks)} in all)" if len(ks) > 8 else "")
