"""The element spec of an export, without TensorFlow.

Workers check every item against it, the manifest stores it as JSON, and
``load_export`` turns it into ``tf.TensorSpec``s. Items are nests of
tuples/lists/dicts (string keys) whose leaves are arrays, numbers, bytes or
strings; leaves are ordered as ``tf.nest`` orders them (dict keys sorted).
Inference follows ``to_dataset``: the first items and the last are probed,
and a dimension that differs between them becomes None.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from kerasfeed._leaves import as_array
from kerasfeed.errors import SignatureError

STRING = "string"
# The numeric dtypes TensorFlow has (numpy names); strings are STRING.
NUMERIC = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_KERAS_NAMES = ("x", "y", "sample_weight")


def _flatten(item: Any, path: tuple, out: list) -> Any:
    if isinstance(item, dict):
        for k in item:
            if not isinstance(k, str):
                raise SignatureError(
                    f"Dict keys of exported items must be strings; the dict at {list(path) or 'top level'} "
                    f"has key {k!r} of type {type(k).__name__}. Received: keys {sorted(map(repr, item))}"
                )
        return {k: _flatten(item[k], path + (k,), out) for k in sorted(item)}
    if isinstance(item, (tuple, list)):
        return [_flatten(v, path + (i,), out) for i, v in enumerate(item)]
    out.append((path, item))
    return None


def flatten(item: Any) -> tuple[Any, list]:
    """Returns ``(skeleton, [(path, leaf), ...])``; skeleton: dict / list / None (a leaf)."""
    out: list = []
    return _flatten(item, (), out), out


def pack(skeleton: Any, leaves: Sequence) -> Any:
    """Rebuilds a nest from its skeleton (lists become tuples) and its leaves."""
    it = iter(leaves)

    def build(s):
        if s is None:
            return next(it)
        if isinstance(s, dict):
            return {k: build(v) for k, v in s.items()}
        return tuple(build(v) for v in s)

    return build(skeleton)


def field_name(path: tuple, skeleton: Any) -> str:
    """Human name of a leaf, as ``to_dataset`` says it: ``x``, ``y['mask']``, ``[3][0]``, ``item``."""
    if not path:
        return "item"
    head, rest = path[0], path[1:]
    if isinstance(skeleton, list) and len(skeleton) <= 3 and isinstance(head, int):
        first = _KERAS_NAMES[head]
    else:
        first = f"[{head!r}]"
    return first + "".join(f"[{p!r}]" for p in rest)


def feature_key(path: tuple, skeleton: Any) -> str:
    """The record's feature name of a leaf: ``x``, ``y/mask``, ``3/0`` or ``item``."""
    if not path:
        return "item"
    head, rest = path[0], path[1:]
    keras_tuple = isinstance(skeleton, list) and len(skeleton) <= 3 and isinstance(head, int)
    first = _KERAS_NAMES[head] if keras_tuple else str(head)
    return "/".join([first] + [str(p) for p in rest])


def dtype_name(a: np.ndarray) -> str:
    if a.dtype.kind in "OSU":
        return STRING
    name = a.dtype.name
    if name not in NUMERIC:
        raise SignatureError(
            f"Unsupported dtype {a.dtype}: an export holds {', '.join(NUMERIC)} or strings. Received: dtype {a.dtype}"
        )
    return name


def _shape_text(shape: Sequence[Optional[int]]) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


class ExportSpec:
    """The structure, feature names, dtypes and shapes (None = varies) of every item.

    Attributes:
        skeleton: the nest with None at the leaves (tuples as lists).
        names: human field names (``x``, ``y['mask']``).
        keys: feature names in the records (``x``, ``y/mask``).
        dtypes: numpy dtype names, or ``"string"``.
        shapes: lists of ints and None.
    """

    def __init__(
        self, skeleton: Any, paths: Sequence[tuple], dtypes: Sequence[str], shapes: Sequence[Sequence[Optional[int]]]
    ):
        self.skeleton = skeleton
        self.paths = [tuple(p) for p in paths]
        self.dtypes = list(dtypes)
        self.shapes = [list(s) for s in shapes]
        self.names = [field_name(p, skeleton) for p in self.paths]
        keys = [feature_key(p, skeleton) for p in self.paths]
        taken = set(keys) | {k + ":shape" for k in keys}
        if len(taken) != 2 * len(keys):  # e.g. a dict key "a/b" next to a nested a -> b
            keys = [f"f{k}" for k in range(len(keys))]
        self.keys = keys

    @classmethod
    def infer(cls, probes: Sequence[tuple[int, Any]]) -> "ExportSpec":
        """From probed ``(index, item)`` pairs; raises SignatureError naming both indices."""
        first_index, first = probes[0]
        skeleton, leaves = flatten(first)
        arrays = [as_array(v) for _, v in leaves]
        dtypes = [dtype_name(a) for a in arrays]
        shapes = [list(a.shape) for a in arrays]
        spec = cls(skeleton, [p for p, _ in leaves], dtypes, shapes)
        for index, item in probes[1:]:
            other, other_leaves = flatten(item)
            if other != skeleton:
                raise SignatureError(
                    f"Items have different structures: item {first_index} is {_describe(skeleton)} but item "
                    f"{index} is {_describe(other)}. Every item must have the same nesting of tuples/dicts."
                )
            for k, (_, leaf) in enumerate(other_leaves):
                a = as_array(leaf)
                if dtype_name(a) != dtypes[k]:
                    raise SignatureError(
                        f"Field {spec.names[k]} changes dtype: item {first_index} has {dtypes[k]}, "
                        f"item {index} has {dtype_name(a)}."
                    )
                if a.ndim != len(shapes[k]):
                    raise SignatureError(
                        f"Field {spec.names[k]} changes rank: item {first_index} has shape {tuple(shapes[k])}, "
                        f"item {index} has shape {a.shape}."
                    )
                shapes[k] = [d if d == e else None for d, e in zip(shapes[k], a.shape)]
        spec.shapes = shapes
        return spec

    @classmethod
    def from_tensor_specs(cls, signature: Any) -> "ExportSpec":
        """From a nest of ``tf.TensorSpec`` (duck-typed: ``.dtype.name``, ``.shape``)."""
        skeleton, leaves = flatten(signature)
        dtypes, shapes = [], []
        for path, s in leaves:
            if not (hasattr(s, "dtype") and hasattr(s, "shape")):
                raise TypeError(
                    f"`output_signature` must be a nest of tf.TensorSpec; the entry at {list(path)} is not. "
                    f"Received: {s!r}"
                )
            name = s.dtype.name
            if name != STRING and name not in NUMERIC:
                raise SignatureError(f"Unsupported dtype in `output_signature` at {list(path)}. Received: {s!r}")
            dtypes.append(name)
            shapes.append(list(s.shape.as_list()))
        return cls(skeleton, [p for p, _ in leaves], dtypes, shapes)

    def arrays(self, index: int, item: Any, hint: str = "") -> list[np.ndarray]:
        """Item ``index``'s leaves as arrays; raises SignatureError naming index and field."""
        skeleton, leaves = flatten(item)
        if skeleton != self.skeleton:
            raise SignatureError(
                f"Item {index} does not match the export's structure: expected {_describe(self.skeleton)}, "
                f"received {_describe(skeleton)}.{hint}"
            )
        out = []
        for k, (_, leaf) in enumerate(leaves):
            a = as_array(leaf)
            got = STRING if a.dtype.kind in "OSU" else a.dtype.name
            if got != self.dtypes[k]:
                self._fail(index, k, f"dtype {self.dtypes[k]}, received {got}", hint)
            if got == STRING:
                odd = next((v for v in a.reshape(-1) if not isinstance(v, bytes)), b"")
                if not isinstance(odd, bytes):
                    self._fail(index, k, f"strings, received an element of type {type(odd).__name__}: {odd!r}", hint)
            shape = self.shapes[k]
            if a.ndim != len(shape) or any(d is not None and d != e for d, e in zip(shape, a.shape)):
                self._fail(index, k, f"shape {_shape_text(shape)}, received shape {a.shape}", hint)
            out.append(a)
        return out

    def _fail(self, index: int, k: int, what: str, hint: str) -> None:
        raise SignatureError(f"Item {index}, field {self.names[k]}: expected {what}.{hint}")

    def to_json(self) -> dict:
        return {
            "structure": self.skeleton,
            "fields": [
                {"name": n, "key": key, "path": list(p), "dtype": d, "shape": s}
                for n, key, p, d, s in zip(self.names, self.keys, self.paths, self.dtypes, self.shapes)
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ExportSpec":
        fields = data["fields"]
        paths, dtypes, shapes = ([f[k] for f in fields] for k in ("path", "dtype", "shape"))
        spec = cls(data["structure"], paths, dtypes, shapes)
        spec.keys = [f["key"] for f in fields]
        return spec

    def tensor_specs(self) -> Any:
        """The nest of ``tf.TensorSpec`` (imports TensorFlow)."""
        import tensorflow as tf

        dtypes = [tf.string if d == STRING else tf.as_dtype(d) for d in self.dtypes]
        specs = [tf.TensorSpec(s, d) for s, d in zip(self.shapes, dtypes)]
        return pack(self.skeleton, specs)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ExportSpec) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {d}{_shape_text(s)}" for n, d, s in zip(self.names, self.dtypes, self.shapes))
        return f"ExportSpec({fields})"


def _describe(skeleton: Any) -> str:
    if skeleton is None:
        return "array"
    if isinstance(skeleton, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in skeleton.items()) + "}"
    return "(" + ", ".join(_describe(v) for v in skeleton) + ("," if len(skeleton) == 1 else "") + ")"
