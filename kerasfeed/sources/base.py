"""Helpers shared by every executor for random-access sources: items by integer index and a length
(``len(source)``, or a ``num_batches`` property as in Keras 3's ``PyDataset``, None for an infinite
source). Optional hooks: ``set_epoch(epoch)``, called in every process that runs items before its items
of pass ``epoch`` (so worker copies see the epoch too), and ``on_epoch_begin()``/``on_epoch_end()``,
once per pass in the consumer process, as Keras calls them on a ``PyDataset``."""

from __future__ import annotations

import collections
import numbers
import threading
import types
import weakref
from typing import Any, Optional

from kerasfeed.errors import short_repr

_EPOCH_HOOKS = ("set_epoch", "on_epoch_begin", "on_epoch_end")


def has_own_epoch_hooks(source: Any) -> bool:
    """Whether ``source`` has an epoch hook written by its user (not kerasfeed's
    or Keras' defaults): one that may change in place what items view.

    A kerasfeed wrapper (``mix``) names the sources its hooks reach in
    ``wrapped_sources``; a hook of any of them counts.
    """
    for name in _EPOCH_HOOKS:
        if name in getattr(source, "__dict__", {}):
            return True
        for c in type(source).__mro__:
            if name in vars(c):
                if not c.__module__.startswith(("kerasfeed.", "keras.")):
                    return True
                break
    return any(has_own_epoch_hooks(part) for part in getattr(source, "wrapped_sources", ()))


def _has_num_batches(source: Any) -> bool:
    # Defined by the user's class (or instance). Keras' own PyDataset
    # defines a default that only forwards to ``__len__``: not a length.
    for c in type(source).__mro__:
        if "num_batches" in vars(c):
            return not (c.__name__ == "PyDataset" and c.__module__.startswith(("keras.", "kerasfeed.")))
    return "num_batches" in getattr(source, "__dict__", {})


def source_length(source: Any, *, allow_infinite: bool = False, owner: str = "kerasfeed", why_finite: str = "",
                  infinite_remedy: str = "") -> Optional[int]:
    """Returns the number of items of ``source`` (module docstring); None for an infinite one.

    Args:
        source: the object to check.
        allow_infinite: accept ``num_batches`` None (returns None).
        owner: who asks, for error messages.
        why_finite, infinite_remedy: why ``owner`` needs a finite source, and what to do instead, for
            the message that refuses an infinite one.

    Raises:
        TypeError: ``source`` is text (``str``/``bytes``), lacks
            ``__getitem__`` or a length, or the length is not an int.
        ValueError: the length is not positive, or the source is infinite
            and ``allow_infinite`` is False.
    """
    if isinstance(source, (str, bytes, bytearray, memoryview)):
        # Indexable, but its items are characters: almost always a path or a name passed by mistake.
        raise TypeError(
            f"{owner} needs an indexable source of items, not text: a {type(source).__name__} would yield its "
            "characters one by one. Wrap the file in a source (e.g. a `kerasfeed.SceneSequence` or the HDF5 "
            f"readers) or pass a list of items. Received: {_short(source)}"
        )
    name = type(source).__name__
    has_len = hasattr(source, "__len__")
    has_nb = not has_len and _has_num_batches(source)
    needs = {"`__getitem__`": hasattr(source, "__getitem__"),
             "length (neither `__len__` nor a `num_batches` property)": has_len or has_nb}
    missing = [m for m, ok in needs.items() if not ok]
    if missing:
        raise TypeError(
            f"{owner} needs an indexable source: an object with `__getitem__(index)` returning item `index`, "
            "and `__len__()` or a `num_batches` property giving the number of items (None: infinite). "
            f"{type(source).__module__}.{type(source).__qualname__} has no {' and no '.join(missing)}. "
            f"Received: {_short(source)}"
        )
    what = f"len({name})" if has_len else f"{name}.num_batches"
    try:
        n = len(source) if has_len else source.num_batches
    except Exception as e:  # re-raised below, naming the source
        raise TypeError(f"{owner}: {what} raised {type(e).__name__}: {e}. Received: {_short(source)}") from e
    if n is None and has_nb:
        if allow_infinite:
            return None
        raise ValueError(
            f"{owner} needs a finite source{why_finite and ': ' + why_finite}, but {what} is None (an infinite "
            f"source).{infinite_remedy and ' ' + infinite_remedy} Received: {_short(source)}"
        )
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{owner}: {what} must return an int{' or None' if has_nb else ''}. Received: {n!r}")
    n = int(n)
    if n <= 0:
        raise ValueError(
            f"The source is empty: {what} is {n}; it must hold at least one item. Received: {_short(source)}"
        )
    return n


def _short(obj: Any) -> str:
    return f"{short_repr(obj, 120)} of type {type(obj).__name__}"


def source_name(source: Any) -> str:
    """The source as messages name it: its ``kerasfeed_name`` if it has one (an internal task names what it
    runs for: export's shards), else its class."""
    name = getattr(source, "kerasfeed_name", None)
    return name if isinstance(name, str) else type(source).__name__


def set_epoch(source: Any, epoch: int) -> None:
    """Tells ``source`` which pass is running, if it wants to know."""
    hook = getattr(source, "set_epoch", None)
    if callable(hook):
        hook(epoch)
    keep_epoch(source, epoch)  # a SceneSequence whose set_epoch override skipped super(): still the pass


def keep_epoch(source: Any, epoch: int) -> None:
    """Sets a ``SceneSequence``'s own ``epoch`` bookkeeping (``_kf_epoch``) to ``epoch``, without its
    ``set_epoch``; nothing for other sources. Each process keeps it for itself (``state_sync._OWN_KEYS``)."""
    if "_kf_epoch" in getattr(source, "__dict__", ()):
        source._kf_epoch = int(epoch)


# A source that orders its own items (an HDF5 reader's shuffle, an H5RowSequence's order) may define
# `kerasfeed_unshardable()`: why several pipelines, each with its own copy, would not read disjoint
# shards of it (None: they would). Every front end asks it before cutting a source into shards.
UNSHARDABLE_HOOK = "kerasfeed_unshardable"


def check_shardable(source: Any, parts: int, api: str) -> None:
    """Refuses to cut ``source`` into ``parts`` shards when it says its copies would not agree.

    Raises:
        ValueError: the source's own reason, and what was asked.
    """
    hook = getattr(source, UNSHARDABLE_HOOK, None)
    why = hook() if parts > 1 and callable(hook) else None
    if why:
        raise ValueError(f"{api}: {source_name(source)} cannot be cut into {parts} disjoint shards: {why}")


def close_quietly(iterator: Any) -> None:
    """Closes a generator (or any iterator with ``close``) whose stream is over
    either way: an exception from its clean-up must not hide the real outcome."""
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001
            pass


class GeneratorsSeen:
    """Refuses an iterator that a stream's task returned before.

    A generator runs once, and every stream closes its iterator when it ends.
    A task that hands back a generator made ahead (``lambda i: gens[i]``, a
    global) would give a stream with no items, silently, from the second
    time on: and the signature probe is already a first time. The same holds
    for any object that is its own iterator (``map``, ``iter(list)``, a file):
    what the task returns is checked when ``iter()`` gives it back unchanged.
    A list or another iterable restarts in ``__iter__`` and is not checked.
    Weak references where the type allows (generators); the last
    ``KEPT_STRONG`` others are held (the built-in iterators take no weak
    reference), so that an id is never another object's.
    """

    KEPT_STRONG = 4096

    def __init__(self) -> None:
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._held: collections.OrderedDict = collections.OrderedDict()  # id -> the iterator, oldest first
        self._lock = threading.Lock()

    def check(self, iterator: Any) -> Any:
        """Returns ``iterator`` (what ``iter()`` gave for the task's value); raises ValueError if the task
        returned this very iterator before."""
        with self._lock:
            if self._seen_before(iterator):
                kind = "a generator object" if isinstance(iterator, types.GeneratorType) else "an iterator"
                raise ValueError(
                    f"the task returned {kind} it had returned before; an iterator runs only "
                    "once and the stream that read it closed it, so this stream would have no items. "
                    "Return a new generator or iterator from every call (kerasfeed calls the task once per "
                    "shard in every pass, and once more for the first shards to infer the signature): e.g. "
                    "`def factory(i): return make_gen(i)`, not `lambda i: gens[i]`. "
                    f"Received: {_short(iterator)}"
                )
        return iterator

    def _seen_before(self, iterator: Any) -> bool:
        try:
            if iterator in self._seen:
                return True
            self._seen.add(iterator)
            return False
        except TypeError:  # no weak reference to this type
            pass
        if id(iterator) in self._held:
            return self._held[id(iterator)] is iterator
        self._held[id(iterator)] = iterator
        while len(self._held) > self.KEPT_STRONG:
            self._held.popitem(last=False)
        return False
