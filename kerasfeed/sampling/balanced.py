"""Class-balanced per-pass orders, decided from labels before any item is read."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from kerasfeed import _validation as v
from kerasfeed.sampling.bijection import (
    SMALL_N,
    TABLE_BUDGET,
    domain,
    draw_table,
    permute,
    shuffled,
    subkeys,
    table,
)
from kerasfeed.sampling.fingerprints import ORDER_VERSION
from kerasfeed.sampling.hdf5_labels import read_labels
from kerasfeed.sampling.labels import encode_labels, group_by_class, missing_labels
from kerasfeed.sampling.weighted import (
    STREAM_CLASS,
    STREAM_COUNTS,
    STREAM_MIX,
    SampledOrder,
    compact,
    sample_without_replacement,
)

OWNER = "BalancedOrder"


class BalancedOrder(SampledOrder):
    """Each pass holds the classes in target proportions (uniform by default).

    Only labels are needed (one per item, e.g. read once from an HDF5 label dataset with ``from_hdf5``);
    items are never loaded to decide, so a pass reads only the items it delivers. The index at every
    position of a pass is a pure function of ``(seed, pass, position)``, computed for a window of
    positions when asked (no pass is held whole): the same in every process and on every run, resumable
    from ``(epoch, position)``, split into equal, disjoint shards.

    How a pass of ``num_samples`` indices is drawn:

    - **Class counts.** ``exact=True``: class ``c`` gets ``num_samples * p_c`` indices rounded down or up
      (within ±1), the classes rounded up drawn by systematic sampling so that the long-run mean is exact
      (computed in integers from the exact values of the float weights: right up to ``num_samples`` of
      2^62). ``exact=False``: counts are multinomial, as with independent draws.
    - **Items of a class.** Each class is cycled through its own seeded permutation: in rank order no item
      repeats until every item of its class has come once (then a new permutation starts), so over a pass
      the counts of a class's items differ by at most 1 (the interleaving spreads the ranks over the pass:
      in reading order a repeat may come before every item came). A class that
      gets fewer indices than it has items contributes a fresh random subset each pass (uniform: a class
      of at most 65,536 items is first shuffled by an exact table per pass).
    - **Interleaving.** The pass's slots (class 0's, then class 1's, ...) are shuffled together by a
      seeded bijection: position ``p`` holds slot ``j = bijection(p)``, whose class and rank within the
      class give the item (``kerasfeed/sampling/bijection.py``).

    With ``replacement=False`` no item comes twice in a pass: with ``exact=True`` every class must have
    enough items for its count; with ``exact=False`` items are drawn one after another in proportion to
    ``p_c / n_c`` among those left (a weighted draw without replacement).

    Memory: 4 bytes per item (8 past 2^31 items) for the items grouped by class (a chunked counting sort
    of the labels, no per-class lists: ``kerasfeed/sampling/labels.py``); per pass, 2 bytes per item of
    the classes of at most 65,536 items (their exact tables, the last two passes, while they hold at most
    2^22 items); no limit at 2^24 items. Only ``exact=False`` with ``replacement=False`` draws a pass
    whole: 16 bytes per item while drawing, the last two passes kept (4 bytes per index).

    Args:
        labels: one label per item of the source (ints, strings, any values ``numpy.unique`` sorts), as
            an array or sequence.
        class_weights: None (uniform), a dict ``{class: weight}`` naming every class, or a sequence of
            weights in sorted class order. Weights are non-negative, finite, not all zero; 0 leaves a
            class out.
        num_samples: indices per pass over all shards; defaults to the number of items (a pass as long as
            an unbalanced one).
        replacement: allow an item more than once per pass (oversampling of rare classes). False: each
            item at most once per pass.
        exact: class counts within ±1 of their target every pass (True) or independent draws (False).
        seed: seed of every pass; None draws one for this object (not allowed with several shards).
        num_shards: number of equal, disjoint shards each pass is split into.
        shard_index: the shard this order yields.

    Raises:
        ValueError: empty or non-1-D labels, a missing label (NaN or None; the message names the first
            item), a class weight for a class no label has or a missing one, negative/NaN/all-zero
            weights, ``num_samples`` not a positive int, or ``replacement=False`` with more samples than
            items. Messages name the argument and value.
        TypeError: labels of kinds that cannot be ordered (ints and strings).

    Example:

    ```python
    import numpy as np
    import kerasfeed

    labels = np.array([0] * 98 + [1] * 2)           # 1:49
    order = kerasfeed.BalancedOrder(labels, seed=0)
    np.bincount(labels[order.indices(0)])          # array([50, 50])
    ```
    """

    # Balanced passes changed with ORDER_VERSION (exact tables over small spaces).
    _order_version = ORDER_VERSION

    def __init__(
        self,
        labels: Any,
        *,
        class_weights: Union[None, Mapping[Any, float], Sequence[float]] = None,
        num_samples: Optional[int] = None,
        replacement: bool = True,
        exact: bool = True,
        seed: Optional[int] = None,
        num_shards: int = 1,
        shard_index: int = 0,
    ):
        given = labels
        labels = np.asarray(labels)
        if labels.dtype.kind in "US" and not isinstance(given, np.ndarray):
            _one_kind(given)  # numpy turns [0, 1, 'a'] into strings: refuse, as for an object array
        if labels.ndim != 1 or labels.size == 0:
            raise ValueError(
                f"{OWNER}: `labels` must be a non-empty 1-D array with one label per item. "
                f"Received: labels of shape {labels.shape}"
            )
        self.replacement = v.flag("replacement", replacement, owner=OWNER)
        self.exact = v.flag("exact", exact, owner=OWNER)
        self._init_common(OWNER, len(labels), num_samples, seed, num_shards, shard_index)
        self.classes, codes, counts = _encoded(labels)
        del labels
        self.class_counts = counts
        # Items grouped by class: class c's items are members[offsets[c]:offsets[c + 1]].
        self._members = group_by_class(codes, counts)
        del codes
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # The Feistel domain of every class's own permutation (see bijection.domain).
        self._pairs = np.array([domain(int(k)) for k in counts], dtype=np.uint64).reshape(-1, 2)
        self._class_w = w = _class_weights(class_weights, self.classes)  # exact targets start from these
        # Made here, not in the first pass: a source holding the order does not change between passes (cache=).
        self._split: Optional[tuple] = exact_split(self.num_samples, w) if self.exact else None
        self.proportions = w / w.sum()
        self._check_replacement()

    # ---- construction helpers ----------------------------------------------

    @classmethod
    def from_hdf5(cls, paths: Any, key: str, storage_options: Optional[Mapping] = None,
                  remote_options: Any = None, *, swmr: bool = False, **kwargs: Any) -> "BalancedOrder":
        """Reads the labels, of shape ``(N,)`` or ``(N, 1)``, once from HDF5 dataset ``key`` (files
        concatenated in order); only the label dataset is read, never the items.

        Args:
            paths: one HDF5 file or a sequence of files (as given to ``H5SliceSequence``/``H5RowSequence``):
                local paths or ``s3://``, ``gs://``, ``http(s)://`` URLs (read once as the readers read them:
                the ``remote`` extra, with their retries and timeouts).
            key: the label dataset in every file.
            storage_options: fsspec's options for URLs (credentials, endpoint), as the readers take them.
            remote_options: a ``kerasfeed.hdf5.RemoteOptions`` or a dict of its fields for URLs (timeout, attempts),
                as the readers take it.
            swmr: open local files in SWMR read mode, for files a SWMR writer holds (as the readers' ``swmr``).
            **kwargs: ``BalancedOrder`` arguments.

        Raises:
            ValueError: a file lacks ``key`` or its labels are not one per row.
            FileNotFoundError, PermissionError, TimeoutError, OSError: a URL's object is missing, refused, or
                did not answer within ``remote_options``' tries (named, as the readers name them).
        """
        return cls(read_labels(paths, key, storage_options, remote_options, swmr), **kwargs)

    def _check_replacement(self) -> None:
        if self.replacement:
            return
        p, n, s = self.proportions, self.class_counts, self.num_samples
        if self.exact:
            need = np.ceil(s * p - 1e-9).astype(np.int64)
            over = np.flatnonzero(need > n)
            if over.size:
                c = int(over[0])
                raise ValueError(
                    f"{OWNER}: replacement=False takes each item at most once per pass, but a pass of "
                    f"num_samples={s} needs up to {int(need[c])} items of class {self.classes.tolist()[c]!r}, "
                    "which has only "
                    f"{int(n[c])}; lower num_samples or allow replacement. Received: num_samples={s}, replacement=False"
                )
        else:
            available = int(n[p > 0].sum())
            if s > available:
                raise ValueError(
                    f"{OWNER}: replacement=False takes each item at most once per pass, but num_samples={s} is "
                    f"more than the {available} items of classes with non-zero weight. "
                    f"Received: num_samples={s}, replacement=False"
                )

    # ---- passes ---------------------------------------------------------------

    def class_targets(self, epoch: int) -> np.ndarray:
        """Indices per class in pass ``epoch`` (over all shards), in ``classes`` order."""
        s, p = self.num_samples, self.proportions
        rng = self._rng(STREAM_COUNTS, epoch)
        if not self.exact:
            return rng.multinomial(s, p).astype(np.int64)
        if self._split is None:
            self._split = exact_split(s, self._class_w)
        base, whole, threshold = self._split
        if not whole[-1]:  # every quota a whole number
            return base.copy()
        # Systematic sampling: class c is rounded up with probability frac[c]; u = units / 2^53 exactly.
        units = int(rng.random() * 2.0**53)
        ticks = whole + (units >= threshold)
        return base + np.diff(ticks, prepend=0)

    def _slots(self, epoch: int) -> np.ndarray:
        # Where each class's slots start in pass ``epoch`` (cumulated targets).
        return np.concatenate([[0], np.cumsum(self.class_targets(epoch))]).astype(np.int64)

    def _at(self, epoch: int, g: np.ndarray) -> np.ndarray:
        if not self.exact and not self.replacement:
            return self._whole_pass(epoch, g)
        starts = self._cached("slots", epoch, self._slots)
        slot = shuffled(g, self.num_samples, self.seed, STREAM_MIX, int(epoch))
        c = np.searchsorted(starts, slot, side="right") - 1
        rank = slot - starts[c]
        n = self.class_counts[c]
        cycle = rank // n  # the class's permutation number: every item once per cycle
        within = permute(
            rank - cycle * n, n, subkeys(self._key(STREAM_CLASS, epoch), c, cycle),
            pairs=(self._pairs[c, 0], self._pairs[c, 1]),
        )
        self._shuffle_small_classes(epoch, c, n, within)
        return self._members[self._offsets[c] + within].astype(np.int64)

    def _shuffle_small_classes(self, epoch: int, c: np.ndarray, n: np.ndarray, within: np.ndarray) -> None:
        # Class k of at most SMALL_N items: its cycles' Feistel permutations are followed by one exactly
        # uniform table of pass ``epoch`` (each cycle's permutation is then exactly uniform).
        small = np.flatnonzero(n <= SMALL_N)
        if not small.size:
            return
        tables, starts = self._cached("tables", epoch, self._class_tables)
        if tables is not None:  # every small class's table of the pass, in one array
            within[small] = tables[starts[c[small]] + within[small]]
            return
        order = small[np.argsort(c[small], kind="stable")]  # too many items for that: class by class
        classes, first = np.unique(c[order], return_index=True)
        bounds = np.append(first, len(order))
        for j, k in enumerate(classes.tolist()):
            at = order[bounds[j] : bounds[j + 1]]
            within[at] = table(int(self.class_counts[k]), self.seed, STREAM_CLASS, int(epoch), k)[within[at]]

    def _class_tables(self, epoch: int) -> tuple:
        # The tables of all classes of at most SMALL_N items, concatenated (2 bytes per item), with
        # where each starts; (None, None) past TABLE_BUDGET items (then cached per class by ``table``).
        small = np.flatnonzero(self.class_counts <= SMALL_N)
        if int(self.class_counts[small].sum()) > TABLE_BUDGET:
            return None, None
        starts = np.full(len(self.class_counts), -1, dtype=np.int64)
        starts[small] = np.concatenate([[0], np.cumsum(self.class_counts[small])[:-1]])
        parts = [draw_table(int(self.class_counts[k]), self.seed, STREAM_CLASS, int(epoch), k) for k in small.tolist()]
        return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), starts

    def _pass(self, epoch: int) -> np.ndarray:
        # exact=False, replacement=False: a weighted draw without replacement, whole.
        item_p = np.repeat(self.proportions / self.class_counts, self.class_counts)
        rng = self._rng(STREAM_CLASS, epoch)
        drawn = sample_without_replacement(rng, item_p, self.num_samples)
        del item_p
        return compact(self._members[drawn], self.length)

    def _fingerprint_parts(self) -> tuple:
        return (self.classes, self.class_counts, self._members, self.proportions, self.replacement, self.exact)

    def _identity_parts(self) -> tuple:
        # The labels' values, not their dtype: int32 or int64 labels (an HDF5 label dataset, a list), or
        # strings of any width, give the same passes, and a run saved with one resumes with the other.
        classes = self.classes
        if classes.dtype.kind in "biu":
            classes = classes.astype(np.uint64 if classes.dtype.kind == "u" and classes.max() > 2**63 - 1
                                     else np.int64)
        elif classes.dtype.kind == "f":
            classes = classes.astype(np.float64)
        elif classes.dtype.kind in "US":
            classes = np.array(classes.tolist(), dtype=object)
        return (classes, *self._fingerprint_parts()[1:])

    def __repr__(self) -> str:
        classes = self.classes.tolist()
        shown = classes if len(classes) <= 8 else classes[:8] + ["..."]
        return (
            f"BalancedOrder(<{self.length} labels, classes {shown}>, num_samples={self.num_samples}, "
            f"replacement={self.replacement}, exact={self.exact}, seed={self.seed}, "
            f"num_shards={self.num_shards}, shard_index={self.shard_index})"
        )


def exact_split(num_samples: int, weights: np.ndarray) -> tuple:
    """What exact class counts are drawn from, in integers: ``(base, whole, threshold)``.

    With ``q_c = num_samples * w_c / sum(w)`` computed exactly (the float weights are dyadic rationals),
    ``base_c = floor(q_c)``; the cumulated remainders ``R_c = sum_{j <= c} (q_j - base_j)`` are split into
    ``whole_c = floor(R_c)`` and a fraction ``f_c``. Systematic sampling with a uniform
    ``u = units / 2^53`` rounds up ``floor(R_c + u)`` classes up to ``c``: ``whole_c + (units >=
    threshold_c)`` with ``threshold_c = ceil(2^53 (1 - f_c))`` (``2^53``, never, when ``f_c = 0``). All
    int64 arrays (``base`` at most ``num_samples``, ``threshold`` at most 2^53).
    """
    ratios = [float(x).as_integer_ratio() for x in weights.tolist()]
    scale = max(d for _, d in ratios)  # powers of two: every weight a whole multiple of 1 / scale
    parts = [m * (scale // d) for m, d in ratios]
    den = sum(parts)
    base, whole, threshold = [], [], []
    cum = 0
    for part in parts:
        b, r = divmod(num_samples * part, den)
        cum += r
        q, f = divmod(cum, den)
        base.append(b)
        whole.append(q)
        threshold.append(-(-((den - f) << 53) // den))
    return tuple(np.array(x, dtype=np.int64) for x in (base, whole, threshold))


def _class_weights(class_weights: Any, classes: np.ndarray) -> np.ndarray:
    names = classes.tolist()
    if class_weights is None:
        return np.ones(len(names))
    if isinstance(class_weights, Mapping):
        unknown = [k for k in class_weights if k not in set(names)]
        if unknown:
            raise ValueError(
                f"{OWNER}: `class_weights` has a weight for class {unknown[0]!r}, which no label has; the labels' "
                f"classes are {v.summarize(names)}. Received: class_weights={dict(class_weights)!r}"
            )
        missing = [c for c in names if c not in class_weights]
        if missing:
            raise ValueError(
                f"{OWNER}: `class_weights` must give a weight for every class (0 leaves a class out); class "
                f"{missing[0]!r} has none. Received: class_weights={dict(class_weights)!r}"
            )
        values = [class_weights[c] for c in names]
        for c, w in zip(names, values):
            ok = isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, bool)
            if not ok or not np.isfinite(w) or w < 0:
                raise ValueError(
                    f"{OWNER}: `class_weights` must be finite and non-negative; class {c!r} has {w!r}. "
                    f"Received: class_weights={dict(class_weights)!r}"
                )
    else:
        values = class_weights
        if len(np.atleast_1d(np.asarray(values, dtype=object))) != len(names):
            raise ValueError(
                f"{OWNER}: `class_weights` as a sequence needs one weight per class, in sorted class order "
                f"({len(names)} classes: {v.summarize(names)}). Received: class_weights={v.summarize(class_weights)}"
            )
    return v.weights("class_weights", values, owner=OWNER)


def _one_kind(given: Any) -> None:
    # Labels numpy made strings of: every one must have been a string (or bytes) already.
    if not (all(isinstance(x, str) for x in given) or all(isinstance(x, bytes) for x in given)):
        kinds = sorted({type(x).__name__ for x in given})
        raise TypeError(
            f"{OWNER}: the labels must be of one comparable kind (ints, strings, ...) to be told apart as "
            f"classes; numpy would turn them all into strings. Received: labels of types {kinds}"
        )


def _encoded(labels: np.ndarray) -> tuple:
    """``encode_labels``, refusing labels that name no class or cannot be ordered."""
    missing = missing_labels(labels)
    if missing.size:
        first = labels[missing[0]]
        first = first.item() if isinstance(first, np.generic) else first
        raise ValueError(
            f"{OWNER}: {missing.size} of {len(labels)} labels are missing (NaN or None), the first at item "
            f"{int(missing[0])}; every item needs a class (drop those items from the source, or give them a "
            f"class of their own). Received: labels[{int(missing[0])}]={first!r}"
        )
    try:
        return encode_labels(labels)
    except TypeError as e:
        kinds = sorted({type(x).__name__ for x in labels[: 1 << 16]})
        raise TypeError(
            f"{OWNER}: the labels must be of one comparable kind (ints, strings, ...) to be told apart as "
            f"classes: {e}. Received: labels of types {kinds}"
        ) from e


__all__ = ["BalancedOrder"]
