"""Whether a cached source changed between passes (``cache=``): the check ``CacheFront`` runs at each pass start.

NOTE [ A source that changes between passes ]
Stored items are what the stored stage made when they were first loaded. A
source whose state changes between passes (an ``on_epoch_end`` that
reshuffles the index list its ``__getitem__`` reads) would make other items
later, so its attributes (the instance's, ``__slots__`` and its own classes'
immutable plain values), and the module globals the stored stage loads
(``outside_state.read_by``: ``load`` or ``__getitem__`` and the functions of
its module it calls) of plain values, or arrays, lists, dicts and sets by
identity (rebinding counts; a change in place is not seen), are compared at every pass start with the last pass's,
and the pass fails naming the one that changed, was set or was dropped.

Three snapshots frame a pass boundary: the last pass start's, the first taken
when a hook is about to run (``on_epoch_end``, ``set_epoch``; ``before_hooks``)
and this pass start's. An attribute set from None before the hooks was set
during the pass, by the items themselves (a file memory-mapped or a table
loaded on first use), or a class-level value changed then (a count of calls),
was set by the items themselves: the source's own state. What the hooks or code between
passes changed counts, except an object set to or from None (a file reopened
lazily) and an underscored attribute set to or from None; a public attribute
of plain data set to or from None (``self.subset = None`` meaning all items)
counts. A pass begun again with no hook between is no boundary. Attributes
the stored stage does not read are named in ``cache_ignores``.

A random generator (numpy's, ``random.Random``) is compared by identity: its
state moves whenever ``augment`` draws from it (``self._rng``, made on first
use), and a stored stage that drew from it would be random anyway.

Values are compared by their pickled bytes (``state_sync.fingerprint``); one
that cannot be pickled whole (a list of open files, a reader holding a lock)
part by part, a part that cannot be pickled as the same object or not
(``_compared``). A kerasfeed source held inside (a mix's parts) is compared by
its pickled state less its epoch counter, which moves every pass.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kerasfeed.cache.keys import stage_of
from kerasfeed.execution import outside_state, own_state
from kerasfeed.execution.state_sync import Same, fingerprint, unpicklable

_OWN = frozenset({"_kf_epoch", "_kf_in_epoch"})  # a kerasfeed source's epoch counters
_HELD_IN_LIST = 256  # a list or tuple this long or shorter is looked into for held kerasfeed sources
_DEPTH = 4  # levels a value that cannot be pickled whole is compared through
_ABSENT = (None, "none")  # an attribute not set: as None
_CLASS_VALUES = (bool, int, float, complex, str, bytes, tuple, frozenset, np.generic)
_REBOUND = (np.ndarray, list, dict, set)  # a module global of these: compared by identity (``state_sync.Same``)
_FRAMEWORK_MODULES = ("kerasfeed.", "keras.", "tensorflow.", "torch.", "jax.", "builtins")


class SourceChanges:
    """The between-pass check of one source; ``ignored``: attribute names left out (``cache_ignores``)."""

    def __init__(self, source: Any, ignored: frozenset):
        self._source = source
        self._ignored = ignored | _OWN
        self._last: Optional[dict] = None  # at the last pass start
        self._pre_hooks: Optional[dict] = None  # before the first hook since then
        stage = getattr(type(source), stage_of(source), None)
        self._globals = outside_state.read_by([stage]) if stage is not None else []

    def before_hooks(self) -> None:
        """A hook of the source is about to run: the state the items left (the first call after a pass start)."""
        last = self._last
        if last is not None and self._pre_hooks is None:  # only what was None or unset: what the check reads
            self._pre_hooks = self._snapshot(lambda k: k not in last or last[k][1] == "none" or "." in k)

    def check(self) -> None:
        """At a pass start, after its hooks.

        Raises:
            ValueError: an attribute the hooks (or code between the passes) changed, named.
        """
        now = self._snapshot()
        before, pre, self._last, self._pre_hooks = self._last, self._pre_hooks, now, None
        if before is None or pre is None:  # the first pass, or one begun again with no hook since: no boundary
            return
        for key in sorted(before.keys() | now.keys(), key=str):  # one set or dropped since counts too
            (was, was_kind), (fp, kind) = before.get(key, _ABSENT), now.get(key, _ABSENT)
            if was == fp or _lazy(key, was_kind, kind):
                continue
            if (was_kind == "none" or "." in key) and pre.get(key, _ABSENT)[0] == fp:
                continue  # set from None (or a class's value changed) during the pass, by the items (see the NOTE)
            is_global = key.startswith("global ")
            what, label = ("module global", key[len("global "):]) if is_global else ("the source's attribute", key)
            name = label.rpartition(".")[2]  # a class value ("Cls.x") by its own name, as cache_ignores takes it
            raise ValueError(
                f"kerasfeed cache: {what} `{label}` changed since the last pass (in on_epoch_end, "
                "set_epoch or on_epoch_begin, or between the passes). Stored items were made from its earlier "
                "value, so they may no longer be what the source makes: with cache=, what the stored stage "
                "(`load`, or `__getitem__`) reads must not change between passes. Do per-pass work in "
                f"`augment(item)`; if the stored stage does not read `{name}`, name it in the source's "
                f"`cache_ignores`. Received: {label} changed in {type(self._source).__name__}"
            )

    def _snapshot(self, wanted: Any = None) -> dict:
        state = _state(self._source)
        left_out = self._ignored | _unpickled(self._source, state)
        rebound = {}
        for namespace, name in self._globals:  # keyed apart from attributes; has a "." like a class's value
            value, key = namespace.get(name), f"global {namespace.get('__name__')}.{name}"
            if name in self._ignored:
                continue
            if isinstance(value, _CLASS_VALUES):
                state[key] = value
            elif isinstance(value, _REBOUND):
                rebound[key] = value
        left_out |= {k for k in state if "." in k and k.rpartition(".")[2] in self._ignored}  # "Cls.x" by "x"
        snap = {k: (_compared(v), _kind(v)) for k, v in state.items()
                if k not in left_out and (wanted is None or wanted(k))}
        snap.update((k, (Same(v), "data")) for k, v in rebound.items() if wanted is None or wanted(k))
        return snap


def _state(source: Any) -> dict:
    """The attributes compared: the instance's, its ``__slots__``' and its own classes' plain values (a level
    in the class body that a hook raises: ``type(self).LEVEL += 1``), not those of kerasfeed's or Keras'."""
    state: dict = {}
    for cls in reversed(type(source).__mro__):
        if (cls.__module__ or "").startswith(_FRAMEWORK_MODULES) or cls.__module__ == "builtins":
            continue
        for k, v in vars(cls).items():  # not a class's lists, dicts, sets or arrays: shared state (a log)
            if not k.startswith("__") and isinstance(v, _CLASS_VALUES):
                state[f"{cls.__qualname__}.{k}"] = v
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and not name.startswith("__") and hasattr(source, name):
                state[name] = getattr(source, name)
    state.update(getattr(source, "__dict__", None) or {})
    return state


def _compared(value: Any, depth: int = _DEPTH) -> Any:
    """``value`` as the check compares it: its fingerprint; a kerasfeed source held inside by its state less its
    epoch counter; one that cannot be pickled whole part by part (see the NOTE)."""
    if own_state.generator(value):
        return ("generator", value)  # the same object (see the NOTE)
    own = _held_state(value)
    if own is not None:
        return (type(value), _compared(own, depth - 1)) if depth > 0 else fingerprint(own)
    fp = None
    if depth <= 0 or not _holds_sources(value):  # a mix's parts: each less its epoch counters, below
        fp = fingerprint(value)
        if not unpicklable(fp) or depth <= 0:
            return fp
    if type(value) in (list, tuple):
        return (type(value), tuple(_compared(v, depth - 1) for v in value))
    if type(value) is dict:
        return (dict, tuple((repr(k), _compared(v, depth - 1)) for k, v in value.items()))
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return (type(value), _compared(dict(state), depth - 1))
    return fp  # a lock, an open file: the same object or not


def _holds_sources(value: Any) -> bool:
    """A short list or tuple holding kerasfeed sources (a mix's parts)."""
    return (type(value) in (list, tuple) and 0 < len(value) <= _HELD_IN_LIST
            and any(_held_state(v) is not None for v in value))


def _own_state(obj: Any) -> Optional[dict]:
    """What ``obj``'s class's own ``__getstate__`` returns (a dict), or None: no such method, it failed (the
    object is compared as it is), or it returned something else."""
    getstate = getattr(type(obj), "__getstate__", None)
    if getstate is None or getstate is getattr(object, "__getstate__", None):
        return None
    try:
        pickled = obj.__getstate__()
    except Exception:  # noqa: BLE001 - what it holds is compared as it is
        return None
    return pickled if isinstance(pickled, dict) else None


def _held_state(value: Any) -> Optional[dict]:
    """A kerasfeed source held by the source (a mix's part, a reader): what it pickles, less its epoch counters."""
    state = getattr(value, "__dict__", None)
    if not isinstance(state, dict) or not _OWN & state.keys():
        return None
    pickled = _own_state(value)
    return {k: v for k, v in (state if pickled is None else pickled).items() if k not in _OWN}


def _unpickled(source: Any, state: dict) -> frozenset:
    """The attributes a source leaves out of its pickled state: this process's own (open handles, a lazy
    cache of datasets that its threads fill as they open files), not what its items are made from."""
    pickled = _own_state(source)  # only the instance's attributes: a class's values ("Cls.x") are not in it
    return frozenset() if pickled is None else frozenset(k for k in state.keys() - pickled.keys() if "." not in k)


def _kind(value: Any) -> str:
    return "none" if value is None else "data" if isinstance(value, own_state.DATA) else "object"


def _lazy(key: str, was: str, now: str) -> bool:
    """A change to or from None (or unset) that is state the source keeps for itself, not what its items are
    made from: an object (a file opened lazily, a session), or an underscored attribute (``self._labels``
    loaded on first use). A public attribute of plain data set to or from None (``self.subset = None``: all
    items) or set for the first time (``self.scale = 10.0``) changes the items: it counts."""
    if "none" not in (was, now):
        return False
    name = key.rpartition(".")[2]  # a class's value or a global by its own name ("_TABLE"), as an attribute's
    return was == now or "object" in (was, now) or name.startswith("_")


__all__ = ["SourceChanges"]
