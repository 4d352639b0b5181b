"""Remote HDF5 readers keep their secrets and their footprint to themselves: no signature in a message, no key in a
pickle, no filesystem or hand-off entry per reader, a bounded memory of kept datasets, requests of bounded size, and
errors that name the URL, key and rows.

Servers on 127.0.0.1 only (``remote_servers.py``): the HTTP store, and moto's S3 for s3fs' option names.
"""

from __future__ import annotations

import gc
import pickle

import cloudpickle
import h5py
import numpy as np
import pytest
from remote_servers import AWS_ISOLATION, MotoS3, RangeServer, _Handler, http_server

import kerasfeed
from kerasfeed import _handoff
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.remote import files
from kerasfeed.remote.chunks import pieces
from kerasfeed.remote.fetch import STORES
from kerasfeed.remote.urls import redact, redact_text, split_options

SIGNED = "?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=deadbeefSIGNATURE"


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    d = tmp_path_factory.mktemp("hygiene")
    return str(make_synthetic_scenes(d / "a.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4, seed=1))


class _RedirectLoop(_Handler):
    def _serve(self, head):
        self._reply(302, headers={"Location": self.path})


def test_a_presigned_urls_signature_is_in_no_error_message():
    srv = RangeServer({})
    srv.RequestHandlerClass = _RedirectLoop
    srv.start()
    try:  # aiohttp gives up after 10 redirects, naming the URL it followed, query string and all
        with pytest.raises(OSError, match=r"'http://127.0.0.1:\d+/a.h5\?…' failed: TooManyRedirects") as info:
            kerasfeed.H5SliceSequence(f"{srv.url}/a.h5{SIGNED}", "x", 4)
    finally:
        srv.stop()
    assert "SIGNATURE" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)
    text = f"url='http://h:1/a.h5{SIGNED}' then URL('https://u:p@h/b{SIGNED}'), GET /c.h5{SIGNED} http://[bad"
    assert redact_text(text) == "url='http://h:1/a.h5?…' then URL('https://h/b?…'), GET /c.h5?… http://[bad"


def test_s3fs_username_and_password_are_never_pickled(scenes, monkeypatch):
    for k, v in AWS_ISOLATION.items():
        monkeypatch.setenv(k, v)
    moto = MotoS3()
    try:
        url = moto.upload(scenes, "u.h5")
        options = {"endpoint_url": moto.endpoint, "username": moto.key, "password": moto.secret}
        seq = kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=options)
        want = kerasfeed.H5SliceSequence(scenes, "labels", 4)[0]
        assert np.array_equal(seq[0], want)
        for blob in (pickle.dumps(seq), cloudpickle.dumps(seq)):
            assert moto.key.encode() not in blob and moto.secret.encode() not in blob
        assert seq._remote[0].credentials.public == {"endpoint_url": moto.endpoint}
        assert np.array_equal(pickle.loads(pickle.dumps(seq))[0], want)  # a copy here finds them again
    finally:
        moto.stop()
    # Other names of a credential: fsspec's and the stores' aliases, and headers given as pairs.
    aliases = {"user": "u", "token": "t", "session_token": "t", "aws_session_token": "t", "access_key_id": "k",
               "secret_access_key": "s", "creds": "c", "sas": "s", "headers": [["Authorization", "Bearer t"]]}
    public, secret = split_options({**aliases, "anon": False, "endpoint_url": "http://h"})
    assert set(secret) == set(aliases) and public == {"anon": False, "endpoint_url": "http://h"}
    # An API key under a header name of the server's own, a passphrase, a user and password in the endpoint.
    public, secret = split_options({"headers": {"X-JFrog-Art-Api": "k"}, "client_kwargs": {"passphrase": "p"},
                                    "endpoint_url": "http://u:p@h", "region_name": "r"})
    assert secret == {"headers": {"X-JFrog-Art-Api": "k"}, "client_kwargs": {"passphrase": "p"},
                      "endpoint_url": "http://u:p@h"} and public == {"client_kwargs": {}, "region_name": "r"}


def test_readers_given_the_same_secrets_share_a_filesystem_and_leave_no_hand_off_entry(scenes):
    options = {"headers": {"Authorization": "Bearer hygiene-token"}}
    gc.collect()
    entries, filesystems = set(_handoff.entries()), len(STORES._filesystems)
    with http_server({"a.h5": scenes}, token="hygiene-token") as srv:
        url = f"{srv.url}/a.h5"
        for _ in range(20):
            seq = kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=options)
            seq[0]
        assert len(STORES._filesystems) <= filesystems + 1  # one connection pool, not one per reader
        copy = pickle.loads(pickle.dumps(seq))
        del seq
        gc.collect()
        assert len(set(_handoff.entries()) - entries) == 1  # the copy's: it still reads
        copy[1]
        del copy
        gc.collect()
        assert set(_handoff.entries()) - entries == set()
        again = kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=options)  # the cached store serves it
        again[2]
    assert len(STORES._filesystems) <= filesystems + 1


def test_a_fallback_read_error_names_the_url_the_key_and_the_rows(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:  # lzf: read by h5py (the fallback), a chunk overwritten
        f.create_dataset("x", data=np.arange(800, dtype=np.float32).reshape(100, 8), chunks=(10, 8), compression="lzf")
        info = []
        f["x"].id.chunk_iter(info.append)
    with open(path, "r+b") as fh:
        fh.seek(info[3].byte_offset)
        fh.write(b"\xff" * info[3].size)
    with http_server({"bad.h5": str(path)}) as srv:
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/bad.h5{SIGNED}", "x", 10)
        assert np.array_equal(seq[0], np.arange(80, dtype=np.float32).reshape(10, 8))
        with pytest.raises(OSError, match=r"H5SliceSequence: reading rows 30..40 of dataset 'x' in "
                                          r"'http://127.0.0.1:\d+/bad.h5\?…' failed: OSError: ") as info:
            seq[3]
    assert "SIGNATURE" not in str(info.value)


def test_a_range_larger_than_max_request_is_split_into_concurrent_requests(tmp_path):
    assert pieces(0, 10, 4) == [(0, 4), (4, 8), (8, 10)] and pieces(5, 9, 4) == [(5, 9)]
    path = tmp_path / "contiguous.h5"
    data = np.arange(32 * 2048, dtype=np.float32).reshape(32, 2048)  # 8 KiB a row, one byte range per run
    with h5py.File(path, "w") as f:
        f["x"] = data
    with http_server({"c.h5": str(path)}) as srv:
        for limit, requests in ((64 << 10, 4), (256 << 10, 1)):  # 256 KiB: in 4 pieces, or one when it fits
            seq = kerasfeed.H5SliceSequence(f"{srv.url}/c.h5", "x", 32,
                                            remote_options={"max_request": limit, "small_dataset": 0})
            before = len(srv.log)
            assert np.array_equal(seq[0], data)
            sizes = [end - start for _, start, end in srv.log[before:]]
            assert len(sizes) == requests and sum(sizes) == data.nbytes and max(sizes) <= limit


def test_small_datasets_are_kept_within_the_process_budget(scenes, monkeypatch):
    plain = kerasfeed.H5SliceSequence(scenes, "labels", 4)
    with http_server({"a.h5": scenes}) as srv:
        def reader():
            return kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", "labels", 4, remote_options={"small_dataset": 1 << 20})

        first = reader()
        size = first._remote[0].layouts["labels"].stored_bytes
        gc.collect()
        monkeypatch.setattr(files, "KEPT_BUDGET", files._KEPT.used + size + size // 2)  # room for one copy
        second = reader()
        for seq in (first, second):
            assert all(np.array_equal(seq[i], plain[i]) for i in (0, 1))
        assert "labels" in first._remote[0].kept and second._remote[0].kept == {}  # past the budget
        before = len(srv.log)
        assert np.array_equal(second[2], plain[2])
        assert sum(end - start for _, start, end in srv.log[before:]) < size  # this batch's chunk, not the whole
        del first  # its kept bytes go with it
        gc.collect()
        third = reader()
        assert np.array_equal(third[3], plain[3]) and "labels" in third._remote[0].kept


def test_a_server_that_ignores_range_gives_the_batches_and_one_warning(tmp_path, caplog):
    path = make_synthetic_scenes(tmp_path / "r.h5", num_scenes=32, points_per_scene=64, chunk_scenes=4, seed=1)
    want = kerasfeed.H5SliceSequence(str(path), ("points", "labels"), 4)
    with http_server({"r.h5": str(path)}) as srv, caplog.at_level("WARNING", logger="kerasfeed"):
        srv.ranges = False
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/r.h5", ("points", "labels"), 4,
                                         remote_options={"small_dataset": 0})
        for i in range(len(seq)):
            for a, b in zip(seq[i], want[i]):
                np.testing.assert_array_equal(a, b)
    warned = [r.getMessage() for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(warned) == 1 and "r.h5" in warned[0], warned


class _SecretsSeen(kerasfeed.SceneSequence):
    """Reports, from the process that makes its items, whether its own secrets and another holder's are there."""

    def __init__(self, mine, other_token):
        super().__init__()
        self.mine, self.other_token = mine, other_token

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.array([self.mine.secrets_here(), _handoff.get(self.other_token) is not None])


def _stream_secrets(arg):
    holder, other_token = arg
    yield np.array([holder.secrets_here(), _handoff.get(other_token) is not None])


def test_a_worker_process_gets_only_the_secrets_its_source_or_task_names():
    from kerasfeed.remote.urls import Credentials

    mine, other = Credentials({"password": "mine-secret"}), Credentials({"password": "other-secret"})
    seq = _SecretsSeen(mine, other.token)
    batch = next(iter(kerasfeed.to_loader(seq, batch_size=2, executor="processes", workers=1)))
    assert batch.tolist() == [[True, False], [True, False]]  # its own: yes; the other reader's: never sent
    ex = kerasfeed.ProcessExecutor(seq, workers=1)
    try:
        later = Credentials({"password": "made-after-the-pool"})  # named by a stream task started later
        (seen,) = list(ex.stream(_stream_secrets, (later, other.token)))
        assert seen.tolist() == [True, False]
    finally:
        ex.close()


def test_readers_with_other_secrets_leave_no_filesystem_connection_or_secret_behind(scenes):
    """A store and its filesystem live while a reader holds them: 20 readers, each with its own secret (say
    rotating credentials), left 20 filesystems, 20 open connections and 20 secrets for the process's life."""
    import os

    import fsspec

    def client_sockets() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:
                pass
        return n

    def secrets_alive() -> int:
        return sum("rotating-" in repr(getattr(o, "storage_options", "")) for o in gc.get_objects()
                   if isinstance(o, fsspec.AbstractFileSystem))

    with http_server({"a.h5": scenes}) as srv:
        url = f"{srv.url}/a.h5"
        gc.collect()
        sockets, stores, filesystems = client_sockets(), len(STORES._stores), len(STORES._filesystems)
        for i in range(20):
            seq = kerasfeed.H5SliceSequence(url, "labels", 4, storage_options={"headers": {"X-Api-Key": f"rotating-{i}"}})
            seq[i % len(seq)]
            if i % 2:
                seq.close()  # closed or just dropped: both let go
            del seq
        gc.collect()
        assert (len(STORES._stores), len(STORES._filesystems)) == (stores, filesystems)
        assert secrets_alive() == 0
        assert client_sockets() <= sockets  # the server runs in this process: its own sockets count too


def test_balanced_order_from_a_url_names_the_url_without_its_signature(scenes):
    """``BalancedOrder.from_hdf5`` read URLs through fsspec and let its errors out as they were: a presigned
    URL's signature in the message, no class or URL named ("[Errno %s not found..."), and "Forbidden" alone."""
    with http_server({"a.h5": scenes}, token="balanced-token") as srv:
        good = {"headers": {"Authorization": "Bearer balanced-token"}}
        order = kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/a.h5", "labels", storage_options=good, seed=0)
        assert order.num_samples == 24  # the labels read: one per scene
        with pytest.raises(FileNotFoundError, match=r"^BalancedOrder.from_hdf5: HDF5 object not found: "
                           r"'http://127.0.0.1:\d+/nope.h5\?…' \(HTTP 404\)") as missing:
            kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/nope.h5{SIGNED}", "labels", storage_options=good)
        with pytest.raises(PermissionError, match=r"^BalancedOrder.from_hdf5: .*'http://127.0.0.1:\d+/a.h5'") as refused:
            kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/a.h5", "labels",
                                              storage_options={"headers": {"Authorization": "Bearer wrong"}})
        with pytest.raises(ValueError, match=r"file 'http://127.0.0.1:\d+/a.h5\?…' has no dataset 'lables'") as key:
            kerasfeed.BalancedOrder.from_hdf5(f"{srv.url}/a.h5{SIGNED}", "lables", storage_options=good)
    for info in (missing, refused, key):
        text = str(info.value)
        assert "SIGNATURE" not in text and "AKIAEXAMPLE" not in text and "balanced-token" not in text, text


def test_an_object_store_key_keeps_its_question_marks_and_hashes_in_messages():
    # They are part of an s3:// or gs:// key, not a query or a fragment: "s3://bkt/runs#8/part-0.h5" was named
    # "s3://bkt/runs" in the readers' repr and errors.
    assert redact("s3://bkt/runs#8/part-0.h5") == "s3://bkt/runs#8/part-0.h5"
    assert redact("gs://bkt/a?b/c.h5") == "gs://bkt/a?b/c.h5"
    assert redact("https://u:p@h:9/a.h5?X-Amz-Signature=s#f") == "https://h:9/a.h5?…"  # http(s) as before


def test_another_store_s_options_on_an_http_url_say_to_key_them_by_scheme(scenes):
    # S3's options given flat to an http:// URL failed with aiohttp's "unexpected keyword argument 'key'" alone.
    with http_server({"a.h5": scenes}) as srv:
        with pytest.raises(OSError, match=r"unexpected keyword argument 'key'.*key those of another store by its "
                                          r"scheme, storage_options=\{'s3'") as info:
            kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", "labels", 4, storage_options={"key": "AKIAX", "secret": "s"})
    assert "AKIAX" not in str(info.value)
