"""A loader's passes as Python iterators, and Keras' model-build replay.

Every ``iter(loader)`` gives a ``PassIterator``; the pass it reads starts
(epoch hooks, the executor's plan) on its first ``next``. Keras builds an
unbuilt model under JAX and PyTorch from one batch of a throwaway iterator,
then resets its epoch iterator: the pass that iterator opened is then taken
over by the next one, which yields that first batch again, so epoch ``k`` of
``fit`` reads pass ``k`` (``Loader.on_epoch_end`` decides when).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from kerasfeed.loader.loader import Loader


class Pass:
    """One pass being read: its order, how far it was read, its first batch.

    The first batch is kept while it is the only one read, so that a pass
    Keras opened only to build the model can be read again from the start.
    """

    __slots__ = ("epoch", "indices", "batches", "position", "first", "reader")

    def __init__(self, epoch: int, indices: np.ndarray, batches: int, reader: int):
        self.epoch = epoch
        self.indices = indices
        self.batches = batches
        self.position = 0  # batches of this pass delivered
        self.first: Any = None
        self.reader = reader  # id of the iterator reading it


class PassIterator:
    """Iterates one pass; the pass starts (hooks, executor plan) on the first ``next``."""

    def __init__(self, loader: "Loader", ident: int, adopted: Optional[Pass]):
        self._loader = loader
        self._id = ident
        self._pass = adopted
        self._replay = adopted is not None
        self._done = False

    def __iter__(self) -> "PassIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        loader = self._loader
        p = self._pass
        if p is None:
            p = self._pass = loader._begin(self._id)
        elif p.reader != self._id:
            raise RuntimeError(
                "kerasfeed: this loader iterator was superseded: a newer iterator took over its pass "
                f"(pass {p.epoch}). Iterate the newest one. Received: a call to next() on the older iterator."
            )
        loader._continue(p)
        if self._replay:
            self._replay = False
            return p.first
        if p.position >= p.batches:
            self._done = True
            p.first = None  # read to its end: never taken over (a one-batch pass included)
            raise StopIteration
        batch = loader._read(p)
        p.position += 1
        p.first = batch if p.position == 1 else None
        return batch


__all__ = ["Pass", "PassIterator"]
