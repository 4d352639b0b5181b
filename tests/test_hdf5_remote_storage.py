"""How an HDF5 file stores a dataset, and what the remote readers make of it: partial edge chunks stored
unfiltered, a userblock before the file (an unwritten contiguous dataset, the chunk index read ahead),
external links. Each read is checked against h5py's own; servers on 127.0.0.1 only (``remote_servers.py``).
"""

from __future__ import annotations

import ctypes
import os

import h5py
import numpy as np
import pytest
from remote_servers import http_server

import kerasfeed
from kerasfeed.remote import chunks, hdf5lib
from kerasfeed.remote.fetch import STATS


def _same(got, want) -> None:
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def _readers(paths, key, rows: int):
    """Every reader, over ``paths``: slices, windows, scattered rows."""
    order = kerasfeed.IndexOrder(rows, shuffle=True, seed=3)
    return [kerasfeed.H5SliceSequence(paths, key, 3),
            kerasfeed.H5WindowSequence(paths, key, 2, window=3, stride=2),
            kerasfeed.H5RowSequence(paths, key, 4, order=order)]


def _all_same(url, local, key, rows: int) -> None:
    for remote, plain in zip(_readers(url, key, rows), _readers(local, key, rows)):
        assert len(remote) == len(plain)
        for i in range(len(plain)):
            _same(remote[i], plain[i])


PARTIAL = {  # name: (shape, chunks, gzip), each written with H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS
    "shuffle_only": ((10, 4), (4, 4), False),
    "shuffle_gzip": ((10, 4), (4, 4), True),
    "inner_edges": ((10, 5), (4, 3), True),  # partial along both axes
}


def test_partial_edge_chunks_stored_unfiltered_are_read_as_h5py_reads_them(tmp_path, monkeypatch):
    """HDF5 >= 1.10 can store a chunked dataset's partial edge chunks unfiltered (``H5Pset_chunk_opts``);
    their filter mask still says 0. The fast path skips the filters on those chunks only; where the chunk
    options cannot be read, a filtered dataset with partial edge chunks goes to h5py."""
    lib = hdf5lib._library()
    assert lib is not None, "h5py's libhdf5 was not found through ctypes"
    lib.H5Pset_chunk_opts.argtypes = [ctypes.c_int64, ctypes.c_uint]
    path = tmp_path / "partial.h5"
    data = {}
    with h5py.File(path, "w", libver="latest") as f:
        for name, (shape, chunk, gzip) in PARTIAL.items():
            data[name] = np.arange(np.prod(shape), dtype="<f4").reshape(shape) * 1.5 - 7
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk(chunk)
            dcpl.set_shuffle()
            if gzip:
                dcpl.set_deflate(4)
            assert lib.H5Pset_chunk_opts(dcpl.id, hdf5lib.DONT_FILTER_PARTIAL_CHUNKS) >= 0
            h5py.h5d.create(f.id, name.encode(), h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple(shape),
                            dcpl=dcpl).write(h5py.h5s.ALL, h5py.h5s.ALL, data[name])
        # Filtered edge chunks (the default) and no edge chunk at all.
        f.create_dataset("filtered_edges", data=data["shuffle_gzip"], chunks=(4, 4), compression="gzip", shuffle=True)
        f.create_dataset("whole_chunks", data=data["shuffle_gzip"], chunks=(5, 4), compression="gzip", shuffle=True)
    keys = (*PARTIAL, "filtered_edges", "whole_chunks")
    with h5py.File(path, "r") as f:
        for name in PARTIAL:
            _same(f[name][()], data[name])
    with http_server({"b/p.h5": str(path)}) as srv:
        url = f"{srv.url}/b/p.h5"
        layouts = kerasfeed.H5SliceSequence(url, {k: k for k in keys}, 4)._remote[0].layouts
        assert all(layouts[k].fast for k in keys)
        assert {k for k in keys if layouts[k].raw_edges} == set(PARTIAL)
        for key in keys:
            _all_same(url, str(path), key, 10)
        # The chunk options unknown (no libhdf5 found through ctypes): h5py reads what might be stored so.
        monkeypatch.setattr(chunks, "chunk_opts", lambda dcpl: None)
        layouts = kerasfeed.H5SliceSequence(url, {k: k for k in keys}, 4)._remote[0].layouts
        assert {k for k in keys if layouts[k].fast} == {"whole_chunks"}
        assert "partial edge chunks" in layouts["filtered_edges"].why
        for key in ("shuffle_only", "inner_edges"):
            _all_same(url, str(path), key, 10)


def test_an_unwritten_contiguous_dataset_after_a_userblock_reads_as_its_fill_value(tmp_path):
    """HDF5 gives an unallocated contiguous dataset's offset as the userblock's last byte, not undefined:
    the readers gave those file bytes as rows."""
    path = tmp_path / "u.h5"
    with h5py.File(path, "w", userblock_size=512) as f:
        f.create_dataset("never", shape=(6, 2), dtype="i2", fillvalue=42)
        f.create_dataset("written", data=np.arange(12, dtype="<i2").reshape(6, 2))
    with http_server({"b/u.h5": str(path)}) as srv:
        url = f"{srv.url}/b/u.h5"
        seq = kerasfeed.H5SliceSequence(url, ("never", "written"), 3)
        assert seq._remote[0].layouts["never"].offset is None
        _same(seq[0][0], np.full((3, 2), 42, "i2"))
        for key in ("never", "written"):
            _all_same(url, str(path), key, 6)


def test_an_external_link_through_a_url_is_refused_naming_the_key_and_url(tmp_path):
    """HDF5 cannot follow an external link from a file object: the key read as missing, "a link whose
    target is missing", even when the target is there."""
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["data"] = np.arange(8, dtype="i4")
    with h5py.File(tmp_path / "main.h5", "w") as f:
        f["inside"] = np.arange(8, dtype="i4")
        f["linked"] = h5py.ExternalLink("other.h5", "/data")
        f["group"] = h5py.ExternalLink("other.h5", "/")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where HDF5 finds other.h5
    try:
        assert kerasfeed.H5SliceSequence(str(tmp_path / "main.h5"), "linked", 4)[1].tolist() == [4, 5, 6, 7]
        with http_server({"d/main.h5": str(tmp_path / "main.h5"), "d/other.h5": str(tmp_path / "other.h5")}) as srv:
            url = f"{srv.url}/d/main.h5"
            for key, what in (("linked", "is an external link to 'other.h5':/data"),
                              ("/group/data", "is under the external link 'group' (to 'other.h5':/)")):
                with pytest.raises(ValueError, match=r"H5SliceSequence: key '%s' of 'http://127\.0\.0\.1:\d+/d/main\.h5' "
                                   % key) as e:
                    kerasfeed.H5SliceSequence(url, ("inside", key), 4)
                assert what in str(e.value), str(e.value)
                assert "cannot follow external links through a URL" in str(e.value)
                assert f"Received: key='{key}', path='{url}'" in str(e.value)
            with pytest.raises(ValueError, match=r"has no dataset key 'nope'"):  # other missing keys: as before
                kerasfeed.H5SliceSequence(url, ("inside", "nope"), 4)
    finally:
        os.chdir(cwd)


def test_a_chunk_index_after_a_userblock_is_read_ahead_as_without_one(tmp_path):
    """NOTE [ A chunk index read one level at a time ]: a node's child addresses count from the end of the
    userblock; read ahead without it, they fetched other bytes and h5py then read node by node."""
    x = np.random.default_rng(3).normal(size=(3000, 256)).astype(np.float32)
    paths = {}
    for name, userblock in (("plain", 0), ("userblock", 512)):
        paths[name] = tmp_path / f"{name}.h5"
        with h5py.File(paths[name], "w", userblock_size=userblock) as f:
            f.create_dataset("x", data=x, chunks=(1, 256), compression="gzip")
    with http_server({f"{k}.h5": str(p) for k, p in paths.items()}) as srv:
        built = {}
        for name in paths:
            STATS.reset()
            seq = kerasfeed.H5SliceSequence(f"{srv.url}/{name}.h5", "x", 500)
            built[name] = STATS.as_dict()
            _same(seq[5], x[2500:3000])
        assert built["userblock"]["requests"] <= built["plain"]["requests"], built
        assert built["userblock"]["rounds"] <= built["plain"]["rounds"], built
