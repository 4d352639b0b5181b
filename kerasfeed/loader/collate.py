"""Items as numpy, without TensorFlow: structure checks and batching samples.

The rules follow ``to_dataset`` so that both front ends yield the same
batches: dicts are read in sorted key order and lists become tuples (as
``tf.nest`` packs them), strings become object arrays of ``bytes`` (what a
``tf.string`` tensor gives back), a dimension that differs between probed
items may vary, and samples whose shapes vary are zero-padded to the largest
in their batch (``padded_batch``), while the batch is assembled in place
(``BatchBuilder``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kerasfeed._leaves import dtype_mismatch, leaf_array, leaf_arrays, loader_dtype, padding_leaves
from kerasfeed._nest import field_name, flatten, infer_fields, leaves_like, pack, shape_fits, shape_text
from kerasfeed.errors import SignatureError


class Signature:
    """The structure, dtypes and shapes (None: any size) every item must have, inferred from probes."""

    def __init__(self, skeleton: Any, names: list, dtypes: list, shapes: list):
        self.skeleton = skeleton
        self.names = names
        self.dtypes = dtypes
        self.shapes = shapes

    @classmethod
    def infer(cls, probes: Sequence[tuple[int, Any]]) -> "Signature":
        """Raises ``SignatureError`` naming both items when probes disagree."""
        skeleton, paths, dtypes, shapes = infer_fields(probes, leaf_arrays, loader_dtype)
        names = [field_name(path, skeleton) for path in paths]
        return cls(skeleton, names, dtypes, shapes)

    def open_leading(self) -> "Signature":
        """The signature with the first dimension of every leaf of rank >= 1
        open (any size): items that are batches may be short anywhere in a
        pass, as under ``to_dataset`` and Keras' own ``fit(seq)``."""
        shapes = [[None, *shape[1:]] if len(shape) else shape for shape in self.shapes]
        return Signature(self.skeleton, self.names, self.dtypes, shapes)

    def flat_arrays(self, index: int, item: Any) -> list:
        """The item's leaves as arrays; ``SignatureError`` on a mismatch."""
        leaves = leaves_like(self.skeleton, index, item, "the loader")
        out = []
        for k, (_, leaf) in enumerate(leaves):
            a = leaf_array(index, self.names[k], leaf)
            if a.dtype != self.dtypes[k]:
                self._fail(index, k, dtype_mismatch(self.dtypes[k], a), "every item must give a field the dtype "
                                                                       "the probed items gave it")
            shape = self.shapes[k]
            if not shape_fits(shape, a.shape):
                self._fail(index, k, f"shape {shape_text(shape)}, received shape {a.shape}")
            out.append(a)
        return out

    def _fail(self, index: int, k: int, what: str, why: str = "None in a shape means any size; probe more "
                                                                "items with `probe=` to widen the signature") -> None:
        raise SignatureError(f"Item {index}, field {self.names[k]}: expected {what}. ({why}.)")

    def padding(self, padding_values: Any) -> list:
        """One padding value per leaf (``_leaves.padding_leaves``)."""
        return padding_leaves(padding_values, self.skeleton, self.dtypes, [None in shape for shape in self.shapes])


def _padded(arrays: Sequence[np.ndarray], value: Any) -> np.ndarray:
    shape = arrays[0].shape
    if all(a.shape == shape for a in arrays):
        return np.stack(arrays)
    full = tuple(max(a.shape[d] for a in arrays) for d in range(len(shape)))
    batch = np.full((len(arrays),) + full, value, dtype=arrays[0].dtype)
    for j, a in enumerate(arrays):
        batch[(j,) + tuple(slice(0, n) for n in a.shape)] = a
    return batch


class BatchBuilder:
    """One batch of ``size`` samples, assembled as the samples arrive.

    A leaf whose shape the signature fixes is written straight into one array
    allocated for the whole batch (one copy per sample, whose own arrays can
    be freed once written); a leaf whose shape may vary is kept until the
    batch is complete, then padded with its padding value (``padded_batch``).

    Args:
        signature: the loader's ``Signature`` (shapes and dtypes per leaf).
        size: samples in this batch.
        padding: one padding value per leaf (``Signature.padding``).
    """

    def __init__(self, signature: Signature, size: int, padding: Sequence[Any]):
        self._out = [
            None if None in shape else np.empty((size, *shape), dtype)
            for shape, dtype in zip(signature.shapes, signature.dtypes)
        ]
        self._varying: list = [[] if out is None else None for out in self._out]
        self._padding = padding
        self._size = size
        self._count = 0

    def add(self, arrays: Sequence[np.ndarray]) -> None:
        """Writes the next sample (its leaves, checked against the signature)."""
        j = self._count
        for k, a in enumerate(arrays):
            out = self._out[k]
            if out is None:
                self._varying[k].append(a)
            else:
                out[j, ...] = a  # also right for 0-d object (string) leaves
        self._count = j + 1

    def finish(self) -> list:
        """The batch's arrays, one per leaf: the samples added (fewer than
        ``size`` when items were left out: ``max_skipped``)."""
        n = self._count
        if not 0 < n <= self._size:
            raise RuntimeError(f"kerasfeed: a batch of {self._size} got {n} samples. Received: {n}")
        return [
            _padded(self._varying[k], self._padding[k]) if out is None else (out if n == self._size else out[:n])
            for k, out in enumerate(self._out)
        ]


__all__ = ["BatchBuilder", "Signature", "flatten", "pack"]
