"""Handing small items to tf.data in groups: one Python call for several items (TF-free).

Every ``tf.numpy_function`` call costs the consumer process a fixed amount of
CPU (the GIL, the call's machinery, waking tf.data's threads) whatever the
item's size: 0.25-0.4 ms per call measured on 2 cores, taken under
``model.fit`` from the training loop's own Python, which holds the GIL for
most of every step. For small items (a latency-bound source returning a few
KB) that is most of the consumer's cost, so ``to_dataset`` loads several
consecutive items per call, stacks them, and lets tf.data split them again in
C++ (``unbatch``). Large items are not grouped: stacking would copy every
byte. A group only takes items that are ready (NOTE [ Groups are a transport
detail ]), so no item waits for a later one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from kerasfeed.sampling.views import as_view

# Items whose arrays take at most this many bytes in all are grouped...
GROUP_ITEM_BYTES = 64 * 2**10
# ... up to this many per call, and at most GROUP_BYTES per call (the stacked copy is made once per group).
# 64 rather than 16 items of a few KB cut tf.data's threads' CPU per item by ~30 % at a fixed pace
# (docs/performance.md, *Changed (larger groups)*).
MAX_GROUP = 64
GROUP_BYTES = 2**20
# Passes of one dataset a group loader keeps track of at once (see ``_PassGroups.begin``).
MAX_OPEN_PASSES = 8


def auto_group_size(item_bytes: int, stackable: bool) -> int:
    """Items per call for items of ``item_bytes`` (1: no grouping)."""
    if not stackable or item_bytes > GROUP_ITEM_BYTES:
        return 1
    return max(2, min(MAX_GROUP, GROUP_BYTES // max(int(item_bytes), 1)))


def stack_flat(items: Sequence[list], open_leading: Optional[Sequence[bool]] = None) -> list:
    """``[[a0, b0], [a1, b1], ...]`` -> ``[stack(a), stack(b)]``.

    Leaves whose leading dimension varies (``open_leading[j]``: the batch
    dimension of items that are batches) are concatenated along it instead,
    and one more array is appended: their lengths, shape ``(items, open leaves)``.
    """
    columns = list(zip(*items))
    if not open_leading or not any(open_leading):
        return [np.stack(column) for column in columns]
    out, lengths = [], []
    for column, is_open in zip(columns, open_leading):
        if is_open:
            out.append(np.concatenate(column))
            lengths.append([len(a) for a in column])
        else:
            out.append(np.stack(column))
    out.append(np.asarray(lengths, dtype=np.int64).T.reshape(len(items), len(lengths)))
    return out


class _PassGroups:
    """Hands a pass's items over in groups: consecutive items, at most
    ``group`` per call, taken as they come ready.

    NOTE [ Groups are a transport detail ]
    A group must never hold an item back: every item is handed over as soon
    as it and every item before it are made, and an error or a stuck item
    touches only itself and what comes after it. So a call waits for its
    first item only; a later item joins only if the executor has it made
    already (``ready``: a non-blocking look at its handle, ~1 us). The first
    item not ready ends the group; the next call starts with it. An item whose
    load raises ends the group before it; the next call raises its error at
    the item's own position, and the pass goes on after it. While the
    consumer is the bottleneck (the case grouping is for: ``model.fit`` on
    small items), the executor is ahead and groups stay full; otherwise
    groups shrink to what is ready and nothing waits.

    The loader keeps each pass's position itself: ``begin`` records its order,
    each ``load(epoch)`` continues it, and a call that finds the pass exhausted
    returns zero items (tf.data stops there).

    Not thread-safe: ``to_dataset`` calls it from a sequential map only.

    Args:
        begin: ``() -> (indices, epoch)`` of the pass that starts (indices: an
            ``IndexView`` or any sequence).
        load_one: ``(index, epoch) -> (list of arrays, last)`` for one item,
            ``last`` telling whether it is the pass's last item to load
            (``PassPipeline.take``).
        ready: ``(index, epoch) -> bool``: ``load_one`` would not wait.
        open_leading: per leaf, whether its leading dimension varies.
        group: items per call at most.
        empty: per leaf, a zero-item array of the right dtype and rank.
        end_pass: called once the pass's last item to load is stacked (None:
            nothing to call): the source's ``on_epoch_end`` may change arrays
            that items of the group view, so it runs only once they are copied.
    """

    def __init__(self, begin: Callable, load_one: Callable, ready: Callable, open_leading: Sequence[bool], group: int,
                 empty: list, end_pass: Optional[Callable[[int], None]] = None):
        self._begin = begin
        self._load_one = load_one
        self._end_pass = end_pass
        self._ready = ready
        self._open = list(open_leading)
        self._group = int(group)
        self._empty = empty
        # ticket (NOTE [ A pass begun again ]) -> [order, next position, held (index, arrays or error)]
        self._passes: dict[int, list] = {}

    def begin(self) -> np.int64:
        indices, ticket = self._begin()
        ticket = int(ticket)
        # The pass's order stays a lazy view: read a position at a time (from its cached chunk).
        self._passes[ticket] = [as_view(indices), 0, None]
        # Passes may be read at once (``zip(ds, ds)``); one no longer read (an iterator deleted
        # mid-pass) is forgotten once enough newer ones began (the oldest begun first).
        while len(self._passes) > MAX_OPEN_PASSES:
            del self._passes[next(iter(self._passes))]
        return np.int64(ticket)

    def _joins(self, items: list, value: list) -> bool:
        """Whether ``value`` may join the group ``items`` (not empty)."""
        return True

    def _stack(self, items: list) -> list:
        raise NotImplementedError

    def load(self, ticket: Any) -> list:
        """The next group of the pass begun as ``ticket``, stacked per leaf; zero items at its end."""
        ticket = int(ticket)
        state = self._passes.get(ticket)
        items: list = []
        ended = False  # the pass's last item to load is in this group
        while state is not None and len(items) < self._group:
            order, position, held = state
            last = False
            if held is not None:
                state[2] = None
                index, value, last = held
            elif position < len(order):
                index = int(order[position])
                if items and not self._ready(index, ticket):
                    break  # never wait for a later item with earlier ones in hand
                state[1] = position + 1
                try:
                    value, last = self._load_one(index, ticket)
                except Exception as e:  # noqa: BLE001 - raised by the call that reaches its position
                    value = e
            else:
                break
            if isinstance(value, BaseException):
                if items:
                    state[2] = (index, value, False)
                    break
                raise value
            if items and not self._joins(items, value):
                state[2] = (index, value, last)  # starts the next group
                break
            items.append(value)
            ended = ended or last
        if not items:
            self._passes.pop(ticket, None)
            return list(self._empty)
        stacked = self._stack(items)  # copies: no array of it views the source any more
        if ended and self._end_pass is not None:
            self._end_pass(ticket)
        return stacked


class RunLoader(_PassGroups):
    """Groups stacked dense: *runs* of items whose open leaves have the same
    leading lengths (items with no open leaf always do).

    Items that are batches keep their batch dimension open (a short batch may
    come anywhere), but mostly every batch but the last has the same size: a
    run of those stacks into one dense array per leaf, which tf.data splits
    with a plain ``unbatch``. Splitting ragged rows instead costs ~15-30 us of
    tf.data CPU per item (decoding each row, then a map to say it is dense),
    taken under ``model.fit`` from the training step (docs/performance.md). An
    item whose lengths differ from the run's starts the next call's run;
    nothing is reloaded or dropped. See ``_PassGroups`` for the rest.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._opened = [j for j, is_open in enumerate(self._open) if is_open]
        self._run_lengths: list = []  # the open leaves' lengths of the run being stacked

    def _joins(self, items: list, value: list) -> bool:
        if not self._opened:  # no open leaf: any item stacks with any other
            return True
        if len(items) == 1:  # a new run: its lengths once, not once per item
            first = items[0]
            self._run_lengths = [len(first[j]) for j in self._opened]
        return [len(value[j]) for j in self._opened] == self._run_lengths

    def _stack(self, items: list) -> list:
        return [np.stack(column) for column in zip(*items)]


class GroupLoader(_PassGroups):
    """Groups of batches whose size varies throughout: the open leaves are
    concatenated along their leading dimension, with one more array, the
    lengths (``stack_flat``), and tf.data splits them back as ragged rows.
    See ``_PassGroups`` for the rest; ``empty`` holds the lengths array too.
    """

    def _stack(self, items: list) -> list:
        return stack_flat(items, self._open)


__all__ = [
    "GROUP_BYTES", "GROUP_ITEM_BYTES", "MAX_GROUP", "MAX_OPEN_PASSES", "GroupLoader", "RunLoader",
    "auto_group_size", "stack_flat",
]
