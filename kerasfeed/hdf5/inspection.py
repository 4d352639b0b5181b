"""Opening a local HDF5 file, and checking an open one against the keys of a sequence being built (local files
and URLs alike)."""

from __future__ import annotations

import errno
import os
from typing import Optional

from kerasfeed.hdf5.keys import list_datasets


def check_file(seq, path: str, f, dataset, specs: dict, first_file: dict, chunk_rows: list) -> int:
    """Checks the keys of one open file against the files before it; returns its rows.

    Args:
        seq: the HDF5 sequence being built (its keys, ``swmr``, class name).
        path: the file's path or URL, as messages show it.
        f: the open ``h5py.File``.
        dataset: ``dataset(key)``: the h5py dataset to check (the shared handle, for local files).
        specs, first_file: each key's ``(row shape, dtype)`` and the file it was first seen in; filled in.
        chunk_rows: gets the first dataset's chunk rows (None if contiguous) if still empty and the
            dataset has rows.

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
            link = _dangling(f, key) if ds is None else None
            if link is not None:
                kind = f"a link whose target is missing ({link}) at"
            raise ValueError(
                f"{cls}: file '{path}' has {kind} key '{key}'. "
                f"Datasets in the file: {list_datasets(f)}. Received: keys={seq._keys_structure!r}"
            )
        ds = dataset(key)
        if seq.swmr:
            ds.refresh()
        missing = _missing_sources(path, ds)
        if missing:
            raise ValueError(
                f"{cls}: dataset '{key}' in file '{path}' is virtual and its source {missing[0]} is not "
                f"there: HDF5 would read its fill value in place of those rows. Received: sources missing={missing}"
            )
        if ds.ndim == 0:
            what = "an empty (null dataspace) dataset" if ds.shape is None else "a scalar"
            raise ValueError(
                f"{cls}: dataset '{key}' in file '{path}' is {what}; rows need at least "
                f"one axis. Received: shape={ds.shape}"
            )
        shapes[key] = ds.shape
        # An enum's names and codes too: numpy's dtype equality leaves out h5py's metadata, so files coding
        # "dog" as 0 and as 1 were mixed.
        spec = (tuple(ds.shape[1:]), ds.dtype)
        if key not in specs:
            specs[key], first_file[key] = spec, path
        elif specs[key] != spec or _enum(specs[key][1]) != _enum(spec[1]):
            enums = (_enum(specs[key][1]), _enum(spec[1]))
            codes = [f" and enum {e}" if enums[0] != enums[1] else "" for e in enums]
            raise ValueError(
                f"{cls}: dataset '{key}' differs between files: '{first_file[key]}' has rows "
                f"of shape {specs[key][0]} and dtype {specs[key][1]}{codes[0]}, but '{path}' has "
                f"rows of shape {spec[0]} and dtype {spec[1]}{codes[1]}."
            )
        if not chunk_rows and ds.shape[0]:  # an empty file's chunks (h5py's guess for a placeholder) say nothing
            chunk_rows.append(ds.chunks[0] if ds.chunks else None)
    lens = {key: s[0] for key, s in shapes.items()}
    if seq.swmr:  # keys a writer appends to one after the other are seen a row apart: the rows all have
        return min(lens.values())
    if len(set(lens.values())) > 1:
        detail = ", ".join(f"'{k}': {n}" for k, n in lens.items())
        raise ValueError(
            f"{cls}: the datasets in file '{path}' have different lengths along "
            f"axis 0; every key must have the same number of rows. Received: {detail}"
        )
    return next(iter(lens.values()))


__all__ = ["check_file"]


def open_local(path: str, swmr: bool, open_kwargs: dict, owner: str):
    """``h5py.File(path, "r")`` with the sequence's options; a failure names what it was.

    Raises:
        TypeError, ValueError: h5py refused ``open_kwargs`` (the file opens without them).
        PermissionError: the file cannot be read.
        OSError: the file is not HDF5, or could not be opened as HDF5.
    """
    import h5py  # lazily: `import kerasfeed` and light workers skip it

    try:
        return h5py.File(path, "r", swmr=swmr, **open_kwargs)
    except PermissionError as e:  # h5py.is_hdf5 below could not read it either: not "no HDF5 signature"
        raise PermissionError(e.errno, f"{owner}: file '{path}' cannot be read (permission denied): {e}") from e
    except Exception as e:
        if getattr(e, "errno", None) in (errno.EMFILE, errno.ENFILE):  # is_hdf5 would fail for the same reason
            import resource

            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise OSError(e.errno, (
                f"{owner}: file '{path}' could not be opened: no file descriptor left (RLIMIT_NOFILE {limit}; a "
                f"sequence keeps up to max_open_files= files open, a quarter of it by default, and other files, "
                f"sockets and sequences use the rest). Pass a smaller max_open_files=, or raise the limit (`ulimit "
                f"-n`, resource.setrlimit(resource.RLIMIT_NOFILE, ...)): {e}")) from e
        try:
            is_hdf5 = h5py.is_hdf5(path)
        except Exception:  # noqa: BLE001 - only refines the message of the error raised below
            is_hdf5 = False
        if is_hdf5 and open_kwargs and _opens_without(h5py, path, swmr):
            kind = type(e) if isinstance(e, (TypeError, ValueError)) else ValueError
            raise kind(f"{owner}: h5py.File refused `open_kwargs` for '{path}' (the file opens without them): "
                       f"{type(e).__name__}: {e}. Received: open_kwargs={open_kwargs!r}") from e
        what = (
            "could not be opened as HDF5 (corrupt or truncated; held open for writing by another process: "
            "without SWMR, or by a SWMR writer while swmr=False, where swmr=True reads it; or not written for "
            "SWMR while swmr=True)"
            if is_hdf5
            else "is not an HDF5 file (no HDF5 signature)"
        )
        raise OSError(f"{owner}: file '{path}' {what}: {type(e).__name__}: {e}") from e


def _missing_sources(path: str, ds) -> list:
    """A local virtual dataset's source files that exist neither as named nor beside ``path`` (HDF5's
    ``HDF5_VDS_PREFIX`` aside); a URL's are checked by the remote reader."""
    if not getattr(ds, "is_virtual", False) or not os.path.isfile(path):
        return []
    here = os.path.dirname(os.path.abspath(path))
    prefix = os.environ.get("HDF5_VDS_PREFIX", "")
    missing = set()
    for name, dset in {(m.file_name, m.dset_name) for m in ds.virtual_sources()}:
        found = path if name == "." else next(
            (p for p in (os.path.join(d, name) for d in ("", here, prefix)) if os.path.exists(p)), None)
        if found is None:
            missing.add(f"file {name!r}")
        elif not _has_dataset(found, dset):
            missing.add(f"dataset {dset!r} in file {name!r}")
    return sorted(missing)


def _enum(dtype) -> Optional[dict]:
    return (dtype.metadata or {}).get("enum")


def _has_dataset(path: str, dset: str) -> bool:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return hasattr(f.get(dset), "shape")
    except Exception:  # noqa: BLE001 - unreadable: HDF5 reads fill values for it too
        return False


def _dangling(f, key: str) -> Optional[str]:
    """What the link at ``key`` points to when ``key`` is a link whose target is missing, else None."""
    try:
        link = f.get(key, getlink=True)
    except Exception:  # noqa: BLE001 - a parent group missing: nothing to say
        return None
    kind = type(link).__name__
    if kind == "ExternalLink":
        return f"an external link to '{link.filename}':{link.path}"
    return f"a soft link to {link.path}" if kind == "SoftLink" else None


def _opens_without(h5py, path: str, swmr: bool) -> bool:
    try:
        h5py.File(path, "r", swmr=swmr).close()
    except Exception:  # noqa: BLE001 - the file itself fails: the caller names the file
        return False
    return True
