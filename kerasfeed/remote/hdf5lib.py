"""HDF5 calls h5py does not wrap, made through ctypes on the very libhdf5 h5py loaded.

A dataset's chunk options (``H5Pget_chunk_opts``) say whether its partial
edge chunks are stored unfiltered (``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``,
HDF5 >= 1.10; the chunk's filter mask does not say so). h5py has no wrapper,
so the function is looked up in the libhdf5 already mapped into this process
and is only trusted when that library's version is h5py's: an identifier of
h5py's is meaningless to another copy of the library (netCDF4's, say). Where
none is found, ``chunk_opts`` returns None and the caller reads the dataset
the safe way (``chunks.Layout.of``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Optional

DONT_FILTER_PARTIAL_CHUNKS = 0x0002  # H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS


def _loaded() -> list:
    """Paths (or, on Windows, names) of the libhdf5 libraries this process has loaded."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "/libhdf5" in line}
    elif sys.platform == "darwin":
        dyld = ctypes.CDLL(None)
        dyld._dyld_get_image_name.restype = ctypes.c_char_p
        names = (dyld._dyld_get_image_name(i) for i in range(dyld._dyld_image_count()))
        paths = {n.decode() for n in names if n and b"/libhdf5" in n}
    elif sys.platform == "win32":
        return ["hdf5.dll"] if ctypes.windll.kernel32.GetModuleHandleW("hdf5.dll") else []
    else:
        return []
    return sorted(paths)


@functools.lru_cache(maxsize=1)
def _library():
    """h5py's libhdf5 (its functions, for ctypes), or None where it cannot be told apart for sure."""
    import h5py

    found = {}  # the address of H5get_libversion -> the library (libhdf5_hl's handle finds libhdf5's too)
    for path in _loaded():
        try:
            lib = ctypes.CDLL(path)  # loaded already: the same library, not a second copy
            major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
            lib.H5get_libversion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
            if (major.value, minor.value, release.value) == h5py.version.hdf5_version_tuple[:3]:
                found.setdefault(ctypes.cast(lib.H5get_libversion, ctypes.c_void_p).value, lib)
        except (OSError, AttributeError):
            continue
    if len(found) != 1:  # none, or two copies of h5py's version: which one holds h5py's identifiers is unknown
        return None
    (lib,) = found.values()
    fn = getattr(lib, "H5Pget_chunk_opts", None)  # HDF5 >= 1.10
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint)], ctypes.c_int
    return lib


def chunk_opts(dcpl) -> Optional[int]:
    """``H5Pget_chunk_opts`` of a chunked dataset's creation property list (h5py's), or None if unknown."""
    try:
        lib = _library()
    except Exception:  # noqa: BLE001 - any failure to find the library means "unknown": the caller plays safe
        return None
    if lib is None:
        return None
    from h5py._objects import phil  # h5py's lock: libhdf5 is called by one thread at a time

    opts = ctypes.c_uint(0)
    with phil:
        status = lib.H5Pget_chunk_opts(dcpl.id, ctypes.byref(opts))
    return int(opts.value) if status >= 0 else None


__all__ = ["DONT_FILTER_PARTIAL_CHUNKS", "chunk_opts"]
