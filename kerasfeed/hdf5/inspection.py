"""Checking an open HDF5 file against the keys of a sequence being built (local files and URLs alike)."""

from __future__ import annotations

from kerasfeed.hdf5.keys import list_datasets


def check_file(seq, path: str, f, dataset, specs: dict, first_file: dict, chunk_rows: list) -> int:
    """Checks the keys of one open file against the files before it; returns its rows.

    Args:
        seq: the HDF5 sequence being built (its keys, ``swmr``, class name).
        path: the file's path or URL, as messages show it.
        f: the open ``h5py.File``.
        dataset: ``dataset(key)``: the h5py dataset to check (the shared handle, for local files).
        specs, first_file: each key's ``(row shape, dtype)`` and the file it was first seen in; filled in.
        chunk_rows: gets the first dataset's chunk rows (None if contiguous) if still empty.

    Raises:
        ValueError: a key is missing, not a dataset, a scalar, differs from the other files, or the keys
            have different lengths; the message names the file and the key.
    """
    cls = type(seq).__name__
    shapes = {}
    for key in seq._leaves:
        ds = f.get(key)
        if ds is None or not hasattr(ds, "shape"):
            kind = "no dataset" if ds is None else "a group, not a dataset, at"
            raise ValueError(
                f"{cls}: file '{path}' has {kind} key '{key}'. "
                f"Datasets in the file: {list_datasets(f)}. Received: keys={seq._keys_structure!r}"
            )
        ds = dataset(key)
        if seq.swmr:
            ds.refresh()
        if ds.ndim == 0:
            raise ValueError(
                f"{cls}: dataset '{key}' in file '{path}' is a scalar; rows need at least "
                f"one axis. Received: shape={ds.shape}"
            )
        shapes[key] = ds.shape
        spec = (tuple(ds.shape[1:]), ds.dtype)
        if key not in specs:
            specs[key], first_file[key] = spec, path
        elif specs[key] != spec:
            raise ValueError(
                f"{cls}: dataset '{key}' differs between files: '{first_file[key]}' has rows "
                f"of shape {specs[key][0]} and dtype {specs[key][1]}, but '{path}' has "
                f"rows of shape {spec[0]} and dtype {spec[1]}."
            )
        if not chunk_rows:
            chunk_rows.append(ds.chunks[0] if ds.chunks else None)
    lens = {key: s[0] for key, s in shapes.items()}
    if len(set(lens.values())) > 1:
        detail = ", ".join(f"'{k}': {n}" for k, n in lens.items())
        raise ValueError(
            f"{cls}: the datasets in file '{path}' have different lengths along "
            f"axis 0; every key must have the same number of rows. Received: {detail}"
        )
    return next(iter(lens.values()))


__all__ = ["check_file"]
