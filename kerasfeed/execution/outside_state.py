"""What a source's code reads outside its instance: its classes' attributes and module globals (TF-free).

NOTE [ State outside the instance ]
An ``on_epoch_end`` may change a class attribute (``type(self).level += 1``)
or a module global (``global STRENGTH``) that ``__getitem__`` reads. Threads
share them, and Keras' own ``use_multiprocessing`` forks its pool again each
epoch, so both see the new value. kerasfeed's worker processes and Ray actors
are persistent: without this module they kept the value of their start,
silently. ``StateTracker`` (state_sync.py) asks ``OutsideState`` for these
values at every pass boundary, next to the instance's own attributes, and
sends the changed ones with them; ``apply`` sets them in the worker.

- Which classes: the source's own classes (its MRO less kerasfeed's, Keras',
  the standard library's base classes and ``object``). Their data attributes
  (not functions, descriptors, classes or modules), read again every pass, so
  one added later counts too.
- Which globals: those the functions of those classes load (``LOAD_GLOBAL``,
  nested code and decorated functions included), and those loaded by the
  module-level functions of the same module they load (a helper). Found once,
  when the tracker starts, with ``dis``, as cloudpickle finds the globals it
  captures: a code object's ``co_names`` also holds attribute names, and
  ``self.epoch`` would tie a script's loop variable ``epoch`` to the source
  (a sync, and the items made ahead dropped, at every pass).
- How a change is seen: numbers, strings, bytes, None and tuples of them by
  value; any other value by identity only (rebinding ``CONFIG = {...}`` is
  seen; ``CONFIG["k"] = v`` in place is not: keep changing state on the
  instance, whose attributes are compared by content). Identity costs nothing
  a pass, where comparing a module-level memo dict by content would pickle it.
- A changed value that cannot be pickled (a lock, a socket opened lazily by
  the consumer's own calls) is not sent: one warning names it.
- Not covered: values set before the workers start, for a class defined in a
  module file. Worker processes are spawned and import that module afresh, so
  they hold its import-time values (as PyTorch's spawned workers do). A class
  defined in ``__main__`` (a script, a notebook) travels by value with the
  globals it reads, as they are when the workers start.
"""

from __future__ import annotations

import dis
import inspect
import types
import warnings
from typing import Any, Iterator

_LIBRARY_ROOTS = frozenset({"builtins", "kerasfeed", "keras", "tensorflow", "abc", "typing", "collections"})
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
         staticmethod, classmethod, property)  # fmt: skip
_ATOMIC = (type(None), bool, int, float, complex, str, bytes)
_warned: set = set()


def _own_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if (c.__module__ or "").split(".")[0] not in _LIBRARY_ROOTS]


def _functions(cls: type) -> Iterator[types.FunctionType]:
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            candidates = (value.fget, value.fset, value.fdel)
        else:
            candidates = (value,)
        for fn in candidates:
            if callable(fn):
                fn = inspect.unwrap(fn)
                if isinstance(fn, types.FunctionType):
                    yield fn


def _names(code: types.CodeType) -> Iterator[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas, comprehensions, nested functions
            yield from _names(const)


def _read_globals(classes: list[type]) -> list[tuple[dict, str]]:
    """``(globals dict, name)`` for every global a function of ``classes`` names, and the functions of the same
    module those name (a helper ``scale(x)`` reading ``STRENGTH``)."""
    return read_by([fn for cls in classes for fn in _functions(cls)])


def read_by(functions: list) -> list[tuple[dict, str]]:
    """``(globals dict, name)`` for every global ``functions`` load, directly or through functions of their
    own module (decorators unwrapped)."""
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    todo = [inspect.unwrap(fn) for fn in functions if isinstance(inspect.unwrap(fn), types.FunctionType)]
    seen: set = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        namespace = fn.__globals__
        for name in set(_names(fn.__code__)):
            if name not in namespace:
                continue  # an attribute name, a builtin
            value = namespace[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                todo.append(inspect.unwrap(value))
            found[(id(namespace), name)] = (namespace, name)
    return list(found.values())


def _fingerprint(value: Any) -> Any:
    if type(value) in _ATOMIC or (type(value) is tuple and all(type(v) in _ATOMIC for v in value)):
        return ("value", type(value), value)
    return ("object", id(value))


class OutsideState:
    """The values ``source``'s code reads outside its instance, keyed ``("class", module, qualname, name)`` or
    ``("global", module, name)``. ``now()`` reads them (a dict of key -> value); ``fingerprints(values)``
    compares them (state_sync's ``_differ``)."""

    def __init__(self, source: Any):
        self.classes = _own_classes(type(source))
        self.globals = _read_globals(self.classes)

    def now(self) -> dict:
        out = {}
        for cls in self.classes:
            for name, value in vars(cls).items():
                if not (name.startswith("__") and name.endswith("__")) and not isinstance(value, _CODE):
                    out[("class", cls.__module__, cls.__qualname__, name)] = value
        for namespace, name in self.globals:
            value = namespace.get(name, _ABSENT)
            if value is not _ABSENT and not isinstance(value, _CODE):
                out[("global", namespace.get("__name__"), name)] = value
        return out

    @staticmethod
    def fingerprints(values: dict) -> dict:
        return {key: _Print(_fingerprint(value), value) for key, value in values.items()}


class _Print:
    """A fingerprint that keeps its value alive (an id compared later must not be reused meanwhile)."""

    __slots__ = ("key", "value")

    def __init__(self, key: Any, value: Any):
        self.key, self.value = key, value

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Print) and self.key == other.key

    __hash__ = None  # type: ignore[assignment]


_ABSENT = object()


def picklable_changes(changed: dict, source_name: str, workers: str) -> dict:
    """``changed`` less what cannot be pickled, each of those warned about once (by key)."""
    from kerasfeed.execution.pickling import dumps

    out = {}
    for key, value in changed.items():
        try:
            dumps(value)
        except Exception as e:  # noqa: BLE001 - named in the warning
            if key not in _warned:
                _warned.add(key)
                warnings.warn(
                    f"kerasfeed: {describe(key)}, read by {source_name}'s code, changed in this process but cannot "
                    f"be pickled ({type(e).__name__}: {e}): the {workers} keep their own value. Keep state that "
                    f"changes between passes on the instance (self.x), or use executor='threads'. "
                    f"Received: {type(value).__module__}.{type(value).__qualname__}",
                    stacklevel=2,
                )
            continue
        out[key] = value
    return out


def describe(key: tuple) -> str:
    if key[0] == "class":
        return f"class attribute {key[2]}.{key[3]}"
    return f"module global {key[1]}.{key[2]}"


def apply(source: Any, changed: dict, removed: list) -> None:
    """Worker side: sets what changed in the worker's own classes and modules (found by name)."""
    classes = _own_classes(type(source))
    by_name = {(c.__module__, c.__qualname__): c for c in classes}
    namespaces: dict[str, list[dict]] = {}
    for fn in (f for c in classes for f in _functions(c)):
        spaces = namespaces.setdefault(fn.__globals__.get("__name__"), [])
        if not any(s is fn.__globals__ for s in spaces):
            spaces.append(fn.__globals__)
    for key, value in [(k, v) for k, v in changed.items()] + [(k, _ABSENT) for k in removed]:
        if key[0] == "class":
            cls = by_name.get((key[1], key[2]))
            if cls is None:
                continue
            if value is _ABSENT:
                if key[3] in vars(cls):
                    delattr(cls, key[3])
            else:
                setattr(cls, key[3], value)
        else:
            for namespace in namespaces.get(key[1], ()):
                if value is _ABSENT:
                    namespace.pop(key[2], None)
                else:
                    namespace[key[2]] = value


__all__ = ["OutsideState", "apply", "describe", "picklable_changes", "read_by"]
