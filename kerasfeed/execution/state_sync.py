"""Carrying what the consumer's epoch hooks change to worker processes (TF-free).

Worker processes hold a copy of the source made when they started; the hooks
(``on_epoch_end``: Keras' place to change a dataset between epochs) run in the
consumer. ``StateTracker`` (consumer side) tells at every pass boundary whether
the source changed since the workers' copy was made and pickles what changed;
``apply_state`` (worker side) applies it before any item of the pass. How a
change is seen (a fingerprint per attribute: by value, content, identity or
CRC-32), what is sent, and what cannot be: docs/keras_parity.md, *State
changed by the hooks, with worker processes*. Beyond that page:

- array buffers are taken out of band (pickle protocol 5, no copy: an
  unchanged source never pickles its arrays); an array counts as read-only
  when ``flags.writeable`` is False down its base chain;
- the changed attributes travel in one pickle (shared references among them
  survive), applied with ``__dict__.update``;
- items made ahead (``Executor.plans_next_pass``: workers call ``set_epoch``
  themselves) are checked from fingerprints taken before ``set_epoch`` and
  before ``on_epoch_begin`` when the source overrides them (one fingerprint a
  pass otherwise);
- ``SceneSequence``'s epoch bookkeeping (``_kf_epoch``, ``_kf_in_epoch``) is
  not a change: every process sets it itself;
- class attributes and module globals the source's code reads travel the same
  way, keyed by tuples (NOTE [ State outside the instance ], outside_state.py);
- an underscored attribute the consumer set from None outside the hooks (a
  generator its ``seq[i]`` made) is its own: not sent (NOTE [ State each
  process makes for itself ], own_state.py).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import zlib
from typing import Any, Iterator, Optional

import numpy as np

from kerasfeed.errors import FileChangedError, short_repr
from kerasfeed.execution import outside_state, own_state

_OWN_KEYS = frozenset({"_kf_epoch", "_kf_in_epoch"})  # bookkeeping every process keeps for itself
_SMALL_BUFFER = 64 * 2**10  # compared by content; larger ones by identity or CRC-32
_ATOMIC = (type(None), bool, int, float, complex, str, bytes)
_WHOLE = "<source>"  # the one key of a source sent whole
_TAKEN = threading.local()  # .memo: {id: (object, fingerprint)} inside ``fingerprints_once``


class Same:
    """Equal to another ``Same`` holding the very same object (a value compared by identity)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


class _Value(Same):
    """Equal to another ``_Value`` of the same type and value."""

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _Value):
            return False
        a, b = self.obj, other.obj
        return a is b or (type(a) is type(b) and a == b)


class _Unpicklable(Same):
    """A value that cannot be pickled: equal only to itself (same object)."""

    def __init__(self, obj: Any, error: BaseException):
        super().__init__(obj)
        self.error = error


def unpicklable(fp: Any) -> bool:
    """Whether ``fp`` (a ``fingerprint``) is of a value that cannot be pickled (equal only to itself)."""
    return isinstance(fp, _Unpicklable)


def _frozen(obj: Any) -> bool:
    """The buffer cannot change: read-only arrays down to an immutable base."""
    while isinstance(obj, np.ndarray):
        if obj.flags.writeable:
            return False
        obj = obj.base
    return obj is None or isinstance(obj, bytes)


@contextlib.contextmanager
def fingerprints_once() -> Iterator[None]:
    """Within it (this thread), each object is fingerprinted once: a second ``fingerprint`` of the same
    object returns the first one's. For a pass start with a cache over worker processes, where the cache
    front and then the state tracker fingerprint the same attributes with no code of the user's between
    (a CRC-32 of a large writable array each: ~0.5 s a GB). Nested uses share the outer one."""
    if getattr(_TAKEN, "memo", None) is not None:
        yield
        return
    _TAKEN.memo = {}
    try:
        yield
    finally:
        _TAKEN.memo = None


def fingerprint(value: Any) -> Any:
    """A comparable summary of ``value``: equal ones mean the same pickled content (up to CRC-32 collisions)."""
    if type(value) in _ATOMIC:
        return _Value(value)
    memo = getattr(_TAKEN, "memo", None)
    if memo is None:
        return _taken(value)
    hit = memo.get(id(value))
    if hit is None:  # the memo holds ``value``: its id is not reused by another object meanwhile
        hit = memo[id(value)] = (value, _taken(value))
    return hit[1]


def _taken(value: Any) -> Any:
    buffers: list = []
    try:
        skeleton = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception:  # noqa: BLE001 - lambdas, classes in __main__, h5py handles: what workers are sent
        from kerasfeed.execution import pickling

        buffers = []
        try:
            skeleton = pickling.dumps(value, buffer_callback=buffers.append)
        except Exception as e:  # noqa: BLE001 - reported if it must be sent
            return _Unpicklable(value, e)
    parts = []
    for pb in buffers:
        raw = pb.raw()
        if raw.nbytes <= _SMALL_BUFFER:
            parts.append(bytes(raw))
        elif _frozen(raw.obj):
            parts.append((raw.nbytes, Same(raw.obj)))
        else:
            parts.append((raw.nbytes, zlib.crc32(raw)))
    return (skeleton, tuple(parts))


def _overrides(source: Any, name: str) -> bool:
    """``source`` has hook ``name`` from a class other than kerasfeed's or Keras' own."""
    fn = getattr(type(source), name, None)
    if fn is None:
        return False
    module = getattr(fn, "__module__", "") or ""
    return not module.startswith(("kerasfeed.sources.sequence", "kerasfeed.sources._light_pydataset", "keras."))


class StateTracker:
    """Tells what changed in ``source`` since the worker processes' copy.

    Create it when the workers receive ``source`` (the baseline); call ``before_hook`` before the pass
    hooks and ``check`` at every pass boundary. Not thread-safe: the pass pipeline calls it from one thread.
    """

    def __init__(self, source: Any, executor: str = "processes"):
        self.source = source
        self.executor = executor  # whose workers get the changes, for messages
        cls = type(source)
        standard = cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
        self.mode = "keys" if standard and isinstance(self._state(), dict) else "whole"
        if self.mode == "keys" and getattr(cls, "__setstate__", None) is not None:
            self.mode = "setstate"
        self._outside = outside_state.OutsideState(source)
        self._outside_sent: set = set()  # keys of outside values sent since the start (``outside_since_start``)
        self._custom_set_epoch = _overrides(source, "set_epoch")
        self._custom_begin = _overrides(source, "on_epoch_begin")
        self._synced = self.fingerprints()
        self._own: dict[str, bool] = {}  # keys each process makes for itself (own_state.py) -> was None (else unset)
        self._window: Optional[dict] = None  # their values when the hooks began
        self._hooked: set = set()  # those the hooks set since the last check
        self._pre: Optional[dict] = None
        self._mid: Optional[dict] = None
        self.syncs = 0  # passes that sent state
        self.sent_bytes = 0

    def _state(self) -> Any:
        getstate = getattr(self.source, "__getstate__", None)
        return getstate() if getstate is not None else dict(self.source.__dict__)

    def fingerprints(self) -> dict:
        """``{attribute: fingerprint}`` of the source now, and of what its code reads outside it (tuple keys)."""
        outside = self._outside.fingerprints(self._outside.now())
        if self.mode == "whole":
            return {_WHOLE: fingerprint(self.source), **outside}
        return {**{k: fingerprint(v) for k, v in self._state().items()}, **outside}

    def _maybe_own(self) -> dict:
        """The instance's underscored attributes that are None or unset in the workers' copy (or each process's
        own already), with their values now (``_MISSING``: unset)."""
        space = getattr(self.source, "__dict__", None)
        if self.mode == "whole" or not isinstance(space, dict):
            return {}
        names = {k for k in space if own_state.per_process(k)} | set(self._own)
        return {k: space.get(k, _MISSING) for k in names
                if k in self._own or k not in self._synced or self._synced[k] == _NONE}

    def before_hook(self, name: str) -> None:
        """Called just before the consumer runs hook ``name`` of a pass."""
        if self._window is None:
            self._window = self._maybe_own()
        # Only a set_epoch of the user's may change what the workers compute themselves: only then is it needed.
        if not self._custom_set_epoch:
            return
        if name == "set_epoch":
            self._pre, self._mid = self.fingerprints(), None
        elif name == "on_epoch_begin" and self._custom_begin and self._pre is not None:
            self._mid = self.fingerprints()

    def after_hook(self, name: str) -> None:
        """Called just after the consumer ran hook ``name`` (``on_epoch_end``; ``on_epoch_begin``, which ends the
        hooks that ``set_epoch`` began)."""
        window, self._window = self._window, None
        if window is not None:
            now = self._maybe_own()
            set_here = {k for k in now.keys() | window.keys() if now.get(k, _MISSING) is not window.get(k, _MISSING)}
            self._hooked |= set_here

    def _own_now(self, post: dict) -> set:
        """Keys each process makes for itself at this check: set from None to such state outside the hooks, or
        already so and not set by them since (the NOTE in own_state.py)."""
        return {k for k, v in self._maybe_own().items() if k not in self._hooked
                and (k in self._own or (k in post and own_state.made_for_itself(v, not unpicklable(post[k]))))}

    @staticmethod
    def _differ(a: dict, b: dict, skip: frozenset = frozenset()) -> set:
        """Keys whose fingerprints differ; an outside value (tuple key) set lazily is none (``outside_state.lazy``)."""
        out = set()
        for k in a.keys() | b.keys():
            x, y = a.get(k, _MISSING), b.get(k, _MISSING)
            if k in skip or x == y:
                continue
            if isinstance(k, tuple) and outside_state.lazy(k, outside_state.value_of(y), outside_state.value_of(x)):
                continue
            out.add(k)
        return out

    def check(self) -> tuple[Optional[bytes], bool]:
        """At a pass boundary, after the pass's hooks ran.

        Returns:
            ``(payload, keep_ahead)``: ``payload`` is None when the workers'
            copy is current, else the pickled change for ``apply_state``;
            ``keep_ahead`` tells whether items the workers made ahead for
            this pass (from their copy, after their own ``set_epoch``) may
            be used.

        Raises:
            TypeError: a changed attribute cannot be pickled; names it.
        """
        post = self.fingerprints()
        pre, mid = self._pre, self._mid
        self._pre = self._mid = None
        mine = self._own_now(post)
        for k in mine - self._own.keys():
            self._own[k] = self._synced.get(k) == _NONE
        for k in self._hooked:
            self._own.pop(k, None)
        self._hooked = set()
        own = (_OWN_KEYS if self.mode != "whole" else frozenset()) | mine
        if pre is None:  # no set_epoch of the user's since the last check: the workers hold the synced state
            keep = not self._differ(post, self._synced, own)
            set_epoch_keys: set = set()
        else:
            # The workers ran the same set_epoch on the synced state: valid if the state before it was the
            # synced one, and on_epoch_begin changed nothing after it.
            keep = not self._differ(pre, self._synced, own) and (mid is None or not self._differ(post, mid, own))
            set_epoch_keys = self._differ(post, pre, own)
        if keep:
            self._synced = post
            return None, True
        send = self._differ(post, self._synced, frozenset(mine)) | set_epoch_keys
        payload = self._payload(post, send)
        self._synced = post
        if payload is None:  # only values that cannot be pickled changed: the workers keep theirs (warned)
            return None, True
        self.syncs += 1
        self.sent_bytes += len(payload)
        return payload, False

    def _payload(self, post: dict, send: set) -> Optional[bytes]:
        from kerasfeed.execution.pickling import dumps

        outside = {k for k in send if isinstance(k, tuple)}
        context = self._outside_change({k: post[k].value for k in outside if k in post}, outside)
        self._outside_sent |= outside
        instance = self._instance_change(post, send - outside) if send - outside else None
        if instance is None and context is None:
            return None
        return dumps((instance, context))  # h5py handles as references, as the source itself travels (h5_handles.py)

    def outside_since_start(self) -> bytes:
        """A change that sets every outside value sent since the start as it is now: what a worker started
        from the source pickled anew (a rebase) needs, since a class in a module file comes back with the
        module's import-time values. Values never sent stay the worker's own (what its worker_init set)."""
        from kerasfeed.execution.pickling import dumps

        return dumps((None, self._outside_change(self._outside.now(), self._outside_sent)))

    def _outside_change(self, now: dict, keys: set) -> Optional[tuple]:
        """``(pickled values, removed keys)`` that set the outside values ``keys`` as ``now`` holds them (a key
        it lacks is removed), or None: nothing to send (what cannot be pickled is warned about and left out)."""
        from kerasfeed.execution.pickling import WORKERS

        changed = outside_state.pickled_changes({k: now[k] for k in keys if k in now}, type(self.source).__name__,
                                                WORKERS[self.executor])  # fmt: skip
        removed = sorted(k for k in keys if k not in now)
        return (changed, removed) if changed or removed else None

    def _instance_change(self, post: dict, send: set) -> tuple:
        from kerasfeed.execution.pickling import WORKERS, find_unpicklable

        for key in sorted(send, key=str):
            fp = post.get(key)
            if isinstance(fp, _Unpicklable):
                where = "source" if key == _WHOLE else f"source.{key}"
                found = find_unpicklable(fp.obj, where)
                path, value, err = found if found is not None else (where, fp.obj, fp.error)
                cls = type(value)
                if isinstance(err, FileChangedError):  # the attribute is the same handle; its file is not
                    raise FileChangedError(
                        f"kerasfeed: `{path}` of {type(self.source).__name__} cannot reach the "
                        f"{WORKERS[self.executor]} for the next pass: {err}. Build the source again to read the new "
                        f"file. Received: {path}={short_repr(value, 120)}"
                    )
                raise TypeError(
                    f"kerasfeed: `{key if key != _WHOLE else 'the source'}` of {type(self.source).__name__} changed in "
                    "this process (in on_epoch_end, set_epoch or on_epoch_begin, or between passes) and must reach the "
                    f"{WORKERS[self.executor]} before the next pass, but `{path}` "
                    f"({cls.__module__}.{cls.__qualname__}) cannot be pickled: {type(err).__name__}: {err}. Keep such "
                    "objects out of the pickled state (open them lazily in `__getitem__` and drop them in "
                    "`__getstate__`), or use executor='threads'. "
                    f"Received: {path}={short_repr(value, 120)}"
                )
        if self.mode == "whole":
            return ("whole", self.source)
        if self.mode == "setstate":  # each process's own state: the worker's, else as its copy had it
            state = dict(self._state())
            for k, was_none in self._own.items():
                state.pop(k, None)
                if was_none:
                    state[k] = None
            return ("setstate", state, sorted(self._own))
        state = self._state()
        return ("keys", {k: state[k] for k in send if k in state}, sorted(k for k in send if k not in state))


_MISSING = Same(object())
_NONE = _Value(None)


def apply_state(source: Any, payload: bytes, loads: Any = pickle.loads) -> Any:
    """Worker side: applies ``StateTracker.check``'s change; returns the source to use (new unless keys changed).
    ``loads``: the unpickler (worker processes: ``light_modules.loads``, as for the source itself, so that a
    source sent whole, its class by value, does not import the real Keras and its backend at the first change)."""
    change, context = loads(payload)
    if change is not None:
        source = _apply_instance(source, change)
    if context is not None:
        outside_state.apply(source, *context, loads)
    return source


def _apply_instance(source: Any, change: tuple) -> Any:
    kind = change[0]
    if kind == "keys":
        _, changed, removed = change
        state = source.__dict__
        state.update(changed)
        for key in removed:
            state.pop(key, None)
        return source
    if kind == "setstate":
        fresh = type(source).__new__(type(source))
        fresh.__setstate__(change[1])
        for k in change[2]:  # what this worker made for itself (own_state.py)
            if getattr(source, k, None) is not None:
                setattr(fresh, k, getattr(source, k))
        return fresh
    return change[1]


__all__ = ["Same", "StateTracker", "apply_state", "fingerprint", "unpicklable"]
