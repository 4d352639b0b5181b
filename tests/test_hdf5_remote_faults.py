"""Faults of a remote store for the HDF5 readers: throttling, dropped connections, stalls, replaced and missing
objects, refused credentials; and credentials that never leave the process that was given them.

Servers on 127.0.0.1 only (``remote_servers.py``): the HTTP server injects the faults into its next requests.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import subprocess
import sys
import threading

import cloudpickle
import numpy as np
import pytest
import s3fs
from remote_servers import AWS_ISOLATION, GCS_ENV, MotoS3, http_server

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.errors import FileChangedError
from kerasfeed.remote.fetch import STATS
from kerasfeed.remote.h5file import collector_held
from kerasfeed.remote.urls import split_options

# The tests' waits between tries stay short, and every batch sends requests (the scene files are small enough
# to be kept whole in memory after the first read otherwise: RemoteOptions.small_dataset).
FAST_RETRY = {"backoff": 0.01, "max_backoff": 0.02, "small_dataset": 0}


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    path = make_synthetic_scenes(d / "a.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4, seed=1)
    want = list(kerasfeed.H5SliceSequence(str(path), ("points", "labels"), 4))
    return str(path), want


@pytest.fixture(scope="module")
def moto():
    """moto's S3 server for this module's S3 tests, with the AWS environment isolated."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in AWS_ISOLATION.items():
            mp.setenv(k, v)
        server = MotoS3()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def srv(scenes):
    with http_server({"a.h5": scenes[0]}) as server:
        yield server


def _same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_throttling_and_dropped_connections_are_retried_and_the_pass_completes(scenes, srv):
    seq = kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", ("points", "labels"), 4, remote_options=FAST_RETRY)
    STATS.reset()
    for fault in ("503", "503", "429", "drop", "503", "drop"):
        srv.inject(fault)
    _same(list(kerasfeed.to_loader(seq, executor="threads")), scenes[1])
    # Every status fault cost a try of ours; a dropped keep-alive connection aiohttp may retry itself.
    assert srv.faults_left() == 0 and 4 <= STATS.as_dict()["retries"] <= 6


def test_a_store_failing_past_the_budget_names_the_url_and_retries_go_on_top(scenes, srv):
    url = f"{srv.url}/a.h5"
    seq = kerasfeed.H5SliceSequence(url, "labels", 4, remote_options={"attempts": 2, **FAST_RETRY})
    rows = kerasfeed.H5RowSequence(url, "labels", 4, order=kerasfeed.IndexOrder(24),
                                   remote_options={"attempts": 2, **FAST_RETRY})
    srv.inject("503", 2)  # both tries of the batch's one request
    with pytest.raises(OSError, match=r"reading bytes \d+-\d+ of '.*/a.h5' failed 2 times \(attempts=2.*HTTP 503"):
        seq[0]
    srv.inject("503", 2)  # the same object, options and process: each reader's messages name its own class
    with pytest.raises(OSError, match=r"^H5RowSequence: reading bytes \d+-\d+ of '.*/a.h5' failed 2 times"):
        rows[0]
    # The batch made again by `retries=` of the loader meets a store that answers.
    srv.inject("503", 2)
    got = list(kerasfeed.to_loader(seq, executor="threads", retries=1))
    assert srv.faults_left() == 0
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([y for _, y in scenes[1]]))


def test_an_answer_of_another_range_is_tried_again_never_decoded(tmp_path):
    """A proxy or CDN answering 206 with another part of the asked length (its Content-Range honest):
    only the length and the total were checked, so an unfiltered dataset read another chunk's bytes."""
    path = make_synthetic_scenes(tmp_path / "plain.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4, seed=1,
                                 compression=None)
    local = kerasfeed.H5SliceSequence(str(path), "points", 4)
    with http_server({"plain.h5": str(path)}) as server:
        seq = kerasfeed.H5SliceSequence(f"{server.url}/plain.h5", "points", 4,
                                        remote_options={"small_dataset": 0, "attempts": 2, **FAST_RETRY})
        server.inject("shift")
        assert np.asarray(seq[0]).tobytes() == np.asarray(local[0]).tobytes() and server.faults_left() == 0
        server.inject("shift", 2)
        with pytest.raises(OSError, match=r"reading bytes (\d+)-\d+ of '.*/plain.h5' failed 2 times .*the answer "
                                          r"holds another part \(Content-Range: bytes \d+-\d+; asked: bytes=\1-"):
            seq[1]


def test_a_size_the_server_does_not_give_is_named(tmp_path, monkeypatch):
    """``Content-Range: bytes 0-0/*`` (the total unknown, as HTTP allows) failed with int()'s own error."""
    import remote_servers

    path = make_synthetic_scenes(tmp_path / "a.h5", num_scenes=8, points_per_scene=16, chunk_scenes=4, seed=1)
    real = remote_servers._Handler.send_header

    def unknown_total(self, key, value):
        real(self, key, value.rpartition("/")[0] + "/*" if key == "Content-Range" else value)

    monkeypatch.setattr(remote_servers._Handler, "send_header", unknown_total)
    with http_server({"a.h5": str(path)}) as server:
        with pytest.raises(OSError, match=r"the server gave no size \(Content-Range 'bytes 0-0/\*', Content-Length "
                                          r"'1'; status 206\)"):
            kerasfeed.H5SliceSequence(f"{server.url}/a.h5", "points", 4, remote_options={"attempts": 1})


def test_a_request_that_stalls_times_out_and_is_tried_again(scenes, srv):
    srv.stall_s = 2.0
    url = f"{srv.url}/a.h5"
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, remote_options={"timeout": 0.3, **FAST_RETRY})
    STATS.reset()
    srv.inject("stall")
    _same([seq[0]], scenes[1][:1])
    assert STATS.as_dict()["retries"] == 1
    seq = kerasfeed.H5SliceSequence(url, "labels", 4, remote_options={"timeout": 0.3, "attempts": 2, **FAST_RETRY})
    srv.inject("stall", 2)
    with pytest.raises(TimeoutError, match=r"failed 2 times .*no answer within timeout=0.3 s"):
        seq[1]


def test_balanced_order_from_hdf5_reads_through_the_readers_retries_and_timeouts(scenes, srv):
    """It read URLs through a plain fsspec file: two 503s in a row were "not found", and a stalled request
    waited as long as the store did (aiohttp's 5-minute default; a helper's report)."""
    url = f"{srv.url}/a.h5"
    want = kerasfeed.BalancedOrder.from_hdf5(scenes[0], "labels", seed=0).indices(0)
    srv.inject("503", 2)
    srv.inject("429")
    got = kerasfeed.BalancedOrder.from_hdf5(url, "labels", seed=0, remote_options=FAST_RETRY)
    assert srv.faults_left() == 0 and np.array_equal(got.indices(0), want)
    srv.stall_s = 2.0
    srv.inject("stall")
    got = kerasfeed.BalancedOrder.from_hdf5(url, "labels", seed=0, remote_options={"timeout": 0.3, **FAST_RETRY})
    assert srv.faults_left() == 0 and np.array_equal(got.indices(0), want)
    srv.inject("stall", 2)
    with pytest.raises(TimeoutError, match=r"^BalancedOrder.from_hdf5: .*failed 2 times .*no answer within "
                                           r"timeout=0.3 s"):
        kerasfeed.BalancedOrder.from_hdf5(url, "labels", remote_options={"timeout": 0.3, "attempts": 2, **FAST_RETRY})


@pytest.mark.parametrize("server_checks_if_match", [True, False])
def test_an_object_replaced_during_the_run_is_a_file_changed_error(scenes, srv, tmp_path, server_checks_if_match):
    srv.if_match = server_checks_if_match  # else the reader compares the ETag of each answer
    path = make_synthetic_scenes(tmp_path / "b.h5", num_scenes=12, points_per_scene=16, chunk_scenes=4, seed=1)
    srv.files["b.h5"] = str(path)
    # (A dataset kept whole in memory, RemoteOptions.small_dataset, reads the version it was fetched from.)
    seq = kerasfeed.H5SliceSequence(f"{srv.url}/b.h5", "points", 4, remote_options=FAST_RETRY)
    seq[0]
    make_synthetic_scenes(path, num_scenes=12, points_per_scene=16, chunk_scenes=4, seed=2)  # renamed over it
    with pytest.raises(FileChangedError, match=r"the object 'http://127.0.0.1:\d+/b.h5' was replaced after"):
        seq[1]
    os.unlink(path)
    with pytest.raises(FileChangedError, match=r"was deleted after the source read its layout"):
        seq[2]


def test_s3_missing_objects_refused_credentials_and_replaced_objects(moto, scenes, tmp_path):
    url = moto.upload(scenes[0], "a.h5")
    with pytest.raises(FileNotFoundError, match=r"HDF5 object not found: 's3://kerasfeed-data/nope.h5'"):
        kerasfeed.H5SliceSequence(url.replace("a.h5", "nope.h5"), "labels", 4, storage_options=moto.options())
    moto.upload(scenes[0], "day1/b.h5")
    for folder in ("s3://kerasfeed-data/day1", "s3://kerasfeed-data/day1/"):  # a prefix, not an object
        with pytest.raises(IsADirectoryError, match=rf"'{folder}' is a folder .* name the files in it"):
            kerasfeed.H5SliceSequence(folder, "labels", 4, storage_options=moto.options())
    with pytest.raises(PermissionError, match=r"access to 's3://kerasfeed-data/a.h5' was refused") as e:
        kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=moto.options(secret="not-it"))
    assert "not-it" not in str(e.value)
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, storage_options=moto.options(),
                                    remote_options=FAST_RETRY)
    _same([seq[0]], scenes[1][:1])
    for blob in (pickle.dumps(seq), cloudpickle.dumps(seq)):  # neither the key nor the secret travels
        assert moto.secret.encode() not in blob and moto.key.encode() not in blob
        assert moto.endpoint.encode() in blob
    other = make_synthetic_scenes(tmp_path / "b.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4,
                                  seed=3)
    moto.upload(str(other), "a.h5")  # a new version: S3 answers 412 to the pinned ETag
    with pytest.raises(FileChangedError, match=r"'s3://kerasfeed-data/a.h5' was replaced .*HTTP 412"):
        seq[1]


def test_s3_throttling_and_dropped_connections_are_retried_and_the_pass_completes(moto, scenes):
    """S3 answering SlowDown (503), 429 and dropped connections: moto behind a proxy that injects them."""
    url = moto.upload(scenes[0], "a.h5")
    with http_server(forward=moto.endpoint) as proxy:
        options = moto.options(endpoint_url=proxy.url)
        seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, storage_options=options,
                                        remote_options=FAST_RETRY)
        for fault in ("503", "503", "429", "drop", "503", "drop"):
            proxy.inject(fault)
        _same(list(kerasfeed.to_loader(seq, executor="threads")), scenes[1])
        assert proxy.faults_left() == 0
        assert {status for _path, _method, status in proxy.log} <= {200, 206}  # the rest went through
        # Past the budget: RemoteOptions is all of it (one request a try: s3fs and botocore would
        # otherwise try each 5 times and more, waiting past `timeout`), and the cause is named.
        seq = kerasfeed.H5SliceSequence(url, "labels", 4, storage_options=options,
                                        remote_options={**FAST_RETRY, "attempts": 2})
        proxy.inject("503", 100)
        with pytest.raises(OSError, match=r"reading bytes \d+-\d+ of 's3://kerasfeed-data/a.h5' failed 2 "
                                          r"times \(attempts=2.*reduce your request rate"):
            seq[0]
        assert proxy.faults_left() == 98  # two requests, one per try
        assert s3fs.S3FileSystem(**options).retries == 5  # the user's own filesystem keeps s3fs' tries
        proxy.clear_faults()
        np.testing.assert_array_equal(seq[1], scenes[1][1][1])


def test_missing_objects_and_refused_credentials_over_http_are_named_at_creation(scenes):
    with http_server({"a.h5": scenes[0]}, token="t0ken-123") as srv:
        with pytest.raises(FileNotFoundError, match=r"HDF5 object not found: 'http://127.0.0.1:\d+/b.h5\?…'"):
            kerasfeed.H5SliceSequence(f"{srv.url}/b.h5?X-Amz-Signature=s3cr3t", "labels", 4,
                                      storage_options={"headers": {"Authorization": "Bearer t0ken-123"}})
        with pytest.raises(PermissionError, match=r"access to 'http://127.0.0.1:\d+/a.h5' was refused \(HTTP 403\)"):
            kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", "labels", 4)
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", ("points", "labels"), 4,
                                        storage_options={"headers": {"Authorization": "Bearer t0ken-123"}})
        _same([seq[i] for i in range(len(seq))], scenes[1])
        # The header is a secret: it stays in this process.
        for dumps in (pickle.dumps, cloudpickle.dumps):
            assert b"t0ken-123" not in dumps(seq)


def test_an_object_that_is_not_hdf5_is_named(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not an HDF5 file\n" * 100)
    with http_server({"notes.h5": str(text)}) as srv:
        with pytest.raises(OSError, match=r"object 'http://127.0.0.1:\d+/notes.h5' could not be opened as HDF5"):
            kerasfeed.H5SliceSequence(f"{srv.url}/notes.h5", "labels", 4)


def test_credentials_are_never_pickled_and_reach_worker_processes_in_memory(scenes, tmp_path, caplog, capfd):
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
    caplog.set_level(logging.DEBUG)  # every logger, kerasfeed's, fsspec's and aiohttp's included
    options = {"headers": {"Authorization": f"Bearer {secret}"}, "client_kwargs": {"trust_env": False}}
    with http_server({"a.h5": scenes[0]}, token=secret) as guarded:
        seq = kerasfeed.H5SliceSequence(f"{guarded.url}/a.h5", ("points", "labels"), 4, storage_options=options)
        for blob in (pickle.dumps(seq), cloudpickle.dumps(seq)):
            assert secret.encode() not in blob
            assert b"trust_env" in blob  # public options travel
        assert secret not in repr(seq) and secret not in repr(seq._remote[0].credentials)
        # A proxy's user and password, under any name (they travelled with the source: only endpoint_url's did not).
        proxy = f"http://user:{secret}@127.0.0.1:{guarded.server_address[1]}"  # it answers proxy requests too
        proxied = {**options, "client_kwargs": {"trust_env": False, "proxy": proxy}}
        split = kerasfeed.H5SliceSequence(f"{guarded.url}/a.h5", "labels", 4, storage_options=proxied)
        assert secret.encode() not in pickle.dumps(split) and secret.encode() not in cloudpickle.dumps(split)
        s3_proxies = {"config_kwargs": {"proxies": {"https": f"http://user:{secret}@proxy:3128", "http": "http://p:1"}}}
        assert split_options(s3_proxies) == ({"config_kwargs": {"proxies": {"http": "http://p:1"}}},
                                             {"config_kwargs": {"proxies": {"https": f"http://user:{secret}@proxy:3128"}}})
        _same([pickle.loads(pickle.dumps(seq))[0]], scenes[1][:1])  # a copy in this process finds them again
        # Worker processes get them with their first message (not with the pickled source): the batches come.
        with kerasfeed.to_loader(seq, executor="processes", workers=2) as loader:
            _same(list(loader), [seq[i] for i in range(len(seq))])
        # A process that was not handed them (a Ray actor, another program) is refused, and told why.
        blob = tmp_path / "source.pkl"
        blob.write_bytes(cloudpickle.dumps(seq))
        code = ("import pickle, sys\nseq = pickle.load(open(sys.argv[1], 'rb'))\n"
                "try:\n    seq[0]\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
        out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, KERAS_BACKEND="numpy"))
        assert "PermissionError" in out.stdout and "never travel to Ray actors" in out.stdout, out.stdout + out.stderr
        assert secret not in out.stdout + out.stderr
        # A failed request is logged (an item left out, its cause, the URL), never the header that went with it.
        once = kerasfeed.H5SliceSequence(f"{guarded.url}/a.h5", ("points", "labels"), 4, storage_options=options,
                                         remote_options={**FAST_RETRY, "attempts": 1})
        with kerasfeed.to_loader(once, executor="threads", max_skipped=1) as loader:  # probed: the file answers
            guarded.inject("503", count=10_000)  # from here on it does not: one item left out, then the pass fails
            with pytest.raises(Exception, match=r"HTTP 503"):
                list(loader)
    logged = [r.getMessage() for r in caplog.records if r.name == "kerasfeed" and "skipped item" in r.getMessage()]
    assert len(logged) == 1 and "HTTP 503" in logged[0] and f"{guarded.url}/a.h5" in logged[0], logged
    # No log line, here or in the workers (their stderr is this process's), holds the secret.
    assert secret not in caplog.text
    assert secret not in "".join(capfd.readouterr())


def _fresh_process(code: str) -> str:
    """What ``code`` prints in a process of its own, where nothing is imported yet."""
    env = dict(os.environ, KERAS_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_local_files_import_no_fsspec(tmp_path):
    code = (
        "import sys, kerasfeed\n"
        "from kerasfeed.datasets import make_synthetic_scenes\n"
        f"p = make_synthetic_scenes({str(tmp_path / 'local.h5')!r}, num_scenes=8, points_per_scene=8)\n"
        "seq = kerasfeed.H5SliceSequence(p, 'labels', 4); seq[0]; seq.kerasfeed_identity()\n"
        "print('imported:', [m for m in ('fsspec', 's3fs', 'gcsfs', 'aiohttp') if m in sys.modules])\n"
    )
    assert "imported: []" in _fresh_process(code), code


def test_the_collector_is_held_off_while_h5py_waits_on_the_network():
    """h5py#2019: a collection on fsspec's loop thread while h5py holds its lock would deadlock."""
    assert gc.isenabled()
    inside = threading.Event()
    leave = threading.Event()

    def other():
        with collector_held():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with collector_held():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(5)
    assert gc.isenabled()


def test_gcs_missing_objects_refused_access_throttling_and_a_new_generation(scenes, tmp_path, monkeypatch):
    """gs:// (gcsfs against the loopback server's JSON API): a missing object and a refused
    access are named at creation with the URL; 503/429 answers still give the local batches;
    an object rewritten (a new generation) is a FileChangedError, never bytes of the new one."""
    for k, v in GCS_ENV.items():
        monkeypatch.setenv(k, v)
    path = make_synthetic_scenes(tmp_path / "g.h5", num_scenes=12, points_per_scene=16, chunk_scenes=4, seed=1)
    want = list(kerasfeed.H5SliceSequence(str(path), ("points", "labels"), 4))
    with http_server({"bkt/g.h5": str(path)}, token="t0ken-9") as locked:
        with pytest.raises(PermissionError, match=r"access to 'gs://bkt/g.h5' was refused"):
            kerasfeed.H5SliceSequence("gs://bkt/g.h5", "labels", 4,
                                      storage_options={"endpoint_url": locked.url, "token": "anon"})
    with http_server({"bkt/g.h5": str(path)}) as srv:
        options = {"endpoint_url": srv.url, "token": "anon"}
        with pytest.raises(FileNotFoundError, match=r"HDF5 object not found: 'gs://bkt/nope.h5'"):
            kerasfeed.H5SliceSequence("gs://bkt/nope.h5", "labels", 4, storage_options=options)
        with pytest.raises(IsADirectoryError, match=r"'gs://bkt/day1/' is a folder"):
            kerasfeed.H5SliceSequence("gs://bkt/day1/", "labels", 4, storage_options=options)
        seq = kerasfeed.H5SliceSequence("gs://bkt/g.h5", ("points", "labels"), 4, storage_options=options,
                                        remote_options=FAST_RETRY)
        for fault in ("503", "429"):
            srv.inject(fault)
        _same([seq[i] for i in range(len(seq))], want)
        assert srv.faults_left() == 0
        # A store that keeps throttling: gcsfs waits 1-2 s before its own second try, past timeout=1.
        slow = kerasfeed.H5SliceSequence("gs://bkt/g.h5", "labels", 4, storage_options=options,
                                         remote_options={**FAST_RETRY, "timeout": 1.0, "attempts": 1})
        srv.inject("503", 20)
        with pytest.raises(TimeoutError, match=r"failed 1 times .*gcsfs tries each request up to 6 times itself"):
            slow[0]
        srv.clear_faults()
        make_synthetic_scenes(path, num_scenes=12, points_per_scene=16, chunk_scenes=4, seed=2)  # a new generation
        with pytest.raises(FileChangedError, match=r"the object 'gs://bkt/g.h5' was replaced after"):
            seq[1]


_FORK_BESIDE_A_HELD_COLLECTOR = """
import gc, os, threading
from kerasfeed.remote.h5file import collector_held
from kerasfeed.remote.urls import split_options

inside, leave = threading.Event(), threading.Event()

def other():
    with collector_held():
        inside.set()
        leave.wait(10)

t = threading.Thread(target=other)
t.start()
assert inside.wait(5) and not gc.isenabled()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: report, then leave at once
    try:
        enabled = gc.isenabled()
        with collector_held():  # neither the lock nor the count is the parent's
            held = not gc.isenabled()
        os.write(write, f"{enabled} {held} {gc.isenabled()}".encode())
    finally:
        os._exit(0)
os.close(write)
with os.fdopen(read) as f:
    report = f.read()
os.waitpid(pid, 0)
parent_still_off = not gc.isenabled()  # the parent's thread is still inside
leave.set()
t.join(10)
print(report, parent_still_off, gc.isenabled())
"""


def test_a_child_forked_while_another_thread_holds_the_collector_off_gets_it_back():
    """Keras' use_multiprocessing forks: the thread inside an h5py call is not in the child, so the collector
    must not stay off there (nor the count's lock stay taken). In a fresh interpreter: no other library's
    threads beside the fork."""
    out = subprocess.run([sys.executable, "-c", _FORK_BESIDE_A_HELD_COLLECTOR], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True", "True", "True"], out.stdout


_FORK_BESIDE_A_HELD_KEPT_LOCK = """
import os, threading
from kerasfeed.remote import files

inside, leave = threading.Event(), threading.Event()

def other():
    with files._KEPT._lock:
        inside.set()
        leave.wait(10)

t = threading.Thread(target=other)
t.start()
assert inside.wait(5)
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the parent's thread is not in it, so its hold on the lock must not be either
    try:
        got = files._KEPT._lock.acquire(timeout=2)
        os.write(write, str(got).encode())
    finally:
        os._exit(0)
os.close(write)
with os.fdopen(read) as f:
    report = f.read()
os.waitpid(pid, 0)
leave.set()
t.join(10)
print(report)
"""


def test_a_child_forked_while_another_thread_holds_the_kept_bytes_lock_can_take_it():
    """The lock of the small datasets kept whole (``_KEPT``) is made anew in a forked child: one held by a
    parent's thread at the fork would have hung the child's first read of a small dataset."""
    out = subprocess.run([sys.executable, "-c", _FORK_BESIDE_A_HELD_KEPT_LOCK], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"], out.stdout


def test_a_short_timeout_counts_the_request_not_the_making_of_the_filesystem(scenes, srv):
    """A process's first request made fsspec's HTTP filesystem (aiohttp's import, ~0.3 s) inside its timeout:
    with `timeout=0.05, attempts=1` a healthy server got no request and the reader failed "no answer within
    timeout" (a helper's report). A fresh process, so that nothing is imported yet."""
    code = (
        "import kerasfeed\n"
        f"seq = kerasfeed.H5SliceSequence({srv.url + '/a.h5'!r}, 'labels', 4, "
        "remote_options={'timeout': 0.05, 'attempts': 1})\n"
        "print('batches', len(seq), seq[0].tolist())\n"
    )
    assert f"batches 6 {scenes[1][0][1].tolist()}" in _fresh_process(code), code


class _Holding(kerasfeed.SceneSequence):
    """A user's source holding a kerasfeed reader as an attribute (its files are in the cache's key)."""

    def __init__(self, reader):
        super().__init__()
        self.reader = reader

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        return self.reader[i]


def test_a_held_reader_whose_version_check_fails_is_refused_not_left_out_of_the_key(scenes, srv, tmp_path):
    # The check's error was swallowed: the key had no file, a full kept cache was emptied ("no longer names"),
    # and a later run whose object had been replaced matched that key and served the old object's items.
    url, cache = f"{srv.url}/a.h5", str(tmp_path / "items")
    reader = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, remote_options={"attempts": 2, **FAST_RETRY})
    with kerasfeed.to_loader(_Holding(reader), executor="threads", cache=cache) as loader:
        _same(list(loader), scenes[1])
    srv.inject("503", 2)  # both tries of the version check
    with pytest.raises(OSError, match=r"a.h5.*failed 2 times \(attempts=2.*HTTP 503"):
        kerasfeed.to_loader(_Holding(reader), executor="threads", cache=cache)
    assert srv.faults_left() == 0
    with kerasfeed.to_loader(_Holding(reader), executor="threads", cache=cache) as loader:
        _same(list(loader), scenes[1])
        assert kerasfeed.stats(loader)["cache_misses"] == 0  # the store answers again: the cache was kept
