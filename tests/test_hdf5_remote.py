"""HDF5 readers over s3://, gs:// and http:// URLs: the local file's batches, bit for bit, from real servers on 127.0.0.1.

The stores (``remote_servers.py``): moto's S3 server in a process of its own
(IAM authentication on), and a stdlib HTTP server with byte ranges that also
answers gcsfs' two calls for ``gs://``. Faults, credentials and changed
objects: ``test_hdf5_remote_faults.py``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle

import h5py
import numpy as np
import pytest
from remote_servers import AWS_ISOLATION, GCS_ENV, MotoS3, http_server

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.remote.fetch import STATS

ROWS = 30


def _write_layouts(path) -> dict:
    """One file, one dataset per layout and filter the readers tell apart; returns what h5py reads of each."""
    rng = np.random.default_rng(5)
    data = {
        "gzip_shuffle": rng.normal(size=(ROWS, 5, 3)).astype("<f4"),
        "gzip_big_endian": rng.normal(size=(ROWS, 4)).astype(">f8"),
        "plain_chunks": rng.integers(-9, 9, size=(ROWS, 7)).astype(np.int16),
        "chunks_2d": rng.integers(0, 255, size=(ROWS, 10), dtype=np.uint8),
        "flags": rng.random(ROWS) > 0.5,
        "complex": (rng.normal(size=ROWS) + 1j * rng.normal(size=ROWS)).astype(np.complex64),
        "contiguous": rng.normal(size=(ROWS, 6)).astype(np.float32),
        "compact": np.arange(ROWS, dtype=np.int32),
        "lzf": rng.normal(size=(ROWS, 3)).astype(np.float32),
        "fletcher32": rng.integers(0, 99, size=(ROWS, 2)).astype(np.int64),
        "words": np.array([f"w{i}" * (i % 4 + 1) for i in range(ROWS)], dtype=object),
        "records": np.array([(i, i / 2) for i in range(ROWS)], dtype=[("a", "<i4"), ("b", "<f8")]),
    }
    with h5py.File(path, "w") as f:
        f.create_dataset("gzip_shuffle", data=data["gzip_shuffle"], chunks=(4, 5, 3), compression="gzip",
                         shuffle=True, maxshape=(None, 5, 3))
        f.create_dataset("gzip_big_endian", data=data["gzip_big_endian"], chunks=(7, 4), compression="gzip",
                         shuffle=True)
        f.create_dataset("plain_chunks", data=data["plain_chunks"], chunks=(3, 7))
        f.create_dataset("chunks_2d", data=data["chunks_2d"], chunks=(4, 3), compression="gzip")  # edge chunks
        f.create_dataset("flags", data=data["flags"], chunks=(8,), compression="gzip")
        f.create_dataset("complex", data=data["complex"], chunks=(6,))
        f.create_dataset("contiguous", data=data["contiguous"])
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple((ROWS,))
        h5py.h5d.create(f.id, b"compact", h5py.h5t.NATIVE_INT32, space, dcpl=dcpl).write(
            h5py.h5s.ALL, h5py.h5s.ALL, data["compact"])
        f.create_dataset("lzf", data=data["lzf"], chunks=(5, 3), compression="lzf")
        f.create_dataset("fletcher32", data=data["fletcher32"], chunks=(4, 2), fletcher32=True)
        f.create_dataset("words", data=data["words"], dtype=h5py.string_dtype(), chunks=(10,))
        f.create_dataset("records", data=data["records"], chunks=(10,))
        # Chunks never written read as the fill value.
        sparse = f.create_dataset("sparse", shape=(ROWS, 2), dtype=np.int32, chunks=(5, 2), fillvalue=-7,
                                  compression="gzip")
        sparse[10:15] = 1
        # ... unless HDF5 never writes fill values: never written, it reads as zeros in h5py.
        never = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        never.set_chunk((5, 2))
        never.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        never.set_fill_value(np.array(9, "i4"))
        h5py.h5d.create(f.id, b"never_filled", h5py.h5t.STD_I32LE, h5py.h5s.create_simple((ROWS, 2)), dcpl=never)
        f["never_filled"][10:15] = 1
        f.create_dataset("szip", data=np.arange(ROWS, dtype=np.int32) * 7, chunks=(10,), compression="szip",
                         compression_opts=("nn", 8))
        f.create_dataset("scaleoffset", data=data["plain_chunks"].astype(np.int32), chunks=(6, 7), scaleoffset=0)
        # Stored types h5py converts on read: bfloat16's layout in 16 bits, an integer of 20 bits, one at a bit offset.
        bf16 = h5py.h5t.IEEE_F32LE.copy()
        bf16.set_fields(15, 7, 8, 0, 7)
        bf16.set_size(2)
        bf16.set_ebias(127)
        i20 = h5py.h5t.STD_I32LE.copy()
        i20.set_precision(20)
        u12 = h5py.h5t.STD_U16LE.copy()
        u12.set_precision(12)
        u12.set_offset(2)
        gzip = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        gzip.set_chunk((8,))
        gzip.set_deflate(4)
        for name, htype, values, dcpl in (("bfloat16", bf16, np.linspace(-3, 3, ROWS, dtype="<f4"), None),
                                          ("int20", i20, np.arange(-ROWS, ROWS, 2, dtype="<i4") * 1000, gzip),
                                          ("uint12_at_bit2", u12, np.arange(ROWS, dtype="<u2") * 100, gzip)):
            h5py.h5d.create(f.id, name.encode(), htype, h5py.h5s.create_simple((ROWS,)), dcpl=dcpl).write(
                h5py.h5s.ALL, h5py.h5s.ALL, values)
        itself = h5py.VirtualLayout(shape=(ROWS, 7), dtype=np.int16)  # sources in this same file: readable
        itself[:] = h5py.VirtualSource(".", "plain_chunks", shape=(ROWS, 7))
        f.create_virtual_dataset("virtual", itself, fillvalue=-1)
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


FAST = {"gzip_shuffle", "gzip_big_endian", "plain_chunks", "chunks_2d", "flags", "complex", "contiguous", "sparse",
        "never_filled"}
FALLBACK = {"compact": "compact layout", "lzf": "lzf filter", "fletcher32": "fletcher32 filter",
            "words": "variable-length", "records": "dtype", "szip": "szip filter",
            "scaleoffset": "scaleoffset filter", "virtual": "a virtual dataset",
            "bfloat16": "stored type", "int20": "stored type", "uint12_at_bit2": "stored type"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Scene files and the layouts file, served over HTTP (and gs://) and uploaded to moto's S3."""
    d = tmp_path_factory.mktemp("remote")
    a = make_synthetic_scenes(d / "a.h5", num_scenes=20, points_per_scene=32, chunk_scenes=4, seed=1)
    b = make_synthetic_scenes(d / "b.h5", num_scenes=13, points_per_scene=32, chunk_scenes=4, seed=2)
    layouts = d / "layouts.h5"
    contents = _write_layouts(layouts)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**AWS_ISOLATION, **GCS_ENV}.items():
            mp.setenv(k, v)
        moto = MotoS3()
        try:
            files = {"bkt/a.h5": str(a), "bkt/b.h5": str(b), "bkt/layouts.h5": str(layouts)}
            with http_server(files) as srv:
                urls = {
                    "http": [f"{srv.url}/bkt/a.h5", f"{srv.url}/bkt/b.h5", f"{srv.url}/bkt/layouts.h5"],
                    "gs": ["gs://bkt/a.h5", "gs://bkt/b.h5", "gs://bkt/layouts.h5"],
                    "s3": [moto.upload(str(p), f"h5/{p.name}") for p in (a, b, layouts)],
                }
                options = {"http": None, "gs": {"endpoint_url": srv.url, "token": "anon"}, "s3": moto.options()}
                yield dict(local=[str(a), str(b), str(layouts)], urls=urls, options=options, srv=srv, moto=moto,
                           contents=contents, mp=mp)
        finally:
            moto.stop()


def _same(got, want) -> None:
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    else:
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()  # bit for bit (NaNs and signed zeros included)


def _drain(seq, **kw) -> list:
    """A whole pass of ``to_loader(seq, **kw)``; the loader is closed (no pass started ahead stays)."""
    loader = kerasfeed.to_loader(seq, **kw)
    try:
        return list(loader)
    finally:
        loader.close()


def _readers(paths, **kw):
    order = kerasfeed.IndexOrder(33, shuffle=True, seed=3)
    return [
        kerasfeed.H5SliceSequence(paths, ("points", {"y": "labels"}), 6, shuffle=True, seed=1, **kw),
        kerasfeed.H5SliceSequence(paths, ("points", "labels"), 5, shuffle_window_chunks=2, seed=2, **kw),
        kerasfeed.H5WindowSequence(paths, "point_labels", 4, window=3, stride=2, shuffle=True, seed=4, **kw),
        kerasfeed.H5RowSequence(paths, ("points", "point_labels"), 7, order=order, **kw),
    ]


@pytest.mark.parametrize("scheme", ["http", "s3", "gs"])
def test_every_reader_gets_the_local_batches_from_urls(stores, scheme):
    local = stores["local"][:2]
    urls = stores["urls"][scheme][:2]
    kw = {} if stores["options"][scheme] is None else {"storage_options": stores["options"][scheme]}
    for mixed in ([urls[0], local[1]], urls):  # a URL beside a local file, and URLs only
        for remote, plain in zip(_readers(mixed, **kw), _readers(local)):
            assert len(remote) == len(plain) and remote.file_lengths == plain.file_lengths == (20, 13)
            for epoch in (0, 1):
                remote.set_epoch(epoch), plain.set_epoch(epoch)
                for i in range(len(plain)):
                    _same(remote[i], plain[i])
    if scheme == "http":  # every batch's chunks fetched (no dataset kept whole: RemoteOptions.small_dataset)
        for remote, plain in zip(_readers(urls, remote_options={"small_dataset": 0}), _readers(local)):
            for i in range(len(plain)):
                _same(remote[i], plain[i])
    seq = kerasfeed.H5SliceSequence(urls, "labels", 4, **kw)
    assert repr(seq).startswith("<H5SliceSequence 2 files, keys='labels'")


def test_layouts_and_filters_take_the_fast_path_or_h5py(stores):
    """Which layouts and filters are decoded by kerasfeed (docs/remote.md), and both give h5py's rows."""
    url, contents = stores["urls"]["http"][2], stores["contents"]
    keys = sorted(FAST | set(FALLBACK))
    seq = kerasfeed.H5SliceSequence(url, {k: k for k in keys}, 7)
    layouts = seq._remote[0].layouts
    assert {k for k in keys if layouts[k].fast} == FAST
    for key, why in FALLBACK.items():
        assert why in layouts[key].why, (key, layouts[key].why)
    assert layouts["contiguous"].kind == "contiguous" and layouts["sparse"].grid.min() == -1  # unwritten chunks
    for i in range(len(seq)):
        batch = seq[i]
        for key in keys:
            want = contents[key][7 * i : 7 * i + 7]
            if key == "words":
                assert list(batch[key]) == list(want)
            else:
                _same(batch[key], want)
    # Scattered rows (runs across chunk edges, repeats) through the fast path and the fallback alike.
    order = kerasfeed.IndexOrder(ROWS, shuffle=True, seed=9)
    rows_seq = kerasfeed.H5RowSequence(url, ("chunks_2d", "lzf", "sparse"), 11, order=order)
    for i in range(len(rows_seq)):
        picked = rows_seq.batch_rows(i)
        got = rows_seq[i]
        for k, key in enumerate(("chunks_2d", "lzf", "sparse")):
            _same(got[k], contents[key][picked])


def test_gzip_chunks_are_inflated_by_zlib_ng_to_the_same_bytes(stores, monkeypatch):
    """The remote extra brings zlib-ng (about 1.5x zlib's inflate rate): the fast path uses it, and
    its rows are zlib's, bit for bit; KERASFEED_INFLATE=zlib picks zlib's."""
    import zlib

    from zlib_ng import zlib_ng

    from kerasfeed.remote import chunks

    assert chunks._inflate is zlib_ng.decompress
    monkeypatch.setenv("KERASFEED_INFLATE", "zlib")
    assert chunks._pick_inflate() is zlib.decompress
    url = stores["urls"]["http"][0]
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, remote_options={"small_dataset": 0})
    fast = [seq[i] for i in range(len(seq))]
    monkeypatch.setattr(chunks, "_inflate", zlib.decompress)
    _same([seq[i] for i in range(len(seq))], fast)


def test_data_in_other_files_is_refused_at_creation_naming_the_key(tmp_path):
    """A virtual dataset's other files and external storage are paths on this machine: never read them.

    Through h5py over a URL, a virtual dataset whose sources are missing reads as its fill value, and
    external storage opens a local file of that name (whatever is there): both refused at creation."""
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f["x"] = np.arange(40, dtype=np.float32).reshape(20, 2)
    (tmp_path / "raw.bin").write_bytes(np.arange(20, dtype=np.int32).tobytes())
    with h5py.File(tmp_path / "main.h5", "w") as f:
        layout = h5py.VirtualLayout(shape=(20, 2), dtype=np.float32)
        layout[:] = h5py.VirtualSource("src.h5", "x", shape=(20, 2))
        f.create_virtual_dataset("virtual", layout, fillvalue=-1)
        f.create_dataset("external", shape=(20,), dtype=np.int32, external=[("raw.bin", 0, 80)])
        f["inside"] = np.arange(20, dtype=np.int32)
    files = {f"d/{p}": str(tmp_path / p) for p in ("main.h5", "src.h5", "raw.bin")}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where HDF5 would find both other files
    try:
        with http_server(files) as srv:
            url = f"{srv.url}/d/main.h5"
            for key, why in (("virtual", "a virtual dataset whose sources are in other files (src.h5)"),
                             ("external", "external storage (its data in raw.bin)")):
                with pytest.raises(ValueError, match=r"key '%s' of 'http://127\.0\.0\.1:\d+/d/main\.h5' is " % key) as e:
                    kerasfeed.H5SliceSequence(url, ("inside", key), 4)
                assert why in str(e.value) and f"Received: key='{key}'" in str(e.value)
            _same(kerasfeed.H5SliceSequence(url, "inside", 4)[1], np.arange(4, 8, dtype=np.int32))
        # The local file reads both (HDF5 finds the other files beside it, and in the working directory).
        local = kerasfeed.H5SliceSequence(str(tmp_path / "main.h5"), ("virtual", "external"), 4)
        _same(local[1], (np.arange(8, 16, dtype=np.float32).reshape(4, 2), np.arange(4, 8, dtype=np.int32)))
    finally:
        os.chdir(cwd)


def test_one_wave_per_batch_merged_ranges_and_no_metadata_after_construction(stores):
    local, srv = stores["local"][0], stores["srv"]
    srv.files["bkt/wave.h5"] = local  # a name of its own: the server's log counts this test's requests only
    url = f"{srv.url}/bkt/wave.h5"

    def served():
        return [r for r in srv.log if r[0] == "bkt/wave.h5"]

    STATS.reset()
    whole = {"small_dataset": 0}  # every key is small here: no dataset fetched whole (see the test below)
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels", "point_labels"), 12, remote_options=whole)
    built = STATS.as_dict()
    assert built["stats"] == 1  # the object's size and version, once
    assert len(served()) <= 2  # construction: the version, then the metadata in one block
    before = len(served())
    STATS.reset()
    x = seq[0]  # rows 0..11: three chunks of each key, adjacent in the file
    first = STATS.as_dict()
    assert first["rounds"] == 1 and first["stats"] == 0  # one wave, no metadata
    layouts = seq._remote[0].layouts
    chunk_ranges = sum(len(layouts[k].ranges([(0, 12)])) for k in ("points", "labels", "point_labels"))
    requests = len(served()) - before
    # 9 chunks, adjacent per key: at most one request per key (keys near each other may share one)
    assert chunk_ranges == 9 and requests == first["requests"] <= 3
    _same(x, kerasfeed.H5SliceSequence(local, ("points", "labels", "point_labels"), 12)[0])
    # A whole pass reads each stored chunk once (batches align with chunks here), plus the small gaps
    # merged requests read across (RemoteOptions.merge_gap, chunks.WASTE): at most 1.1 bytes per byte stored.
    stored = sum(int(layouts[k].size.sum()) for k in ("points", "labels", "point_labels"))
    STATS.reset()
    for i in range(len(seq)):
        seq[i]
    assert STATS.as_dict()["rounds"] == len(seq) and stored <= STATS.as_dict()["bytes"] <= 1.1 * stored


def test_a_small_dataset_is_fetched_whole_once_per_process(stores):
    url, local = stores["urls"]["http"][0], stores["local"][0]
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, remote_options={"small_dataset": 1024})
    labels, points = seq._remote[0].layouts["labels"], seq._remote[0].layouts["points"]
    assert labels.stored_bytes <= 1024 < points.stored_bytes
    plain = kerasfeed.H5SliceSequence(local, ("points", "labels"), 4)
    STATS.reset()
    _same(seq[0], plain[0])
    first = STATS.as_dict()
    assert first["rounds"] == 1 and first["bytes"] >= labels.stored_bytes  # labels whole, in the same wave
    STATS.reset()
    for i in range(1, len(seq)):
        _same(seq[i], plain[i])
    rest = STATS.as_dict()
    # Afterwards only points' chunks are fetched: the labels are kept in this process (not pickled).
    assert rest["bytes"] == points.stored_bytes - points.ranges([(0, 4)])[0][1] + points.ranges([(0, 4)])[0][0]
    assert "labels" in seq._remote[0].kept and pickle.loads(pickle.dumps(seq))._remote[0].kept == {}


def test_a_small_dataset_wanted_by_many_threads_at_once_is_fetched_whole_once(stores, monkeypatch):
    # A run over a partly filled kept cache starts every missing item at once, none finding the labels
    # kept yet: each fetched them whole (43 fetches for 43 items, a helper measured). One thread fetches
    # them whole; the others fetch their own rows meanwhile (waiting, they waited for that thread's whole
    # batch, a slow request for its points included), and none fetches them whole once they are kept.
    from kerasfeed.remote import files

    srv = stores["srv"]
    url, local = stores["urls"]["http"][0], stores["local"][0]
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)
    plain = kerasfeed.H5SliceSequence(local, ("points", "labels"), 4)
    claims = []
    claim = files._KEPT.claim
    monkeypatch.setattr(files._KEPT, "claim", lambda rf, key: claims.append((key, claim(rf, key))) or claims[-1][1])
    srv.delay = 0.05  # every request takes a while: the threads' reads overlap
    try:
        with concurrent.futures.ThreadPoolExecutor(len(seq)) as pool:
            got = list(pool.map(seq.__getitem__, range(len(seq))))
    finally:
        srv.delay = 0.0
    for i, batch in enumerate(got):
        _same(batch, plain[i])
    for key in ("points", "labels"):  # both small here
        assert claims.count((key, "mine")) == 1 and key in seq._remote[0].kept, claims


def test_threads_processes_and_export_give_the_local_batches(stores, tmp_path):
    """The fast path in worker processes needs no metadata request: the layouts travel with the source."""
    url, local = stores["urls"]["http"][:2], stores["local"][:2]
    want = _drain(kerasfeed.H5SliceSequence(local, ("points", "labels"), 4), executor="threads")
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)
    srv = stores["srv"]
    before = len(srv.log)
    STATS.reset()
    _same(_drain(seq, executor="threads"), want)
    in_process = srv.log[before:]
    assert len(in_process) == STATS.as_dict()["requests"] and STATS.as_dict()["stats"] == 0
    before = len(srv.log)
    _same(_drain(seq, executor="processes", workers=2), want)
    # The workers asked for chunks only (within the ranges this process asked for): no version, no metadata
    # block. Not the very same ranges: a worker makes several items at once, and one that plans while another
    # is keeping the file's small datasets (points, then labels) may find labels kept and points not, and
    # fetch points alone (CI, 2026-11-25: ('b.h5', 16168, 24013) beside ('b.h5', 16168, 24075)).
    in_workers = srv.log[before:]
    assert in_workers and all(
        isinstance(start, int) and any(name == n and s <= start and end <= e for n, s, e in in_process)
        for name, start, end in in_workers
    ), (in_workers, in_process)
    assert {name for name, _, _ in in_workers} == {name for name, _, _ in in_process}
    # export: items in index order, the local file's.
    kerasfeed.export(seq, tmp_path / "exported", num_shards=2, executor="threads", progress=False)
    _same([item for item in kerasfeed.load_export(tmp_path / "exported").as_numpy_iterator()], want)


def test_every_reader_on_worker_processes_gives_the_local_batches(stores):
    """The window and row readers too, not only slices: URLs mixed with a local path, on worker processes."""
    urls, local = stores["urls"]["http"][:2], stores["local"][:2]
    mixed = [urls[0], local[1]]
    for remote, plain in zip(_readers(mixed), _readers(local)):
        _same(_drain(remote, executor="processes", workers=2), _drain(plain, executor="threads"))


def test_s3_on_worker_processes_with_credentials_from_the_environment(stores):
    moto, mp = stores["moto"], stores["mp"]
    url, local = stores["urls"]["s3"][:2], stores["local"][:2]
    mp.setenv("AWS_ACCESS_KEY_ID", moto.key)  # what worker processes inherit
    mp.setenv("AWS_SECRET_ACCESS_KEY", moto.secret)
    try:
        seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 5, storage_options={"endpoint_url": moto.endpoint})
        plain = kerasfeed.H5SliceSequence(local, ("points", "labels"), 5)
        _same(_drain(seq, executor="processes", workers=2, shuffle=True, seed=1),
              _drain(plain, executor="threads", shuffle=True, seed=1))
    finally:
        mp.delenv("AWS_ACCESS_KEY_ID")
        mp.delenv("AWS_SECRET_ACCESS_KEY")


def test_kerasfeed_identity_names_each_file_and_changes_with_it(stores, tmp_path):
    srv = stores["srv"]
    path = make_synthetic_scenes(tmp_path / "c.h5", num_scenes=8, points_per_scene=8, seed=1)
    srv.files["bkt/c.h5"] = str(path)
    url = f"{srv.url}/bkt/c.h5"
    moto = stores["moto"]
    s3 = moto.upload(str(path), "h5/c.h5")
    # storage_options keyed by scheme: the S3 options reach s3fs only, not the HTTP file system.
    seq = kerasfeed.H5SliceSequence([str(path), url, s3], "labels", 4, storage_options={"s3": moto.options()})
    first = seq.kerasfeed_identity()
    st = os.stat(path)
    assert list(first) == [str(path), url, s3]
    assert first[str(path)] == f"size={st.st_size},mtime_ns={st.st_mtime_ns}"
    assert first[url].startswith('etag="') and first[url].endswith(f",size={st.st_size}")
    assert first[s3].startswith('etag="') and first[s3].endswith(f",size={st.st_size}")
    assert seq.kerasfeed_identity() == first  # stable while nothing changes
    make_synthetic_scenes(path, num_scenes=8, points_per_scene=8, seed=2)  # same size, new bytes
    moto.upload(str(path), "h5/c.h5")
    # This sequence reads the objects it pinned: no identity of the new ones (test_hdf5_remote_versions.py).
    with pytest.raises(kerasfeed.FileChangedError, match=r"was replaced after the sequence was built"):
        seq.kerasfeed_identity()
    seq = kerasfeed.H5SliceSequence([str(path), url, s3], "labels", 4, storage_options={"s3": moto.options()})
    now = seq.kerasfeed_identity()
    assert all(now[k] != first[k] for k in first)
    # The identity holds no credentials, and pickling keeps the method.
    assert moto.secret not in repr(now) and pickle.loads(pickle.dumps(seq)).kerasfeed_identity() == now
    # URLs that differ only in their query (a download endpoint's ?f=): one entry each, or a cache keyed by
    # them would not see the first one replaced (its identity overwritten by the second's).
    twins = kerasfeed.H5SliceSequence([f"{url}?f=a", f"{url}?f=b", str(path)], "labels", 4).kerasfeed_identity()
    assert list(twins) == [f"{url}?… (file 0)", f"{url}?… (file 1)", str(path)], twins
    assert "f=a" not in repr(twins) and twins[f"{url}?… (file 0)"] == now[url]
    # Without an ETag, two such URLs (each alone in its run) would have one identity across runs when their
    # objects share a size and a second: a digest of the query (never the query) tells them apart.
    srv.etag = None
    try:
        a = kerasfeed.H5SliceSequence(f"{url}?f=a", "labels", 4).kerasfeed_identity()
        b = kerasfeed.H5SliceSequence(f"{url}?f=b", "labels", 4).kerasfeed_identity()
    finally:
        srv.etag = "strong"
    assert list(a) == list(b) == [f"{url}?…"] and a != b, (a, b)
    assert ",query=" in a[f"{url}?…"] and "f=a" not in repr(a)


def test_remote_arguments_are_checked_up_front(stores):
    url, local = stores["urls"]["http"][0], stores["local"][0]
    with pytest.raises(ValueError, match=r"`storage_options` apply to s3://, gs:// and http\(s\):// paths"):
        kerasfeed.H5SliceSequence(local, "labels", 4, storage_options={"anon": True})
    with pytest.raises(TypeError, match=r"unknown `remote_options` field 'retry'"):
        kerasfeed.H5SliceSequence(url, "labels", 4, remote_options={"retry": 3})
    with pytest.raises(ValueError, match=r"`attempts` must be a positive int. Received: attempts=0"):
        kerasfeed.H5SliceSequence(url, "labels", 4, remote_options={"attempts": 0})
    with pytest.raises(TypeError, match=r"`storage_options` must be a dict"):
        kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=["key"])
    with pytest.raises(ValueError, match=r"`swmr=True` .* a URL cannot be one"):
        kerasfeed.H5SliceSequence(url, "labels", 4, swmr=True)
    with pytest.raises(ValueError, match=r"may not carry credentials") as e:
        kerasfeed.H5SliceSequence("https://me:hunter2@127.0.0.1:9/a.h5", "labels", 4)
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match=r"has no dataset key 'nope'"):
        kerasfeed.H5SliceSequence(url, "nope", 4)
    # Other stores' URLs were looked up as local files ("HDF5 file not found"), a bad port came out bare.
    with pytest.raises(ValueError, match=r"'file://' paths are not read: .* pass the local path itself"):
        kerasfeed.H5SliceSequence("file://" + os.path.abspath(local), "labels", 4)
    with pytest.raises(ValueError, match=r"H5RowSequence: 'az://' paths are not read: kerasfeed reads local paths and "
                       r"s3://, gs:// and http\(s\):// URLs. Received: path='az://box/a.h5'"):
        kerasfeed.H5RowSequence([local, "az://box/a.h5"], "labels", 4, order=kerasfeed.IndexOrder(8))
    with pytest.raises(ValueError, match=r"the URL cannot be read \(Port could not be cast .*\). Received: path='http://h:8x/a.h5"):
        kerasfeed.H5SliceSequence("http://h:8x/a.h5?sig=1", "labels", 4)


def test_a_remote_source_cached_to_a_kept_directory_reads_the_store_once(stores, tmp_path, caplog):
    """Issue 47 with the item cache: a second run over a kept directory fetches no chunk (only the
    object's version, for the key); an object replaced in the store rebuilds the cache."""
    srv = stores["srv"]
    own = make_synthetic_scenes(tmp_path / "own.h5", num_scenes=16, points_per_scene=32, chunk_scenes=4, seed=5)
    srv.files["bkt/own.h5"] = str(own)
    url, cache = f"{srv.url}/bkt/own.h5", tmp_path / "items"

    def run() -> tuple:
        seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)  # metadata requests happen here
        before = len(srv.log)
        with kerasfeed.to_loader(seq, shuffle=True, seed=0, executor="processes", workers=2, cache=str(cache)) as ld:
            passes = [[np.asarray(x).tobytes() for x, _ in ld] for _ in range(2)]
        return passes, srv.log[before:]

    first, fetched = run()
    assert fetched and {name for name, *_ in fetched} == {"bkt/own.h5"}  # pass 0 read the chunks, once
    again, fetched_again = run()
    assert all(end - start <= 1 for _, start, end in fetched_again), fetched_again  # no chunk: the store served
    assert again == first
    key = json.load(open(cache / "key.json"))
    assert url in key["files"] and "etag" in key["files"][url].lower(), key["files"]
    # The object is replaced (other scenes): its ETag changes, the cache is rebuilt, the new data read.
    make_synthetic_scenes(tmp_path / "own.h5", num_scenes=16, points_per_scene=32, chunk_scenes=4, seed=6)
    with caplog.at_level("WARNING", logger="kerasfeed"):
        replaced, fetched_new = run()
    assert replaced != first and any(end - start > 1 for _, start, end in fetched_new)
    assert any("rebuilt" in r.getMessage() and url in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_a_large_chunk_index_is_read_a_level_at_a_time(tmp_path, libver):
    """NOTE [ A chunk index read one level at a time ]: 5,000 chunks put ~90 leaf nodes of a three-level
    B-tree in the default file (``earliest``); read node by node they cost 96 round trips (measured), here 7,
    and the layouts are h5py's own. A ``latest`` file's index (a fixed array) takes a few reads as before."""
    from kerasfeed.remote.h5file import BlockFile

    path = tmp_path / "many.h5"
    # 4 KB chunks that do not compress: the leaves lie ~200 KB apart, each in a block of its own (64 KiB).
    x = np.random.default_rng(3).normal(size=(5000, 1024)).astype(np.float32)
    with h5py.File(path, "w", libver=libver) as f:
        f.create_dataset("x", data=x, chunks=(1, 1024), compression="gzip", shuffle=True)
        f.create_dataset("y", data=np.arange(5000), chunks=(1,))
    want = {}
    with h5py.File(path, "r") as f:
        for k in ("x", "y"):
            found: list = []
            f[k].id.chunk_iter(lambda info: found.append((info.byte_offset, info.size)))
            want[k] = sorted(found)
    read_ahead = []
    real = BlockFile._fetch_below

    def counted(self, node):
        read_ahead.append(len(self._nodes))
        return real(self, node)

    with http_server({"m.h5": str(path)}) as srv, pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockFile, "_fetch_below", counted)
        STATS.reset()
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/m.h5", ("x", "y"), 100)
        built = STATS.as_dict()
        layouts = seq._remote[0].layouts
        for k in ("x", "y"):
            assert sorted(zip(layouts[k].addr.tolist(), layouts[k].size.tolist())) == want[k]
        # earliest: one wave per level of each index (and the open's few); latest: a fixed array, a handful of reads
        assert built["rounds"] <= 10, built
        if libver == "earliest":
            assert max(read_ahead) > 64  # leaves were held ahead (a three-level tree: 64 children at most below one)
        local = kerasfeed.H5SliceSequence(str(path), ("x", "y"), 100)
        for i in (0, 7, len(seq) - 1):
            _same(seq[i], local[i])


def test_a_node_that_is_not_a_chunk_index_node_fetches_nothing_ahead():
    """``tree_children`` parses a version-1 B-tree node of raw-data chunks only; anything else gives no address."""
    from kerasfeed.remote.h5file import tree_children

    rank, key = 2, 8 + 8 * 3
    two_k = 4

    def node(kind=1, level=1, entries=2, children=(1000, 2000), sig=b"TREE"):
        body = bytearray(sig + bytes([kind, level]) + entries.to_bytes(2, "little") + bytes(16))
        for i in range(two_k):
            body += bytes(key) + (children[i] if i < len(children) else 0).to_bytes(8, "little")
        return bytes(body + bytes(key))

    assert tree_children(node(), rank, 10_000) == [1000, 2000]
    assert tree_children(node(level=0), rank, 10_000) == []  # a leaf: its children are chunks
    assert tree_children(node(kind=0), rank, 10_000) == []  # a group's node
    assert tree_children(node(sig=b"HEAP"), rank, 10_000) == []
    assert tree_children(node(entries=5), rank, 10_000) == []  # more entries than a node of this size holds
    assert tree_children(node(children=(1000, 9_900)), rank, 10_000) == []  # a child past the object's end
    assert tree_children(node(), rank + 1, 10_000) == []  # another rank: the sizes do not add up


def test_several_files_are_pinned_and_opened_in_one_wave_each(tmp_path):
    """``files.pin_all``: the size and version of every file, then its first block, go out together; each
    file's construction then needs only h5py's further reads: two round trips fewer per file after the first
    than building each alone. A missing object in the list is still named, with its URL, at creation."""
    paths = [make_synthetic_scenes(tmp_path / f"s{j}.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4, seed=j)
             for j in range(5)]
    with http_server({f"s{j}.h5": str(p) for j, p in enumerate(paths)}) as srv:
        urls = [f"{srv.url}/s{j}.h5" for j in range(5)]
        alone = []
        for url in urls:
            STATS.reset()
            kerasfeed.H5SliceSequence(url, ("points", "labels"), 8)
            alone.append(STATS.as_dict()["rounds"])
        STATS.reset()
        seq = kerasfeed.H5SliceSequence(urls, ("points", "labels"), 8)
        together = STATS.as_dict()
        assert together["stats"] == 5 and together["rounds"] == sum(alone) - 2 * (len(urls) - 1), (together, alone)
        local = kerasfeed.H5SliceSequence([str(p) for p in paths], ("points", "labels"), 8)
        for i in range(len(seq)):
            _same(seq[i], local[i])
        with pytest.raises(FileNotFoundError, match=r"HDF5 object not found: 'http://127.0.0.1:\d+/gone.h5'"):
            kerasfeed.H5SliceSequence([urls[0], f"{srv.url}/gone.h5", urls[1]], "labels", 8)


def test_a_big_endian_dataset_reads_as_the_local_file_across_files_and_row_runs(tmp_path):
    """Batches of a big-endian dataset keep its dtype when their rows come from several runs or files (the
    local and remote readers concatenated at different points, and numpy's concatenation turned rows native)."""
    paths = []
    for j, n in enumerate((7, 6)):
        path = tmp_path / f"be{j}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=(np.arange(n * 3) + 50 * j).reshape(n, 3).astype(">f8"), chunks=(2, 3),
                             compression="gzip", shuffle=True)
        paths.append(str(path))
    with http_server({f"be{j}.h5": p for j, p in enumerate(paths)}) as srv:
        urls = [f"{srv.url}/be{j}.h5" for j in range(2)]
        order = kerasfeed.IndexOrder(13, shuffle=True, seed=3)
        for make in (lambda p: kerasfeed.H5SliceSequence(p, "x", 5),  # batch 1 straddles the files
                     lambda p: kerasfeed.H5RowSequence(p, "x", 4, order=order)):  # several runs a batch
            local, remote, mixed = make(paths), make(urls), make([urls[0], paths[1]])
            for i in range(len(local)):
                want = local[i]
                assert want.dtype.str == ">f8"
                _same(remote[i], want)
                _same(mixed[i], want)


def test_a_dataset_never_written_without_a_fill_value_fails_as_the_local_file_does(tmp_path):
    """Its URL read as zeros, made up, where h5py and the local reader refuse it (helper, 3 of 3)."""
    import ctypes

    from kerasfeed.remote.hdf5lib import _library

    path = str(tmp_path / "undefined.h5")
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)  # contiguous; H5Pset_fill_value(..., NULL): undefined
        lib = _library()
        assert lib is not None, "h5py's libhdf5 was not found through ctypes"
        assert lib.H5Pset_fill_value(ctypes.c_int64(dcpl.id), ctypes.c_int64(h5py.h5t.NATIVE_INT32.id), None) >= 0
        h5py.h5d.create(f.id, b"x", h5py.h5t.STD_I32LE, h5py.h5s.create_simple((8, 2)), dcpl=dcpl)
        dcpl.set_chunk((2, 2))  # the same, chunked: no chunk stored (a review's report)
        h5py.h5d.create(f.id, b"z", h5py.h5t.STD_I32LE, h5py.h5s.create_simple((8, 2)), dcpl=dcpl)
        f.create_dataset("y", data=np.arange(8))
    for key in ("x", "z"):
        with pytest.raises(OSError, match="no data can be read"):
            kerasfeed.H5SliceSequence(path, (key, "y"), 4)[0]
    with http_server({"undefined.h5": path}) as srv:
        for key in ("x", "z"):
            seq = kerasfeed.H5SliceSequence(f"{srv.url}/undefined.h5", (key, "y"), 4)
            assert seq._remote[0].layouts[key].why == "never written and without a fill value"
            with pytest.raises(OSError, match=rf"rows 0\.\.4 of dataset '{key}' in 'http://127\.0\.0\.1:\d+/"
                                              r"undefined\.h5' failed: .*no data can be read"):
                seq[0]
