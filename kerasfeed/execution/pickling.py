"""Sending the source to workers by value (cloudpickle), with a useful error.

cloudpickle pickles classes and functions defined in ``__main__`` or in a
notebook cell by value, so a source defined there works in a worker that
never saw that code. h5py files, groups and datasets opened read-only travel
as references that each worker reopens (NOTE [ HDF5 handles travel to
workers ] in ``h5_handles.py``). What cannot be pickled (an open file, an
h5py handle open for writing, a lock, a socket) gets an error that names the
attribute holding it. Workers unpickle with ``light_modules.loads``.
"""

from __future__ import annotations

import functools
import io
import types
from typing import Any, Optional

from kerasfeed.errors import short_repr
from kerasfeed.execution import h5_handles

_MAX_DEPTH = 4
_MAX_CHECKS = 200

_FIX = (
    "Open files, HDF5 handles that are not read-only, locks and connections lazily inside `__getitem__` "
    "(e.g. `if self._file is None: self._file = h5py.File(self.path, 'r')`) rather than in "
    "`__init__`, or drop them in `__getstate__`; or use executor='threads'."
)


def _children(obj: Any, path: str):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{path}[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"{path}[{i}]", v
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for k, v in state.items():
                yield f"{path}.{k}", v
        for cls in type(obj).__mro__:
            for k in getattr(cls, "__slots__", ()):
                if isinstance(k, str) and hasattr(obj, k):
                    yield f"{path}.{k}", getattr(obj, k)


# cloudpickle 3.1.3 names every code object it pickles by value "<dynamic-code>" (deterministic payloads),
# so a worker's traceback through a class defined in ``__main__`` or a test shows no source lines. Workers
# run on this machine and can read the file: the real name is kept (earlier versions keep it already).
_ANONYMOUS_FILE = "<dynamic-code>"


def _code_keeping_its_file(pickler: Any, code: types.CodeType) -> Any:
    rebuild, args = pickler.dispatch_table[types.CodeType](code)
    return rebuild, tuple(code.co_filename if a == _ANONYMOUS_FILE else a for a in args)


@functools.lru_cache(maxsize=None)
def _pickler() -> Any:
    """cloudpickle's ``Pickler`` that also reduces h5py objects (``h5_handles.reduce``)."""
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, types.CodeType):
                return _code_keeping_its_file(self, obj)
            reduced = h5_handles.reduce(obj)
            return reduced if reduced is not None else super().reducer_override(obj)

    return Pickler


def dumps(obj: Any, buffer_callback: Any = None) -> bytes:
    """``cloudpickle.dumps(obj, protocol=5)``, with h5py handles as references (TypeError if one cannot travel)."""
    with io.BytesIO() as f:
        _pickler()(f, protocol=5, buffer_callback=buffer_callback).dump(obj)
        return f.getvalue()


def find_unpicklable(obj: Any, path: str) -> Optional[tuple[str, Any, BaseException]]:
    """``(path, value, error)`` of the deepest part of ``obj`` that cannot be pickled; None if it pickles."""
    checks = 0

    def visit(o: Any, p: str, depth: int):
        nonlocal checks
        checks += 1
        try:
            dumps(o)
            return None
        except Exception as e:  # noqa: BLE001 - any failure is what we look for
            err = e
        if depth < _MAX_DEPTH and not h5_handles.is_h5(o):  # an h5py object is the answer, not its insides
            for cp, child in _children(o, p):
                if checks >= _MAX_CHECKS:
                    break
                found = visit(child, cp, depth + 1)
                if found is not None:
                    return found
        return (p, o, err)

    return visit(obj, path, 0)


# What an executor's workers are called in messages.
WORKERS = {"processes": "worker processes", "ray": "Ray actors"}


def dumps_for_workers(source: Any, worker_init: Any = None, executor: str = "processes") -> bytes:
    """Pickles ``(source, worker_init)`` for the workers of ``executor`` (a key of ``WORKERS``).

    Raises:
        TypeError: something in them cannot be pickled; the message names it.
    """
    try:
        return dumps((source, worker_init))
    except Exception as e:  # re-raised with a better message
        for obj, path, what in ((source, "source", "source"), (worker_init, "worker_init", "`worker_init`")):
            found = find_unpicklable(obj, path)
            if found is None:
                continue
            where, value, err = found
            cls = type(value)
            raise TypeError(
                f"kerasfeed: executor='{executor}' sends the {what} to {WORKERS[executor]} by pickling it "
                f"(cloudpickle), but `{where}` ({cls.__module__}.{cls.__qualname__}) cannot be pickled: "
                f"{type(err).__name__}: {err}. {_FIX} Received: {path}={short_repr(obj, 200)}"
            ) from e
        raise TypeError(
            f"kerasfeed: could not pickle the source for the {WORKERS[executor]}: {type(e).__name__}: {e}. "
            f"{_FIX} Received: source={short_repr(source, 200)}"
        ) from e


def dumps_task(fn: Any, arg: Any, name: str) -> bytes:
    """Pickles a streaming task ``fn(arg)``; TypeError naming what failed."""
    try:
        return dumps((fn, arg))
    except Exception as e:
        found = find_unpicklable(fn, "task") or find_unpicklable(arg, "arg")
        where, value, err = found if found else ("task", fn, e)
        cls = type(value)
        raise TypeError(
            f"kerasfeed: the streaming task {name} cannot be sent to a worker process: `{where}` "
            f"({cls.__module__}.{cls.__qualname__}) cannot be pickled: {type(err).__name__}: {err}. "
            f"{_FIX} Received: task={short_repr(fn, 200)}, arg={short_repr(arg, 200)}"
        ) from e
