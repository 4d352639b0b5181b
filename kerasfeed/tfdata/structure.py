"""Item structures: flattening with field names, signature inference and checks.

Items are nests of tuples/lists/dicts whose leaves are arrays, numbers or
strings; ``kerasfeed/_nest.py`` flattens them and names their fields (as
``to_loader`` and ``export`` do). This module adds TensorFlow's side (specs,
dtypes), so only the consumer process uses it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from kerasfeed._leaves import dtype_mismatch, leaf_array, leaf_arrays
from kerasfeed._nest import field_name, flatten, infer_fields, leaves_like, shape_check, shape_text
from kerasfeed._nest import pack as _pack
from kerasfeed.errors import SignatureError


def tf_dtype(a: np.ndarray) -> tf.DType:
    if a.dtype.kind in "OSU":
        return tf.string
    try:
        return tf.as_dtype(a.dtype)
    except TypeError as e:
        raise SignatureError(f"Unsupported dtype {a.dtype} (TensorFlow has no such type).") from e


def infer_signature(probes: Sequence[tuple[int, Any]]) -> Any:
    """Infers a nest of ``tf.TensorSpec`` from probed ``(index, item)`` pairs.

    A dimension that differs between probes becomes None. Structure, dtype
    or rank differences raise ``SignatureError`` naming both indices.
    """
    skeleton, _, dtypes, shapes = infer_fields(probes, leaf_arrays, tf_dtype)
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
        self._shape_checks = [None if s is None else shape_check(s) for s in self.shapes]
        # Items that are a flat tuple (or list) of numeric arrays, the usual ``(x, y)``, skip the generic
        # walk (``_fast``); anything else, or anything wrong, takes it (and its messages).
        self._flat_numeric = (
            isinstance(skeleton, tuple) and all(leaf is None for leaf in skeleton) and None not in self.np_dtypes
        )

    def pack(self, tensors: list) -> Any:
        return _pack(self.skeleton, tensors)

    def element(self, flat: list, marked: bool) -> Any:
        """The dataset element of one item's flat tensors (its leaves, then with ``marked`` its
        kept mark: ``(item, kept)``, the tail drops items left out), with the signature's shapes."""
        for t, spec in zip(flat, self.specs):
            t.set_shape(spec.shape)
        if marked:
            flat[-1].set_shape([])
            return self.pack(flat[:-1]), flat[-1]
        return self.pack(flat)

    def flat_arrays(self, index: int, item: Any) -> list:
        """Returns the item's leaves as arrays; raises SignatureError on mismatch."""
        if self._flat_numeric and type(item) in (tuple, list):
            fast = self._fast(item)
            if fast is not None:
                return fast
        leaves = leaves_like(self.skeleton, index, item, "the dataset")
        out = []
        for k, (_, leaf) in enumerate(leaves):
            a = leaf_array(index, self.names[k], leaf)
            want = self.np_dtypes[k]
            if want is None:
                if a.dtype != object:
                    self._fail(index, k, f"dtype string, received {a.dtype}")
            elif a.dtype != want:
                self._fail(index, k, dtype_mismatch(want, a))
            check = self._shape_checks[k]  # runs for every item: C-level calls only
            if check is not None and (a.ndim != check[0] or check[1](a.shape) != check[2]):
                self._fail(index, k, f"shape {shape_text(self.shapes[k])}, received shape {a.shape}")
            out.append(a)
        return out

    def _fast(self, item: Any) -> Any:
        """The leaves of a flat tuple or list of arrays that fit (the same checks as
        the generic walk, C-level calls only), else None."""
        if len(item) != len(self.np_dtypes):
            return None
        for a, want, check in zip(item, self.np_dtypes, self._shape_checks):
            if type(a) is not np.ndarray or a.dtype != want:
                return None
            if check is not None and (a.ndim != check[0] or check[1](a.shape) != check[2]):
                return None
        return list(item)

    def _fail(self, index: int, k: int, what: str) -> None:
        raise SignatureError(
            f"Item {index}, field {self.names[k]}: expected {what}. (None in a "
            "shape means any size; pass `output_signature=` to to_dataset to "
            "widen the signature, or probe more items with `probe=`.)"
        )
