"""One item per Python call, in pass order, the pass's position kept here (TF-free).

NOTE [ A sequential map keeps its own position ]
When the executor makes items ahead, ``to_dataset`` picks them up with a
sequential map: its calls come one after another, in pass order. The map then
needs no index per element: ``begin`` records the pass's order (a lazy view,
read a position at a time) and says how many items it has, tf.data repeats
the pass's number that many times, and each ``load(epoch)`` takes the next
position. Feeding the indices through tf.data instead (a window of them per
Python call, split into elements by ``flat_map``: ``index_windows.py``, which
a parallel map still needs) cost the training loop ~70 us of CPU per item
under ``model.fit`` on 2 cores, about what one ``numpy_function`` call per
item costs (docs/performance.md, *Picking up an item*). The group loaders
(``groups.py``) keep their position the same way.

Not thread-safe for one pass: a sequential map calls it from one thread.
Several passes may be read at once (``zip(ds, ds)``), each under its own
number.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kerasfeed.loading.begins import pass_of
from kerasfeed.sampling.views import as_view

# Passes of one dataset read at once, at most (older ones are iterators given up).
MAX_OPEN_PASSES = 8


class PassInOrder:
    """The items of each pass, one per ``load`` call, in the pass's order.

    Args:
        begin: ``() -> (indices, epoch)`` of the pass that starts
            (``PassPipeline.begin``; indices: an ``IndexView`` or any sequence).
        load: ``(index, epoch) -> arrays`` of one item (``PassPipeline.load``
            or ``load_marked``).
    """

    def __init__(self, begin: Callable[[], tuple], load: Callable[[int, int], Any]):
        self._begin = begin
        self._load = load
        self._passes: dict[int, list] = {}  # ticket (NOTE [ A pass begun again ]) -> [order, next position]

    def begin(self) -> tuple[np.int64, np.int64]:
        """Starts the next pass: ``(items in it, ticket)``."""
        indices, ticket = self._begin()
        return self.start(indices, ticket)

    def start(self, indices: Any, ticket: Any) -> tuple[np.int64, np.int64]:
        """Records the pass begun as ``ticket`` (``PassPipeline.begin``'s ``indices``) for ``load``:
        ``(items in it, ticket)``."""
        ticket = int(ticket)
        order = as_view(indices)
        self._passes[ticket] = [order, 0]
        while len(self._passes) > MAX_OPEN_PASSES:  # iterators given up mid-pass, the oldest begun first
            del self._passes[next(iter(self._passes))]
        return np.int64(len(order)), np.int64(ticket)

    def load(self, ticket: Any) -> Any:
        """The next item of the pass begun as ``ticket``. The position moves on before the
        item loads: an item that raises fails alone, the next call goes on."""
        ticket = int(ticket)
        state = self._passes.get(ticket)
        if state is None:
            epoch = pass_of(ticket)
            raise RuntimeError(
                f"kerasfeed: pass {epoch} is no longer read: an iterator of it went on after {MAX_OPEN_PASSES} "
                f"newer passes began, or past its end. Iterate the newest iterator. Received: epoch={epoch}"
            )
        order, position = state
        state[1] = position + 1
        if position + 1 >= len(order):
            del self._passes[ticket]  # its last item: tf.data asks no further
        return self._load(int(order[position]), ticket)


__all__ = ["MAX_OPEN_PASSES", "PassInOrder"]
