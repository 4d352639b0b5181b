"""The arithmetic of a mix (``kerasfeed.mix``): which part and item every element is (TF-free).

``MixCore`` is shared by ``Mix`` (``mix.py``) and ``MixedSequence``
(``mixseq.py``, a ``SceneSequence``); both sit above this module.
"""

from __future__ import annotations

import heapq
import math
import warnings
from fractions import Fraction
from typing import Any

import numpy as np

from kerasfeed import _validation as v
from kerasfeed._nest import KERAS_NAMES
from kerasfeed.sources.base import set_epoch, source_length

# Float weights are turned into whole slots of a block this long at most.
MAX_PERIOD = 10_000


class MixCore:
    # A memo of block permutations, filled as items are read: no setting (the cache's between-pass check).
    cache_ignores = ("_blocks",)
    """The arithmetic of a mix; ``Mix`` and ``MixedSequence`` share it."""

    def _init_mix(self, parts: list, weights: Any, seed: Any, check: Any) -> None:
        lengths = []
        for k, part in enumerate(parts):
            try:
                lengths.append(source_length(part))
            except (TypeError, ValueError) as e:
                raise type(e)(f"mix: part {k}: {e}") from e
        if weights is None:
            weights = [1] * len(parts)
        w = v.weights("weights", weights, owner="mix")
        if len(w) != len(parts):
            raise ValueError(
                f"mix: `weights` needs one weight per part ({len(parts)} parts). Received: weights={list(weights)!r}"
            )
        self.parts = parts
        self.seed = v.seed("seed", seed, owner="mix")
        self.slots = _whole_slots(w)  # slots of part k per block
        self.period = int(self.slots.sum())
        self._pattern, self._rank = _interleave(self.slots)
        used = self.slots > 0
        blocks = min(n // s for n, s in zip(np.asarray(lengths)[used], self.slots[used]))
        self.full_blocks = int(blocks)
        # The last, partial block: the longest prefix of the pattern whose parts still have items.
        left = np.asarray(lengths) - blocks * self.slots
        taken = np.zeros(len(parts), dtype=np.int64)
        for k in self._pattern.tolist():
            if taken[k] == left[k]:
                break
            taken[k] += 1
        self.tail = int(taken.sum())
        self._length = self.full_blocks * self.period + self.tail
        self.part_lengths = tuple(int(n) for n in lengths)
        self._blocks: dict = {}
        if v.flag("check", check, owner="mix"):
            _check_structures(parts)

    @property
    def wrapped_sources(self) -> tuple:
        """The parts, which the mix's epoch hooks reach (``has_own_epoch_hooks``)."""
        return tuple(self.parts)

    @property
    def proportions(self) -> np.ndarray:
        """The share of every part in a whole block."""
        return self.slots / self.period

    def __len__(self) -> int:
        return self._length

    def locate(self, index: int) -> tuple[int, int]:
        """``(part, index in that part)`` of element ``index``."""
        n = self._length
        i = v.sequence_index(index, n, "mix", lambda: f"mix: index {int(index)} is out of range for {n} elements.")
        block, slot = divmod(i, self.period)
        if self.seed is not None:
            slot = int(self._block_order(block)[slot])
        part = int(self._pattern[slot])
        return part, block * int(self.slots[part]) + int(self._rank[slot])

    def __getitem__(self, index: int) -> Any:
        part, j = self.locate(index)
        return self.parts[part][j]

    def _block_order(self, block: int) -> np.ndarray:
        order = self._blocks.get(block)
        if order is None:
            size = self.period if block < self.full_blocks else self.tail
            order = np.random.default_rng([self.seed, 15, block]).permutation(size)
            if len(self._blocks) >= 8:
                self._blocks.clear()
            self._blocks[block] = order
        return order

    # Epoch hooks reach every part, in this process and in worker copies.
    def set_epoch(self, epoch: int) -> None:
        parent = getattr(super(), "set_epoch", None)
        if parent is not None:
            parent(epoch)
        for part in self.parts:
            set_epoch(part, epoch)

    def on_epoch_begin(self) -> None:
        self._call_hooks("on_epoch_begin")

    def on_epoch_end(self) -> None:
        self._call_hooks("on_epoch_end")

    def _call_hooks(self, name: str) -> None:
        # The next class's hook (SceneSequence's, in a MixedSequence), then every part's.
        parent = getattr(super(), name, None)
        if parent is not None:
            parent()
        for part in self.parts:
            hook = getattr(part, name, None)
            if callable(hook):
                hook()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_blocks"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} of {len(self.parts)} parts, slots per block {self.slots.tolist()}, "
            f"{self._length} elements>"
        )


def _whole_slots(w: np.ndarray) -> np.ndarray:
    """Weights as whole slots per block, in their lowest terms; a share that rounding moves by over 1 % is
    warned about (weights too fine for a block of ``MAX_PERIOD``, or a positive weight raised to one slot)."""
    if np.all(w == np.round(w)) and w.sum() <= MAX_PERIOD:
        slots = w.astype(np.int64)
    else:
        quota = w / w.sum() * MAX_PERIOD
        slots = np.floor(quota).astype(np.int64)
        short = MAX_PERIOD - int(slots.sum())
        slots[np.argsort(slots - quota, kind="stable")[:short]] += 1  # largest remainders
        slots[(slots == 0) & (w > 0)] = 1  # a positive weight keeps at least one slot
        asked, given = w / w.sum(), slots / slots.sum()
        moved = np.where(asked > 0, np.abs(given - asked) / np.where(asked > 0, asked, 1), given > 0)
        k = int(np.argmax(moved))
        if moved[k] > 0.01:
            want = f"{asked[k]:.6g}" if asked[k] > 0 or w[k] == 0 else "a share under float64's smallest number"
            warnings.warn(
                f"mix: the weights are rounded to whole slots of a block of {MAX_PERIOD}, which gives part {k} a "
                f"share of {given[k]:.6g} where the weights ask for {want}. Whole-number weights summing to "
                f"at most {MAX_PERIOD} are used exactly. Received: weights={w.tolist()!r}",
                UserWarning,
                stacklevel=v.caller_stacklevel(),
            )
    g = math.gcd(*slots.tolist())
    return slots // g


def _interleave(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One block: the part of every slot and its rank within that part, so that every prefix of the block
    holds each part's share within less than one item (Tijdeman's chairman assignment: at most
    ``1 - 1/(2n - 2)`` for ``n`` parts; R. Tijdeman, 1980).

    Step ``t`` (1-based) places, among the parts whose next item may come without getting ahead of its
    share by more than ``d = 1 - 1/(2n - 2)``, the one whose item is due first (before the part falls
    behind by more than ``d``); one always may (the shares sum to ``t``). Exact integer and rational
    arithmetic, so the block is the same on every machine.
    """
    sizes = [int(x) for x in slots]
    n, total = len(sizes), sum(sizes)
    used = [k for k, size in enumerate(sizes) if size > 0]
    parts = np.empty(total, np.int32)
    ranks = np.empty(total, np.int64)
    if len(used) == 1:
        parts[:], ranks[:] = used[0], np.arange(total)
        return parts, ranks
    m = 2 * len(used) - 2
    # Item j of part k may come at step ceil((j m + 1) total / (size m)), and is due at (j m + m - 1) total / (size m).
    waiting = [(_release(0, size, m, total), k) for k, size in enumerate(sizes) if size > 0]
    heapq.heapify(waiting)
    ready: list = []
    count = [0] * n
    for t in range(1, total + 1):
        while waiting and waiting[0][0] <= t:
            _, k = heapq.heappop(waiting)
            heapq.heappush(ready, (Fraction(count[k] * m + m - 1, sizes[k]), k))
        _, k = heapq.heappop(ready)
        parts[t - 1], ranks[t - 1] = k, count[k]
        count[k] += 1
        if count[k] < sizes[k]:
            heapq.heappush(waiting, (_release(count[k], sizes[k], m, total), k))
    return parts, ranks


def _release(j: int, size: int, m: int, total: int) -> int:
    return -(-(j * m + 1) * total // (size * m))  # ceil


def _leaves(item: Any, path: str, out: list) -> Any:
    if isinstance(item, dict):
        return {k: _leaves(item[k], f"{path}[{k!r}]", out) for k in sorted(item, key=repr)}
    if isinstance(item, (tuple, list)):
        # Field names as in kerasfeed's signature errors: (x, y, sample_weight) at the top.
        keras_names = not path and len(item) <= 3
        return tuple(_leaves(x, KERAS_NAMES[i] if keras_names else f"{path}[{i}]", out) for i, x in enumerate(item))
    a = np.asarray(item)
    out.append((path or "item", a.dtype, a.ndim))
    return None


def _check_structures(parts: list) -> None:
    first: list = []
    skeleton = _leaves(parts[0][0], "", first)
    for k, part in enumerate(parts[1:], start=1):
        leaves: list = []
        other = _leaves(part[0], "", leaves)
        if other != skeleton:
            raise ValueError(
                f"mix: items of part {k} have a different structure from part 0's: part 0 gives "
                f"{_shape_of(skeleton)}, part {k} gives {_shape_of(other)}. Received: part {k} item 0"
            )
        for (name, dt0, nd0), (_, dt, nd) in zip(first, leaves):
            if dt0 != dt or nd0 != nd:
                raise ValueError(
                    f"mix: field {name} of part {k} differs from part 0: part 0 has {dt0} with {nd0} dims, "
                    f"part {k} has {dt} with {nd} dims. Received: part {k} item 0"
                )


def _shape_of(skeleton: Any) -> str:
    if skeleton is None:
        return "an array"
    if isinstance(skeleton, dict):
        return "{" + ", ".join(f"{k!r}: {_shape_of(x)}" for k, x in skeleton.items()) + "}"
    return "(" + ", ".join(_shape_of(x) for x in skeleton) + ")"


__all__ = ["MAX_PERIOD", "MixCore"]
