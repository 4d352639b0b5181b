"""An item as a small picklable *spec* and its array bytes at 64-byte aligned offsets (numpy only).

An item (an array, or tuples/lists/dicts/namedtuples of arrays, scalars and
strings) is split in two: the spec (the structure, and for every array leaf
its dtype, shape and byte offset; other leaves pickled inline) and the arrays,
laid out one after another at ``ALIGN``-byte aligned offsets from 0. Whatever
holds the bytes (a worker's shared-memory slot: ``execution/processes/shm.py``;
a cached item's record: ``cache/records.py``) rebuilds the item from the spec
over its own buffer (``rebuild``), as views or as copies.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import numpy as np

ALIGN = 64  # cache line; also what TensorFlow needs to wrap an array without copying


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# ---------------------------------------------------------------- encoding
# Spec nodes (tuples, so they pickle small and fast):
#   ("a", dtype, shape, offset)   array leaf stored in the segment
#   ("o", obj)                    anything else, pickled inline (scalars, str,
#                                 object arrays, empty arrays)
#   ("t", [children]) / ("l", [children]) / ("d", [(key, child), ...])
#   ("n", namedtuple_type, [children])


def encode(item: Any) -> tuple[Any, list[tuple[int, np.ndarray]], int]:
    """Splits ``item`` into a spec, the arrays to write and the bytes needed.

    Returns:
        ``(spec, [(offset, array), ...], nbytes)``.
    """
    arrays: list[tuple[int, np.ndarray]] = []
    spec = _encode(item, arrays)
    end = arrays[-1][0] + arrays[-1][1].nbytes if arrays else 0
    return spec, arrays, end


def _encode(obj: Any, arrays: list) -> Any:
    # A module-level function, not a recursive closure: a closure that refers
    # to itself is a reference cycle, and it would keep every item's arrays
    # alive until the cyclic garbage collector happens to run.
    t = type(obj)
    if t is np.ndarray and not obj.dtype.hasobject and obj.nbytes > 0:
        offset = round_up(arrays[-1][0] + arrays[-1][1].nbytes, ALIGN) if arrays else 0
        arrays.append((offset, obj))
        return ("a", obj.dtype, obj.shape, offset)
    if t is tuple:
        return ("t", [_encode(x, arrays) for x in obj])
    if t is list:
        return ("l", [_encode(x, arrays) for x in obj])
    if t is dict:
        return ("d", [(k, _encode(v, arrays)) for k, v in obj.items()])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("n", t, [_encode(x, arrays) for x in obj])
    if t is np.memmap or t is memoryview:
        # Arrays to every consumer (threads batch them as such): a slice of np.load(mmap_mode="r") went through
        # the socket pickled, and a memoryview as its bytes (cloudpickle), a 0-d object array at the other end.
        try:
            return _encode(np.asarray(obj), arrays)
        except (TypeError, ValueError):  # a buffer numpy cannot read (a format of its own): as before
            pass
    return ("o", obj)


def rebuild(spec: Any, array: Callable[[Any, tuple, int], np.ndarray]) -> Any:
    """The item of ``spec``, each array leaf made by ``array(dtype, shape, offset)``."""
    # A module-level function, not a recursive closure (see ``_encode``).
    kind = spec[0]
    if kind == "a":
        _, dtype, shape, offset = spec
        return array(dtype, shape, offset)
    if kind == "o":
        return spec[1]
    if kind == "t":
        return tuple(rebuild(c, array) for c in spec[1])
    if kind == "l":
        return [rebuild(c, array) for c in spec[1]]
    if kind == "d":
        return {k: rebuild(c, array) for k, c in spec[1]}
    if kind == "n":
        return spec[1](*(rebuild(c, array) for c in spec[2]))
    raise ValueError(f"kerasfeed: corrupt item spec node. Received: {kind!r}")


def dumps_spec(spec: Any) -> bytes:
    """Pickles a spec; falls back to cloudpickle for inline objects of classes
    that only exist by value in this process (e.g. defined in a notebook).

    Raises:
        TypeError: an inline leaf neither pickles, named (an object array by its
            elements' type: h5py's object references, say).
    """
    try:
        return pickle.dumps(spec, protocol=5)
    except Exception:  # noqa: BLE001 - whatever pickle refuses, cloudpickle tries
        import cloudpickle

        try:
            return cloudpickle.dumps(spec, protocol=5)
        except Exception as e:  # said as what the item holds
            raise TypeError(
                f"kerasfeed: the item holds {_inline_kinds(spec)}, which cannot be pickled to leave a worker "
                f"process or be stored ({type(e).__name__}: {e}). Return numeric arrays, numbers, str or bytes "
                "(convert object arrays with np.asarray(v, dtype=...))."
            ) from e


def _inline_kinds(spec: Any) -> str:
    """What a spec's inline leaves that do not pickle are, for a message: ``"an object array of
    Reference"``, ``"a Lock"``."""
    import cloudpickle

    kinds: list = []
    stack = [spec]
    while stack:
        node = stack.pop()
        if node[0] == "o":
            obj = node[1]
            try:
                cloudpickle.dumps(obj, protocol=5)
                continue
            except Exception:  # noqa: BLE001 - the one to name
                pass
            if isinstance(obj, np.ndarray) and obj.dtype.hasobject and obj.size:
                kinds.append(f"an object array of {type(obj.flat[0]).__name__}")
            else:
                kinds.append(f"a {type(obj).__name__}")
        elif node[0] in ("t", "l"):
            stack.extend(node[1])
        elif node[0] == "d":
            stack.extend(c for _, c in node[1])
        elif node[0] == "n":
            stack.extend(node[2])
    return ", ".join(dict.fromkeys(kinds)) or "an object"


# Unpickled specs of items made of arrays only, by their bytes. Most sources
# return the same shapes and dtypes every time, so the consumer would unpickle
# the same few hundred bytes (numpy dtypes included: ~4 us) for every item.
# A spec is only read, and ``_rebuild`` makes new containers and arrays, so
# one object can serve every item. Specs holding inline objects ("o" nodes)
# are not cached: those objects must not be shared between items.
_SPEC_CACHE: dict = {}
_SPEC_CACHE_MAX = 64


def _arrays_only(spec: Any) -> bool:
    kind = spec[0]
    if kind == "a":
        return True
    if kind in ("t", "l"):
        return all(_arrays_only(c) for c in spec[1])
    if kind == "d":
        return all(_arrays_only(c) for _, c in spec[1])
    if kind == "n":
        return all(_arrays_only(c) for c in spec[2])
    return False


def loads_spec(raw: bytes) -> Any:
    """Unpickles a spec made by ``dumps_spec`` (cached when it holds arrays only)."""
    spec = _SPEC_CACHE.get(raw)
    if spec is None:
        spec = pickle.loads(raw)
        if _arrays_only(spec):
            if len(_SPEC_CACHE) >= _SPEC_CACHE_MAX:  # shapes that keep changing: start again
                _SPEC_CACHE.clear()
            _SPEC_CACHE[raw] = spec
    return spec
