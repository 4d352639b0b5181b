"""A pass's item indices as a lazy view, computed window by window (TF-free).

The front ends and executors never hold a whole pass: they read its indices a window of positions at a
time, ahead of the consumer. An ``IndexView`` is what they read from: ``len(view)``,
``view.window(start, stop)`` (an int64 array), ``view[p]`` (an int), ``view[a:b]`` (a lazy sub-view),
iteration.

- ``pass_view(order, epoch)``: the view of one pass of an order. An order with ``at(epoch, positions)``
  (every built-in order) is computed per window; any other order's ``indices(epoch)`` array is wrapped
  as it is.
- ``as_view(indices)``: any sequence or array of indices as a view (what ``Executor.plan`` accepts).

NOTE [ Windows are cached in aligned chunks ]
Consumers read a pass mostly in order, a few positions at a time (a batch, an item, a plan's next
request). Computing a window costs a fixed numpy overhead per call (tens of microseconds for a shuffled
order), so a view computes ``CHUNK`` aligned positions at once and keeps the last two chunks: a read
inside them costs a dict lookup. Larger windows are computed directly. Memory: two chunks (64 KB) per
view, whatever the pass length.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Optional

import numpy as np

CHUNK = 4096


class IndexView:
    """The item indices of one pass, computed when asked (see the module docs).

    Subclasses implement ``_compute(start, stop)`` (positions ``start`` to ``stop`` of the view,
    ``0 <= start <= stop <= len``) and may give a ``key`` (equal keys: the same pass; None: compare values).
    """

    def __init__(self, length: int):
        self._length = int(length)
        self._chunks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._length

    @property
    def key(self) -> Optional[tuple]:
        return None

    def _chunk(self, c: int) -> np.ndarray:
        with self._lock:
            chunk = self._chunks.get(c)
        if chunk is None:
            start = c * CHUNK
            chunk = self._compute(start, min(start + CHUNK, self._length))
            chunk.setflags(write=False)
            with self._lock:
                if len(self._chunks) >= 2:
                    self._chunks.pop(next(iter(self._chunks)))
                self._chunks[c] = chunk
        return chunk

    def window(self, start: int, stop: int) -> np.ndarray:
        """The int64 indices at positions ``start`` to ``stop`` (clipped to the view)."""
        start, stop = max(0, int(start)), min(int(stop), self._length)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        if stop - start > CHUNK:
            return self._compute(start, stop)
        first, last = start // CHUNK, (stop - 1) // CHUNK
        if first == last:
            return self._chunk(first)[start - first * CHUNK : stop - first * CHUNK]
        head = self._chunk(first)[start - first * CHUNK :]
        return np.concatenate([head, self._chunk(last)[: stop - last * CHUNK]])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._length)
            if step != 1:
                raise ValueError(f"An IndexView slices with step 1 only. Received: step={step}")
            if start == 0 and stop >= self._length:
                return self  # the whole pass: the same view (and the same key)
            return SliceView(self, start, max(start, stop))
        c, p = divmod(self._position(key), CHUNK)
        return int(self._chunk(c)[p])

    def _position(self, key: Any) -> int:
        p = int(key)
        if p < 0:
            p += self._length
        if not 0 <= p < self._length:
            raise IndexError(f"position {int(key)} is out of range for a pass of {self._length} indices.")
        return p

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self._length, CHUNK):
            yield from self.window(start, start + CHUNK).tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self._length, dtype=np.int64)
        for start in range(0, self._length, 1 << 20):
            out[start : start + (1 << 20)] = self.window(start, start + (1 << 20))
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list:
        return list(self)

    def same_pass(self, other: Any) -> bool:
        """Whether ``other`` holds the same indices (by key when both have one)."""
        if other is self:
            return True
        other = as_view(other)
        if len(other) != self._length:
            return False
        if self.key is not None and other.key is not None:
            return self.key == other.key
        return all(np.array_equal(self.window(s, s + CHUNK), other.window(s, s + CHUNK))
                   for s in range(0, self._length, CHUNK))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_chunks"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        head = self.window(0, 5).tolist()
        return f"<{type(self).__name__} of {self._length} indices: {head}{' ...' if self._length > 5 else ''}>"


class ArrayView(IndexView):
    """Indices held in an array (a user's order, a short list)."""

    def __init__(self, indices: Any):
        a = np.asarray(indices)
        if a.ndim != 1:
            a = a.reshape(-1)
        self._array = a.astype(np.int64, copy=False)
        super().__init__(len(self._array))

    def _compute(self, start: int, stop: int) -> np.ndarray:
        return self._array[start:stop]

    def window(self, start: int, stop: int) -> np.ndarray:
        return self._array[max(0, int(start)) : int(stop)]  # a view of the array: no chunks needed


class RangeView(IndexView):
    """``start, start + step, ...``: ``length`` indices by arithmetic."""

    def __init__(self, start: int, step: int, length: int):
        super().__init__(length)
        self.start, self.step = int(start), int(step)

    @property
    def key(self) -> tuple:
        return ("range", self.start, self.step, self._length)

    def _compute(self, start: int, stop: int) -> np.ndarray:
        return self.start + self.step * np.arange(start, stop, dtype=np.int64)


class OrderView(IndexView):
    """Pass ``epoch`` of an order with ``at(epoch, positions)``: computed per window."""

    def __init__(self, order: Any, epoch: int, length: int):
        super().__init__(length)
        self.order, self.epoch = order, int(epoch)

    @property
    def key(self) -> tuple:
        return ("order", id(self.order), self.epoch, self._length)

    def _compute(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.order.at(self.epoch, np.arange(start, stop, dtype=np.int64)), dtype=np.int64)


class SliceView(IndexView):
    """Positions ``start`` to ``stop`` of another view (reads go to its chunks)."""

    def __init__(self, parent: IndexView, start: int, stop: int):
        if isinstance(parent, SliceView):
            parent, start, stop = parent.parent, parent.start + start, parent.start + stop
        super().__init__(stop - start)
        self.parent, self.start = parent, int(start)

    @property
    def key(self) -> Optional[tuple]:
        parent = self.parent.key
        return None if parent is None else ("slice", parent, self.start, self._length)

    def _compute(self, start: int, stop: int) -> np.ndarray:
        return self.parent.window(self.start + start, self.start + stop)

    def window(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, int(start)), min(int(stop), self._length)
        return self.parent.window(self.start + start, self.start + max(start, stop))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return super().__getitem__(key)
        return self.parent[self.start + self._position(key)]


def as_view(indices: Any) -> IndexView:
    """``indices`` as an ``IndexView`` (a view is returned as it is)."""
    if isinstance(indices, IndexView):
        return indices
    if isinstance(indices, range):
        return RangeView(indices.start, indices.step, len(indices))
    return ArrayView(indices)


def pass_view(order: Any, epoch: int) -> IndexView:
    """The indices of pass ``epoch`` of ``order`` as a view (see the module docs)."""
    if callable(getattr(order, "at", None)):
        return OrderView(order, epoch, int(order.shard_length))
    return ArrayView(order.indices(epoch))


def check_positions(positions: Any, length: int, owner: str) -> np.ndarray:
    """``positions`` as a 1-D int64 array, each in ``[0, length)``.

    Raises:
        TypeError: a position that is not an integer (a float, a string, a bool).
        IndexError: a position outside ``[0, length)``.
    """
    try:
        a = np.asarray(positions)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nests, ...
        raise TypeError(f"{owner}.at: `positions` must be integers. Received: positions={_short(positions)}") from e
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)  # [] is a float64 array: nothing asked
    if a.dtype.kind == "O":  # Python ints past int64 (2**64), or mixed objects
        values = a.reshape(-1).tolist()
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in values):
            raise TypeError(f"{owner}.at: `positions` must be integers. Received: positions={_short(positions)}")
        low, high = min(int(x) for x in values), max(int(x) for x in values)
    elif a.dtype.kind in "iu":
        low, high = int(a.min()), int(a.max())
    else:
        raise TypeError(
            f"{owner}.at: `positions` must be integers (a float or string position is not read as one). "
            f"Received: positions={_short(positions)}"
        )
    if low < 0 or high >= length:
        raise IndexError(
            f"{owner}.at: positions must be in [0, {length}) (the shard's pass length). "
            f"Received: position {low if low < 0 else high}"
        )
    return a.reshape(-1).astype(np.int64, copy=False)


def _short(value: Any) -> str:
    # A short repr for ``Received:`` (a window can hold thousands of positions).
    try:
        a = np.asarray(value, dtype=object).reshape(-1)
    except (TypeError, ValueError):
        return repr(value)[:200]
    return repr(value) if a.size <= 8 else f"{type(value).__name__} of {a.size}: {a[:8].tolist()!r} ..."


def indices_by_windows(at: Callable[[int, np.ndarray], np.ndarray], epoch: int, length: int) -> np.ndarray:
    """A whole pass from ``at(epoch, positions)``, a large window at a time (whose temporaries are all the
    extra memory used)."""
    out = np.empty(int(length), dtype=np.int64)
    step = 1 << 20
    for start in range(0, int(length), step):
        stop = min(start + step, int(length))
        out[start:stop] = at(epoch, np.arange(start, stop, dtype=np.int64))
    return out


__all__ = [
    "CHUNK", "ArrayView", "IndexView", "OrderView", "RangeView", "SliceView",
    "as_view", "check_positions", "indices_by_windows", "pass_view",
]
