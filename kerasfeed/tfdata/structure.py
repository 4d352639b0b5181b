"""Item structures: flattening with field names, signature inference and checks.

Items are nests of tuples/lists/dicts whose leaves are arrays, numbers or
strings. Field names follow Keras: a top-level tuple of 1-3 entries is
``(x, y, sample_weight)``; dict keys read ``['image']``; other positions
``[2]``. This module imports TensorFlow, so only the consumer process uses it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from kerasfeed._leaves import UnsupportedLeaf, as_array
from kerasfeed._leaves import short_repr as _short_repr
from kerasfeed.errors import SignatureError

_KERAS_NAMES = ("x", "y", "sample_weight")


def _flatten(item: Any, path: tuple, out: list) -> Any:
    """Appends ``(path, leaf)`` pairs to ``out``; returns the item's skeleton."""
    if isinstance(item, dict):
        return {k: _flatten(item[k], path + (k,), out) for k in sorted(item)}
    if isinstance(item, (tuple, list)):
        return tuple(_flatten(v, path + (i,), out) for i, v in enumerate(item))
    out.append((path, item))
    return None


def flatten(item: Any) -> tuple[Any, list]:
    """Returns ``(skeleton, [(path, leaf), ...])`` in ``tf.nest`` order."""
    out: list = []
    skeleton = _flatten(item, (), out)
    return skeleton, out


def field_name(path: tuple, skeleton: Any) -> str:
    """Human name of a leaf: ``x``, ``y['mask']``, ``[3][0]`` or ``item``."""
    if not path:
        return "item"
    parts = []
    head, rest = path[0], path[1:]
    if isinstance(skeleton, tuple) and len(skeleton) <= 3 and isinstance(head, int):
        parts.append(_KERAS_NAMES[head])
    else:
        parts.append(f"[{head!r}]")
    parts.extend(f"[{p!r}]" for p in rest)
    return "".join(parts)


def _describe(skeleton: Any) -> str:
    if skeleton is None:
        return "array"
    if isinstance(skeleton, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in skeleton.items()) + "}"
    return "(" + ", ".join(_describe(v) for v in skeleton) + ("," if len(skeleton) == 1 else "") + ")"


def leaf_error(index: Any, name: str, problem: UnsupportedLeaf) -> SignatureError:
    """The SignatureError for an unsupported leaf, naming item and field."""
    what, value = problem.args
    field = "" if name == "item" else f", field {name}"
    hint = (
        "Return numeric arrays, numbers, str or bytes (convert object arrays with "
        "np.asarray(v, dtype=...); use a padded array or ragged=True for varying lengths)."
    )
    return SignatureError(f"Item {index}{field} {what}. {hint} Received: {_short_repr(value)}")


def _leaf_arrays(index: Any, leaves: list, skeleton: Any) -> list:
    out = []
    for path, leaf in leaves:
        try:
            out.append(as_array(leaf))
        except UnsupportedLeaf as e:
            raise leaf_error(index, field_name(path, skeleton), e) from None
    return out


def tf_dtype(a: np.ndarray) -> tf.DType:
    if a.dtype.kind in "OSU":
        return tf.string
    try:
        return tf.as_dtype(a.dtype)
    except TypeError as e:
        raise SignatureError(f"Unsupported dtype {a.dtype} (TensorFlow has no such type).") from e


def _pack(skeleton: Any, leaves: list) -> Any:
    return _build(skeleton, iter(leaves))


def _build(skeleton: Any, leaves: Any) -> Any:
    # A module-level function, not a recursive closure: a closure that calls
    # itself is a reference cycle (function -> cell -> function) holding the
    # leaves' iterator, so every packed chunk's arrays would live until the
    # cyclic garbage collector runs (gigabytes with large items).
    if skeleton is None:
        return next(leaves)
    if isinstance(skeleton, dict):
        return {k: _build(v, leaves) for k, v in skeleton.items()}
    return tuple(_build(v, leaves) for v in skeleton)


def infer_signature(probes: Sequence[tuple[int, Any]]) -> Any:
    """Infers a nest of ``tf.TensorSpec`` from probed ``(index, item)`` pairs.

    A dimension that differs between probes becomes None. Structure, dtype
    or rank differences raise ``SignatureError`` naming both indices.
    """
    first_index, first = probes[0]
    skeleton, leaves = flatten(first)
    arrays = _leaf_arrays(first_index, leaves, skeleton)
    shapes = [list(a.shape) for a in arrays]
    dtypes = [tf_dtype(a) for a in arrays]
    for index, item in probes[1:]:
        other_skeleton, other_leaves = flatten(item)
        if other_skeleton != skeleton:
            raise SignatureError(
                f"Items have different structures: item {first_index} is "
                f"{_describe(skeleton)} but item {index} is {_describe(other_skeleton)}. "
                "Every item must have the same nesting of tuples/dicts."
            )
        other_arrays = _leaf_arrays(index, other_leaves, skeleton)
        for k, (path, _) in enumerate(other_leaves):
            a = other_arrays[k]
            name = field_name(path, skeleton)
            if tf_dtype(a) != dtypes[k]:
                raise SignatureError(
                    f"Field {name} changes dtype: item {first_index} has "
                    f"{dtypes[k].name}, item {index} has {tf_dtype(a).name}."
                )
            if a.ndim != len(shapes[k]):
                raise SignatureError(
                    f"Field {name} changes rank: item {first_index} has shape "
                    f"{tuple(shapes[k])}, item {index} has shape {a.shape}."
                )
            shapes[k] = [d if d == e else None for d, e in zip(shapes[k], a.shape)]
    specs = [tf.TensorSpec(s, d) for s, d in zip(shapes, dtypes)]
    return _pack(skeleton, specs)


def open_leading_dimension(signature: Any) -> Any:
    """The signature with the first dimension of every leaf of rank >= 1 set
    to None: the batch dimension of items that are batches."""
    skeleton, leaves = flatten(signature)
    specs = [
        tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype) if spec.shape.rank else spec
        for _, spec in leaves
    ]
    return _pack(skeleton, specs)


def normalize_signature(signature: Any) -> Any:
    """Checks a user ``output_signature`` and turns lists into tuples."""

    def norm(s, path):
        if isinstance(s, tf.TensorSpec):
            return s
        if isinstance(s, dict):
            return {k: norm(s[k], path + (k,)) for k in sorted(s)}
        if isinstance(s, (tuple, list)):
            return tuple(norm(v, path + (i,)) for i, v in enumerate(s))
        raise TypeError(
            "`output_signature` must be a tf.TensorSpec or a tuple/list/dict "
            f"nest of them; the entry at {list(path) or 'top level'} is not. Received: {s!r}"
        )

    return norm(signature, ())


class ItemChecker:
    """Checks items against a signature and flattens them for numpy_function."""

    def __init__(self, signature: Any):
        skeleton, leaves = flatten(signature)
        self.skeleton = skeleton
        self.specs = [spec for _, spec in leaves]
        self.names = [field_name(path, skeleton) for path, _ in leaves]
        self.np_dtypes = [None if s.dtype == tf.string else s.dtype.as_numpy_dtype for s in self.specs]
        self.shapes = [s.shape.as_list() if s.shape.rank is not None else None for s in self.specs]

    def pack(self, tensors: list) -> Any:
        return _pack(self.skeleton, tensors)

    def flat_arrays(self, index: int, item: Any) -> list:
        """Returns the item's leaves as arrays; raises SignatureError on mismatch."""
        skeleton, leaves = flatten(item)
        if skeleton != self.skeleton:
            raise SignatureError(
                f"Item {index} does not match the dataset's structure: expected "
                f"{_describe(self.skeleton)}, received {_describe(skeleton)}."
            )
        out = []
        for k, (_, leaf) in enumerate(leaves):
            try:
                a = as_array(leaf)
            except UnsupportedLeaf as e:
                raise leaf_error(index, self.names[k], e) from None
            want = self.np_dtypes[k]
            if want is None:
                if a.dtype != object:
                    self._fail(index, k, f"dtype string, received {a.dtype}")
            elif a.dtype != want:
                self._fail(index, k, f"dtype {np.dtype(want).name}, received {a.dtype.name}")
            shape = self.shapes[k]
            if shape is not None and (
                a.ndim != len(shape) or any(d is not None and d != e for d, e in zip(shape, a.shape))
            ):
                dims = ", ".join("None" if d is None else str(d) for d in shape)
                expected = "(" + dims + ("," if len(shape) == 1 else "") + ")"
                self._fail(index, k, f"shape {expected}, received shape {a.shape}")
            out.append(a)
        return out

    def _fail(self, index: int, k: int, what: str) -> None:
        raise SignatureError(
            f"Item {index}, field {self.names[k]}: expected {what}. (None in a "
            "shape means any size; pass `output_signature=` to to_dataset to "
            "widen the signature, or probe more items with `probe=`.)"
        )
