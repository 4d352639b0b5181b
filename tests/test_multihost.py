"""to_loader under a multi-process Keras distribution (JAX): each process reads its own shard.

The cluster test starts ``examples/multihost_jax.py`` as two real JAX
processes on 127.0.0.1 (CPU, gloo collectives, two devices each) with
``keras.distribution.DataParallel`` at its defaults and ``model.fit(
kerasfeed.to_loader(..., shuffle=True, seed=0, executor="processes"))``,
twice: an uninterrupted run plus a run stopped mid-epoch, then both processes
restarted from the saved state (and the failures at creation, and which
shard a loader reads under two ``ModelParallel`` meshes). The other
tests stand in for the peer process (``hosts.exchange``) to check the rules
without a cluster.
"""

import json
import os
import sys
from collections import Counter

import numpy as np
import pytest

import kerasfeed
from kerasfeed.integrations.keras import fingerprint_of
from kerasfeed.loading import agreement, hosts
from kerasfeed.sampling.order import IndexOrder
from kerasfeed.sampling.protocol import order_fingerprint

sys.path.insert(0, os.path.dirname(__file__))
from multiworker_launch import keras_jax_env, run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multihost_jax.py")
ITEMS, BATCH, EPOCHS, SEED, STOP, PROCESSES = 64, 4, 3, 0, 10, 2
STEPS = ITEMS // PROCESSES // BATCH


class Items:
    """Item ``i`` is ``[i, i]`` (float32)."""

    def __init__(self, n=10, rows=None):
        self.n, self.rows = n, rows

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.rows is not None:
            return np.full((self.rows, 2), i, np.float32)
        return np.full(2, i, np.float32)


class Pairs(Items):
    """Item ``i`` is ``([i], [2 i])``: an (x, y) sample."""

    def __getitem__(self, i):
        return np.full(1, i, np.float32), np.full(1, 2 * i, np.float32)


class Batches:
    """Items that are whole batches (``batch_size=None``): ``size(i)`` rows of ``[i, i]``."""

    def __init__(self, n, size):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((self.size(i), 2), i, np.float32)


def _short_last(n=8):
    return Batches(n, lambda i: 4 if i < n - 1 else 2)


def _short_at(j, n=16):  # item j is short
    return Batches(n, lambda i: 2 if i == j else 4)


def _processes(index=1, local=1, shards=2):
    return hosts.ProcessShards(2, index, shards, index if shards > 1 else 0, local, "FakeDistribution", "batch")


def _peer(monkeypatch, processes, change=None, failed=False):
    """Stands in for the other process: it sends this process's row (``change``
    applied: ``{fact: value}``), or a failure. Returns the rows sent."""
    sent = []

    def exchange(p, row):
        sent.append(row.copy())
        other = row.copy()
        if failed:
            other[:] = 0
            other[0] = 1
        for name, value in (change or {}).items():
            other[agreement._HEAD + hosts.FACTS.index(name)] = agreement._code(value)
        return np.stack([other, row] if p.process_index == 1 else [row, other])

    monkeypatch.setattr(hosts, "current_processes", lambda: processes)
    monkeypatch.setattr(hosts, "exchange", exchange)
    return sent


def test_the_shard_rule_follows_the_keras_distribution(monkeypatch):
    from types import SimpleNamespace as Fake

    class FakeDistribution:
        batch_dim_name, device_mesh = "batch", None  # no mesh: Keras' even split of the replicas

        def __init__(self, processes, replicas, shard_id):
            self.num_processes, self.num_model_replicas, self.data_shard_id = processes, replicas, shard_id

    # Stand-ins for the imported JAX and Keras (current_processes imports neither).
    cluster = Fake(process_index=lambda: 1, process_count=lambda: 3, distributed=Fake(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "jax", cluster)
    cases = {  # (processes, replicas, data_shard_id) -> (num_shards, shard_index, local batch shards)
        (2, 2, 1): (2, 1, 1),  # DataParallel, one device per process
        (2, 4, 1): (2, 1, 2),  # DataParallel, two devices per process
        (4, 2, 1): (2, 1, 1),  # ModelParallel: two processes per replica read one shard
        (2, 1, 0): (1, 0, 1),  # one replica: every process reads everything
    }
    for (p, r, shard), expected in cases.items():
        dist = FakeDistribution(p, r, shard)
        monkeypatch.setitem(sys.modules, "keras", Fake(distribution=Fake(distribution=lambda: dist)))
        got = hosts.current_processes()
        assert (got.num_shards, got.shard_index, got.local_batch_shards) == expected, (p, r, got)
        assert got.num_processes == p and got.global_batch(8) == 8 * expected[0]
    monkeypatch.setitem(sys.modules, "keras", Fake(distribution=Fake(distribution=lambda: None)))
    assert hosts.current_processes() is None  # one process: nothing changes
    # A jax.distributed cluster before set_distribution: one shard per process.
    cluster.distributed.is_initialized = lambda: True
    got = hosts.current_processes()
    assert (got.num_processes, got.process_index, got.num_shards, got.shard_index) == (3, 1, 3, 1)
    # JAX 0.4.38 (Keras 3.7-3.9) has no is_initialized: its distributed module's state says.
    del cluster.distributed.is_initialized
    state = Fake(global_state=Fake(client=None))
    monkeypatch.setitem(sys.modules, "jax._src.distributed", state)
    assert hosts.current_processes() is None
    state.global_state.client = object()
    got = hosts.current_processes()
    assert (got.num_processes, got.process_index, got.num_shards, got.shard_index) == (3, 1, 3, 1)


def test_loader_reads_its_process_shard_after_the_processes_agree(monkeypatch):
    sent = _peer(monkeypatch, _processes(index=1))
    with kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3) as loader:
        got = [b[:, 0].astype(int).tolist() for b in loader]
        assert kerasfeed.stats(loader)["process"] == 1
    shard = IndexOrder(11, shuffle=True, seed=3, num_shards=2, shard_index=1).indices(0).tolist()
    assert sum(got, []) == shard and len(got) == len(loader) == 3  # 11 // 2 = 5 items, in batches of 2
    assert len(sent) == 1 and sent[0][0] == 0  # one exchange, this process succeeded
    facts = dict(zip(hosts.FACTS, sent[0][agreement._HEAD:].tolist()))
    assert facts["len(source)"] == 11 and facts["seed"] == 3 and facts["batches per pass"] == 3
    # Explicit shard arguments win: no exchange, the whole source.
    with kerasfeed.to_loader(Items(11), batch_size=2, num_shards=1) as loader:
        assert sum(len(b) for b in loader) == 11 and len(sent) == 1


def test_processes_that_disagree_or_fail_raise_on_every_process(monkeypatch):
    from kerasfeed.loader.loader import Loader

    closed, close = [], Loader.close
    monkeypatch.setattr(Loader, "close", lambda self: closed.append(self) or close(self))
    _peer(monkeypatch, _processes(index=1), change={"len(source)": 12})
    with pytest.raises(ValueError, match=r"disagree on len\(source\).*process 0: 12, process 1: 11.*Received: "
                                         r"len\(source\)=11 on process 1"):
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3)
    assert len(closed) == 1  # the loader made before the exchange is closed (its executor stopped)
    _peer(monkeypatch, _processes(index=1), failed=True)
    with pytest.raises(RuntimeError, match=r"process 0 of 2 failed to create its pipeline"):
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3)
    # A local failure is sent too (the peer then raises instead of waiting), then raised here.
    sent = _peer(monkeypatch, _processes(index=0))
    with pytest.raises(ValueError, match=r"needs an explicit `seed`.*Received: seed=None"):
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int"):
        kerasfeed.to_loader(Items(11), batch_size=0, shuffle=True, seed=3)
    assert [int(row[0]) for row in sent] == [1, 1]


def test_a_fingerprint_that_differs_is_shown_as_the_table_shows_it(monkeypatch):
    """The table named the order as '#1bd2...' and the Received part as its text: the two could not be matched."""
    import re

    _peer(monkeypatch, _processes(index=1), change={"order fingerprint": "another order"})
    with pytest.raises(ValueError) as info:
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3)
    mine = re.search(r"process 1: (#[0-9a-f]+)\)", str(info.value)).group(1)
    assert re.search(rf"Received: order fingerprint='[0-9a-f]+' \({mine}\) on process 1$", str(info.value))


def test_a_sharded_order_must_give_each_data_shard_its_own_order_shard(monkeypatch):
    """A sharded ``order=`` is taken as it is; left at ``shard_index=0`` on every process, every process read
    shard 0, silently. The processes now check that data shards and order shards pair one to one."""
    order = IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=0)
    _peer(monkeypatch, _processes(index=1), change={"data shard": 0, "order shard_index": 0})
    with pytest.raises(ValueError, match=r"^to_loader: the processes read the shards of the `order` as order "
                                         r"shard_index \(process 0: 0, process 1: 0\), but their data shards are 0, 1: "
                                         r".*shard_index=<this process's data shard> \(here 1\)\. Received: order "
                                         r"shard_index=0 on process 1$"):
        kerasfeed.to_loader(Items(16), order=order)
    own = IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=1)
    with kerasfeed.to_loader(Items(16), order=own) as loader:  # each process its own order shard: as before
        assert [int(b[0]) for b in loader] == own.indices(0).tolist()
    # Processes that share a data shard (their devices hold the same slices of the batch) share the order's.
    _peer(monkeypatch, _processes(index=1, shards=1), change={"order shard_index": 0})
    with pytest.raises(ValueError, match=r"process 0: 0, process 1: 1\), but their data shards are 0, 0"):
        kerasfeed.to_loader(Items(16), order=own)


def test_a_per_process_batch_must_divide_among_the_local_devices(monkeypatch):
    _peer(monkeypatch, _processes(index=0, local=2))
    with pytest.raises(ValueError, match=r"3 samples do not divide among 2 devices.*Received: batch_size=3"):
        kerasfeed.to_loader(Items(20), batch_size=3)
    with pytest.raises(ValueError, match=r"last batch of every pass has 1 samples.*drop_remainder=True"):
        kerasfeed.to_loader(Items(10), batch_size=2)  # 5 items per process
    with kerasfeed.to_loader(Items(10), batch_size=2, drop_remainder=True) as loader:
        assert len(loader) == 2
    with pytest.raises(ValueError, match=r"whole batches \(batch_size=None\) of 3 samples"):
        kerasfeed.to_loader(Items(10, rows=3))


def test_items_that_are_batches_must_have_one_size_on_every_process(monkeypatch):
    """Before: a short item on one process at a step where the other had a
    full one reached jax.make_array_from_process_local_data silently (a wrong
    global batch, and a different loss on every process)."""
    sent = _peer(monkeypatch, _processes(index=0))
    # Probes include the source's last item, where a short batch usually is: refused at creation.
    with pytest.raises(ValueError, match=r"^to_loader: item 7 is a batch of 2 samples, but the probed items are "
                       r"batches of 4 \(item 0\)\. Under the 2 processes of the FakeDistribution, each reading its "
                       r"own shard, .*Received: item 7 batch size=2, expected 4$"):
        kerasfeed.to_loader(_short_last())
    assert int(sent[-1][0]) == 1  # the failure is sent to the peer (it raises instead of waiting)
    # A short item that no probe saw is refused as it is read, before its batch is handed out.
    with kerasfeed.to_loader(_short_at(8)) as loader:  # shard 0: items 0, 2, 4, 6, 8, ...
        it = iter(loader)
        assert [int(next(it)[0, 0]) for _ in range(4)] == [0, 2, 4, 6]
        with pytest.raises(ValueError, match=r"item 8 is a batch of 2 samples, but the probed items are batches of 4"
                           r" \(item 0\).*Received: item 8 batch size=2, expected 4$"):
            next(it)
    assert dict(zip(hosts.FACTS, sent[-1][agreement._HEAD:].tolist()))["item batch size"] == 4  # the processes agree on it too
    _peer(monkeypatch, _processes(index=0), change={"item batch size": 6})
    with pytest.raises(ValueError, match=r"disagree on item batch size: item batch size \(process 0: 4, process 1: 6\)"):
        kerasfeed.to_loader(Batches(8, lambda i: 4))
    # Samples (batch_size set) may still vary: they are padded to one batch shape.
    _peer(monkeypatch, _processes(index=0))
    with kerasfeed.to_loader(Batches(16, lambda i: 1 + i * 7 % 5), batch_size=2, padding_values=0.0) as loader:
        assert [b.shape[0] for b in loader] == [2] * 4
    # Explicit shards in the cluster: the same rule; one shard (the whole source): no rule.
    with pytest.raises(ValueError, match=r"item 7 is a batch of 2 samples"):
        kerasfeed.to_loader(_short_last(), num_shards=2, shard_index=1)
    with kerasfeed.to_loader(_short_last(), num_shards=1) as loader:
        assert [len(b) for b in loader] == [4] * 7 + [2]


def test_num_shards_alone_reads_this_process_s_shard(monkeypatch):
    """Before: `num_shards=2` without `shard_index` read shard 0 on every process
    (the docstring promised "this process's")."""
    _peer(monkeypatch, _processes(index=1))
    with kerasfeed.to_loader(Items(16), batch_size=2, shuffle=True, seed=0, num_shards=2) as loader:
        got = [int(v) for b in loader for v in b[:, 0]]
    assert got == IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=1).indices(0).tolist()
    with pytest.raises(ValueError, match=r"^to_loader: `num_shards=4` without `shard_index` in a cluster of 2 "
                       r"processes: .*Pass `shard_index` \(this process is 1\), or num_shards=2\. "
                       r"Received: num_shards=4, shard_index=None, processes=2$"):
        kerasfeed.to_loader(Items(16), num_shards=4)
    assert len(kerasfeed.to_loader(Items(16), num_shards=1)) == 16  # the whole source, as documented
    with kerasfeed.to_loader(Items(16), num_shards=4, shard_index=3) as loader:  # explicit: as given
        assert [int(b[0]) for b in loader] == [3, 7, 11, 15]


def test_explicit_shards_under_several_processes_check_the_local_batch(monkeypatch):
    """Before: explicit shards skipped the per-device check (local_distribution
    was None under several processes), so `fit` failed mid-pass with a bare
    JAX error; now refused at creation, and when an epoch begins."""
    from types import SimpleNamespace as Fake

    _peer(monkeypatch, _processes(index=0, local=2))
    monkeypatch.setitem(sys.modules, "jax", sys.modules.get("jax") or Fake())
    monkeypatch.setattr(hosts, "_active_distribution", lambda: Fake(num_processes=2))
    assert hosts.local_distribution().local_batch_shards == 2
    with pytest.raises(ValueError, match=r"last batch of every pass has 1 samples, which do not divide among the 2 "
                       r"devices of process 0.*Received: batch_size=2, drop_remainder=False, last batch=1$"):
        kerasfeed.to_loader(Items(14), batch_size=2, num_shards=2, shard_index=0)  # 7 items per process
    with pytest.raises(ValueError, match=r"3 samples do not divide among 2 devices"):
        kerasfeed.to_loader(Items(14), batch_size=3, num_shards=2, shard_index=0)
    monkeypatch.setattr(hosts, "_active_distribution", lambda: None)  # set after the loader was made
    with kerasfeed.to_loader(Items(14), batch_size=2, num_shards=2, shard_index=0) as loader:
        monkeypatch.setattr(hosts, "_active_distribution", lambda: Fake(num_processes=2))
        with pytest.raises(ValueError, match=r"last batch of every pass has 1 samples"):
            loader.on_epoch_begin()


def test_a_source_shorter_than_the_data_shards_is_refused_in_the_distribution_s_words(monkeypatch):
    _peer(monkeypatch, _processes(index=1))
    # Before: "IndexOrder: `num_shards` must be in [1, 1]", about an order the user never made.
    with pytest.raises(ValueError, match=r"^to_loader: the source has 1 items per pass, fewer than the 2 data shards "
                       r"of the 2-process FakeDistribution \(process 1\): every shard needs one. "
                       r"Received: len\(source\)=1$"):
        kerasfeed.to_loader(Items(1))


def test_an_unsharded_order_is_cut_per_process(monkeypatch):
    class Reversed:
        shard_length = 9

        def indices(self, epoch):
            return np.arange(9)[::-1] if epoch % 2 == 0 else np.arange(9)

    fingerprints = []
    for index in (0, 1):
        _peer(monkeypatch, _processes(index=index))
        with kerasfeed.to_loader(Items(9), order=Reversed()) as loader:
            assert [int(b[0]) for b in loader] == list(range(8, -1, -1))[index::2][:4]
            fingerprints.append(fingerprint_of(loader))
    assert fingerprints[0] == fingerprints[1] != order_fingerprint(Reversed())


def test_run_directories_name_the_process(monkeypatch):
    from kerasfeed.integrations.input_stats import input_run_dir

    monkeypatch.setattr(hosts, "current_processes", lambda: _processes(index=1))
    assert kerasfeed.worker_run_dir("logs") == os.path.join("logs", "worker_1")
    assert input_run_dir("logs") == os.path.join("logs", "worker_1", "input")


# ---------------------------------------------------------------- the cluster
def _shard(k, epoch):
    return IndexOrder(ITEMS, shuffle=True, seed=SEED, num_shards=PROCESSES, shard_index=k).indices(epoch).tolist()


def _calls(path):
    """``(probes, calls)``: lines before the first ``--`` are the probes."""
    lines = open(path).read().split()
    cut = lines.index("--")
    return [int(v) for v in lines[:cut]], [int(v) for v in lines[cut + 1 :] if v != "--"]


def _replay(epochs):
    """The weights SGD reaches when every step's global batch is both
    processes' batches together (numpy, float64)."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    from multihost_jax import LR, sample

    w, b = np.zeros(4), 0.0
    for e in range(epochs):
        for s in range(STEPS):
            idx = sum((_shard(k, e)[s * BATCH : (s + 1) * BATCH] for k in range(PROCESSES)), [])
            x = np.stack([sample(i)[0] for i in idx]).astype(np.float64)
            y = np.array([sample(i)[1][0] for i in idx], np.float64)
            r = x @ w + b - y
            w, b = w - LR * 2 * x.T @ r / len(idx), b - LR * 2 * r.mean()
    return w, b


@pytest.mark.timeout(300)
def test_two_jax_processes_fit_their_own_shards_and_resume(tmp_path):
    out = str(tmp_path)
    common = ["--out", out, "--items", str(ITEMS), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
              "--seed", str(SEED), "--stop-after", str(STOP)]
    run_workers(EXAMPLE, [*common, "--phases", "full,stop"], cwd=out, timeout=240, env_for=keras_jax_env)
    state = json.load(open(tmp_path / "data_state.json"))  # written by process 0
    # With the order's fingerprint (TrainingProgress(order=loader)): a resume on another number of processes
    # is refused (test_sampling_orders.py names the counts).
    assert {k: state[k] for k in ("epoch", "batches")} == {"epoch": STOP // STEPS, "batches": STOP % STEPS}
    assert state["order"] and state["items"] == STOP % STEPS * BATCH
    run_workers(EXAMPLE, [*common, "--phases", "resume", "--check-errors"], cwd=out, timeout=240,
                env_for=keras_jax_env)
    first = [json.load(open(tmp_path / f"result_{k}_full_stop.json")) for k in range(PROCESSES)]
    resumed = [json.load(open(tmp_path / f"result_{k}_resume.json")) for k in range(PROCESSES)]

    for k, r in enumerate(first):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (k, 2, 4, 2)
        full = r["full"]
        assert full["steps"] == [STEPS] * EPOCHS  # the same steps on every process: its shard's batches
        assert full["loss"][-1] < full["loss"][0] / 10, full["loss"]
        assert full["stats_process"] == k
        assert full["input_run_dir"] == os.path.join("logs", f"worker_{k}", "input")
        assert full["worker_run_dir"] == os.path.join("logs", f"worker_{k}")
        assert r["stop"]["steps"] == [STEPS, STOP - STEPS] and r["stop"]["state"] == state
    assert first[0]["full"]["weights"] == first[1]["full"]["weights"]  # identical weights
    w, b = _replay(EPOCHS)  # each global batch = the two processes' batches
    np.testing.assert_allclose(np.ravel(first[0]["full"]["weights"][0]), w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(first[0]["full"]["weights"][1], [b], rtol=1e-4, atol=1e-5)

    # Computed items: each process made exactly its shard of every pass (plus at most
    # the next pass's first items, made ahead), and the shards of a pass are disjoint
    # and cover it: every index computed once per pass over both processes.
    for e in range(EPOCHS):
        assert sorted(_shard(0, e) + _shard(1, e)) == list(range(ITEMS))
    for k in range(PROCESSES):
        probes, calls = _calls(tmp_path / f"calls_full_{k}.txt")
        assert set(probes) <= set(_shard(k, 0)[:3])  # probes only its own items
        expected = Counter(sum((_shard(k, e) for e in range(EPOCHS)), []))
        made = Counter(calls)
        assert expected - made == Counter(), (k, "not made", expected - made)
        extra = made - expected
        assert set(extra) <= set(_shard(k, EPOCHS)[:8]) and max(extra.values(), default=1) == 1, (k, extra)

    # Resumed after restarting both processes: the rest of the interrupted pass, then
    # whole passes, ending at exactly the uninterrupted run's weights.
    for k, r in enumerate(resumed):
        assert r["resume"]["steps"] == [STEPS - STOP % STEPS] + [STEPS] * (EPOCHS - STOP // STEPS - 1)
        assert {k: r["resume"]["state"][k] for k in ("epoch", "batches")} == {"epoch": EPOCHS, "batches": 0}
        np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in r["resume"]["weights"]]),
                                   np.concatenate([np.ravel(a) for a in first[k]["full"]["weights"]]), rtol=1e-6)
        _, calls = _calls(tmp_path / f"calls_resume_{k}.txt")
        rest = _shard(k, 1)[STOP % STEPS * BATCH :] + _shard(k, 2)
        assert Counter(rest) - Counter(calls) == Counter(), k

    # The failures at creation, on both processes.
    errors = [r["errors"] for r in resumed]
    for k, err in enumerate(errors):
        assert err["mismatch"].startswith("ValueError") and "len(source) (process 0: 64, process 1: 63)" in err[
            "mismatch"], err["mismatch"]
        assert f"Received: len(source)={ITEMS - k} on process {k}" in err["mismatch"]
        assert "3 samples do not divide among 2 devices" in err["indivisible"]
        assert "needs an explicit `seed`" in err["no_seed"]
    assert errors[0]["peer_failed"].startswith("RuntimeError: to_loader: process 1 of 2 failed")
    assert "`batch_size` must be a positive int" in errors[1]["peer_failed"]

    # ModelParallel meshes (loaders only): processes holding different slices of the
    # batch axis read disjoint shards; processes holding all of it read the whole pass.
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    from multihost_jax import sample

    index_of = {float(sample(i)[0][0]): i for i in range(16)}
    for k, r in enumerate(resumed):
        rows, columns = r["meshes"]["batch_rows"], r["meshes"]["batch_columns"]
        assert rows["shards"] == [2, k, 1] and columns["shards"] == [1, 0, 2]
        shard = IndexOrder(16, shuffle=True, seed=SEED, num_shards=2, shard_index=k).indices(0).tolist()
        assert [index_of[v] for v in rows["x0"]] == shard
        assert [index_of[v] for v in columns["x0"]] == IndexOrder(16, shuffle=True, seed=SEED).indices(0).tolist()


# ------------------------------------- the sharding rules on a real cluster
def _cluster_rules(out):
    """Run as each of two JAX processes (``python test_multihost.py --rules OUT``):
    the rules above, on a real cluster under ``DataParallel`` (two devices
    per process). Writes ``rules_<k>.json``: each case's items or error."""
    import jax
    import keras

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    k, got = jax.process_index(), {}

    def case(name, make, read=lambda b: [int(v) for v in np.ravel(b[..., 0])]):
        try:
            with make() as loader:
                got[name] = [read(b) for b in loader]
        except Exception as e:  # noqa: BLE001 - the error is the result
            got[name] = f"{type(e).__name__}: {e}"

    # Every automatic creation is one exchange: both processes run the same cases, in order.
    case("short_last", lambda: kerasfeed.to_loader(_short_last()))
    case("short_last_explicit", lambda: kerasfeed.to_loader(_short_last(), num_shards=2, shard_index=k))
    case("short_mid", lambda: kerasfeed.to_loader(_short_at(8)))  # item 8: process 0's shard, not probed
    case("batch_sizes_differ", lambda: kerasfeed.to_loader(Batches(8, lambda i: 4 + 2 * k)))
    case("padded", lambda: kerasfeed.to_loader(Batches(16, lambda i: 1 + i * 7 % 5), batch_size=2),
         lambda b: [b[:, 0, 0].astype(int).tolist(), list(b.shape)])
    case("num_shards_only", lambda: kerasfeed.to_loader(Items(16), batch_size=2, shuffle=True, seed=0, num_shards=2))
    case("num_shards_other", lambda: kerasfeed.to_loader(Items(16), num_shards=4))
    case("explicit_indivisible", lambda: kerasfeed.to_loader(Items(14), batch_size=2, num_shards=2, shard_index=k))
    case("order_shard_zero", lambda: kerasfeed.to_loader(  # left at shard_index=0 on both: the same items
        Items(16), order=IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=0)))
    # cache= with an order whose shards keep their items: each process stores and reads only its own.
    loads = []

    class Logged(Items):
        def __getitem__(self, i):
            loads.append(int(i))
            return super().__getitem__(i)

    order = IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=k, fixed_shards=True)
    with kerasfeed.to_loader(Logged(16), batch_size=2, cache="memory", order=order) as loader:
        passes = [[int(v) for b in loader for v in np.ravel(b[..., 0])] for _ in range(3)]
    got["cached_fixed_shards"] = {"passes": passes, "loads": sorted(loads)}
    # A kept directory shared by the processes: each keeps its own shard-<k>-of-<n> subdirectory.
    loads.clear()
    with kerasfeed.to_loader(Logged(16), batch_size=2, cache=os.path.join(out, "items"), order=order) as loader:
        kept = [[int(v) for b in loader for v in np.ravel(b[..., 0])] for _ in range(2)]
    got["kept_fixed_shards"] = {"passes": kept, "loads": sorted(loads)}
    # A mesh whose processes each read the whole pass, over one kept directory: each process its own
    # subdirectory (one was refused, "in use by another run", and the other failed in the exchange).
    mesh = keras.distribution.DeviceMesh((2, 2), ["model", "batch"],
                                         np.array(keras.distribution.list_devices()).reshape(2, 2))
    whole = keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")
    with whole.scope():
        case("kept_whole", lambda: kerasfeed.to_loader(Items(16), batch_size=2, cache=os.path.join(out, "whole")))
    # A backup directory of each process's own (a local disk per host): process 0 keeps its backup, process 1's
    # is deleted at the fit's end. Resumed, process 0 restored a backup and process 1 none: their steps differed,
    # gloo aborted process 1 and process 0 waited for ever.
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    backup_dir = os.path.join(out, f"backup_{k}")
    for run in range(2):
        with kerasfeed.to_loader(Pairs(16), batch_size=2) as loader:
            try:
                model.fit(loader, epochs=1, verbose=0, callbacks=[
                    kerasfeed.BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=k == 1)])
                got[f"backup_run_{run}"] = "done"
            except Exception as e:  # noqa: BLE001 - the error is the result
                got[f"backup_run_{run}"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rules_{k}.json"), "w") as f:
        json.dump(got, f)


@pytest.mark.timeout(300)
def test_the_sharding_rules_on_two_jax_processes(tmp_path):
    run_workers(os.path.abspath(__file__), ["--rules", str(tmp_path)], cwd=str(tmp_path), env_for=keras_jax_env)
    got = [json.load(open(tmp_path / f"rules_{k}.json")) for k in range(PROCESSES)]
    cached = [r["cached_fixed_shards"] for r in got]
    for c in cached:  # the same own items every pass, a new order each pass, each item loaded once
        assert len({tuple(sorted(p)) for p in c["passes"]}) == 1 and len({tuple(p) for p in c["passes"]}) == 3
        own, loads = set(c["passes"][0]), Counter(c["loads"])
        assert all(loads[i] == 1 for i in own) and set(loads) - own <= {0, 1, 2, 15}  # other items: probes only
    assert sorted(cached[0]["passes"][0] + cached[1]["passes"][0]) == list(range(16))
    for c, k in zip([r["kept_fixed_shards"] for r in got], range(PROCESSES)):  # a directory: the same passes
        assert c["passes"] == cached[k]["passes"][:2]
        assert all(n == 1 for i, n in Counter(c["loads"]).items() if i in set(c["passes"][0]))
    assert sorted(os.listdir(tmp_path / "items")) == ["shard-0-of-2", "shard-1-of-2"]
    assert all(isinstance(r["kept_whole"], list) for r in got), [r["kept_whole"] for r in got]
    assert [sorted(sum(r["kept_whole"], [])) for r in got] == [list(range(16))] * 2
    assert sorted(os.listdir(tmp_path / "whole")) == ["process-0-of-2", "process-1-of-2"]
    for sub in ("shard-0-of-2", "shard-1-of-2"):
        assert {"key.json", "data.bin", "index.bin"} <= set(os.listdir(tmp_path / "items" / sub))
    for k, r in enumerate(got):
        # Items that are batches: one size on every process (the short last one is probed everywhere).
        assert r["short_last"].startswith("ValueError: to_loader: item 7 is a batch of 2 samples, but the probed "
                                          "items are batches of 4") and "DataParallel, each" in r["short_last"]
        assert r["short_last_explicit"].startswith("ValueError: to_loader: item 7 is a batch of 2 samples")
        assert "disagree on item batch size: item batch size (process 0: 4, process 1: 6)" in r["batch_sizes_differ"]
        # Samples of varying shapes with `batch_size`: padded per batch, as before.
        pairs = [[4 * j + k, 4 * j + 2 + k] for j in range(4)]
        assert r["padded"] == [[p, [2, max(1 + i * 7 % 5 for i in p), 2]] for p in pairs], r["padded"]
        # num_shards alone: this process's shard; shards disjoint and covering the pass.
        r["num_shards_only"] = sum(r["num_shards_only"], [])
        assert r["num_shards_only"] == IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=k).indices(0).tolist()
        assert r["num_shards_other"].startswith("ValueError: to_loader: `num_shards=4` without `shard_index` in a "
                                                "cluster of 2 processes"), r["num_shards_other"]
        assert r["num_shards_other"].endswith("Received: num_shards=4, shard_index=None, processes=2")
        # Explicit shards: the per-device check at creation, as the automatic path does.
        assert r["explicit_indivisible"].startswith(f"ValueError: to_loader: the last batch of every pass has 1 "
                                                    f"samples, which do not divide among the 2 devices of process {k}")
    assert sorted(got[0]["num_shards_only"] + got[1]["num_shards_only"]) == list(range(16))
    for k, r in enumerate(got):
        assert r["order_shard_zero"].startswith("ValueError: to_loader: the processes read the shards of the `order` "
                                                "as order shard_index (process 0: 0, process 1: 0), but their data "
                                                "shards are 0, 1"), r["order_shard_zero"]
    for k, r in enumerate(got):
        assert r["backup_run_0"] == "done", r["backup_run_0"]
        assert r["backup_run_1"] == (
            "ValueError: BackupAndRestore: the processes found different backups (process 0: epoch 1 batch 0, process "
            "1: no backup): every process must restore the same one, or they run other steps and the first "
            "collective fails (a crash on one, a hang on the others). Give every process the same backup_dir on "
            f"storage all of them see (process 0 writes it). Received: backup_dir='{tmp_path}/backup_{k}' on "
            f"process {k}"), r["backup_run_1"]
    assert "item 8 is a batch of 2 samples" in got[0]["short_mid"]  # as process 0 reads it
    assert isinstance(got[1]["short_mid"], list) and len(got[1]["short_mid"]) == 8  # its items are all full


if __name__ == "__main__" and sys.argv[1:2] == ["--rules"]:
    _cluster_rules(sys.argv[2])
