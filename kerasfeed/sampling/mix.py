"""``mix``: several indexable sources as one, in given proportions, by arithmetic (TF-free)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from kerasfeed.sampling.mixcore import MixCore


def mix(
    sources: Sequence[Any], weights: Optional[Sequence[float]] = None, *, seed: Optional[int] = None, check: bool = True
) -> Any:
    """Several indexable sources as one indexable source, in the given proportions.

    The mix is a block of ``P`` slots repeated: part ``k`` owns ``w_k`` slots of every block (the weights
    as whole numbers, ``P = sum(w)``), its items taken in order, so element ``i`` is found by arithmetic:
    block ``i // P``, slot ``i % P``. Access is random, the length is known, every element comes from
    exactly one part and every item of a part comes at most once. The mix ends when the first part runs
    out (as with Grain's ``MapDataset.mix``): ``len = min_k len_k / p_k`` roughly, then a partial block.
    Shuffle it like any source (``to_dataset(..., shuffle=True)`` or an order); to oversample a small
    part instead, use a ``BalancedOrder``.

    Args:
        sources: two or more indexable sources (``__len__`` and ``__getitem__``) whose items share one
            structure (same nest, dtypes and ranks; dimensions may differ).
        weights: one non-negative weight per part, not all zero; None mixes equally. Whole numbers summing
            to at most 10,000 are used exactly; other weights are rounded to ``1/10000`` of a block (a
            positive weight keeps at least one slot; a share moved by over 1 % is warned about).
        seed: None: the slots of every block are evenly interleaved: every prefix of the mix holds each
            part's share within less than one item (any window, within less than two). An int: the slots
            of every block are shuffled with ``(seed, block)``.
        check: compare item 0 of every part with item 0 of the first part and name the first mismatch
            (part and field).

    Returns:
        A ``kerasfeed.sampling.mix.Mix``; when the parts are Keras ``PyDataset``s (e.g.
        ``SceneSequence``s) a ``MixedSequence``, itself a ``SceneSequence`` for ``model.fit(mixed)``,
        that forwards ``set_epoch``/``on_epoch_begin``/``on_epoch_end`` to its parts. Either pickles (for
        worker processes) when its parts do.

    Raises:
        ValueError: fewer than two parts, bad weights (count, negative, NaN, all zero), or parts whose
            items differ in structure.
        TypeError: a part is not indexable.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    a = np.zeros((90, 3), "float32")          # any indexable: arrays, sequences
    b = np.ones((10, 3), "float32")
    mixed = kerasfeed.mix([a, b], [3, 1])     # 3:1, ends when b runs out
    len(mixed), mixed.locate(2)               # (42, (1, 0)): slots 0, 0, 1, 0 per block
    ds = kerasfeed.to_dataset(mixed, batch_size=8, shuffle=True, seed=0)
    ```
    """
    parts = list(sources) if isinstance(sources, (list, tuple)) else sources
    if not isinstance(parts, list) or len(parts) < 2:
        raise ValueError(
            f"mix: `sources` must be a list or tuple of two or more indexable sources. Received: sources={sources!r}"
        )
    if any(_is_pydataset(p) for p in parts):
        # Imported here: it imports Keras (~2 s), which a mix of plain arrays never needs.
        # No cycle: mixseq imports mixcore only.
        from kerasfeed.sampling.mixseq import MixedSequence

        return MixedSequence(parts, weights, seed=seed, check=check)
    return Mix(parts, weights, seed=seed, check=check)


def _is_pydataset(obj: Any) -> bool:
    # By name: importing Keras just to ask would cost every caller ~2 s.
    return any(c.__name__ == "PyDataset" for c in type(obj).__mro__)


class Mix(MixCore):
    """Several indexable sources as one (see ``mix``)."""

    def __init__(self, sources: Sequence[Any], weights: Any = None, *, seed: Optional[int] = None, check: bool = True):
        self._init_mix(list(sources), weights, seed, check)


__all__ = ["Mix", "mix"]
