"""Chunks: how the stream datasets move items from Python into tf.data.

Each call of the pull function takes every item that is ready (up to
``CHUNK_ITEMS`` items or ``CHUNK_BYTES`` bytes), stacks them (variable shapes
zero-padded, true shapes sent alongside), and tf.data unbatches and slices
them back in C++. One Python call per chunk instead of per item keeps the
per-item cost at a few microseconds. Used by ``stream_assembly.py``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from kerasfeed.errors import SignatureError, StreamError
from kerasfeed.streams.options import END, NOT_READY
from kerasfeed.tfdata.exit_guard import exiting
from kerasfeed.tfdata.structure import ItemChecker

CHUNK_ITEMS = 64
CHUNK_BYTES = 8 << 20
# When nothing is ready, the pull returns an empty chunk after this long
# instead of blocking on. A tf.data thread blocked inside a Python function
# cannot be cancelled, so dropping an iterator (a `break`, the end of `fit`)
# would wait for the next item, forever for an idle queue; with heartbeats it
# waits at most this long. The prefetch(2) right after the pull keeps the
# empty chunks in a cancellable tf.data buffer.
HEARTBEAT_S = 0.1


class Label:
    """Names an item in a SignatureError; formatted only when one is raised."""

    __slots__ = ("origin", "describe")

    def __init__(self, origin: Any, describe: Callable[[Any], str]):
        self.origin = origin
        self.describe = describe

    __str__ = __repr__ = lambda self: self.describe(self.origin)  # f"{label}" too (object.__format__)


class ChunkCodec:
    """Checks items against the signature and packs them into chunks."""

    def __init__(self, signature: Any, api: str):
        self.api = api
        self.checker = ItemChecker(signature)
        self.specs = self.checker.specs
        for name, spec in zip(self.checker.names, self.specs):
            if spec.shape.rank is None:
                raise ValueError(
                    f"`output_signature` needs a known rank for every field; field {name} has an "
                    f"unknown rank. Received: {spec}"
                )
        self.variable = [None in s.shape.as_list() for s in self.specs]
        chunk_specs = []
        for spec, var in zip(self.specs, self.variable):
            shape = spec.shape.as_list()
            chunk_specs.append(tf.TensorSpec([None, *shape], spec.dtype))
            if var:
                chunk_specs.append(tf.TensorSpec([None, len(shape)], tf.int64))
        # Without variable shapes the chunks carry the item's own structure, so
        # unbatch alone restores the items (no per-item map).
        self.needs_decode = any(self.variable)
        self.chunk_signature = tuple(chunk_specs) if self.needs_decode else self.checker.pack(chunk_specs)
        self.empty = self.encode([])

    def check(self, item: Any, origin: Any, describe: Callable[[Any], str]) -> list:
        try:
            return self.checker.flat_arrays(Label(origin, describe), item)
        except SignatureError as e:
            raise SignatureError(str(e).replace("to_dataset", self.api)) from None

    def _encode_leaf(self, k: int, col: list) -> tuple:
        spec, variable = self.specs[k], self.variable[k]
        dtype = object if spec.dtype == tf.string else spec.dtype.as_numpy_dtype
        shape = spec.shape.as_list()
        if not col:
            empty = np.zeros((0, *[d or 0 for d in shape]), dtype)
            return (empty, np.zeros((0, len(shape)), np.int64)) if variable else (empty,)
        if not variable:
            return (col[0][None] if len(col) == 1 else np.stack(col),)
        shapes = np.array([a.shape for a in col], np.int64).reshape(len(col), len(shape))
        top = shapes.max(axis=0)
        if (shapes == top).all():
            stacked = col[0][None] if len(col) == 1 else np.stack(col)
        else:
            stacked = np.full((len(col), *top), b"" if dtype is object else 0, dtype)
            for j, a in enumerate(col):
                stacked[(j, *[slice(0, d) for d in a.shape])] = a
        return stacked, shapes

    def grown(self, tops: Optional[list], arrays: list, count: int) -> tuple[list, int]:
        """The variable leaves' largest shapes with ``arrays`` added, and what ``count`` such items take
        stacked: those leaves padded to those shapes (strings and fixed leaves: their own bytes)."""
        grown, nbytes = [], 0
        for k, a in enumerate(arrays):
            top = None if tops is None else tops[k]
            if self.variable[k] and a.dtype != object:
                top = a.shape if top is None else tuple(map(max, top, a.shape))
                nbytes += count * math.prod(top) * a.itemsize
            else:
                nbytes += count * a.nbytes
            grown.append(top)
        return grown, nbytes

    def encode(self, rows: list) -> Any:
        out = []
        for k in range(len(self.specs)):
            out.extend(self._encode_leaf(k, [r[k] for r in rows]))
        return tuple(out) if self.needs_decode else self.checker.pack(out)

    def decode(self, *flat) -> Any:
        """One unbatched element: slices padded leaves to their true shape."""
        leaves, tensors = [], iter(flat)
        for spec, var in zip(self.specs, self.variable):
            x = next(tensors)
            if var:  # its true shape comes next
                shape = next(tensors)
                x = tf.slice(x, tf.zeros_like(shape), shape)
                x.set_shape(spec.shape)
            leaves.append(x)
        return self.checker.pack(leaves)


# NOTE [ Chunks of items of varying shapes ]
# A chunk stacks each variable leaf padded to the largest shape in it, so its size is the items' count times
# that shape, not the items' own bytes: one 6 MB point cloud among 63 of 12 KB made a 384 MB chunk (25-90x
# the documented bound, measured: 784 MB of RSS for 26 MB of data; items of (1000, 10) and (10, 1000): 256 MB
# chunks). An item that would pad its chunk past ``CHUNK_BYTES`` (and past the items' own bytes) starts the
# next chunk instead.


def chunks(
    open_pass: Callable[[], Any],
    codec: ChunkCodec,
    describe: Callable[[Any], str],
    stats: Any = None,
    epoch: int = 0,
    pass_timeout: Optional[float] = None,
    api: str = "",
    waits: Any = None,
):
    """The generator behind ``from_generator``: one pass, in chunks.

    ``stats``: a ``StatsCollector`` that gets each item's pick-up wait.
    ``pass_timeout``: seconds the pass may go without an item before it fails
    (not counted while a worker unpickles a shard's task: ``p.starting()``).
    ``waits``: the source's ``WaitScope``: between heartbeats, a wait for the
    next item sees Ctrl-C, gives up when the last iterator is deleted, and
    gives the stuck-wait notice (``execution/waits.py``)."""
    try:
        p = open_pass()
    except Exception:
        if exiting():  # the exit hook closed the stream's pool: TensorFlow would log the error as a failure
            return
        raise
    awaited = getattr(p, "pending", None)
    starting = getattr(p, "starting", None)

    def waiting_for() -> str:
        return f"{api} (pass {epoch}): " + (awaited() if awaited is not None else f"item {made}")

    wait = None  # begun at the first heartbeat without an item
    quiet_since = time.monotonic()
    made = 0
    if stats is not None:
        stats.pass_begin(epoch)
    blocked = 0.0  # waited in empty heartbeats since the last item
    pending: Optional[BaseException] = None
    carry: Optional[list] = None
    try:
        while True:
            if pending is not None:
                raise pending
            rows, nbytes, tops = [], 0, None
            if carry is not None:  # the item the last chunk left out: it starts this one
                rows, nbytes, tops, carry = [carry], sum(a.nbytes for a in carry), codec.grown(None, carry, 1)[0], None
            ended = False
            timeout = HEARTBEAT_S
            while len(rows) < CHUNK_ITEMS and nbytes < CHUNK_BYTES:
                try:
                    t0 = time.perf_counter() if stats is not None else 0.0
                    r = p.take(timeout)
                    if stats is not None:
                        t1 = time.perf_counter()
                        blocked += t1 - t0
                        if r is not END and r is not NOT_READY:
                            stats.picked(epoch, blocked, t1)
                            blocked = 0.0
                    if r is END:
                        ended = True
                        break
                    if r is NOT_READY:
                        if starting is not None and starting():  # a worker unpickling a task: start-up
                            quiet_since = time.monotonic()
                        if pass_timeout is not None and not rows and time.monotonic() - quiet_since > pass_timeout:
                            raise StreamError(
                                f"{api} (pass {epoch})", "TimeoutError",
                                f"no item for timeout={pass_timeout} s after {made} items; a generator, reader or "
                                f"worker is stuck (waiting for {waiting_for()}). Received: timeout={pass_timeout}",
                                "(none: nothing raised, no item came)\n",
                                None, made,
                            )
                        if waits is not None and not rows:
                            wait = wait or waits.begin()
                            wait.check(waiting_for)
                        break
                    wait = None
                    quiet_since = time.monotonic()
                    made += 1
                    arrays = codec.check(r[0], r[1], describe)
                except Exception as e:
                    if exiting():  # as above: the pass ends with the process
                        return
                    if stats is not None:
                        stats.error()
                    if not rows:
                        raise
                    pending = e
                    break
                size = sum(a.nbytes for a in arrays)
                if codec.needs_decode:  # NOTE [ Chunks of items of varying shapes ]
                    grown, padded = codec.grown(tops, arrays, len(rows) + 1)
                    if rows and padded > max(CHUNK_BYTES, nbytes + size):
                        carry = arrays
                        break
                    tops = grown
                rows.append(arrays)
                nbytes += size
                timeout = 0  # then take only what is ready already
            if rows or not ended:
                yield codec.encode(rows) if rows else codec.empty
            if ended:
                return
    finally:
        p.close()


__all__ = ["ChunkCodec", "Label", "chunks", "CHUNK_ITEMS", "CHUNK_BYTES", "HEARTBEAT_S"]
