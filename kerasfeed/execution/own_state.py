"""State a source makes for itself on first use, kept in the process that made it (TF-free).

NOTE [ State each process makes for itself ]
A source often makes per-process state on first use, under an attribute that
was None or not set: ``if self._rng is None: self._rng = default_rng()``, a
file, a connection. Worker processes each make their own, unless they are sent
the consumer's: then every worker holds the same generator and draws the same
numbers (a helper's review: 12 distinct draws of 24 items, silently). The
consumer runs items too:

- kerasfeed's own calls before the workers start: ``executor="auto"``'s timing
  probe and, with ``cache=``, the check of a class's own ``__getitem__``
  (``cached_split.py``). ``undone`` runs them and then sets what they set
  from None back to None (or removes what they added), so the workers start
  from the source as the user left it, as with any other executor. The
  consumer makes its own again if it needs it.
- the user's ``seq[i]`` between passes. At a pass boundary the state tracker
  (``state_sync.py``) does not send an underscored attribute that was None
  (or not set) in the workers' copy and was set outside the epoch hooks, nor
  its later changes outside them; one the hooks set (``before_hook`` ..
  ``after_hook``) is sent as any change. A public attribute set from None is
  sent: a setting the user gives the workers between passes
  (``seq.augmenter = Flip()``).

Not covered: state made in the consumer before the loader is built (it is in
the source the workers are given, as PyTorch's workers get it), and a worker
started again after a failure, which gets the consumer's source as it is then
(NOTE [ Replacing a worker ]). ``kerasfeed.item_rng()`` draws per item, in any
process, with none of this.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_ABSENT = object()


def per_process(name: str) -> bool:
    """Whether attribute ``name`` may be state each process makes for itself: underscored, not a dunder nor
    kerasfeed's own bookkeeping (``_kf_``)."""
    return name.startswith("_") and not name.startswith(("__", "_kf_"))


@contextlib.contextmanager
def undone(source: Any) -> Iterator[None]:
    """Within it, kerasfeed runs items of ``source`` in this process before its workers start; on the way out,
    every attribute the calls set from None is None again, every one they added is removed (the NOTE).

    Example:

    ```python
    with undone(seq):
        seq[0]  # may set seq._rng = default_rng()
    # seq._rng is None again: each worker makes its own
    ```
    """
    space = getattr(source, "__dict__", None)
    before = dict(space) if isinstance(space, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for name in list(space):
                was = before.get(name, _ABSENT)
                if (was is None or was is _ABSENT) and space[name] is not was and not name.startswith("_kf_"):
                    if was is None:
                        space[name] = None
                    else:
                        del space[name]


__all__ = ["per_process", "undone"]
