"""Passes read from the item store without a Python call per item: the Python side (TF-free).

NOTE [ A stored pass runs in the graph ]
With ``cache=`` and no ``augment``, a pass whose items were all stored before
it began needs nothing per item but the stored bytes. ``to_dataset`` then
reads it in the graph: ``begin`` (the pass's one ``numpy_function`` call, as
for any pass: its hooks, the executor's empty plan) returns, per item in pass
order, where each leaf lies in the store's data file and its shape; tf.data
slices the leaves out of a tensor that maps the file up to its last record
(a private mapping, ``ItemStore.graph_view``, that ``begin`` returns: TensorFlow takes an aligned
array a ``numpy_function`` returns without a copy, where a tensor the dataset
captured would be copied into the serialized graph at every iterator: 4.7 GB
of RSS for a 1 GB store), and the
elements are views of the store's pages, as those the consumer serves
itself. One ``numpy_function`` call per item cost ~0.11 ms of CPU more than
the slices on 2 cores; the iterator, which Keras makes every epoch, costs
~1.3 ms more to make, so only passes of ``MIN_PASS_ITEMS`` or more are read
this way (``tfdata/stored_items.py``; ``benchmarks/README.md``, *Stored
passes read in the graph*). After the
pass's last item, ``end`` runs what ``load``'s last item would (the source's
``on_epoch_end``, the stats, the hits).

Where each item's leaves lie is learned once per item, the first time a pass
reads it this way: ``ItemStore.get`` and the checker, as ``load`` would, then
the address of each leaf in the mapping. A pass with an item not stored, a
leaf the checker had to copy (a dtype cast, a Python scalar), or an item that
fails the signature goes through ``load`` as before (that item fails there,
with its own error); a copied leaf means every later pass does too, as does a
store whose file the kernel will not map privately (larger than memory).

An iterator dropped mid-pass never reaches ``end``: that pass's items are not
counted in the stats, and its ``on_epoch_end`` does not run (as a pass whose
last item was never loaded).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Optional

import numpy as np

from kerasfeed.errors import SignatureError
from kerasfeed.loading.begins import pass_of

logger = logging.getLogger("kerasfeed")

# Passes begun and not yet ended, at most (older ones are iterators given up). An entry is two numbers: with
# 8, a pass read whole after 8 newer ones began (zip of 9 iterators) lost its on_epoch_end and its counts.
_OPEN_PASSES = 4096
_NO_DATA = np.zeros(0, np.uint8)


class StoredPasses:
    """Each pass's start for ``to_dataset``: read in the graph when every item is stored, else
    item by item through ``in_order`` (NOTE [ A stored pass runs in the graph ]).

    Args:
        pipeline: the ``PassPipeline`` (its ``begin``, ``read_whole``).
        in_order: the ``PassInOrder`` the other passes go through.
        front: the ``CacheFront`` executor (``whole_passes`` true).
        checker: the item signature's checker (``flat_arrays``).
        itemsizes: per leaf, its dtype's size in bytes.
        ranks: per leaf, its rank.
        fixed: per leaf, whether its shape is fully defined (no size and shape columns).
    """

    def __init__(self, pipeline: Any, in_order: Any, front: Any, checker: Any, itemsizes: list, ranks: list,
                 fixed: list):
        self._pipeline, self.in_order, self._front, self._checker = pipeline, in_order, front, checker
        self._store = front.store
        self._itemsizes, self._ranks = [int(s) for s in itemsizes], [int(r) for r in ranks]
        self.fixed = [bool(f) for f in fixed]
        self._lock = threading.Lock()
        self._known: Optional[np.ndarray] = None  # per source index: where its leaves lie is learned
        self._starts: list = []  # per leaf: int64 [n], in elements of its dtype
        self._shapes: list = []  # per leaf: int64 [n, rank] (open leaves only)
        # No pass is read in the graph: a leaf the checker copied, or the store's file could not be mapped.
        self._never = False
        self._open: dict[int, tuple[int, float]] = {}  # ticket (NOTE [ A pass begun again ]) -> (items, began)
        self._data: Optional[np.ndarray] = None  # the store's file for TensorFlow (``_mapped``)
        # Dropped when the store closes: a dataset that outlives its pipeline keeps none of the store mapped.
        self._store.on_close(_Unmap(self))
        # Each column's row shape (``_columns``): per leaf its start, and for an open leaf its size and shape.
        self.column_shapes: list = []
        for fixed, rank in zip(self.fixed, self._ranks):
            self.column_shapes += [[1]] + ([] if fixed else [[1], [rank]])
        self._none = [np.zeros([0] + shape, np.int64) for shape in self.column_shapes]  # a pass through ``load``

    # ------------------------------------------------------------ passes
    def begin(self) -> list:
        """Starts the next pass: ``[items through load, epoch, items read in the graph, data,
        *columns]``. One of the counts is 0. ``data``: the store's data file as uint8 (handed to
        TensorFlow without a copy: a ``numpy_function`` output that is an aligned array), empty
        for a pass through ``load``. The columns, per leaf: starts ``[m, 1]`` (in elements of
        its dtype), and for an open leaf sizes ``[m, 1]`` and shapes ``[m, rank]``."""
        indices, ticket = self._pipeline.begin()
        ticket = int(ticket)
        order = self._readable(pass_of(ticket), indices)
        data = None if order is None else self._mapped()
        if data is None:
            count, ticket_ = self.in_order.start(indices, ticket)
            return [count, ticket_, np.int64(0), _NO_DATA] + self._none
        with self._lock:
            self._open[ticket] = (len(order), time.perf_counter())
            while len(self._open) > _OPEN_PASSES:  # the oldest begun first
                del self._open[next(iter(self._open))]
        return [np.int64(0), np.int64(ticket), np.int64(len(order)), data] + self._columns(order)

    def end(self, ticket: Any) -> np.int64:
        """The items of the pass begun as ``ticket`` were all read in the graph (after its last one)."""
        with self._lock:
            opened = self._open.pop(int(ticket), None)
        if opened is not None:
            count, first = opened
            self._front.served(count)
            self._pipeline.read_whole(int(ticket), count, first, time.perf_counter())
        return np.int64(0)

    # ------------------------------------------------------------ where items lie
    def _readable(self, epoch: int, indices: Any) -> Optional[np.ndarray]:
        """The pass's order (int64) when it can be read in the graph, else None."""
        cut = self._front.all_stored(epoch)
        if cut is None or self._never:
            return None
        n = len(indices)
        order = np.asarray(indices.window(0, n) if hasattr(indices, "window") else indices, np.int64)
        with self._lock:
            if self._known is None:
                self._allocate()
            unknown = order[~self._known[order]]
            for index in np.unique(unknown).tolist():
                if not self._learn(index, cut):
                    return None
        return order

    def _mapped(self) -> Optional[np.ndarray]:
        """The store's file up to every record stored so far (``ItemStore.graph_view``), mapped
        again only when the store has grown past it; None when the kernel refuses the mapping."""
        capacity = self._store.capacity - self._store.capacity % 64
        length = min(capacity, -(-self._store.figures()["used"] // 64) * 64)
        with self._lock:
            if self._store.closed:  # checked under the lock ``_Unmap`` takes: nothing mapped after it
                return None
            if self._data is None or len(self._data) < length:
                try:
                    self._data = self._store.graph_view(length)
                except OSError as e:
                    logger.info("kerasfeed cache: passes are read item by item, not in the graph: mapping %d "
                                "bytes of the item store failed (%s)", length, e)
                    self._never, self._data = True, None
            return self._data

    def _allocate(self) -> None:
        n = self._store.n
        self._known = np.zeros(n, bool)
        self._starts = [np.zeros(n, np.int64) for _ in self.fixed]
        self._shapes = [None if f else np.zeros((n, r), np.int64) for f, r in zip(self.fixed, self._ranks)]

    def _learn(self, index: int, cut: int) -> bool:
        """Records where item ``index``'s leaves lie; False when it cannot be read in the graph."""
        item = self._store.get(index, cut)
        if item is None:
            return False
        try:
            arrays = self._checker.flat_arrays(index, item)
        except SignatureError:  # ``load`` raises it, in the item's place
            return False
        starts = []
        for k, a in enumerate(arrays):
            at = 0 if isinstance(a, np.ndarray) and a.nbytes == 0 else self._store.locate(a)
            if at is None or at % self._itemsizes[k]:
                self._never = True  # the checker copied it: so it will for the other items
                return False
            starts.append(at // self._itemsizes[k])
        for k, (a, at) in enumerate(zip(arrays, starts)):
            self._starts[k][index] = at
            if self._shapes[k] is not None:
                self._shapes[k][index] = a.shape
        self._known[index] = True
        return True

    def _columns(self, order: np.ndarray) -> list:
        out = []
        for k, fixed in enumerate(self.fixed):
            out.append(self._starts[k][order].reshape(-1, 1))
            if not fixed:
                shapes = self._shapes[k][order]
                out += [np.prod(shapes, axis=1, dtype=np.int64).reshape(-1, 1), shapes]
        return out

    def _unmap(self) -> None:
        with self._lock:
            self._data = None


class _Unmap:
    """The store's close callback: drops ``StoredPasses``' mapping (a weak reference: the store must
    not keep the passes alive)."""

    __slots__ = ("passes",)

    def __init__(self, passes: StoredPasses):
        self.passes = weakref.ref(passes)

    def __call__(self) -> None:
        passes = self.passes()
        if passes is not None:
            passes._unmap()


__all__ = ["StoredPasses"]
