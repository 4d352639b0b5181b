"""executor="ray" on a real Ray cluster: two worker nodes on 127.0.0.1, each its own raylet and object store.

One cluster serves the whole module (``ray_cluster``, ~5 s to start): a head
without CPUs (where this process is the driver, as a GPU host joining with
``--num-cpus=0`` would be) and two nodes of one CPU each. Everything listens
on 127.0.0.1 (NOTE [ Ray started by kerasfeed listens on 127.0.0.1 only ]).
Its GCS, raylets and the worker processes the raylets pool are registered
with conftest's ``owned_process_trees``: they outlive single tests by design,
and the fixture checks that they are all gone at its own teardown.

The sources are module-level classes with no framework import at the top of
this module, so the actors (which import this module to unpickle them) stay light.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import psutil
import pytest
from _util import wait_until

import kerasfeed

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never report anywhere (and never reach out)
ray = pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 2**20
_INITS = 0  # worker_init calls in this process (an actor's)


def _count_init():
    global _INITS
    _INITS += 1


_SHIFT = 0.0  # changed by Mixed.on_epoch_end: a module global the actors must see change


class Mixed:
    """Dict items drawn with ``item_rng``; ``on_epoch_end`` changes what later passes make: an attribute, a
    class attribute and a module global (NOTE [ State outside the instance ])."""

    bias = 0.0

    def __init__(self, n: int = 24):
        global _SHIFT
        self.n = n
        self.offset = 0.0
        type(self).bias, _SHIFT = 0.0, 0.0  # the import-time values, which the actors start from

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = kerasfeed.get_worker_info()
        noise = kerasfeed.item_rng().normal(size=3).astype(np.float32)
        tag = np.array([info.num_workers if info else -1, _INITS], np.int64)
        x = np.full(3, i + self.offset + type(self).bias + _SHIFT, np.float32) + noise
        return {"x": x, "tag": tag}, np.int64(i)

    def on_epoch_end(self):
        global _SHIFT
        self.offset += 100.0
        type(self).bias += 1000.0
        _SHIFT += 10000.0


class StandIns:
    """Says whether its actor unpickled it without kerasfeed's light framework stand-ins."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        from kerasfeed.execution.processes import frameworks

        return np.array([frameworks._stand_ins_off[0]])


class Slow:
    """256 KB items (above Ray's inline limit: each lives in its node's object store), 30 ms each."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.03)
        return np.full(64 * 1024, i, np.float32)


class Blobs:
    """Batches of a learnable regression (items are batches of 8)."""

    def __init__(self, n: int, fail_at: int = -1):
        self.n = n
        self.fail_at = fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"item {i} is broken")
        rng = np.random.default_rng(i)
        x = rng.normal(size=(8, 4)).astype(np.float32)
        return x, (x @ np.arange(1, 5, dtype=np.float32)[:, None]).astype(np.float32)


class Moody:
    """Item 3 never returns; item 5 raises on its first call (a marker file says it ran)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            time.sleep(3600)
        if i == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise OSError("a flaky read")
        return np.full(2, i, np.int64)


def _children() -> set:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _own(cluster_ns, before: set) -> None:
    """The processes started since ``before`` belong to the cluster (conftest's allow-list)."""
    cluster_ns.pids |= _children() - before
    cluster_ns.owned["ray_cluster"] = frozenset(cluster_ns.pids)


def _kerasfeed_actors() -> list:
    """kerasfeed's actors alive in the cluster (each is named ``kerasfeed-...``)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("kerasfeed-")]


def _no_kerasfeed_actors(timeout: float = 15.0) -> bool:
    return wait_until(lambda: not _kerasfeed_actors(), timeout=timeout, interval=0.2)


@pytest.fixture(scope="module")
def ray_cluster(owned_process_trees):
    from ray.cluster_utils import Cluster

    from kerasfeed.execution.ray.cluster import _loopback_stays_loopback

    before = _children()
    ns = types.SimpleNamespace(owned=owned_process_trees, pids=set(), nodes=[], cluster=None)
    node = dict(num_cpus=1, object_store_memory=80 * MB, node_ip_address="127.0.0.1")
    try:
        with _loopback_stays_loopback():
            ns.cluster = Cluster(
                initialize_head=True,
                head_node_args=dict(node, num_cpus=0, include_dashboard=False, no_monitor=True),
            )
            ns.nodes = [ns.cluster.add_node(**node) for _ in range(2)]
            ray.init(address=ns.cluster.address, _node_ip_address="127.0.0.1", logging_level="warning")
        ns.address = ns.cluster.address
        ns.node_args = node
        _own(ns, before)
        yield ns
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
            if ns.cluster is not None:
                ns.cluster.shutdown()
            gone = wait_until(lambda: not (_children() - before), timeout=20, interval=0.2)
            assert gone, f"the Ray cluster left processes: {sorted(_children() - before)}"
        finally:
            owned_process_trees.pop("ray_cluster", None)


def _batches(loader_or_ds, epochs: int) -> list:
    out = []
    for _ in range(epochs):
        for b in loader_or_ds:
            out.append(b)
    return out


def _same(a, b) -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_shuffled_pass_equals_the_processes_executors_batch_for_batch(ray_cluster):
    kw = dict(batch_size=4, shuffle=True, seed=7, workers=2, worker_init=_count_init)
    ray_loader = kerasfeed.to_loader(Mixed(), executor="ray", **kw)
    ex = kerasfeed.executor_of(ray_loader)
    assert ex.name == "ray" and ex.workers == 2
    got = _batches(ray_loader, 2)
    want = _batches(kerasfeed.to_loader(Mixed(), executor="processes", **kw), 2)
    assert len(got) == len(want) == 12
    _same(got, want)
    assert {int(t) for b in got for t in b[0]["tag"][:, 1]} == {1}  # worker_init ran once per actor
    assert {int(t) for b in got for t in b[0]["tag"][:, 0]} == {2}  # get_worker_info() in the actors
    assert 11_090 < float(got[6][0]["x"].min()) < 11_130  # on_epoch_end's 3 changes reached the actors for pass 1
    stats = ex.stats()
    nodes = {w["node_id"] for w in stats["per_worker"]}
    assert len(nodes) == 2 and stats["items"] >= 48 and stats["state"]["syncs"] == 1
    assert stats["cluster"]["owner"] == "user"  # the fixture's connection: left as it is
    ex.close()

    ray_ds = kerasfeed.to_dataset(Mixed(), executor="ray", **kw)
    got = _batches(ray_ds.as_numpy_iterator(), 1) + _batches(ray_ds.as_numpy_iterator(), 1)
    want_ds = kerasfeed.to_dataset(Mixed(), executor="processes", **kw)
    want = _batches(want_ds.as_numpy_iterator(), 1) + _batches(want_ds.as_numpy_iterator(), 1)
    assert len(got) == len(want) == 12
    _same(got, want)
    kerasfeed.executor_of(ray_ds).close()
    kerasfeed.executor_of(want_ds).close()
    assert _no_kerasfeed_actors()


def test_hdf5_over_http_on_actors_gives_the_local_batches(ray_cluster, tmp_path):
    """A remote HDF5 source travels to the actors with its chunk layouts; its headers do not."""
    from remote_servers import http_server

    from kerasfeed.datasets import make_synthetic_scenes

    path = str(make_synthetic_scenes(tmp_path / "a.h5", num_scenes=24, points_per_scene=16, chunk_scenes=4))
    secret = "ray-header-s3cr3t"
    with http_server({"a.h5": path}) as srv:
        seq = kerasfeed.H5SliceSequence(f"{srv.url}/a.h5", ("points", "labels"), 4, shuffle=True, seed=2,
                                        storage_options={"headers": {"Authorization": secret, "X-Trace": "t1"}})
        blob = ray.cloudpickle.dumps(seq)
        # Headers stay, all of them: any may be a credential under a server's own name (X-JFrog-Art-Api); actors
        # find credentials the way fsspec does (docs/remote.md). This store asks for none.
        assert secret.encode() not in blob and b"X-Trace" not in blob
        kw = dict(batch_size=2, shuffle=True, seed=5)
        local = kerasfeed.H5SliceSequence(path, ("points", "labels"), 4, shuffle=True, seed=2)
        _same(_batches(kerasfeed.to_loader(seq, executor="ray", workers=2, **kw), 2),
              _batches(kerasfeed.to_loader(local, executor="threads", **kw), 2))
        assert srv.counts()[0] > 0
        # The window and row readers too, and export on actors.
        order = kerasfeed.IndexOrder(24, shuffle=True, seed=3)
        for make in (lambda p: kerasfeed.H5WindowSequence(p, "points", 3, window=2, stride=3, shuffle=True, seed=4),
                     lambda p: kerasfeed.H5RowSequence(p, ("points", "labels"), 5, order=order)):
            _same(_batches(kerasfeed.to_loader(make(f"{srv.url}/a.h5"), executor="ray", workers=2), 2),
                  _batches(kerasfeed.to_loader(make(path), executor="threads"), 2))
        fresh = [kerasfeed.H5SliceSequence(p, ("points", "labels"), 4) for p in (f"{srv.url}/a.h5", path)]
        kerasfeed.export(fresh[0], tmp_path / "e", num_shards=2, executor="ray", progress=False)
        _same(list(kerasfeed.load_export(tmp_path / "e").as_numpy_iterator()), [fresh[1][i] for i in range(6)])
    assert _no_kerasfeed_actors()


def test_a_node_removed_mid_pass_loses_and_repeats_nothing(ray_cluster):
    n = 48
    ex = kerasfeed.RayExecutor(Slow(n), workers=2, seed=1)
    by_node = {w["node_id"]: w["id"] for w in ex.stats()["per_worker"]}
    assert len(by_node) == 2
    victim = next(node for node in ray_cluster.nodes if node.node_id in by_node and by_node[node.node_id] == 1)
    loader = kerasfeed.to_loader(ex.source, executor=ex, shuffle=True, seed=1)
    remover = threading.Thread(target=ray_cluster.cluster.remove_node, args=(victim,))
    seen = []
    for k, item in enumerate(loader):
        assert item.shape == (64 * 1024,) and (item == item[0]).all()
        # A view of the object store (NOTE [ Items from the object store are read-only ]); the pipeline
        # copies a pass's last item (the epoch hook runs before it is handed over).
        assert item.flags.writeable == (k == n - 1)
        seen.append(int(item[0]))
        if k == 8:  # the node of worker 1 goes, with its actor and the items made ahead in its object store
            remover.start()
            remover.join()  # from another thread, while the window of the pass is in flight
    ray_cluster.nodes.remove(victim)
    assert seen == kerasfeed.IndexOrder(n, shuffle=True, seed=1).indices(0).tolist()  # each once, in order
    stats = ex.stats()
    assert stats["replaced_workers"] >= 1 and stats["requeued_items"] >= 1, stats
    before = _children()
    ray_cluster.nodes.append(ray_cluster.cluster.add_node(**ray_cluster.node_args))  # back to 2 CPUs
    _own(ray_cluster, before)
    assert wait_until(lambda: ex.stats()["per_worker"][1]["alive"], timeout=30, interval=0.2)  # the replacement
    second = [int(item[0]) for item in loader]
    assert second == kerasfeed.IndexOrder(n, shuffle=True, seed=1).indices(1).tolist()
    ex.close()
    assert _no_kerasfeed_actors()


def test_dropped_loaders_and_closed_executors_leave_no_actor(ray_cluster):
    loader = kerasfeed.to_loader(Blobs(16), executor="ray", workers=2, shuffle=True, seed=0)
    it = iter(loader)
    next(it), next(it)
    assert len(_kerasfeed_actors()) == 2
    del it, loader
    gc.collect()
    assert _no_kerasfeed_actors()
    # A failed pass is left: the actors stop (parking) although the loader lives on.
    loader = kerasfeed.to_loader(Blobs(16, fail_at=5), executor="ray", workers=2)
    with pytest.raises(kerasfeed.ItemError, match="item 5 is broken"):
        list(loader)
    assert _no_kerasfeed_actors()
    del loader
    gc.collect()
    assert _no_kerasfeed_actors()


def test_actors_unpickle_without_the_stand_ins_where_they_do_not_fit_this_keras(ray_cluster, monkeypatch):
    from kerasfeed.execution.processes import light_modules

    for fits in (True, False):  # False: what ``stand_ins_fit`` says of a Keras whose PyDataset moved
        monkeypatch.setattr(light_modules, "_fits", fits)
        with kerasfeed.to_loader(StandIns(), executor="ray", workers=1) as loader:
            assert [b.tolist() for b in loader] == [[not fits]] * 2


def test_no_room_and_another_cluster_fail_at_once_with_clear_errors(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(kerasfeed.WorkerError, match=r"has no room for the workers: 5 worker\(s\) .*Received: workers=5"):
        kerasfeed.RayExecutor(Blobs(8), workers=5, start_timeout=2)
    with pytest.raises(kerasfeed.WorkerError, match=r"has no CPU for the workers: .*ask for \{'CPU': 4.0\} each"):
        kerasfeed.RayExecutor(Blobs(8), resources={"CPU": 4}, start_timeout=1)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ValueError, match=r"connected to the Ray cluster at .* already.*Received: address='127.0.0.1:1'"):
        kerasfeed.RayExecutor(Blobs(8), address="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"`resources` maps Ray resource names"):
        kerasfeed.RayExecutor(Blobs(8), resources={"CPU": -1})
    with pytest.raises(ValueError, match=r"recycle worker processes; executor='ray'"):
        kerasfeed.to_loader(Blobs(8), executor="ray", worker_max_items=3)
    assert _no_kerasfeed_actors()


def test_timeout_replaces_a_stuck_actor_and_retries_make_an_item_again(ray_cluster, tmp_path):
    ex = kerasfeed.RayExecutor(Moody(str(tmp_path / "ran")), workers=2, timeout=1, retries=1)
    ex.plan(0, list(range(8)))
    got = [int(ex.load(i, 0)[0]) for i in range(3)]
    with pytest.raises(kerasfeed.WorkerError, match=r"did not return Moody\[3\] within timeout=1 s.*2 attempts") as e:
        ex.load(3, 0)
    assert e.value.index == 3 and e.value.attempts == 2
    got += [int(ex.load(i, 0)[0]) for i in range(4, 8)]  # item 5 raised once and was made again
    assert got == [0, 1, 2, 4, 5, 6, 7]
    stats = ex.stats()
    assert stats["replaced_workers"] >= 2 and stats["retried_items"] >= 2 and stats["failed_items"] == 1, stats
    ex.close()
    assert _no_kerasfeed_actors()


class Steady:
    """12 items of 0.3 s each; item 4 raises on its first call (a marker file says it ran)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __len__(self):
        return 12

    def __getitem__(self, i):
        time.sleep(0.3)
        if i == 4 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise OSError("a flaky read")
        return np.full(2, i, np.int64)


def test_a_retried_item_times_from_when_its_actor_runs_it(ray_cluster, tmp_path):
    """A retry goes behind its actor's later items; its timeout counted from the resend killed a healthy
    actor and failed the pass (the processes executor counts from when the worker is ready for it)."""
    ex = kerasfeed.RayExecutor(Steady(str(tmp_path / "ran")), workers=2, timeout=0.8, retries=1)
    ex.plan(0, list(range(12)))
    assert [int(ex.load(i, 0)[0]) for i in range(12)] == list(range(12))
    stats = ex.stats()
    assert stats["retried_items"] == 1 and stats["replaced_workers"] == 0 and stats["failed_items"] == 0, stats
    ex.close()
    assert _no_kerasfeed_actors()


class Stalls:
    """16 items; item 3 raises on its first call, item 11 hangs on its first call (marker files)."""

    def __init__(self, marks: str):
        self.marks = marks

    def __len__(self):
        return 16

    def __getitem__(self, i):
        first = not os.path.exists(f"{self.marks}/{i}")
        open(f"{self.marks}/{i}", "a").close()
        if first and i == 3:
            raise OSError("a flaky read")
        if first and i == 11:
            time.sleep(600)
        return np.full(2, i, np.int64)


def test_a_retry_behind_an_item_made_ahead_that_hangs_is_not_stuck_with_it(ray_cluster, tmp_path):
    """Item 3's retry went to the actor running item 11 (made ahead, hung): only the call waited for was
    timed, so the pass waited for ever (the processes executor completes it)."""
    order = kerasfeed.IndexOrder(16, shuffle=True, seed=1)  # item 3 first, 11 fifth
    with kerasfeed.to_loader(Stalls(str(tmp_path)), order=order, executor="ray", workers=2, retries=2,
                             timeout=3) as loader:
        t0 = time.monotonic()
        assert [int(b[0]) for b in loader] == order.indices(0).tolist()
        assert time.monotonic() - t0 < 30
        stats = kerasfeed.stats(loader)
    assert stats["replaced_workers"] >= 1 and stats["failed_items"] == 0, stats
    assert _no_kerasfeed_actors()


class Locked(Blobs):
    def __init__(self, n: int):
        super().__init__(n)
        self.guard = threading.Lock()


def test_what_cannot_reach_the_actors_is_named_for_ray_not_processes(ray_cluster):
    with pytest.raises(TypeError, match=r"^kerasfeed: executor='ray' sends the source to Ray actors by pickling it "
                                        r"\(cloudpickle\), but `source.guard` \(_thread.lock\) cannot be pickled"):
        kerasfeed.RayExecutor(Locked(4), workers=1)
    src = Blobs(4)
    with kerasfeed.RayExecutor(src, workers=1) as ex:
        loader = kerasfeed.to_loader(src, executor=ex)
        next(iter(loader))
        src.guard = threading.Lock()  # set between passes: the actors' copy must get it
        with pytest.raises(TypeError, match=r"`guard` of Blobs changed in this process .* must reach the Ray actors "
                                            r"before the next pass"):
            list(loader)


def test_fit_trains_on_tensorflow_with_ray_input_and_validation(ray_cluster):
    import keras

    train = kerasfeed.to_dataset(Blobs(24), executor="ray", workers=1, shuffle=True, seed=0)
    val = kerasfeed.to_dataset(Blobs(4), executor="ray", workers=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    stats_cb = kerasfeed.InputStats(every_n_steps=4, dataset=train)
    history = model.fit(train, validation_data=val, epochs=3, verbose=0, shuffle=False, callbacks=[stats_cb])
    losses = history.history["loss"]
    assert len(losses) == 3 and losses[-1] < losses[0] and np.isfinite(history.history["val_loss"]).all()
    assert "input_wait_share" in history.history, sorted(history.history)  # InputStats logged each epoch
    stats = kerasfeed.stats(train)
    assert stats["executor"] == "ray" and stats["items_made"] >= 72 and len(stats["workers"]) == 1, stats
    for ds in (train, val):
        kerasfeed.executor_of(ds).close()
    bad = kerasfeed.to_dataset(Blobs(12, fail_at=7), executor="ray", workers=2)
    with pytest.raises(Exception, match="item 7 is broken"):  # TensorFlow's UnknownError, holding the ItemError
        model.fit(bad, epochs=1, verbose=0, shuffle=False)
    assert _no_kerasfeed_actors()  # the failed fit's executor parked: its actors are gone (the dataset lives on)


def test_export_writes_its_shards_on_ray_actors(ray_cluster, tmp_path):
    manifest = kerasfeed.export(Blobs(6), tmp_path / "e", num_shards=2, executor="ray", progress=False)
    assert [s["count"] for s in manifest["shards"]] == [3, 3]
    assert kerasfeed.verify_export(tmp_path / "e")["items"] == 6
    assert _no_kerasfeed_actors()


def _run_script(code: str, tmp_path, env: dict, timeout: float = 240) -> dict:
    (tmp_path / "blobs_src.py").write_text(
        "import numpy as np\n\n" + textwrap.dedent(
            """
            class Blobs:
                def __init__(self, n):
                    self.n = n

                def __len__(self):
                    return self.n

                def __getitem__(self, i):
                    rng = np.random.default_rng(i)
                    x = rng.normal(size=(8, 4)).astype(np.float32)
                    return x, (x @ np.arange(1, 5, dtype=np.float32)[:, None]).astype(np.float32)


            class RayInWorker:
                def __len__(self):
                    return 1

                def __getitem__(self, i):
                    import sys

                    return np.array(["ray" in sys.modules])
            """
        )
    )
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(code))
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(PYTHONPATH=ROOT, RAY_USAGE_STATS_ENABLED="0", **env)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fit_trains_on_jax_connecting_by_address_and_leaves_the_cluster_running(ray_cluster, tmp_path):
    out = _run_script(
        f"""
        import json
        import keras
        import kerasfeed
        from blobs_src import Blobs

        ex = kerasfeed.RayExecutor(Blobs(16), address={ray_cluster.address!r}, workers=1)
        loader = kerasfeed.to_loader(ex.source, executor=ex, shuffle=True, seed=0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        losses = model.fit(loader, epochs=3, verbose=0).history["loss"]
        owner = ex.stats()["cluster"]["owner"]
        ex.close()
        import ray
        print(json.dumps({{"losses": losses, "backend": keras.backend.backend(), "owner": owner,
                          "connected_after": ray.is_initialized()}}))
        """,
        tmp_path,
        {"KERAS_BACKEND": "jax"},
    )
    assert out["backend"] == "jax" and out["losses"][-1] < out["losses"][0], out
    assert out["owner"] == "connected" and not out["connected_after"]  # kerasfeed connected it, and disconnected
    assert ray.cluster_resources().get("CPU") == 2.0  # the cluster itself runs on
    assert _no_kerasfeed_actors()


def test_unreachable_address_fails_fast_and_a_local_start_stays_on_loopback_and_stops(tmp_path):
    out = _run_script(
        """
        import gc, json, sys, time
        import psutil
        import kerasfeed
        from blobs_src import Blobs, RayInWorker

        kerasfeed.RayExecutor, kerasfeed.to_loader  # resolving the names imports no Ray
        with kerasfeed.ProcessExecutor(RayInWorker(), workers=1) as pex:  # nor do worker processes
            light = "ray" not in sys.modules and not pex.load(0, 0)[0]

        t0 = time.monotonic()
        try:
            kerasfeed.RayExecutor(Blobs(4), address="127.0.0.1:1")
            error = None
        except ConnectionError as e:
            error = str(e)
        seconds = time.monotonic() - t0

        loader = kerasfeed.to_loader(Blobs(6), executor="ray", workers=1)
        first = [float(x[0, 0]) for x, _ in loader]
        ex = kerasfeed.executor_of(loader)
        owner = ex.stats()["cluster"]["owner"]
        kids = psutil.Process().children(recursive=True)
        listen = set()
        for p in kids:
            try:
                listen |= {c.laddr.ip for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        import ray
        running = ray.is_initialized()
        del loader, ex
        gc.collect()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in kids):
            time.sleep(0.2)
        left = [p.pid for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        print(json.dumps({"error": error, "seconds": seconds, "first": first, "owner": owner, "listen": sorted(listen),
                          "running": running, "initialized_after": ray.is_initialized(), "left": left,
                          "processes": len(kids), "light": light}))
        """,
        tmp_path,
        {"HOME": str(tmp_path)},  # Ray's local start writes its auth token there
    )
    assert out["light"], out  # `import kerasfeed`, its names and worker processes stay free of Ray
    assert out["error"] and "no Ray cluster answers at 127.0.0.1:1" in out["error"], out
    assert out["error"].endswith("Received: address='127.0.0.1:1'") and out["seconds"] < 10, out
    assert out["first"] == [float(Blobs(6)[i][0][0, 0]) for i in range(6)]
    assert out["owner"] == "started" and out["running"] and out["processes"] >= 3, out
    assert out["listen"] and set(out["listen"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, out  # loopback only
    assert not out["initialized_after"] and not out["left"], out  # Ray stopped with the last executor


class LoadAugment:
    """cache=: ``load`` counted through a log file (any process), ``augment`` drawing from item_rng."""

    def __init__(self, log: str):
        self.log = log

    def __len__(self):
        return 12

    def load(self, i):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return np.arange(i, i + 6, dtype=np.float32).reshape(2, 3)

    def augment(self, x):
        return x + kerasfeed.item_rng().normal(size=x.shape).astype(np.float32)

    def __getitem__(self, i):
        return self.augment(self.load(i))


def test_cache_on_ray_loads_each_item_once_and_augments_as_the_processes_executor(ray_cluster, tmp_path):
    kw = dict(shuffle=True, seed=5, workers=2)
    log = str(tmp_path / "ray-loads")
    with kerasfeed.to_loader(LoadAugment(log), executor="ray", cache="memory", **kw) as loader:
        got = _batches(loader, 3)
        stats = kerasfeed.stats(loader)
    with kerasfeed.to_loader(LoadAugment(str(tmp_path / "p-loads")), executor="processes", **kw) as plain:
        want = _batches(plain, 3)
    _same(got, want)
    with open(log) as f:
        loads = [tuple(int(x) for x in line.split()) for line in f]
    # Item 0 twice here, when the cache opened: its own __getitem__ against augment(load(0)), the load stored
    # (NOTE [ A class's own __getitem__ beside load and augment ]); every other item once, by an actor.
    assert [i for pid, i in loads if pid == os.getpid()] == [0, 0]
    assert sorted(i for pid, i in loads if pid != os.getpid()) == list(range(1, 12)), "once each, by an actor"
    assert stats["cache_items"] == 12 and stats["cache_hits"] >= 24


class FlakyAugment:
    """cache=: item 3's ``augment`` fails while the marker file is missing (then writes it when ``once``)."""

    def __init__(self, marker: str, once: bool):
        self.marker, self.once = marker, once

    def __len__(self):
        return 6

    def load(self, i):
        return np.full((2,), i, np.float32)

    def augment(self, x):
        if int(x[0]) == 3 and not os.path.exists(self.marker):
            if self.once:
                open(self.marker, "w").close()
            raise ValueError("bad augment")
        return x + 1

    def __getitem__(self, i):
        return self.augment(self.load(i))


def test_cache_on_ray_an_augment_error_is_named_and_retried_as_on_other_executors(ray_cluster, tmp_path):
    # Under Ray with cache= the consumer runs augment (the actors make load only): its error came out bare
    # (ValueError: bad augment), and retries= and max_skipped= did not apply to it.
    marker = str(tmp_path / "failed-once")
    with kerasfeed.to_loader(FlakyAugment(marker, once=False), executor="ray", cache="memory", workers=2,
                             batch_size=None) as loader:
        with pytest.raises(kerasfeed.ItemError, match=r"FlakyAugment\[3\] raised ValueError: bad augment"):
            list(loader)
    with kerasfeed.to_loader(FlakyAugment(marker, once=True), executor="ray", cache="memory", workers=2,
                             batch_size=None, retries=1) as loader:
        assert [int(x[0]) for x in loader] == [1, 2, 3, 4, 5, 6]
        assert kerasfeed.stats(loader)["retried_items"] == 1
    os.remove(marker)
    with kerasfeed.to_loader(FlakyAugment(marker, once=False), executor="ray", cache="memory", workers=2,
                             batch_size=None, max_skipped=1) as loader:
        assert [int(x[0]) for x in loader] == [1, 2, 3, 5, 6]


def test_ctrl_c_inside_ray_init_leaves_nothing_it_started():
    """Ctrl-C while kerasfeed started a local Ray: the guard was made only once ray.init returned, so the agents
    Ray had started were left orphaned for about a minute (helper, 5 of 5). A stand-in for ray starts a child
    and is interrupted; the child is gone when the KeyboardInterrupt arrives."""
    from kerasfeed.execution.ray import cluster

    started = []

    class HalfStarted:
        @staticmethod
        def init(**kwargs):
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise KeyboardInterrupt

        @staticmethod
        def shutdown():
            pass

    with pytest.raises(KeyboardInterrupt):
        cluster._start_local(HalfStarted)
    assert started and wait_until(lambda: started[0].poll() is not None, timeout=10)
