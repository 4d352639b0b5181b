"""Reading one batch of a pass (TF-free).

What a batch's arrays share with the source and the workers, by default and
with ``copy=True``: docs/backends.md, *What a batch shares*. With
``batch_size=n`` samples are written straight into one array per leaf
allocated for the batch (``BatchBuilder``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.loader.collate import BatchBuilder, Signature, pack
from kerasfeed.loader.passes import END, Pass


def _fresh(arrays: list) -> list:
    return [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in arrays]


class BatchReader:
    """Loads the items of one batch of a pass and assembles the batch.

    Args:
        load: ``PassPipeline.load``: ``(index, epoch) -> [array per leaf]``,
            or None for an item left out (``max_skipped``).
        signature: what every item must look like.
        batch_size: None (items are batches) or samples per batch.
        padding: one padding value per leaf.
        copy: hand over fresh arrays even when items are whole batches.

    An item left out (``max_skipped``): NOTE [ A skipped item and its batch ]
    in ``kerasfeed/loading/skips.py``.
    """

    def __init__(
        self,
        load: Callable[[int, int], Optional[list]],
        signature: Signature,
        batch_size: Optional[int],
        padding: list,
        copy: bool,
    ):
        self._load = load
        self._signature = signature
        self._batch_size = batch_size
        self._padding = padding
        self._copy = copy
        # With batch_size=None: ``check(index, arrays)`` of each item, or None (Loader.check_batches).
        self.check_item: Optional[Callable[[int, list], None]] = None

    def read(self, p: Pass) -> Any:
        """Batch ``p.position`` of pass ``p``, as a nest of numpy arrays (``END``:
        the pass ended on items left out)."""
        if self._batch_size is None:
            return self._next_item(p)
        load, k = self._load, self._batch_size
        start = p.position * k
        rows = p.indices[start : start + k]
        batch = BatchBuilder(self._signature, len(rows), self._padding)
        for i in rows:
            arrays = load(i, p.ticket)
            if arrays is not None:  # a batch keeps its positions: an item left out is a row less
                batch.add(arrays)
        if p.position + 1 == p.batches:
            # The dropped remainder still passes through the pipeline (as in
            # to_dataset), so the pass ends for the source and the executor.
            for i in p.indices[start + k :]:
                load(i, p.ticket)
        return pack(self._signature.skeleton, batch.finish())

    def _next_item(self, p: Pass) -> Any:
        """The next item of ``p`` not left out (items are batches): each one
        left out moves the pass on by one (``p.skipped``)."""
        while True:
            at = p.position + p.skipped
            if at >= p.batches:
                return END
            index = p.indices[at]
            arrays = self._load(index, p.ticket)
            if arrays is not None:
                break
            p.skipped += 1
        if self.check_item is not None:
            self.check_item(int(index), arrays)
        return pack(self._signature.skeleton, _fresh(arrays) if self._copy else arrays)


__all__ = ["BatchReader"]
