"""Item leaves as numpy arrays, the same way for every front end (TF-free).

``to_dataset``, ``to_loader`` and ``export`` all turn the leaves of an item
into arrays here: text becomes object arrays of UTF-8 bytes (what
TensorFlow's string tensors hold, byte for byte: trailing NUL bytes kept),
and leaves no front end can hold (None, arbitrary objects) are refused with
what is wrong, for the caller to name the item and field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kerasfeed._nest import field_name
from kerasfeed.errors import SignatureError


class UnsupportedLeaf(ValueError):
    """A leaf no front end can hand over (the rule is what TensorFlow holds); the caller adds the index and field."""


def short_repr(obj: Any, limit: int = 80) -> str:
    r = repr(obj)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _to_bytes(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    raise UnsupportedLeaf(v)


def as_array(leaf: Any) -> np.ndarray:
    """Converts a leaf to an ndarray that ``tf.numpy_function`` accepts.

    Raises:
        UnsupportedLeaf: the leaf is None, an arbitrary Python object, an
            object array holding anything but str/bytes, or a ragged nested
            list; its ``args`` are (what is wrong, the offending value).
    """
    if leaf is None:
        raise UnsupportedLeaf("is None", leaf)
    try:
        a = np.asarray(leaf)
    except ValueError as e:  # numpy >= 1.24: ragged nested sequences
        raise UnsupportedLeaf(f"cannot become an array ({e})", leaf) from None
    if a.dtype.kind == "U":
        if isinstance(leaf, str):  # numpy's "U" dtype drops trailing NULs; keep them
            return np.array(leaf.encode("utf-8"), dtype=object)
        return np.char.encode(a, "utf-8").astype(object)
    if a.dtype.kind == "S":
        if isinstance(leaf, np.ndarray):
            return a.astype(object)
        # Python bytes: numpy's "S" dtype drops trailing NUL bytes; keep them.
        return np.array(leaf, dtype=object)
    if a.dtype.kind == "O":
        # TensorFlow holds only strings in object arrays; anything else (None,
        # Python ints, nested arrays) would fail inside tf.data with
        # "Unsupported object type" and no index. One pass converts and checks.
        out = np.empty(a.shape, object)
        flat_in, flat_out = a.reshape(-1), out.reshape(-1)
        for j, v in enumerate(flat_in):
            try:
                flat_out[j] = _to_bytes(v)
            except UnsupportedLeaf:
                if not a.ndim:
                    what = (
                        f"is an object of type {type(v).__name__}, which kerasfeed cannot hand over "
                        "(object arrays hold only str/bytes)"
                    )
                else:
                    at = tuple(int(d) for d in np.unravel_index(j, a.shape))
                    what = (
                        f"is an object array (dtype=object) whose element {at} is {type(v).__name__} "
                        f"{short_repr(v, 40)}; object arrays may hold only str/bytes "
                        "(what tf.data holds; to_loader keeps the same rule)"
                    )
                raise UnsupportedLeaf(what, leaf) from None
        return out
    return a


def leaf_error(index: Any, name: str, problem: UnsupportedLeaf) -> SignatureError:
    """The ``SignatureError`` for an unsupported leaf, naming item and field."""
    what, value = problem.args
    field = "" if name == "item" else f", field {name}"
    hint = (
        "Return numeric arrays, numbers, str or bytes (convert object arrays with "
        "np.asarray(v, dtype=...); for varying lengths use a padded array, or ragged=True with to_dataset)."
    )
    return SignatureError(f"Item {index}{field} {what}. {hint} Received: {short_repr(value)}")


def leaf_array(index: Any, name: str, leaf: Any) -> np.ndarray:
    """``as_array(leaf)`` for field ``name`` of item ``index``; a ``SignatureError`` naming both."""
    try:
        return as_array(leaf)
    except UnsupportedLeaf as e:
        raise leaf_error(index, name, e) from None


def leaf_arrays(index: Any, leaves: list, skeleton: Any) -> list:
    """The ``(path, leaf)`` pairs of item ``index`` as arrays (``leaf_array``), for ``infer_fields``."""
    return [leaf_array(index, field_name(path, skeleton), leaf) for path, leaf in leaves]
