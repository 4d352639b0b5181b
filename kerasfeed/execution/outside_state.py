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
  nested code and decorated functions included), the attributes they read of
  a module they load (``cfg.STRENGTH``), and the same for the functions they
  call that way (a helper, here or imported from another module), as long as
  the module is the user's: not the standard library's nor an installed
  package's (``_users``). Found once, when the tracker starts, from the
  functions' source, not from their bytecode: ``symtable`` (Python's own
  scope rules) says which names are global in the function or the code
  nested in it, ``ast`` the attributes read of them in a row. A code
  object's ``co_names`` alone also holds attribute names, and ``self.epoch``
  would tie a script's loop variable ``epoch`` to the source (a sync, and the
  items made ahead dropped, at every pass); it is the fallback where there is
  no source that is the function's (``exec``, code typed at a prompt, a file
  edited since it was imported: its source must name what its code does).
  Not seen through: a decorator without ``functools.wraps``.
- How a change is seen: numbers, strings, bytes, None and short tuples of them
  by value; any other value by identity only (rebinding ``CONFIG = {...}`` is
  seen; ``CONFIG["k"] = v`` in place is not: keep changing state on the
  instance, whose attributes are compared by content). Identity costs nothing
  a pass, where comparing a module-level memo dict by content would pickle it.
- A changed value that cannot be pickled (a lock, a socket) is not sent: one
  warning names it. Nor is a random generator or an object that cannot be
  pickled set from None, of an underscored name silently, of a public one with
  one warning: state a process makes for itself on first use
  (``_RNG = np.random.default_rng(os.getpid())``), which the consumer makes
  too when it runs an item (``seq[0]`` between passes): sent, every worker
  drew the consumer's numbers (helper's review; NOTE [ State each process
  makes for itself ], own_state.py). Anything else set from None
  (``_ORDER = perm``, ``AUGMENTER = Flip()``) and a change to None (a
  feature turned off) are sent.
- Not covered: values set before the workers start, for a class defined in a
  module file. Worker processes are spawned and import that module afresh, so
  they hold its import-time values (as PyTorch's spawned workers do). A class
  defined in ``__main__`` (a script, a notebook) travels by value with the
  globals it reads, as they are when the workers start.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import symtable
import sys
import sysconfig
import types
import warnings
from typing import Any, Iterator, Optional

from kerasfeed.execution import own_state

_LIBRARY_ROOTS = frozenset({"builtins", "kerasfeed", "keras", "tensorflow", "abc", "typing", "collections"})
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
         staticmethod, classmethod, property)  # fmt: skip
_ATOMIC = (type(None), bool, int, float, complex, str, bytes)
_SHORT_TUPLE = 64  # longer tuples: ``_Tuple``
_MODULE_DEPTH = 3  # module levels followed without a source (``pkg.sub.cfg.X``)
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


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas, comprehensions, nested functions
            yield from _codes(const)


def _names(fn: types.FunctionType) -> set[tuple[str, tuple]]:
    """``(name, attributes)`` for each global ``fn`` reads, with the attributes it then reads of it in a row
    (``pkg.cfg.STRENGTH``: ``("pkg", ("cfg", "STRENGTH"))``): from its source, the names Python's own scope
    rules (``symtable``) make global in it or its nested code. Without a source that is ``fn``'s (none, or a
    file edited since), every name of ``co_names`` and, through the user's modules, every attribute among them:
    more than it reads (a sync too many), never less."""
    named = {part for c in _codes(fn.__code__) for n in c.co_names for part in n.split(".")}
    parsed = _source(fn, named)
    if parsed is None:
        return _by_names(fn, named)
    text, tree = parsed
    try:
        scopes = list(symtable.symtable(text, "<kerasfeed>", "exec").get_children())
    except SyntaxError:  # a method's ``nonlocal`` of the function its class is made in: no scope here to bind
        return _by_names(fn, named)
    read = set()
    while scopes:  # the function's scope and those nested in it (the top one holds its decorators)
        scope = scopes.pop()
        read |= {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
        scopes += scope.get_children()
    found = {(name, ()) for name in read}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in read:
                found.add((base.id, tuple(reversed(chain))))
    return found


_IMPLICIT = frozenset({"__name__", "__module__", "__qualname__", "__doc__", "__class__"})  # a nested class body's


def _source(fn: types.FunctionType, named: set) -> Optional[tuple[str, ast.AST]]:
    """``fn``'s source and its tree, or None: no source (``exec``, a prompt), a lambda's part of a line, or a
    source that names less than ``fn``'s code does (its file edited since it was imported)."""
    try:
        text = inspect.getsource(fn)
        text = "if 1:\n" + text if text[:1].isspace() else text  # a method's: a block of its own (dedent would
        tree = ast.parse(text)  # fail on a string's unindented lines)
    except (OSError, TypeError, SyntaxError):
        return None
    seen = set(_IMPLICIT)
    for node in ast.walk(tree):
        seen.update(n for n in (getattr(node, "id", None), getattr(node, "attr", None), getattr(node, "name", None),
                                getattr(node, "arg", None)) if isinstance(n, str))
        if isinstance(node, (ast.ImportFrom, ast.alias)):
            seen.update((getattr(node, "module", None) or getattr(node, "name", None) or "").split("."))
    mangled = {n for n in named - seen if n.startswith("_") and n[n.find("__", 1):] in seen and "__" in n[1:]}
    return (text, tree) if named - mangled <= seen else None


def _by_names(fn: types.FunctionType, named: set) -> set[tuple[str, tuple]]:
    found, todo = set(), [(fn.__globals__, name, ()) for name in named]
    while todo:
        namespace, name, chain = todo.pop()
        found.add((chain[0] if chain else name, (*chain[1:], name) if chain else ()))
        value = namespace.get(name)
        if isinstance(value, types.ModuleType) and _users(value.__name__) and len(chain) < _MODULE_DEPTH:
            head = (*chain, name)
            todo += [(vars(value), a, head) for a in named if a in vars(value)]
    return found


@functools.lru_cache(maxsize=None)
def _library_paths() -> tuple:
    import site

    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:  # Debian's /usr/lib/python3/dist-packages, the user's site: not in sysconfig's
        found += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site.py
        pass
    return tuple(os.path.realpath(p) + os.sep for p in found)


def _users(module_name: Optional[str]) -> bool:
    """Whether a module is the user's own: not the standard library's or an installed package's."""
    if not module_name or module_name.split(".")[0] in _LIBRARY_ROOTS:
        return False
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module is None:
        return True  # a script, a notebook; a class pickled by value
    path = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or ()), None)
    return bool(path) and not os.path.realpath(path).startswith(_library_paths())  # (a namespace package: __path__)


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
        for name, chain in _names(fn):
            namespace = fn.__globals__
            if name not in namespace:
                continue  # a builtin
            for attribute in chain:  # through modules (``pkg.cfg``) to the value read
                module = namespace[name]
                if not isinstance(module, types.ModuleType) or not _users(module.__name__):
                    break  # np.pi, os.environ: not the user's state; an object's attribute
                namespace, name = vars(module), attribute
                if name not in namespace:
                    break
            if name not in namespace:
                continue
            value = namespace[name]
            if isinstance(value, types.FunctionType) and _users(getattr(value, "__module__", None)):
                todo.append(inspect.unwrap(value))
            found[(id(namespace), name)] = (namespace, name)
    return list(found.values())


def _fingerprint(value: Any) -> Any:
    if type(value) in _ATOMIC or (
        type(value) is tuple and len(value) <= _SHORT_TUPLE and all(type(v) in _ATOMIC for v in value)
    ):
        return ("value", type(value), value)
    if type(value) is tuple:
        return _Tuple(value)
    return ("object", id(value))


class _Tuple:
    """A long tuple: the same object, or (only when rebound) an equal one. Checking that every element is a
    number on every pass cost 132 ms a pass for 2M of them; an equal tuple rebuilt by a hook is no change."""

    __slots__ = ("value",)

    def __init__(self, value: tuple):
        self.value = value

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _Tuple):
            return False
        if self.value is other.value:
            return True
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - arrays inside: ambiguous, so changed
            return False

    __hash__ = None  # type: ignore[assignment]


def lazy(key: tuple, was: Any, now: Any) -> bool:
    """A value set from None (``_ABSENT``: not set) that is state a process makes for itself on first use: a
    random generator or what cannot be pickled (``own_state.made_for_itself``), of an underscored name (silently)
    or of a public one (warned about once, by key: it may be a setting the hooks meant the workers to see). Any
    other value set from None, and a change *to* None (a feature turned off), count."""
    was, now = (None if v is _ABSENT else v for v in (was, now))
    if was is not None or not own_state.made_for_itself(now):
        return False
    if key[-1].startswith("_"):
        return True
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"kerasfeed: {describe(key)} was set from None to a random generator or an object that cannot be pickled "
            "in this process (the consumer) and is not sent to the worker processes: taken as state each process "
            "makes for itself on first use (a generator, a file, a session), as the consumer does when it runs an "
            "item. If the epoch hooks set it for the workers to use, give it a value other than None before they "
            "start (then every change is sent), or keep it on the instance (self.x). "
            f"Received: {type(now).__module__}.{type(now).__qualname__}",
            stacklevel=2,
        )
    return True


def value_of(fp: Any) -> Any:
    """The value an ``OutsideState.fingerprints`` entry holds (``_ABSENT`` for anything else)."""
    return fp.value if isinstance(fp, _Print) else _ABSENT


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


def pickled_changes(changed: dict, source_name: str, workers: str) -> list:
    """``[pickled {key: value}]`` of ``changed``: one pickle (names bound to one object stay one object there),
    or, where something cannot be pickled, one per value less those, each warned about once."""
    from kerasfeed.execution.pickling import dumps

    if not changed:
        return []
    try:
        return [dumps(changed)]
    except Exception:  # noqa: BLE001 - found below, value by value
        pass
    out = []
    for key, value in changed.items():
        try:
            out.append(dumps({key: value}))
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
    return out


def describe(key: tuple) -> str:
    if key[0] == "class":
        return f"class attribute {key[2]}.{key[3]}"
    return f"module global {key[1]}.{key[2]}"


def apply(source: Any, pickled: list, removed: list, loads: Any) -> None:
    """Worker side: sets what changed (``pickled_changes``' pickles, unpickled with ``loads``) in the worker's
    own classes and modules (found by name: a class function's globals, or the module imported here)."""
    changed = {k: v for blob in pickled for k, v in loads(blob).items()}
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
            spaces = list(namespaces.get(key[1], ()))
            module = sys.modules.get(key[1]) if key[1] != "__main__" else None  # cfg.STRENGTH: imported here
            if module is not None and not any(s is vars(module) for s in spaces):
                spaces.append(vars(module))
            for namespace in spaces:
                if value is _ABSENT:
                    namespace.pop(key[2], None)
                else:
                    namespace[key[2]] = value


__all__ = ["OutsideState", "apply", "describe", "lazy", "pickled_changes", "read_by", "value_of"]
