"""Item nests, the same way for every front end (TF-free; ``docs/architecture.md``, "Item nests").

``to_dataset``, ``to_loader`` and ``export`` flatten, name and describe items here, so that the three
agree: leaves in ``tf.nest`` order (dict keys sorted, lists read as tuples); field names as in Keras,
a top-level tuple of 1-3 entries being ``(x, y, sample_weight)``, dict keys ``['image']``, other
positions ``[2]``. A *skeleton* is the nest with None at the leaves, dicts kept and sequences as
tuples (one read back from JSON has lists; every function here takes both).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

from kerasfeed.errors import SignatureError, held_objects, short_repr

KERAS_NAMES = ("x", "y", "sample_weight")


def _flatten(item: Any, path: tuple, out: list, check_dict: Optional[Callable[[dict, tuple], None]]) -> Any:
    if isinstance(item, dict):
        if check_dict is not None:
            check_dict(item, path)
        try:
            keys = sorted(item)
        except TypeError:  # e.g. {1: ..., "a": ...}: int and str do not compare
            raise _UnsortableKeys(path, list(item)) from None
        return {k: _flatten(item[k], path + (k,), out, check_dict) for k in keys}
    if isinstance(item, (tuple, list)):
        return tuple(_flatten(v, path + (i,), out, check_dict) for i, v in enumerate(item))
    out.append((path, item))
    return None


class _UnsortableKeys(Exception):
    pass


def flatten(
    item: Any, check_dict: Optional[Callable[[dict, tuple], None]] = None, index: Any = None
) -> tuple[Any, list]:
    """Returns ``(skeleton, [(path, leaf), ...])``, leaves in ``tf.nest`` order.

    Args:
        item: the nest.
        check_dict: called as ``check_dict(d, path)`` on every dict before
            its keys are sorted (to refuse keys a front end cannot hold).
        index: the item's index, for messages.

    Raises:
        SignatureError: a dict whose keys do not sort (``tf.nest``'s order).
    """
    out: list = []
    try:
        return _flatten(item, (), out, check_dict), out
    except _UnsortableKeys as e:
        path, keys = e.args
        where = f"Item {index}" if index is not None else "An item"
        inner = f" at {''.join(f'[{p!r}]' for p in path)}" if path else ""
        raise SignatureError(
            f"{where} has a dict{inner} whose keys do not sort together (items are read in sorted key order, as "
            f"tf.nest does): use keys of one type, e.g. all str. Received: keys={keys!r}"
        ) from None


def leaves_like(skeleton: Any, index: Any, item: Any, owner: str, hint: str = "",
                check_dict: Optional[Callable[[dict, tuple], None]] = None) -> list:
    """``[(path, leaf), ...]`` of item ``index``, which must have ``skeleton``'s structure.

    Args:
        check_dict: as in ``flatten``.

    Raises:
        SignatureError: another structure; ``owner`` says whose (``the
            dataset``, ``the loader``, ``the export``).
    """
    other, leaves = flatten(item, check_dict, index)
    if other != skeleton:
        raise SignatureError(
            f"Item {index} does not match {owner}'s structure: expected {describe(skeleton)}, "
            f"received {_received(item, other)}.{hint}"
        )
    return leaves


def _build(skeleton: Any, leaves: Any) -> Any:
    # A module-level function, not a recursive closure: a closure that calls
    # itself is a reference cycle (function -> cell -> function) holding the
    # leaves' iterator, so every packed batch's arrays would live until the
    # cyclic garbage collector runs (gigabytes with large items).
    if skeleton is None:
        return next(leaves)
    if isinstance(skeleton, dict):
        return {k: _build(v, leaves) for k, v in skeleton.items()}
    return tuple(_build(v, leaves) for v in skeleton)


def pack(skeleton: Any, leaves: Sequence[Any]) -> Any:
    """Rebuilds a nest shaped like ``skeleton`` (sequences become tuples)."""
    return _build(skeleton, iter(leaves))


def _keras_position(path: tuple, skeleton: Any) -> bool:
    """Whether the leaf's first step is a position of a Keras ``(x, y, sample_weight)`` tuple."""
    return isinstance(skeleton, (tuple, list)) and len(skeleton) <= 3 and isinstance(path[0], int)


def field_name(path: tuple, skeleton: Any) -> str:
    """Human name of a leaf: ``x``, ``y['mask']``, ``[3][0]`` or ``item``."""
    if not path:
        return "item"
    first = KERAS_NAMES[path[0]] if _keras_position(path, skeleton) else f"[{path[0]!r}]"
    return first + "".join(f"[{p!r}]" for p in path[1:])


def feature_key(path: tuple, skeleton: Any) -> str:
    """A leaf's name as a record feature: ``x``, ``y/mask``, ``3/0`` or ``item``."""
    if not path:
        return "item"
    first = KERAS_NAMES[path[0]] if _keras_position(path, skeleton) else str(path[0])
    return "/".join([first] + [str(p) for p in path[1:]])


def _received(item: Any, structure: Any) -> str:
    """``describe`` of an item's structure; a leaf that is no array or number is named by its type (a generator
    returned by mistake was "received array")."""
    if item is None:
        return "None"
    if structure is None and not hasattr(item, "__array__") and not isinstance(item, (int, float, complex, str, bytes)):
        return f"an object of type {type(item).__name__}"
    return describe(structure)


def describe(skeleton: Any) -> str:
    """A structure as messages show it: ``({'image': array}, array)``."""
    if skeleton is None:
        return "array"
    if isinstance(skeleton, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in skeleton.items()) + "}"
    return "(" + ", ".join(describe(v) for v in skeleton) + ("," if len(skeleton) == 1 else "") + ")"


def shape_text(shape: Sequence[Optional[int]]) -> str:
    """``(None, 3)``, ``(5,)``: a shape whose unknown dimensions are None."""
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def shape_fits(shape: Sequence[Optional[int]], actual: Sequence[int]) -> bool:
    """Whether ``actual`` has ``shape``'s rank and its known dimensions."""
    return len(actual) == len(shape) and all(d is None or d == e for d, e in zip(shape, actual))


def shape_check(shape: Sequence[Optional[int]]) -> tuple:
    """``(ndim, get, want)``: ``shape_fits(shape, actual)`` is ``len(actual) == ndim
    and get(actual) == want``, with C-level calls only (for per-item checks)."""
    known = [i for i, d in enumerate(shape) if d is not None]
    if not known:
        return len(shape), len, len(shape)  # only the rank is known
    get = operator.itemgetter(*known)
    return len(shape), get, get(tuple(shape))


def infer_fields(
    probes: Sequence[tuple[Any, Any]], arrays: Callable[[Any, list, Any], list], dtype_of: Callable[[Any], Any],
    check_dict: Optional[Callable[[dict, tuple], None]] = None,
) -> tuple[Any, list, list, list]:
    """What every item must be, from probed ``(index, item)`` pairs.

    A dimension that differs between probes becomes None; a structure, dtype
    or rank that differs raises ``SignatureError`` naming both items.

    Args:
        probes: at least one ``(index, item)``.
        arrays: ``arrays(index, leaves, skeleton)`` gives the leaves as arrays.
        dtype_of: the dtype a front end records for an array (compared with
            ``==``; messages show its ``.name``, or the value itself).
        check_dict: as in ``flatten``.

    Returns:
        ``(skeleton, paths, dtypes, shapes)``, shapes as lists of ints and None.
    """
    def name(dtype: Any) -> str:
        return getattr(dtype, "name", dtype)

    first_index, first = probes[0]
    skeleton, leaves = flatten(first, check_dict, first_index)
    if not leaves:  # tf.data could make nothing of it (a bare TypeError inside TensorFlow); no front end could
        raise SignatureError(
            f"Item {first_index} holds no array (it is {describe(skeleton)}): an item must hold at least one (a batch, "
            f"a sample, a tuple or dict of fields). Received: item {first_index}={short_repr(first, 80)}"
        )
    first_arrays = arrays(first_index, leaves, skeleton)
    shapes = [list(a.shape) for a in first_arrays]
    dtypes = []
    for (path, _), a in zip(leaves, first_arrays):
        try:
            dtypes.append(dtype_of(a))
        except SignatureError as e:  # which field of which item: a compound HDF5 dataset's, say
            raise SignatureError(f"Item {first_index}, field {field_name(path, skeleton)}: {e}") from None
    for index, item in probes[1:]:
        other, other_leaves = flatten(item, check_dict, index)
        if other != skeleton:
            raise SignatureError(
                f"Items have different structures: item {first_index} is {describe(skeleton)} but item "
                f"{index} is {'None' if item is None else describe(other)}. Every item must have the same nesting "
                "of tuples/dicts."
            )
        for k, a in enumerate(arrays(index, other_leaves, skeleton)):
            if dtype_of(a) != dtypes[k]:
                field = field_name(other_leaves[k][0], skeleton)
                held = held_objects(a)  # a str leaf, say: which
                raise SignatureError(
                    f"Field {field} changes dtype: item {first_index} has {name(dtypes[k])}, "
                    f"item {index} has {name(dtype_of(a))}{f' ({held})' if held else ''}."
                )
            if a.ndim != len(shapes[k]):
                field = field_name(other_leaves[k][0], skeleton)
                raise SignatureError(
                    f"Field {field} changes rank: item {first_index} has shape {tuple(shapes[k])}, "
                    f"item {index} has shape {a.shape}."
                )
            shapes[k] = [d if d == e else None for d, e in zip(shapes[k], a.shape)]
    return skeleton, [path for path, _ in leaves], dtypes, shapes
