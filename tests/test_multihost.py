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
from kerasfeed.loading import hosts
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
            other[1 + hosts.FACTS.index(name)] = hosts._code(value)
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


def test_loader_reads_its_process_shard_after_the_processes_agree(monkeypatch):
    sent = _peer(monkeypatch, _processes(index=1))
    with kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3) as loader:
        got = [b[:, 0].astype(int).tolist() for b in loader]
        assert kerasfeed.stats(loader)["process"] == 1
    shard = IndexOrder(11, shuffle=True, seed=3, num_shards=2, shard_index=1).indices(0).tolist()
    assert sum(got, []) == shard and len(got) == len(loader) == 3  # 11 // 2 = 5 items, in batches of 2
    assert len(sent) == 1 and sent[0][0] == 0  # one exchange, this process succeeded
    facts = dict(zip(hosts.FACTS, sent[0][1:].tolist()))
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
    with pytest.raises(RuntimeError, match=r"process 0 of 2 failed to create its loader"):
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True, seed=3)
    # A local failure is sent too (the peer then raises instead of waiting), then raised here.
    sent = _peer(monkeypatch, _processes(index=0))
    with pytest.raises(ValueError, match=r"needs an explicit `seed`.*Received: seed=None"):
        kerasfeed.to_loader(Items(11), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive int"):
        kerasfeed.to_loader(Items(11), batch_size=0, shuffle=True, seed=3)
    assert [int(row[0]) for row in sent] == [1, 1]


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
    assert state == {"epoch": STOP // STEPS, "batches": STOP % STEPS}
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
        assert r["resume"]["state"] == {"epoch": EPOCHS, "batches": 0}
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
