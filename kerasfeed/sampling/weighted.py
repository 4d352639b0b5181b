"""Weighted per-pass orders: the sharded, resumable form of a weighted random sampler."""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from kerasfeed import _validation as v
from kerasfeed.sampling.bijection import MAX_N, derive_key, uniforms
from kerasfeed.sampling.fingerprints import ORDER_VERSION_1, hash_parts
from kerasfeed.sampling.views import check_positions, indices_by_windows

# Distinct generator streams, so that no two uses of (seed, pass) share draws.
STREAM_WEIGHTED, STREAM_COUNTS, STREAM_CLASS, STREAM_MIX = 11, 12, 13, 14


class SampledOrder:
    """What the sampled orders share: pass length, seed, shards, per-position passes.

    A subclass defines ``_at(epoch, g)``: the items at positions ``g`` (an array) of a pass over all
    shards, a pure function of ``(seed, epoch, g)``; shard ``k`` takes positions ``k, k + num_shards,
    ...``, cut to ``num_samples // num_shards`` so that all shards have the same length. The few modes
    that cannot be computed per position (draws without replacement in proportion to weights) compute
    their pass whole in ``_pass(epoch)``, cached (the last two passes). ``_fingerprint_parts()``: what
    the fingerprint hashes besides the shared arguments.
    """

    # The algorithm's name in the fingerprint (see fingerprints.ORDER_VERSION).
    _order_version = ORDER_VERSION_1

    def _init_common(
        self, owner: str, length: int, num_samples: Any, seed: Any, num_shards: Any, shard_index: Any
    ) -> None:
        self.length = int(length)
        self.num_samples = v.positive_int("num_samples", num_samples, allow_none=True, owner=owner) or self.length
        self.num_shards = v.positive_int("num_shards", num_shards, owner=owner)
        self.shard_index = v.non_negative_int("shard_index", shard_index, owner=owner)
        if self.num_samples > MAX_N:
            raise ValueError(f"{owner}: `num_samples` must be at most 2^62. Received: num_samples={self.num_samples}")
        if self.num_shards > self.num_samples:
            raise ValueError(
                f"{owner}: `num_shards` must be at most num_samples={self.num_samples} (every shard needs an item "
                f"per pass). Received: num_shards={self.num_shards}"
            )
        if self.shard_index >= self.num_shards:
            raise ValueError(
                f"{owner}: `shard_index` must be in [0, {self.num_shards}). Received: shard_index={self.shard_index}"
            )
        seed = v.seed("seed", seed, owner=owner)
        self.seed_drawn = seed is None  # another process's copy made anew draws another: sources.base
        if seed is None:
            if self.num_shards > 1:
                raise ValueError(
                    f"{owner}: several shards need an explicit `seed` so that they all draw the same passes "
                    f"and stay disjoint. Received: seed=None, num_shards={self.num_shards}"
                )
            seed = int(np.random.SeedSequence().entropy % (2**63))  # fixed for this object
        self.seed = seed
        self._cache: dict = {}
        self._cache_lock = threading.Lock()
        self._fingerprint: Optional[str] = None

    @property
    def shard_length(self) -> int:
        """Number of indices in every pass of this shard."""
        return self.num_samples // self.num_shards

    def at(self, epoch: int, positions: Any) -> np.ndarray:
        """The int64 item indices at ``positions`` (of this shard, in ``[0, shard_length)``) in pass
        ``epoch``: a pure function of ``(seed, epoch, position)`` and the arguments."""
        epoch = v.non_negative_int("epoch", epoch, owner=type(self).__name__)
        g = check_positions(positions, self.shard_length, type(self).__name__)
        if self.num_shards > 1:
            g = g * self.num_shards + self.shard_index
        return self._at(epoch, g)

    def indices(self, epoch: int) -> np.ndarray:
        """The int64 item indices of pass ``epoch`` for this shard (the whole pass: 8 bytes per index; the
        front ends read ``at`` by windows)."""
        epoch = v.non_negative_int("epoch", epoch, owner=type(self).__name__)
        return indices_by_windows(self.at, epoch, self.shard_length)

    @property
    def fingerprint(self) -> str:
        """Identifies the pass sequence over all shards (kept in resume states)."""
        if self._fingerprint is None:
            self._fingerprint = self._hash(self._identity_parts())
        return self._fingerprint

    def _hash(self, parts: tuple) -> str:
        return hash_parts(type(self).__name__, *parts, self.num_samples, self.seed, self.num_shards,
                          self._order_version)

    def _identity_parts(self) -> tuple:
        """What the fingerprint hashes besides the shared arguments: ``_fingerprint_parts()``, less what
        does not change the passes (a subclass's choice)."""
        return self._fingerprint_parts()

    @property
    def fingerprint_aliases(self) -> tuple:
        """Other fingerprints of these very passes: what an earlier kerasfeed hashed (a state saved with
        one resumes as with ``fingerprint``)."""
        raw = self._hash(self._fingerprint_parts())
        return () if raw == self.fingerprint else (raw,)

    @property
    def legacy_fingerprints(self) -> dict:
        """Fingerprints the same arguments had under earlier algorithms (``IndexOrder.legacy_fingerprints``)."""
        parts = (type(self).__name__, *self._fingerprint_parts(), self.num_samples, self.seed, self.num_shards)
        legacy = {hash_parts(*parts): "0.1"}
        if self._order_version != ORDER_VERSION_1:
            legacy[hash_parts(*parts, ORDER_VERSION_1)] = ORDER_VERSION_1
        return legacy

    def _key(self, stream: int, epoch: int, *more: int) -> np.uint64:
        return derive_key(self.seed, stream, int(epoch), *more)

    def _rng(self, stream: int, epoch: int, *more: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, int(epoch), *more])

    def _cached(self, name: str, epoch: int, make: Any) -> Any:
        """``make(epoch)``, kept for the last two passes (per ``name``)."""
        key = (name, epoch)
        with self._cache_lock:
            value = self._cache.get(key)
        if value is None:
            value = make(epoch)
            with self._cache_lock:
                mine = [k for k in self._cache if k[0] == name]
                if len(mine) >= 2:
                    self._cache.pop(min(mine))
                self._cache[key] = value
        return value

    def _whole_pass(self, epoch: int, g: np.ndarray) -> np.ndarray:
        full = self._cached("pass", epoch, self._pass)
        return full[g].astype(np.int64)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"] = {}
        state.pop("_cache_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()


def compact(indices: np.ndarray, length: int) -> np.ndarray:
    """Item indices in int32 when ``length`` allows (a pass kept whole)."""
    return indices.astype(np.int32 if length < 2**31 else np.int64, copy=False)


def sample_without_replacement(rng: np.random.Generator, weights: np.ndarray, k: int) -> np.ndarray:
    """``k`` distinct positions drawn one after another with probability proportional to ``weights``
    among those not drawn yet, in draw order. Exponential keys ``E / w``: the ``k`` smallest, sorted,
    have exactly that distribution (zero weights get infinite keys and are drawn last)."""
    e = rng.standard_exponential(len(weights))
    try:
        with np.errstate(divide="ignore", over="raise"):
            keys = e / weights
    except FloatingPointError:  # some weights so small (next to E) that E / w overflowed
        return _with_overflowing_keys(e, weights, k)
    del e
    return _smallest(keys, k)


def _smallest(keys: np.ndarray, k: int) -> np.ndarray:
    """The positions of the ``k`` smallest ``keys``, sorted by key."""
    part = np.argpartition(keys, k - 1)[:k] if k < len(keys) else np.arange(len(keys))
    return part[np.argsort(keys[part], kind="stable")]


def _with_overflowing_keys(e: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """``sample_without_replacement`` where some ``E / w`` overflowed: those keys became inf, tied with
    the keys of zero weights, and a draw that reached them took items of weight 0. They rank after
    every finite key, among themselves by ``log E - log w`` (the same order); zero weights come last."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        keys = e / weights
    finite = np.isfinite(keys)
    if k <= np.count_nonzero(finite):  # the overflowed keys are never reached: the usual draw
        return _smallest(keys, k)
    first = np.flatnonzero(finite)
    first = first[np.argsort(keys[first], kind="stable")]
    over = np.flatnonzero(~finite & (weights > 0))
    over = over[np.argsort(np.log(e[over]) - np.log(weights[over]), kind="stable")]  # E > 0, w > 0 here
    zero = np.flatnonzero(~finite & (weights == 0))
    return np.concatenate([first, over, zero])[:k]


class WeightedOrder(SampledOrder):
    """Each pass draws items with probability proportional to per-item weights.

    The sharded, resumable form of PyTorch's ``WeightedRandomSampler``: pass ``epoch`` is a pure function
    of ``(seed, epoch)``, every shard computes the same pass and takes its own equal, disjoint share of
    positions, and the state needed to resume is just ``(epoch, position)``. With replacement, the item at
    position ``p`` is drawn by inverse CDF from a uniform that is a pure function of ``(seed, epoch, p)``
    (a counter-based hash): nothing is held per pass, and memory is 8 bytes per item (the cumulative
    weights, made in place of the order's own copy of ``weights``: editing the caller's array later
    changes nothing), with no limit at 2^24 items. Without replacement a pass is drawn whole (16 bytes
    per item while drawing; the last two passes kept, 4 bytes per index).

    Args:
        weights: one non-negative, finite weight per item of the source (not all zero). Items with weight
            0 are never drawn.
        num_samples: indices per pass over all shards; defaults to the number of items.
        replacement: True: independent draws (an item may come several times per pass). False: every item
            at most once per pass, drawn one after another in proportion to the weights of those left.
        seed: seed of every pass; None draws one for this object (not allowed with several shards).
        num_shards: number of equal, disjoint shards each pass is split into.
        shard_index: the shard this order yields.

    Raises:
        ValueError: negative, NaN or all-zero weights, ``num_samples`` not a positive int, or
            ``replacement=False`` with more samples than items of non-zero weight. Messages name the
            argument.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    weights = np.array([1.0, 1.0, 8.0, 0.0])
    order = kerasfeed.WeightedOrder(weights, num_samples=10, seed=0)
    order.indices(0)  # mostly 2, never 3
    ```
    """

    def __init__(
        self,
        weights: Any,
        *,
        num_samples: Optional[int] = None,
        replacement: bool = True,
        seed: Optional[int] = None,
        num_shards: int = 1,
        shard_index: int = 0,
    ):
        owner = "WeightedOrder"
        w = v.weights("weights", weights, owner=owner)
        self.replacement = v.flag("replacement", replacement, owner=owner)
        self._init_common(owner, len(w), num_samples, seed, num_shards, shard_index)
        positive = int(np.count_nonzero(w))
        if not self.replacement and self.num_samples > positive:
            raise ValueError(
                f"{owner}: replacement=False draws every item at most once per pass, but num_samples="
                f"{self.num_samples} is more than the {positive} items of non-zero weight. "
                f"Received: num_samples={self.num_samples}, replacement=False"
            )
        self._weights_digest = hash_parts(w)
        self._weights = None if self.replacement else w  # w: this order's own read-only copy
        if self.replacement:
            w.setflags(write=True)  # it owns its data: the cumulative sum is made in its place
            self._cdf = np.cumsum(w, out=w)
            self._cdf.setflags(write=False)
        else:
            self._cdf = None

    def _at(self, epoch: int, g: np.ndarray) -> np.ndarray:
        if not self.replacement:
            return self._whole_pass(epoch, g)
        u = uniforms(self._key(STREAM_WEIGHTED, epoch), g)
        u *= self._cdf[-1]
        # side="right": an item of weight 0 spans no interval of u.
        idx = np.searchsorted(self._cdf, u, side="right")
        # A u * total rounded up to the total (not seen since _validation.weights keeps the total normal)
        # takes the last item of non-zero weight, the first whose cumulative weight is the total.
        last = np.searchsorted(self._cdf, self._cdf[-1], side="left")
        return np.minimum(idx, last).astype(np.int64)

    def _pass(self, epoch: int) -> np.ndarray:
        rng = self._rng(STREAM_WEIGHTED, epoch)
        return compact(sample_without_replacement(rng, self._weights, self.num_samples), self.length)

    def _fingerprint_parts(self) -> tuple:
        return (self._weights_digest, self.replacement)

    def __repr__(self) -> str:
        return (
            f"WeightedOrder(<{self.length} weights>, num_samples={self.num_samples}, replacement={self.replacement}, "
            f"seed={self.seed}, num_shards={self.num_shards}, shard_index={self.shard_index})"
        )


__all__ = ["SampledOrder", "WeightedOrder", "compact", "sample_without_replacement"]
