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

from typing import Any, Iterator, Sequence

import numpy as np

from kerasfeed._leaves import as_array
from kerasfeed.errors import SignatureError

_KERAS_NAMES = ("x", "y", "sample_weight")


def _flatten(item: Any, path: tuple, out: list) -> Any:
    if isinstance(item, dict):
        return {k: _flatten(item[k], path + (k,), out) for k in sorted(item)}
    if isinstance(item, (tuple, list)):
        return tuple(_flatten(v, path + (i,), out) for i, v in enumerate(item))
    out.append((path, item))
    return None


def flatten(item: Any) -> tuple[Any, list]:
    """Returns ``(skeleton, [(path, leaf), ...])``: leaves in ``tf.nest`` order."""
    out: list = []
    return _flatten(item, (), out), out


def _build(skeleton: Any, leaves: Iterator[Any]) -> Any:
    # A module-level function, not a recursive closure: a closure that calls
    # itself is a reference cycle holding ``leaves``, so every batch would
    # live until the garbage collector runs (lent shared memory not given
    # back, freed arrays not reused by malloc).
    if skeleton is None:
        return next(leaves)
    if isinstance(skeleton, dict):
        return {k: _build(v, leaves) for k, v in skeleton.items()}
    return tuple(_build(v, leaves) for v in skeleton)


def pack(skeleton: Any, leaves: Sequence[Any]) -> Any:
    """Rebuilds a nest shaped like ``skeleton`` (None marks a leaf)."""
    return _build(skeleton, iter(leaves))


def field_name(path: tuple, skeleton: Any) -> str:
    """``x``, ``y['mask']``, ``[3][0]`` or ``item``, as in ``to_dataset``'s errors."""
    if not path:
        return "item"
    head, rest = path[0], path[1:]
    if isinstance(skeleton, tuple) and len(skeleton) <= 3 and isinstance(head, int):
        first = _KERAS_NAMES[head]
    else:
        first = f"[{head!r}]"
    return first + "".join(f"[{p!r}]" for p in rest)


def describe(skeleton: Any) -> str:
    if skeleton is None:
        return "array"
    if isinstance(skeleton, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in skeleton.items()) + "}"
    return "(" + ", ".join(describe(v) for v in skeleton) + ("," if len(skeleton) == 1 else "") + ")"


def _shape_text(shape: Sequence) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


class Signature:
    """The structure, dtypes and shapes every item must have (TF-free).

    Inferred from probed items like ``to_dataset``'s signature: a dimension
    that differs between probes becomes None (any size).
    """

    def __init__(self, skeleton: Any, names: list, dtypes: list, shapes: list):
        self.skeleton = skeleton
        self.names = names
        self.dtypes = dtypes
        self.shapes = shapes

    @classmethod
    def infer(cls, probes: Sequence[tuple[int, Any]]) -> "Signature":
        """Raises ``SignatureError`` naming both items when probes disagree."""
        first_index, first = probes[0]
        skeleton, leaves = flatten(first)
        arrays = [as_array(v) for _, v in leaves]
        shapes = [list(a.shape) for a in arrays]
        dtypes = [a.dtype for a in arrays]
        names = [field_name(path, skeleton) for path, _ in leaves]
        for index, item in probes[1:]:
            other, other_leaves = flatten(item)
            if other != skeleton:
                raise SignatureError(
                    f"Items have different structures: item {first_index} is {describe(skeleton)} but item "
                    f"{index} is {describe(other)}. Every item must have the same nesting of tuples/dicts."
                )
            for k, (_, leaf) in enumerate(other_leaves):
                a = as_array(leaf)
                if a.dtype != dtypes[k]:
                    raise SignatureError(
                        f"Field {names[k]} changes dtype: item {first_index} has {dtypes[k].name}, "
                        f"item {index} has {a.dtype.name}."
                    )
                if a.ndim != len(shapes[k]):
                    raise SignatureError(
                        f"Field {names[k]} changes rank: item {first_index} has shape {tuple(shapes[k])}, "
                        f"item {index} has shape {a.shape}."
                    )
                shapes[k] = [d if d == e else None for d, e in zip(shapes[k], a.shape)]
        return cls(skeleton, names, dtypes, shapes)

    def flat_arrays(self, index: int, item: Any) -> list:
        """The item's leaves as arrays; ``SignatureError`` on a mismatch."""
        skeleton, leaves = flatten(item)
        if skeleton != self.skeleton:
            raise SignatureError(
                f"Item {index} does not match the loader's structure: expected "
                f"{describe(self.skeleton)}, received {describe(skeleton)}."
            )
        out = []
        for k, (_, leaf) in enumerate(leaves):
            a = as_array(leaf)
            if a.dtype != self.dtypes[k]:
                self._fail(index, k, f"dtype {self.dtypes[k].name}, received {a.dtype.name}")
            shape = self.shapes[k]
            if a.ndim != len(shape) or any(d is not None and d != e for d, e in zip(shape, a.shape)):
                self._fail(index, k, f"shape {_shape_text(shape)}, received shape {a.shape}")
            out.append(a)
        return out

    def _fail(self, index: int, k: int, what: str) -> None:
        raise SignatureError(
            f"Item {index}, field {self.names[k]}: expected {what}. (None in a shape means any size; "
            "probe more items with `probe=` to widen the signature.)"
        )

    def padding(self, padding_values: Any) -> list:
        """One padding value per leaf: 0 (``b""`` for strings), a scalar for all
        leaves, or a nest shaped like the items."""
        if padding_values is None:
            return [b"" if d == np.dtype(object) else 0 for d in self.dtypes]
        if np.ndim(padding_values) == 0 and not isinstance(padding_values, (dict, tuple, list)):
            return [padding_values] * len(self.dtypes)
        skeleton, leaves = flatten(padding_values)
        if skeleton != self.skeleton:
            raise ValueError(
                "`padding_values` must be one scalar or a nest shaped like the items "
                f"({describe(self.skeleton)}). Received: padding_values={padding_values!r}"
            )
        return [v for _, v in leaves]


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

    A leaf whose shape the signature fixes is written straight into one
    array allocated for the whole batch (one copy per sample, and each
    sample's own arrays can be freed as soon as it is written). A leaf whose
    shape may vary is kept until the batch is complete, then padded at the
    end of every dimension to the largest size in the batch with its
    padding value (``padded_batch``'s rule).

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
        """The batch's arrays, one per leaf."""
        if self._count != self._size:
            raise RuntimeError(f"kerasfeed: a batch of {self._size} got {self._count} samples. Received: {self._count}")
        return [
            _padded(self._varying[k], self._padding[k]) if out is None else out for k, out in enumerate(self._out)
        ]


__all__ = ["BatchBuilder", "Signature", "flatten", "pack"]
