"""Item leaves as numpy arrays, the same way for every front end (TF-free).

``to_dataset``, ``to_loader`` and ``export`` all turn the leaves of an item
into arrays here: text becomes object arrays of UTF-8 bytes (what
TensorFlow's string tensors hold, byte for byte: trailing NUL bytes kept),
and leaves no front end can hold (None, arbitrary objects) are refused with
what is wrong, for the caller to name the item and field.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from kerasfeed._nest import describe, field_name, flatten, pack
from kerasfeed.errors import SignatureError, held_objects, short_repr


class UnsupportedLeaf(ValueError):
    """A leaf no front end can hand over (the rule is what TensorFlow holds); the caller adds the index and field."""


def _to_bytes(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8")
    raise UnsupportedLeaf(v)


def dtype_mismatch(want: Any, got: np.ndarray) -> str:
    """``"dtype float32, received float64"``; with the byte order where only it
    differs (``"<f4, received >f4"``, not ``"float32, received float32"``), and
    what an object array holds (``"received object: str 'oops'"``: a str leaf)."""
    want, dtype = np.dtype(want), got.dtype
    if want.name == dtype.name:
        return f"dtype {want.str}, received {dtype.str}"
    # A str or bytes leaf becomes an object array: say what it holds.
    return f"dtype {want.name}, received {held_objects(got) or dtype.name}"


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
    except (TypeError, RuntimeError) as e:  # e.g. a torch tensor that requires grad, or of bfloat16
        raise UnsupportedLeaf(
            f"cannot become a numpy array ({type(e).__name__}: {e}; a torch tensor: `.detach().cpu().numpy()`)", leaf
        ) from None
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
                    what = (f"is an object of type {type(v).__name__}, which kerasfeed cannot hand over "
                            "(object arrays hold only str/bytes)")
                else:
                    at = tuple(int(d) for d in np.unravel_index(j, a.shape))
                    what = (f"is an object array (dtype=object) whose element {at} is {type(v).__name__} "
                            f"{short_repr(v, 40)}; object arrays may hold only str/bytes "
                            "(what tf.data holds; to_loader keeps the same rule)")
                raise UnsupportedLeaf(what, leaf) from None
        return out
    if not a.dtype.isnative:  # e.g. a big-endian HDF5 dataset's rows: TensorFlow, JAX and torch take native only
        return a.astype(a.dtype.newbyteorder("="))
    return a


def loader_dtype(a: np.ndarray) -> np.dtype:
    """The dtype ``to_loader`` records for leaf ``a``: only those ``to_dataset`` has (under the TensorFlow
    backend, Keras reads a loader through tf.data). ``SignatureError`` for dates, durations, records, and
    extended precision (``np.longdouble`` where it is float128)."""
    wide = a.dtype.kind in "fc" and a.dtype.itemsize > (8 if a.dtype.kind == "f" else 16)  # float128, complex256
    if a.dtype.kind in "Mm" or a.dtype.type is np.void or wide:
        raise SignatureError(
            f"Unsupported dtype {a.dtype}: to_loader takes the dtypes to_dataset takes (TensorFlow has no such "
            "type, and Keras' TensorFlow backend reads a loader through tf.data). Convert it in the item: "
            "a.astype('int64') for dates and durations, one field per leaf for a structured array, float64 for "
            "extended precision."
        )
    return a.dtype


def leaf_array(index: Any, name: str, leaf: Any) -> np.ndarray:
    """``as_array(leaf)`` for field ``name`` of item ``index``; a ``SignatureError`` naming both."""
    try:
        return as_array(leaf)
    except UnsupportedLeaf as e:
        what, value = e.args
    field = "" if name == "item" else f", field {name}"
    hint = ("Return numeric arrays, numbers, str or bytes (convert object arrays with "
            "np.asarray(v, dtype=...); for varying lengths use a padded array, or ragged=True with to_dataset).")
    raise SignatureError(f"Item {index}{field} {what}. {hint} Received: {short_repr(value)}") from None


def leaf_arrays(index: Any, leaves: list, skeleton: Any) -> list:
    """The ``(path, leaf)`` pairs of item ``index`` as arrays (``leaf_array``), for ``infer_fields``."""
    return [leaf_array(index, field_name(path, skeleton), leaf) for path, leaf in leaves]


def padding_leaves(padding_values: Any, skeleton: Any, dtypes: list, varying: list) -> list:
    """One padding value per leaf, as a 0-d array of the leaf's dtype.

    ``padding_values``: None (0; ``b""`` for strings), one scalar for every
    leaf, or a nest shaped like the items (``skeleton``). A leaf whose shape
    may vary (``varying``) is padded, so its value must fit its dtype:
    integers and bools exactly, floats within range, strings for string
    leaves. A fixed-shape leaf is never padded: it gets its value when the
    value fits, else the default. Both front ends use this, so
    ``to_dataset``'s ``padded_batch`` gets what ``to_loader`` pads with.

    Raises:
        ValueError: a nest of another structure, or a value a padded leaf's
            dtype cannot hold; the message names the field.
    """
    names = [field_name(path, skeleton) for path, _ in flatten(pack(skeleton, dtypes))[1]]
    if padding_values is None:
        values = [None] * len(dtypes)
    elif isinstance(padding_values, (dict, tuple, list)):
        given, leaves = flatten(padding_values)
        if given != skeleton:
            raise ValueError("`padding_values` must be one scalar or a nest shaped like the items "
                             f"({describe(skeleton)}). Received: padding_values={short_repr(padding_values)}")
        values = [v for _, v in leaves]
    else:
        values = [padding_values] * len(dtypes)
    out = []
    for name, dtype, value, pads in zip(names, dtypes, values, varying):
        field = "the items" if name == "item" else f"field {name}"
        try:
            out.append(_padding_leaf(field, np.dtype(dtype), value))
        except ValueError:
            if pads:
                raise
            out.append(_padding_leaf(field, np.dtype(dtype), None))  # never used: no shape of it varies
    return out


def _padding_leaf(field: str, dtype: np.dtype, value: Any) -> np.ndarray:
    if dtype == np.dtype(object):  # strings
        if value is None:
            return np.array(b"", dtype=object)
        if isinstance(value, (str, bytes, np.str_, np.bytes_)):
            return np.array(_to_bytes(value.item() if isinstance(value, np.generic) else value), dtype=object)
        raise ValueError(f"`padding_values` for {field} (strings) must be str or bytes. Received: {value!r}")
    if value is None:
        return np.zeros((), dtype)
    a = np.asarray(value)
    if a.ndim or a.dtype.kind not in "biufc":
        raise ValueError(f"`padding_values` for {field} ({dtype.name}) must be a number. Received: {value!r}")
    if a.dtype.kind == "c" and dtype.kind != "c" and a.imag == 0:
        a = a.real
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ComplexWarning (a dropped imaginary part): refused below
        cast = a.astype(dtype)
    exact = dtype.kind in "biu" or a.dtype.kind == "c"  # rounding a real into a float leaf is fine
    fits = cast == a if exact else (np.isfinite(cast) | ~np.isfinite(a)) & (np.isnan(cast) == np.isnan(a))
    if not fits:
        raise ValueError(f"`padding_values` for {field} must fit its dtype {dtype.name}, which cannot hold it "
                         f"(it would become {cast.item()!r}). Received: {value!r}")
    return cast
