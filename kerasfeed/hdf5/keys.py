"""Paths and keys of the HDF5 sequences: checking them, and packing read arrays into the keys' structure."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence, Union

PathsLike = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
KeysLike = Union[str, Sequence[Any], Mapping[str, Any]]


def check_paths(paths, cls) -> tuple:
    """The paths as a tuple of ``os.PathLike``/str, at least one; ``cls`` names the caller in errors."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if isinstance(paths, (bytes, Mapping)) or not isinstance(paths, Sequence) or not len(paths):
        raise ValueError(
            f"{cls}: `paths` must be a path or a non-empty sequence of paths. Received: paths={paths!r}"
        )
    out = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"{cls}: every path must be a str or os.PathLike. Received: {p!r} in paths")
        out.append(os.fspath(p))
    return tuple(out)


def parse_keys(keys, cls):
    """Checks a nest of dataset names; returns ``(structure, leaves)``: the nest and its unique names, in order."""
    leaves: list = []

    def walk(node, where):
        if isinstance(node, str):
            if not node:
                raise ValueError(f"{cls}: dataset names must be non-empty. Received: keys{where}={node!r}")
            if node not in leaves:
                leaves.append(node)
            return node
        if isinstance(node, Mapping):
            if not node:
                raise ValueError(f"{cls}: `keys` has an empty dict at keys{where}. Received: keys={keys!r}")
            return {k: walk(v, f"{where}[{k!r}]") for k, v in node.items()}
        if isinstance(node, (tuple, list)):
            if not node:
                raise ValueError(f"{cls}: `keys` has an empty sequence at keys{where}. Received: keys={keys!r}")
            return tuple(walk(v, f"{where}[{j}]") for j, v in enumerate(node))
        raise TypeError(
            f"{cls}: `keys` must be a dataset name, a tuple/list or a dict of them; found "
            f"{type(node).__name__} at keys{where}. Received: keys={keys!r}"
        )

    structure = walk(keys, "")
    return structure, tuple(leaves)


def build_structure(structure, arrays):
    """The arrays read (by dataset name) packed into the nest of ``keys``."""
    if isinstance(structure, str):
        return arrays[structure]
    if isinstance(structure, dict):
        return {k: build_structure(v, arrays) for k, v in structure.items()}
    return tuple(build_structure(v, arrays) for v in structure)


def list_datasets(f, limit: int = 20) -> list:
    """Up to ``limit`` dataset names in an open file, for error messages."""
    names: list = []

    def visit(name, obj):
        if hasattr(obj, "shape"):
            names.append(name)
        return None if len(names) < limit else True

    f.visititems(visit)
    return names


__all__ = ["PathsLike", "KeysLike", "check_paths", "parse_keys", "build_structure", "list_datasets"]
