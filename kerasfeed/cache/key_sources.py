"""What a kept cache's key reads of a source: its attributes, and the files they name (part of
NOTE [ When a kept cache is stale ], ``keys.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Mapping, Optional

import numpy as np

# Keras' PyDataset settings and kerasfeed's epoch bookkeeping: they do not change what kerasfeed stores.
_SKIPPED = frozenset({"_workers", "_use_multiprocessing", "_max_queue_size", "_kf_epoch", "_kf_in_epoch",
                      "cache_ignores"})
# A SceneSequence's seed of items made outside kerasfeed (Keras' own fit, seq[i]); another source's attribute of
# that name is its own, and counts.
_SCENE_SKIPPED = _SKIPPED | {"item_seed"}
SEQUENCE_MAX = 10_000
NESTED_DEPTH = 4  # levels of lists, tuples, sets, dicts and dataclasses an attribute's value is read through
_PATHS_SAMPLE = 100  # values of a long list looked at to tell a list of paths
_SCAN_BUDGET = 1_000_000  # values looked at for files, per attribute
_NUMBERS = (bool, int, float, complex, np.number, np.bool_)  # never a file: not looked at further
# Classes whose attributes are not the user's: kerasfeed's, Keras' (a PyDataset's), Python's own.
_FOREIGN = frozenset({"builtins", "abc", "typing", "keras", "kerasfeed"})


def attributes(source: Any, *, shared: bool = False) -> dict:
    """The source's attributes: its instance's, over the plain values of its own classes' bodies (``PATH =
    "..."``, ``SCALE = 2.0``, read as ``self.PATH``); not methods, properties or other descriptors, nor what
    kerasfeed's and Keras' classes define. ``shared``: with a class's lists, dicts and sets, which the
    attributes' key leaves out (state shared by its instances, such as a registry or a count, more often than
    a setting) and the file check reads (``FILES = [...]``)."""
    found: dict = {}
    for klass in reversed(type(source).__mro__):  # a subclass's value over its base's
        if str(getattr(klass, "__module__", "")).split(".")[0] in _FOREIGN:
            continue
        for k, v in vars(klass).items():
            method = callable(v) and not isinstance(v, type)  # a class is a setting (``DTYPE = np.float16``)
            if not (k.startswith("__") or method or hasattr(type(v), "__get__")
                    or (not shared and isinstance(v, (list, dict, set)))):
                found[k] = v
    found.update(getattr(source, "__dict__", None) or {})
    skipped = _SCENE_SKIPPED if _is_scene_sequence(source) else _SKIPPED
    return {k: v for k, v in found.items() if k not in skipped}


def _is_scene_sequence(source: Any) -> bool:
    return any(k.__module__ == "kerasfeed.sources.sequence" and k.__qualname__ == "SceneSequence"
               for k in type(source).__mro__)  # fmt: skip


def defining_class(source: Any, name: str) -> Optional[type]:
    """The class of ``source``'s MRO whose body defines ``name`` (None: none does)."""
    return next((k for k in type(source).__mro__ if name in vars(k)), None)


def ignored(source: Any) -> frozenset:
    """The names in ``cache_ignores``: the instance's and every class's, a subclass's adding to its bases'
    (a subclass of a kerasfeed reader naming its log keeps the reader's ``seed``)."""
    names: set = set()
    for owner in (*type(source).__mro__, source):
        own = vars(owner).get("cache_ignores") if hasattr(owner, "__dict__") else None
        names.update(own or ())
    return frozenset(names)


def members(value: Any, keys: bool = False) -> Optional[list]:
    """The values a list, tuple, set, dict or dataclass instance holds (None for anything else); a set's
    in an order that is the same in every run (not its hash order); ``keys``: a dict's keys too."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()] if keys else list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=lambda v: (type(v).__qualname__, repr(v)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    return None


def file_identity(path: str) -> Optional[str]:
    """``size=...,mtime_ns=...`` of a local file; None when it is not one."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not os.path.isfile(path):
        return None
    return f"size={st.st_size},mtime_ns={st.st_mtime_ns}"


def own_files(value: Any) -> Optional[dict]:
    """``{path or URL: identity}`` from ``value.kerasfeed_identity()`` (kerasfeed's HDF5 readers); None
    when it has none."""
    own = getattr(value, "kerasfeed_identity", None)
    if not callable(own) or isinstance(value, type):
        return None
    files = own()
    if not isinstance(files, Mapping):  # a mock, say, answering every attribute: not a reader
        return None
    return {str(k): str(v) for k, v in files.items()}


def _files_in(value: Any, found: dict) -> None:
    # A kerasfeed HDF5 reader the source holds: its files. Its errors (a file gone, an object replaced, a
    # store that does not answer) propagate as for a reader given itself: a key without its files would
    # be matched by a later run whose objects changed.
    held = own_files(value)
    if held is not None:
        found.update(held)
        return
    if isinstance(value, (str, os.PathLike)):
        try:
            path = os.fspath(value)
        except TypeError:
            return
        if isinstance(path, str) and len(path) < 4096 and os.path.isfile(path):
            found[os.path.abspath(path)] = file_identity(path)
        return
    if isinstance(value, np.memmap):  # np.load(mmap_mode=...): its file, whatever its size (the key's array
        name = getattr(value, "filename", None)  # digest stops at _ARRAY_DIGEST_MAX)
        identity = file_identity(name) if isinstance(name, str) else None
        if identity is not None:
            found[os.path.abspath(name)] = identity
        return
    if type(value).__module__.startswith("h5py") and hasattr(value, "file"):
        try:
            name = value.file.filename
        except Exception:  # noqa: BLE001 - a closed h5py object has no file
            return
        identity = file_identity(name)
        if identity is not None:
            found[os.path.abspath(name)] = identity


def _scan(value: Any, found: dict, depth: int, budget: list) -> None:
    """The files ``value`` names, and those of the values it holds, ``depth`` levels down (a config dict
    of paths, a dataclass holding one)."""
    budget[0] -= 1
    if budget[0] < 0 or value is None or isinstance(value, _NUMBERS):
        return
    _files_in(value, found)
    values = members(value, keys=True) if depth > 0 and not isinstance(value, np.ndarray) else None
    if not values:
        return
    if len(values) > SEQUENCE_MAX and not any(map(_names_a_file, itertools.islice(values, _PATHS_SAMPLE))):
        return  # a long list of labels or numbers, not of paths: not a stat per value every run
    for v in values:
        _scan(v, found, depth - 1, budget)


def source_files(source: Any) -> dict:
    """``{path or URL: identity}`` of the files ``source`` names (see the NOTE)."""
    found: dict = own_files(source) or {}
    skipped = ignored(source)
    for name, value in attributes(source, shared=True).items():
        if name not in skipped:  # a log the source appends to, say: not what the stored stage reads
            _scan(value, found, NESTED_DEPTH, [_SCAN_BUDGET])  # each its own: a big one leaves the next one's
    return found


def _names_a_file(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` names a file, or holds one that does (``(path, label)`` pairs, ``{"path": ...}``)."""
    if isinstance(value, (str, os.PathLike)):  # a path of an existing file, not any string (a label)
        found: dict = {}
        _files_in(value, found)
        return bool(found)
    if type(value).__module__.startswith("h5py") or callable(getattr(value, "kerasfeed_identity", None)):
        return True
    held = members(value, keys=True) if depth > 0 and not isinstance(value, (str, bytes, np.ndarray)) else None
    return bool(held) and any(_names_a_file(v, depth - 1) for v in held[:_PATHS_SAMPLE])


__all__ = ["NESTED_DEPTH", "SEQUENCE_MAX", "attributes", "defining_class", "file_identity", "ignored", "members",
           "own_files", "source_files"]
