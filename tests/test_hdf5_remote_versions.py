"""The version a remote HDF5 reader pins, against stores that validate it in other ways or not at all: a weak
ETag, no ETag (Last-Modified only), no validator, an S3 store that ignores If-Match; the identity a cache keys
by; and the pinned file read in a forked child.

Servers on 127.0.0.1 only (``remote_servers.py``).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal

import h5py
import numpy as np
import pytest
from remote_servers import AWS_ISOLATION, MotoS3, RangeServer, http_server

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.errors import FileChangedError

# Every batch sends requests (no dataset kept whole in memory), one try each.
NOT_KEPT = {"small_dataset": 0, "attempts": 1, "timeout": 10}


def _write(path, seed: int, mtime: float | None = None, rows: int = 64) -> str:
    """Uncompressed chunks: another seed gives another object of the same size and layout. Written aside and
    renamed over ``path`` (a new inode), its mtime set (whole seconds apart: Last-Modified's resolution)."""
    tmp = f"{path}.tmp"
    with h5py.File(tmp, "w") as f:
        f.create_dataset("x", data=np.random.default_rng(seed).normal(size=(rows, 4)).astype(np.float32),
                         chunks=(8, 4))
    if mtime is not None:
        os.utime(tmp, (mtime, mtime))
    os.replace(tmp, path)
    return str(path)


def _rows(path, batch: int) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["x"][batch * 8 : (batch + 1) * 8]


@pytest.fixture
def srv(tmp_path):
    with http_server({"x.h5": _write(tmp_path / "x.h5", 1, mtime=1_700_000_000)}) as server:
        yield server


def test_a_weak_etag_is_compared_by_the_reader_not_sent_as_if_match(srv, tmp_path):
    srv.etag = "weak"  # and If-Match by strong comparison: a weak ETag never matches (RFC 7232; nginx, Go)
    url, path = f"{srv.url}/x.h5", srv.files["x.h5"]
    seq = kerasfeed.H5SliceSequence(url, "x", 8, remote_options=NOT_KEPT)
    assert seq._remote[0].pin.etag.startswith('W/"')
    for i in range(len(seq)):
        np.testing.assert_array_equal(seq[i], _rows(path, i))
    srv.if_match = False  # a server that ignores If-Unmodified-Since too: the answer's tag tells
    _write(path, 2, mtime=1_700_000_000)  # same size and date, new bytes (a new inode: a new ETag)
    with pytest.raises(FileChangedError, match=rf"the object '{url}' was replaced .*the store answered ETag W/"):
        seq[1]
    srv.if_match = True  # the server checks the date the reader sends in place of If-Match
    _write(path, 3, mtime=1_700_000_100)
    with pytest.raises(FileChangedError, match=r"replaced .*412 to If-Unmodified-Since"):
        seq[1]


@pytest.mark.parametrize("server_checks", [False, True])
def test_without_an_etag_the_version_is_pinned_by_last_modified(srv, server_checks):
    srv.etag, srv.if_match = None, server_checks
    url, path = f"{srv.url}/x.h5", srv.files["x.h5"]
    seq = kerasfeed.H5SliceSequence(url, "x", 8, remote_options=NOT_KEPT)
    assert seq._remote[0].pin.etag is None and seq._remote[0].pin.last_modified
    np.testing.assert_array_equal(seq[1], _rows(path, 1))
    _write(path, 2, mtime=1_700_000_100)  # the same size and layout, new rows, a later date
    why = r"412 to If-Unmodified-Since" if server_checks else r"the server answered Last-Modified .*, the source read"
    with pytest.raises(FileChangedError, match=rf"the object '{url}' was replaced .*{why}"):
        seq[1]


def test_a_server_with_no_validator_is_warned_of_once_and_a_new_size_is_caught(srv, caplog):
    srv.etag, srv.last_modified = None, False
    url, path = f"{srv.url}/x.h5", srv.files["x.h5"]
    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        seq = kerasfeed.H5SliceSequence(url, "x", 8, remote_options=NOT_KEPT)
        np.testing.assert_array_equal(seq[2], _rows(path, 2))
        seq.kerasfeed_identity()
    warned = [r.getMessage() for r in caplog.records if "neither ETag nor Last-Modified" in r.getMessage()]
    assert len(warned) == 1 and url in warned[0], warned
    _write(path, 2, rows=72)  # another size: what is left to tell
    with pytest.raises(FileChangedError, match=r"the answer is of an object of \d+ bytes, the source read \d+"):
        seq[2]


def test_an_s3_store_that_ignores_if_match_gives_a_file_changed_error(tmp_path, monkeypatch):
    for k, v in AWS_ISOLATION.items():
        monkeypatch.setenv(k, v)
    moto = MotoS3(auth=False)  # the header dropped below was signed
    try:
        proxy = RangeServer(forward=moto.endpoint).start()
        proxy.if_match = False  # If-Match is dropped on the way to the store
        try:
            url = moto.upload(_write(tmp_path / "a.h5", 1), "a.h5")
            seq = kerasfeed.H5SliceSequence(url, "x", 8, storage_options=moto.options(endpoint_url=proxy.url),
                                            remote_options=NOT_KEPT)
            np.testing.assert_array_equal(seq[1], _rows(tmp_path / "a.h5", 1))
            moto.upload(_write(tmp_path / "b.h5", 2), "a.h5")  # same size: the ETag tells
            with pytest.raises(FileChangedError, match=r"'s3://kerasfeed-data/a.h5' was replaced .*answered ETag"):
                seq[1]
            moto.upload(_write(tmp_path / "c.h5", 3, rows=72), "a.h5")  # the size in Content-Range tells first
            with pytest.raises(FileChangedError, match=r"replaced .*an object of \d+ bytes, the source read \d+"):
                seq[1]
        finally:
            proxy.stop()
    finally:
        moto.stop()


def test_identity_is_the_version_read_and_a_replaced_object_is_refused(tmp_path):
    """The cache keys by ``kerasfeed_identity()``: it is the pinned version, so that a reader serving a small
    dataset kept in memory never fills a cache keyed by the replacing object's version."""
    path = make_synthetic_scenes(tmp_path / "k.h5", num_scenes=16, points_per_scene=8, chunk_scenes=4, seed=1)
    cache = str(tmp_path / "cache")
    with http_server({"k.h5": str(path)}) as srv:
        url = f"{srv.url}/k.h5"
        seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)
        seq[0]  # both datasets kept whole in this process: the old version keeps being served
        pinned = seq._remote[0].pin.identity()
        assert seq.kerasfeed_identity() == {url: pinned}
        make_synthetic_scenes(path, num_scenes=16, points_per_scene=8, chunk_scenes=4, seed=2)
        for source in (seq, pickle.loads(pickle.dumps(seq))):
            with pytest.raises(FileChangedError, match=rf"the object '{url}' was replaced after the sequence was "
                                                       rf"built.*Received: etag=.* now, {pinned} at construction"):
                source.kerasfeed_identity()
        with pytest.raises(FileChangedError, match=r"was replaced after the sequence was built"):
            with kerasfeed.to_loader(seq, executor="threads", cache=cache) as ld:
                list(ld)
        fresh = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)
        with kerasfeed.to_loader(fresh, executor="threads", cache=cache) as ld:
            got = [np.asarray(x).copy() for x, _ in ld]
    local = kerasfeed.H5SliceSequence(str(path), ("points", "labels"), 4)
    assert len(got) == len(local) and all(np.array_equal(g, local[i][0]) for i, g in enumerate(got))


def test_a_forked_child_reads_the_fallback_through_its_own_file(tmp_path):
    """Keras' worker processes fork after the parent read a batch: the parent's h5py file of a dataset off the
    fast path (lzf) reads through the parent's event loop and session, which the child must not use."""
    path = tmp_path / "lzf.h5"
    data = np.random.default_rng(0).normal(size=(20000, 4)).astype(np.float32)  # 5 blocks: the last not read yet
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(10, 4), compression="lzf")
    with http_server({"lzf.h5": str(path)}) as srv:
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/lzf.h5", "x", 10, remote_options=NOT_KEPT)
        assert seq._remote[0].layouts["x"].kind == "fallback"
        np.testing.assert_array_equal(seq[0], data[:10])  # the parent's h5py file is open
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its batch, or its error, down the pipe; never back into pytest
            code = 1
            try:
                os.close(r)
                got = seq[1990].tobytes()
                seq._remote[0].close()
                os.write(w, got)
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(w, f"{type(e).__name__}: {e}".encode()[:4000])
            finally:
                os._exit(code)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 60)  # a hung child fails the test instead of hanging it
        got = os.read(r, 1 << 16) if ready else b""
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and got == data[19900:19910].tobytes(), got[:400]
        np.testing.assert_array_equal(seq[1991], data[19910:19920])  # the parent's file is still open and fine
