"""What a kept cache was made from: the key checked before a directory's items are served again.

NOTE [ When a kept cache is stale ]
A directory cache outlives the run that filled it, so before serving its
items a new run checks that the source would make the same ones. The key
holds:

- ``class``, ``length`` and ``version`` (``Cache(version=...)``: the user's
  lever for anything the rest cannot see);
- ``code``: a digest of the cached stage's code (``load`` when items are
  ``augment(load(i))``, else ``__getitem__``: ``stage_of``; its bytecode,
  constants (sets sorted) and names, not its line numbers; its defaults and
  closure values; each decorator layer down ``__wrapped__``), so editing what
  makes an item rebuilds the cache, and editing a comment does not;
- ``attributes``: the source's public plain attributes, its instance's and
  its own classes' (``SCALE = 2.0`` in the class body; not a class's lists,
  dicts and sets: shared state) (numbers, strings,
  small arrays, dtypes (``np.float16``, ``np.dtype("f2")``, structured ones
  by their fields), classes by name (a class body's too), enum members with
  their values, slices, ranges, paths, and lists, tuples, sets, dicts (keys
  by value: the same text in every run) and dataclass instances of them,
  nested up to 4 levels (deeper: a digest of plain values, else a marker),
  a function inside by its code,
  another object by its type: what its constructor was given, such as a
  batch size, a point count or a config) by value or digest, and
  functions they hold by their code (``_callable_value``). An
  attribute set in one run and not the other counts as changed. Left out:
  attributes whose name starts with ``_`` (a class's own state: open
  handles, pids), attributes that hold objects (open files, models), and
  those the source names in ``cache_ignores`` (a seed drawn per run that the
  stored stage does not read);
- for a source that is itself the data (an array, a list or tuple of
  items), a digest of all its values (``container_digest``);
- ``settings``: what a kerasfeed reader's underscored state decides (its
  keys, its files' order: ``kerasfeed_settings()``), the source's own and
  those of readers its attributes hold, with such a reader's public
  attributes (its window, its transform's code); a reader inside a list,
  dict or dataclass counts the same way, in ``attributes``;
- ``files``: every file the source names, as ``size`` and ``mtime_ns``
  (remote objects as their store's ETag): the source's own
  ``kerasfeed_identity()`` (kerasfeed's HDF5 readers have it), plus its
  attributes that are existing paths, h5py objects, memory-mapped arrays
  and objects with their own ``kerasfeed_identity()`` (a kerasfeed HDF5
  reader it holds), 4 levels into lists, tuples, sets, dicts and dataclass
  instances, a class body's lists and dicts too (not those in
  ``cache_ignores``: a log the source appends to): ``key_sources.py``.

Any difference rebuilds the cache and one log line says which part changed.
The records themselves carry their items' specs, so the item spec needs no
entry of its own: it follows from the code, the attributes and the files.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from typing import Any, Optional

import numpy as np

from kerasfeed.cache.key_sources import NESTED_DEPTH, attributes, defining_class, ignored, members, source_files

_ATOMIC = (bool, int, float, complex, str, bytes, np.generic)
_ARRAY_DIGEST_MAX = 64 * 2**20  # larger arrays count by shape and dtype only


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def stage_of(source: Any) -> str:
    """The cached stage's name: ``"load"`` when the source's items are ``augment(load(i))`` (it keeps
    ``SceneSequence.__getitem__``, or defines ``augment`` too), else ``"__getitem__"``: a class with its
    own ``__getitem__`` and a helper named ``load`` has its items made by ``__getitem__``."""
    if not callable(getattr(source, "load", None)):
        return "__getitem__"
    if callable(getattr(source, "augment", None)):
        return "load"
    owner = defining_class(source, "__getitem__")
    # By name: this layer does not import kerasfeed.sources (nor Keras with it).
    inherited = owner is None or (owner.__module__, owner.__qualname__) == ("kerasfeed.sources.sequence",
                                                                            "SceneSequence")
    return "load" if inherited else "__getitem__"


def _const(const: Any) -> bytes:
    # A set literal compiles to a frozenset, whose repr's order follows the run's string hashing
    # (PYTHONHASHSEED): its elements count sorted, so the digest is the same in every run.
    if isinstance(const, frozenset):
        return b"frozenset{" + b",".join(sorted(_const(c) for c in const)) + b"}"
    if isinstance(const, tuple):
        return b"(" + b",".join(_const(c) for c in const) + b")"
    if isinstance(const, types.CodeType):
        h = hashlib.blake2b(const.co_code, digest_size=12)
        h.update(repr(const.co_names).encode())
        for c in const.co_consts:
            h.update(_const(c))
        return b"code:" + h.hexdigest().encode()
    return repr(const).encode()


def _bound_value(value: Any) -> str:
    # A default or a closure cell: by value where ``_value`` takes it, else by type.
    text = _value(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>" if text is None else text


def _code_digest(fn: Any) -> str:
    """The stage's code, its defaults and closure values, and every decorator layer's (``__wrapped__``, and
    functions held in closures: a decorator without ``functools.wraps``), so editing any of them counts."""
    h = hashlib.blake2b(digest_size=12)
    seen: dict = {}  # id -> the layer, held so that no id is reused meanwhile
    pending, hashed = [fn], False
    while pending and len(seen) < 100:
        layer = pending.pop()
        layer = getattr(layer, "__func__", layer)
        if layer is None or id(layer) in seen:
            continue
        seen[id(layer)] = layer
        code = getattr(layer, "__code__", None)
        if isinstance(code, types.CodeType):
            hashed = True
            h.update(_const(code))
            h.update(repr(tuple(_bound_value(v) for v in getattr(layer, "__defaults__", None) or ())).encode())
            kwdefaults = getattr(layer, "__kwdefaults__", None) or {}
            h.update(repr(sorted((k, _bound_value(v)) for k, v in kwdefaults.items())).encode())
            for cell in getattr(layer, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell (a name not bound yet)
                    h.update(b"<empty>")
                    continue
                if isinstance(value, (types.FunctionType, types.MethodType)):
                    pending.append(value)
                else:
                    h.update(_bound_value(value).encode())
        else:
            h.update(f"<{type(layer).__qualname__}>".encode())
        wrapped = getattr(layer, "__wrapped__", None)  # functools.wraps, lru_cache, cache
        if callable(wrapped):
            pending.append(wrapped)
    if not hashed:
        return f"<no code: {type(getattr(fn, '__func__', fn)).__name__}>"
    return h.hexdigest()


def _atomic(value: Any) -> str:
    # None, a number, a string: its repr, or a digest of a long one.
    text = repr(value)
    return text if len(text) <= 200 else "digest:" + _digest(text.encode())


def _value(value: Any) -> Optional[str]:
    """A plain attribute's value (or digest); None for what the key leaves out."""
    if value is None or isinstance(value, _ATOMIC):
        return _atomic(value)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        if value.nbytes > _ARRAY_DIGEST_MAX:
            return f"array{value.shape}:{value.dtype}"
        return f"array{value.shape}:{value.dtype}:{_digest(np.ascontiguousarray(value).tobytes())}"
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, _ATOMIC) for v in value):
        # flat, of any length (one fold's 100,000 file names): keyed as before nested values were, so that
        # kept caches of such sources stay valid
        return f"{type(value).__name__}:{_digest(repr(value).encode())}"
    if isinstance(value, (tuple, list, dict, set, frozenset)) or _is_dataclass(value):
        text = _nested(value, NESTED_DEPTH, [float("inf")])  # every value, to 4 levels (past them: a marker)
        return None if text is None else f"{type(value).__name__}:{_digest(text.encode())}"
    return _setting(value)


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _setting(value: Any) -> Optional[str]:
    """A value that names a setting by what it is: a dtype (``np.float16``, ``np.dtype("f2")``, a structured
    one by its fields), a class by its name, an enum member, a slice, a range, a path; None for other objects."""
    if isinstance(value, np.dtype):
        return f"dtype:{value if value.fields is not None or value.subdtype is not None else value.str}"
    if isinstance(value, type):
        if issubclass(value, np.generic):
            try:
                return f"dtype:{np.dtype(value).str}"
            except TypeError:  # an abstract one (np.floating): by its name below
                pass
        return f"class:{value.__module__}.{value.__qualname__}"  # ``dtype=float``, a layer class
    if isinstance(value, enum.Enum):
        return f"enum:{type(value).__module__}.{type(value).__qualname__}.{value.name}={_bound_value(value.value)}"
    if isinstance(value, (slice, range)):
        parts = [_value(v) for v in (value.start, value.stop, value.step)]
        return None if None in parts else f"{type(value).__name__}({','.join(parts)})"
    if isinstance(value, os.PathLike):  # a folder, or a file not there yet: by its path (a file: also ``files``)
        path = os.fspath(value)
        return f"path:{path}" if isinstance(path, str) else None
    return None


def _key_text(key: Any) -> str:
    # A dict's key: its repr where that is stable (a string, a number), else as a value (a frozenset's elements
    # sorted, an object by its type: a repr may follow the run's string hashing or hold an address).
    if key is None or isinstance(key, (bool, int, float, str, bytes)):
        return repr(key)
    text = _nested(key, NESTED_DEPTH, [float("inf")])  # a nested tuple's every level: keys must not collide
    return repr(key) if text is None else text


def _keyed(value: Any) -> Optional[str]:
    """A value by ``_value``, a function (not a class) by its code (``_callable_value``); None for what the
    key leaves out."""
    if callable(value) and not isinstance(value, type):
        return _callable_value(value)
    return _value(value)


def _leaf(value: Any) -> str:
    # A value inside a list, tuple, set, dict or dataclass: as an attribute's (``_keyed``), a kerasfeed reader by
    # what makes its items (``_held_reader``), else by type.
    return _keyed(value) or _held_reader(value) or _bound_value(value)


def _nested(value: Any, depth: int, budget: list) -> Optional[str]:
    """A list, tuple, set, dict or dataclass of plain values (nested: a config, a list of lists) as text for
    the key; an object inside counts by its type, what lies past ``NESTED_DEPTH`` levels by a digest of its
    values (``<deeper>`` where it holds an object or a set: what is above it still counts). None past
    ``budget[0]`` values."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if value is None or isinstance(value, _ATOMIC):  # most of a big list: first
        return _atomic(value)
    if isinstance(value, (tuple, list, dict, set, frozenset)) or _is_dataclass(value):
        if depth == 0:  # past the levels read by name: the values below by digest where they have one
            h = hashlib.blake2b(digest_size=8)
            return f"<deeper:{h.hexdigest()}>" if _feed(h, value, 4 * NESTED_DEPTH) else "<deeper>"
        if isinstance(value, dict):
            pairs = sorted(((_key_text(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        elif _is_dataclass(value):  # a config object: its fields by name, not those in its ``cache_ignores``
            left_out = ignored(value)
            pairs = [(repr(f.name), getattr(value, f.name, None)) for f in dataclasses.fields(value)
                     if f.name not in left_out]
        else:
            pairs = [(None, v) for v in members(value)]
        parts = []
        for k, v in pairs:
            text = _nested(v, depth - 1, budget)
            if text is None:
                return None
            parts.append(text if k is None else f"{k}:{text}")
        if isinstance(value, (set, frozenset)):  # in the run's hash order: sorted, the same in every run
            parts.sort()
        return f"{type(value).__qualname__}[{','.join(parts)}]"
    return _leaf(value)


def _feed(h: Any, value: Any, depth: int) -> bool:
    """Feeds ``value`` (an array, a plain value, or lists, tuples and dicts of them) into the hash ``h``,
    arrays whole; False for what it cannot key (an object, past ``NESTED_DEPTH`` levels)."""
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h.update(f"array{value.shape}:{value.dtype.str};".encode())
        data = np.ascontiguousarray(value)
        try:
            h.update(memoryview(data).cast("B"))  # no copy
        except (TypeError, ValueError):  # a dtype the buffer protocol does not take (datetime64): a copy
            h.update(data.tobytes())
        return True
    if value is None or isinstance(value, _ATOMIC):
        h.update(repr(value).encode() + b";")
        return True
    if isinstance(value, (tuple, list, dict)) and depth > 0:
        pairs = sorted(value.items(), key=lambda kv: repr(kv[0])) if isinstance(value, dict) else enumerate(value)
        h.update(f"{type(value).__name__}[{len(value)}".encode())
        for k, v in pairs:
            h.update(repr(k).encode() + b":")
            if not _feed(h, v, depth - 1):
                return False
        h.update(b"]")
        return True
    return False


def container_digest(source: Any) -> Optional[str]:
    """A digest of every item of a source that is itself the data (an array, a list or tuple of items):
    such a source has no attributes or files to key, so its values are the key, all of them (its items
    are in memory; a kept cache of it is rebuilt when any changes). None for other sources; raises
    ``TypeError`` for a container holding what cannot be keyed (objects)."""
    if not isinstance(source, (np.ndarray, list, tuple)):
        return None
    h = hashlib.blake2b(digest_size=16)
    if not _feed(h, source, NESTED_DEPTH + 1):
        raise TypeError(
            "a kept `cache` directory keys a source that is a list, tuple or array by its items' values, and this "
            "one holds objects whose values cannot be keyed (only arrays, numbers, strings and lists, tuples and "
            f"dicts of them). Use cache='memory', or make it a class with a `version`. Received: "
            f"{type(source).__name__} of {len(source)} items"
        )
    return h.hexdigest()


def _own_settings(value: Any) -> Optional[str]:
    """``value.kerasfeed_settings()`` as text (kerasfeed's HDF5 readers: the files' order, the keys)."""
    own = getattr(value, "kerasfeed_settings", None)
    if not callable(own) or isinstance(value, type):
        return None
    try:
        return repr(sorted(dict(own()).items()))
    except Exception:  # noqa: BLE001 - not a kerasfeed reader's (a mock answers any name): no settings
        return None


def _held_reader(value: Any) -> Optional[str]:
    """A kerasfeed reader that the source holds (as an attribute, or in a list, dict or dataclass): its
    settings and its public attributes keyed as a source's (a window, a transform's code), not in its
    ``cache_ignores`` (a seed drawn per run): all that makes its items. None for anything else."""
    own = _own_settings(value)
    if own is None:
        return None
    return own + repr(list(_keyed_all(_public(value)).items()))


def _public(obj: Any) -> dict:
    """``obj``'s attributes the key reads: not underscored, not in its ``cache_ignores``."""
    left_out = ignored(obj)
    return {k: v for k, v in attributes(obj).items() if not k.startswith("_") and k not in left_out}


def _keyed_all(public: dict) -> dict:
    """``{name: text}`` of the attributes ``_keyed`` takes, by name."""
    keyed = {}
    for k, v in sorted(public.items()):
        text = _keyed(v)
        if text is not None:
            keyed[k] = text
    return keyed


def _callable_value(value: Any) -> Optional[str]:
    """A function an attribute holds (``self.transform = fn``): its code, as the stage's is keyed; a bound
    method's with its object's plain settings, a builtin or ufunc by name (``partial(np.multiply, k)`` was
    left out, arguments and all), a callable object (``ScenePointSampler(...)``) by the code of its class's
    ``__call__`` (and ``call``/``forward``: a Keras layer, a torch module) and its plain settings."""
    if isinstance(value, functools.partial):
        inner = _callable_value(value.func)
        args = repr((tuple(_bound_value(a) for a in value.args),
                     sorted((k, _bound_value(v)) for k, v in value.keywords.items())))
        return None if inner is None else f"partial:{_digest((inner + args).encode())}"
    if isinstance(value, (types.FunctionType, types.MethodType)):
        owner = getattr(value, "__self__", None)
        own = "" if owner is None or isinstance(owner, type) else ":" + _object_settings(owner)
        return "code:" + _code_digest(value) + own
    if isinstance(value, (types.BuiltinFunctionType, np.ufunc)):
        module = getattr(value, "__module__", None) or type(getattr(value, "__self__", None)).__qualname__
        return f"builtin:{module}.{getattr(value, '__qualname__', getattr(value, '__name__', '?'))}"
    cls = type(value)
    code = [getattr(cls, name, None) for name in ("__call__", "call", "forward")]
    code = [fn for fn in code if isinstance(fn, types.FunctionType)]
    if code:  # an object whose class defines __call__ (or call, forward) in Python
        digests = ":".join(_code_digest(fn) for fn in code)
        return f"object:{cls.__qualname__}:{digests}:{_object_settings(value)}"
    return None


def _object_settings(obj: Any) -> str:
    """A digest of the plain public settings of an object a held callable belongs to: numbers, strings,
    arrays, flat lists of them, dtypes, classes, enum members, paths; not its ``cache_ignores``, and not the
    objects or functions it holds (keyed by value, they could lead back to the source: a recursion)."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return f"<{type(obj).__qualname__}>"
    skipped, kept = ignored(obj), []
    for k, v in attrs.items():
        if not isinstance(k, str) or k.startswith("_") or k in skipped:
            continue
        flat = isinstance(v, (tuple, list)) and all(x is None or isinstance(x, _ATOMIC) for x in v)
        plain = v is None or isinstance(v, _ATOMIC) or flat or (isinstance(v, np.ndarray) and not v.dtype.hasobject)
        text = _value(v) if plain else _setting(v)
        if text is not None:
            kept.append((k, text))
    return _digest(repr(sorted(kept)).encode())


def _settings(source: Any, public: dict) -> dict:
    """The settings of the source (``_own_settings``; its public attributes are keyed as any source's) and of the
    kerasfeed readers its attributes hold (``_held_reader``)."""
    found = {}
    for name, value in [("", source), *public.items()]:
        text = _own_settings(value) if value is source else _held_reader(value)
        if text is not None:
            found[name or "<the source>"] = text
    return found


def source_key(source: Any, length: int, version: Any, layout: int) -> dict:
    """The key of a cache of ``source`` (see NOTE [ When a kept cache is stale ])."""
    cls = type(source)
    stage = stage_of(source)
    public = _public(source)
    keyed = _keyed_all(public)
    held = container_digest(source)
    if held is not None:  # an array or a list is its own data: its values are what the items are
        keyed["<the items>"] = held
    settings = _settings(source, public)
    return {
        "layout": layout,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "length": int(length),
        "version": None if version is None else repr(version),
        "stage": stage,
        "code": _code_digest(getattr(cls, stage, None)),
        "attributes": keyed,
        "files": source_files(source),
        **({"settings": settings} if settings else {}),  # absent, not empty: other sources' keys stay as they were
    }


def key_change(old: Optional[dict], new: dict) -> Optional[str]:
    """Why a cache made under ``old`` cannot serve ``new`` (one sentence), or None when it can."""
    if old is None:
        return "it has no key (not a kerasfeed cache, or one cut short before its key was written)"
    for part in ("layout", "class", "length", "version", "stage", "code"):
        if old.get(part) != new.get(part):
            what = {"code": f"the code of `{new['stage']}` changed", "layout": "its file layout is another version's"}
            return what.get(part, f"`{part}` changed ({old.get(part)} -> {new.get(part)})")
    old_files, new_files = old.get("files", {}), new.get("files", {})
    for name in sorted(old_files.keys() | new_files.keys()):
        if old_files.get(name) != new_files.get(name):
            if name not in new_files:
                return f"the source no longer names {name}"
            if name not in old_files:
                return f"the source names a new file, {name}"
            return f"{name} changed ({old_files[name]} -> {new_files[name]})"
    old_set, new_set = old.get("settings", {}), new.get("settings", {})
    for name in sorted(old_set.keys() | new_set.keys()):  # a reader's keys or its files' order
        if old_set.get(name) != new_set.get(name):
            where = "the source's" if name == "<the source>" else f"the reader in `{name}`:"
            return f"{where} settings changed ({old_set.get(name)} -> {new_set.get(name)})"
    old_attrs, new_attrs = old.get("attributes", {}), new.get("attributes", {})
    for name in sorted(old_attrs.keys() | new_attrs.keys()):  # one set only in one run changes items too
        if old_attrs.get(name) != new_attrs.get(name):
            was, now = old_attrs.get(name, "not set or not keyed"), new_attrs.get(name, "not set or not keyed")
            return f"the source's attribute `{name}` changed ({was} -> {now})"
    return None


__all__ = ["container_digest", "key_change", "source_key", "stage_of"]
