"""State a source makes for itself on first use, kept in the process that made it (TF-free).

NOTE [ State each process makes for itself ]
A source often makes per-process state on first use, under an attribute that
was None or not set: ``if self._rng is None: self._rng = default_rng()``, a
file, a connection: a random generator or an object that cannot be pickled
(``made_for_itself``; not data, nor a picklable object such as a DataFrame or
a tensor). Worker processes each make their own, unless
they are sent the consumer's: then every worker holds the same generator and
draws the same numbers (a helper's review: 12 distinct draws of 24 items,
silently). The consumer runs items too:

- kerasfeed's own calls before the workers start: ``executor="auto"``'s timing
  probe and, with ``cache=``, the check of a class's own ``__getitem__``
  (``cached_split.py``). ``undone`` runs them and, if they made such state,
  puts back every attribute they set (a flag beside it, ``self._ready``,
  too: a review found it True with ``_rng`` None), so the workers start
  from the source as the user left it, as with any other executor. The
  consumer makes its own again if it needs it.
- the user's ``seq[i]`` between passes. At a pass boundary the state tracker
  (``state_sync.py``) does not send an underscored attribute that was None
  (or not set) in the workers' copy and was set to such an object outside the
  epoch hooks, nor its later changes outside them; one the hooks set
  (``before_hook`` .. ``after_hook``) is sent as any change. Sent too: other
  values (a Keras callback's ``seq._scale = epoch + 2``, a review found it
  lost, and an order made on first use, which every worker must share), and a public
  attribute (a setting the user gives the workers between passes,
  ``seq.augmenter = Flip()``). The cost of the rule: an underscored generator
  a Keras callback sets from None stays the consumer's; set it in the
  source's ``on_epoch_end``, or give it a value other than None first.

Not covered: state made in the consumer before the loader is built (it is in
the source the workers are given, as PyTorch's workers get it); a source of
``__slots__`` at a pass boundary (sent whole: ``undone`` covers its probes); a
worker started again after a failure, which gets the consumer's source as it
is then (NOTE [ Replacing a worker ]). A class with its own ``__setstate__``
is sent its whole state at a change: its workers keep theirs of what the
consumer's own state withheld.
``kerasfeed.item_rng()`` draws per item, in any process, with none of this.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import sys
from typing import Any, Iterator, Optional

import numpy as np

_ABSENT = object()
DATA = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, np.ndarray, np.generic)


def per_process(name: str) -> bool:
    """Whether attribute ``name`` may be state each process makes for itself: underscored, not a dunder nor
    kerasfeed's own bookkeeping (``_kf_``)."""
    return name.startswith("_") and not name.startswith(("__", "_kf_"))


_GENERATORS = (np.random.Generator, np.random.RandomState, np.random.BitGenerator, random.Random)


def generator(value: Any) -> bool:
    """A random generator: numpy's, ``random.Random``, torch's (its state moves with every draw)."""
    torch = sys.modules.get("torch")
    return isinstance(value, _GENERATORS) or (torch is not None and isinstance(value, torch.Generator))


def _holds_generator(value: Any, depth: int = 2) -> bool:
    """A generator, or one held a level or two down: ``{"rng": default_rng()}``, an augmenter object's ``self.rng``
    (at most 64 values a level)."""
    if generator(value):
        return True
    if depth == 0 or isinstance(value, (str, bytes, np.ndarray, np.generic)):
        return False
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (
        getattr(value, "__dict__", None) or {}).values()
    return len(inner) <= 64 and any(_holds_generator(v, depth - 1) for v in inner)


def made_for_itself(value: Any, picklable: Optional[bool] = None) -> bool:
    """Whether ``value``, set from None, is state a process makes for itself: a random generator (or what holds
    one, ``_holds_generator``), or an object that cannot be pickled (a file, a lock, a connection).
    ``picklable``: known already (else tried)."""
    if value is None:
        return False
    if _holds_generator(value):
        return True
    if isinstance(value, DATA):
        return False
    if picklable is None:
        try:
            pickle.dumps(value)
            picklable = True
        except Exception:  # noqa: BLE001 - what cannot be pickled: each process's own
            picklable = False
    return not picklable


def _slots(source: Any) -> list:
    return [n for c in type(source).__mro__ for n in getattr(c, "__slots__", ()) if isinstance(n, str)
            and n not in ("__dict__", "__weakref__")]


@contextlib.contextmanager
def undone(source: Any) -> Iterator[None]:
    """Within it, kerasfeed runs items of ``source`` in this process before its workers start; on the way out,
    if the calls set an attribute (``__slots__`` too) from None to such state (``made_for_itself``), every
    attribute they set anew is as it was (removed if they added it): a flag set beside it (``self._ready``)
    stays consistent with it (the NOTE).

    Example:

    ```python
    with undone(seq):
        seq[0]  # may set seq._rng = default_rng()
    # seq._rng is None again: each worker makes its own
    ```
    """
    names = _slots(source)
    space = getattr(source, "__dict__", None)
    before = {n: getattr(source, n, _ABSENT) for n in names}
    before.update(space if isinstance(space, dict) else {})
    try:
        yield
    finally:
        changed = {}
        for name in [*names, *(space if isinstance(space, dict) else ())]:
            was, now = before.get(name, _ABSENT), getattr(source, name, _ABSENT)
            if now is not was and not name.startswith("_kf_"):
                changed[name] = (was, now)
        if any((was is None or was is _ABSENT) and made_for_itself(now) for was, now in changed.values()):
            for name, (was, _) in changed.items():
                if was is _ABSENT:
                    delattr(source, name)
                else:
                    setattr(source, name, was)


__all__ = ["DATA", "generator", "made_for_itself", "per_process", "undone"]
