"""The element spec of an export, without TensorFlow.

Workers check every item against it, the manifest stores it as JSON, and
``load_export`` turns it into ``tf.TensorSpec``s (with the leading dimension
open, as ``to_dataset`` gives). Items are nests of
tuples/lists/dicts (string keys) whose leaves are arrays, numbers, bytes or
strings; leaves are ordered as ``tf.nest`` orders them (dict keys sorted).
Inference follows ``to_dataset``: the first items and the last are probed,
and a dimension that differs between them becomes None.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from kerasfeed import _nest
from kerasfeed._leaves import leaf_array, leaf_arrays
from kerasfeed._nest import feature_key, field_name, shape_fits
from kerasfeed._nest import shape_text as _shape_text
from kerasfeed.errors import SignatureError

STRING = "string"
# The numeric dtypes TensorFlow has (numpy names); strings are STRING.
NUMERIC = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip


def _check_keys(d: dict, path: tuple) -> None:
    for k in d:
        if not isinstance(k, str):
            raise SignatureError(
                f"Dict keys of exported items must be strings; the dict at {list(path) or 'top level'} "
                f"has key {k!r} of type {type(k).__name__}. Received: keys {sorted(map(repr, d))}"
            )


def _sequences_as(kind: type, skeleton: Any) -> Any:
    """The skeleton with its sequences as ``kind``: lists as JSON holds them, tuples as ``flatten`` makes them."""
    if isinstance(skeleton, dict):
        return {k: _sequences_as(kind, v) for k, v in skeleton.items()}
    if isinstance(skeleton, (tuple, list)):
        return kind(_sequences_as(kind, v) for v in skeleton)
    return skeleton


def dtype_name(a: np.ndarray) -> str:
    if a.dtype.kind in "OSU":
        return STRING
    name = a.dtype.name
    if name not in NUMERIC:
        raise SignatureError(
            f"Unsupported dtype {a.dtype}: an export holds {', '.join(NUMERIC)} or strings. Received: dtype {a.dtype}"
        )
    return name


class ExportSpec:
    """The structure, feature names, dtypes and shapes (None = varies) of every item.

    Attributes:
        skeleton: the nest with None at the leaves (sequences as tuples).
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
        skeleton, paths, dtypes, shapes = _nest.infer_fields(probes, leaf_arrays, dtype_name, _check_keys)
        return cls(skeleton, paths, dtypes, shapes)

    @classmethod
    def from_tensor_specs(cls, signature: Any) -> "ExportSpec":
        """From a nest of ``tf.TensorSpec`` (duck-typed: ``.dtype.name``, ``.shape``)."""
        skeleton, leaves = _nest.flatten(signature, _check_keys)
        dtypes, shapes = [], []
        for path, s in leaves:
            if not (hasattr(s, "dtype") and hasattr(getattr(s, "shape", None), "as_list")):  # a numpy array too
                raise TypeError(
                    f"`output_signature` must be a nest of tf.TensorSpec; the entry at {list(path)} is not. "
                    f"Received: {s!r}"
                )
            name, kind = s.dtype.name, type(s).__name__
            if kind in ("RaggedTensorSpec", "SparseTensorSpec"):  # else taken as a dense spec of that shape
                raise TypeError(
                    f"`output_signature` at {list(path)} is a {kind}: export writes each leaf of an item as one dense "
                    f"array, whose dimensions may vary between items, and load_export reads it back dense. Give a "
                    f"tf.TensorSpec with None for the dimensions that vary, e.g. tf.TensorSpec("
                    f"{s.shape.as_list()}, {name!r}). Received: {s!r}")
            if name != STRING and name not in NUMERIC:
                raise SignatureError(f"Unsupported dtype in `output_signature` at {list(path)}. Received: {s!r}")
            if getattr(s.shape, "rank", 0) is None:  # the reader parses "<key>:shape" with a fixed length
                raise ValueError(
                    f"`output_signature` at {list(path)} has an unknown rank; give every entry its rank, with None "
                    f"for the dimensions that vary, e.g. tf.TensorSpec([None, 3], {name!r}). Received: {s!r}"
                )
            dtypes.append(name)
            shapes.append(list(s.shape.as_list()))
        return cls(skeleton, [p for p, _ in leaves], dtypes, shapes)

    def arrays(self, index: int, item: Any, hint: str = "") -> list[np.ndarray]:
        """Item ``index``'s leaves as arrays; raises SignatureError naming index and field."""
        leaves = _nest.leaves_like(self.skeleton, index, item, "the export", hint, _check_keys)
        out = []
        for k, (_, leaf) in enumerate(leaves):
            a = leaf_array(index, self.names[k], leaf)
            got = STRING if a.dtype.kind in "OSU" else a.dtype.name
            if got != self.dtypes[k]:
                self._fail(index, k, f"dtype {self.dtypes[k]}, received {got}", hint)
            if got == STRING:
                odd = next((v for v in a.reshape(-1) if not isinstance(v, bytes)), b"")
                if not isinstance(odd, bytes):
                    self._fail(index, k, f"strings, received an element of type {type(odd).__name__}: {odd!r}", hint)
            shape = self.shapes[k]
            if not shape_fits(shape, a.shape):
                self._fail(index, k, f"shape {_shape_text(shape)}, received shape {a.shape}", hint)
            out.append(a)
        return out

    def _fail(self, index: int, k: int, what: str, hint: str) -> None:
        raise SignatureError(f"Item {index}, field {self.names[k]}: expected {what}.{hint}")

    def to_json(self) -> dict:
        return {
            "structure": _sequences_as(list, self.skeleton),
            "fields": [
                {"name": n, "key": key, "path": list(p), "dtype": d, "shape": s}
                for n, key, p, d, s in zip(self.names, self.keys, self.paths, self.dtypes, self.shapes)
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> "ExportSpec":
        fields = data["fields"]
        paths, dtypes, shapes = ([f[k] for f in fields] for k in ("path", "dtype", "shape"))
        spec = cls(_sequences_as(tuple, data["structure"]), paths, dtypes, shapes)
        spec.keys = [f["key"] for f in fields]
        return spec

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ExportSpec) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {d}{_shape_text(s)}" for n, d, s in zip(self.names, self.dtypes, self.shapes))
        return f"ExportSpec({fields})"

