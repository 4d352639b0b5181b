"""executor="auto" with cache=: it probes what the executor will run per item (NOTE [ Auto with cache= ])."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution import auto

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers do not import this module


def _busy(ms: float) -> int:
    """About ``ms`` of GIL-held pure Python."""
    s, end = 0, time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        s += 1
    return s


def _count(log: str, i: int) -> None:
    with open(log, "a") as f:
        f.write(f"{i}\n")


def _counted(log: str) -> int:
    return sum(1 for _ in open(log)) if os.path.exists(log) else 0


class Stage(kerasfeed.SceneSequence):
    """``__getitem__`` stored whole: it waits (``waits``) or is GIL-bound Python; every call counted."""

    def __init__(self, log: str, waits: bool, n: int = 12):
        super().__init__()
        self._log, self.waits, self.n = log.encode(), waits, n  # bytes: not a file a kept cache's key would watch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        _count(self._log, i)
        if self.waits:
            time.sleep(0.01)
        else:
            _busy(3)
        return np.full((2, 3), i, np.float32), np.int64(i)


class LoadThenAugment(kerasfeed.SceneSequence):
    """``load`` waits 30 ms (stored); ``augment`` is ~3 ms of GIL-held Python (``busy``) or a 5 ms wait."""

    def __init__(self, log: str, busy: bool, n: int = 12):
        super().__init__()
        self._log, self.busy, self.n = log.encode(), busy, n

    def __len__(self):
        return self.n

    def load(self, i):
        _count(self._log, i)
        time.sleep(0.03)
        return np.full((2, 3), i, np.float32), np.int64(i)

    def augment(self, item):
        x, y = item
        if self.busy:
            _busy(3)
        else:
            time.sleep(0.005)
        return x + kerasfeed.item_rng().normal(size=x.shape).astype(np.float32), y


@pytest.fixture
def four_cpus(monkeypatch):
    """The decision as on 4 CPUs (2 workers): GIL-bound work then gains enough from processes on any machine."""
    monkeypatch.setattr(auto, "usable_cpus", lambda: 4)


@pytest.mark.parametrize("waits", [True, False])
def test_without_augment_auto_decides_for_what_pass_0_makes(tmp_path, four_cpus, waits):
    loader = kerasfeed.to_loader(Stage(str(tmp_path / "calls"), waits), executor="auto", workers=2, cache="memory")
    try:
        ex = kerasfeed.executor_of(loader)
        assert ex.name == ("threads" if waits else "processes"), ex.reason
        assert "with cache= and no augment the executor makes only the items not stored yet (pass 0)" in ex.reason
        assert ex.probe.wall_s >= (0.01 if waits else 0.002)
        for _ in range(2):
            assert [int(y) for _, y in loader] == list(range(12))
    finally:
        loader.close()


def test_a_kept_cache_holding_every_item_starts_threads_without_a_probe(tmp_path, four_cpus):
    log, directory = str(tmp_path / "calls"), str(tmp_path / "kept")
    first = kerasfeed.to_loader(Stage(log, waits=False), executor="auto", workers=2, cache=directory)
    try:
        assert kerasfeed.executor_of(first).name == "processes"
        assert [int(y) for _, y in first] == list(range(12))  # pass 0 stores every item
    finally:
        first.close()
    made = _counted(log)
    second = kerasfeed.to_loader(Stage(log, waits=False), executor="auto", workers=2, cache=directory)
    try:
        ex = kerasfeed.executor_of(second)
        assert ex.name == "threads" and ex.probe is None
        assert "every item is stored already (12) and nothing runs per pass" in ex.reason
        assert "no probe and no worker processes" in ex.reason
        assert [int(y) for _, y in second] == list(range(12))
        assert _counted(log) == made  # no probe call, no item made: the store served them all
    finally:
        second.close()


def test_a_kept_shard_holding_its_first_pass_starts_threads_without_a_probe(tmp_path, four_cpus):
    """A host's kept directory holds its shard only: all its first pass needs, though not all of the source."""
    log, directory = str(tmp_path / "calls"), str(tmp_path / "kept")
    kw = dict(executor="auto", workers=2, cache=directory, num_shards=2, shard_index=1)
    with kerasfeed.to_loader(Stage(log, waits=False), **kw) as first:
        want = [int(y) for _, y in first]
    assert len(want) == 6
    made = _counted(log)
    with kerasfeed.to_loader(Stage(log, waits=False), **kw) as second:
        ex = kerasfeed.executor_of(second)
        assert ex.name == "threads" and ex.probe is None, ex.reason
        assert "every item of the first pass (this shard's) is stored already (6)" in ex.reason
        assert [int(y) for _, y in second] == want
    assert _counted(log) == made  # no probe call, no item made


@pytest.mark.parametrize("busy", [True, False])
def test_with_augment_auto_probes_augment_alone(tmp_path, four_cpus, busy):
    """``load`` waits 30 ms either way: a probe of the whole item would see a waiting source (threads). What
    every pass after the first runs is ``augment``: GIL-bound Python goes to processes, a wait to threads."""
    log = str(tmp_path / "calls")
    ds = kerasfeed.to_dataset(LoadThenAugment(log, busy), executor="auto", workers=2, cache="memory", seed=0)
    ex = kerasfeed.executor_of(ds)
    try:
        assert ex.name == ("processes" if busy else "threads"), ex.reason
        assert "every pass runs augment on the executor, over the stored item: decided for augment alone" in ex.reason
        assert ex.probe.wall_s < 0.03  # augment timed, not load (whose own sleep is 30 ms): 5 ms sleeps overshoot under load
        first = [int(y) for _, y in ds]
        assert first == list(range(12)) and [int(y) for _, y in ds] == first
    finally:
        ex.close()
    assert _counted(log) <= 12 + 4 + 12  # the probe loads 4 items (not stored), the pass 12, none after


def test_an_item_the_cached_probe_fails_on_is_named_by_the_source(tmp_path):
    class Broken(LoadThenAugment):
        def augment(self, item):
            raise ValueError("no augment today")

    with pytest.raises(kerasfeed.ItemError, match=r"Broken\[0\] raised ValueError: no augment today"):
        kerasfeed.to_loader(Broken(str(tmp_path / "calls"), busy=False), executor="auto", cache="memory")


class _Counted(kerasfeed.SceneSequence):
    """A cheap ``load`` counted in a file (auto may choose worker processes: a busy machine's probe), and an
    ``augment`` from ``item_rng()``."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __len__(self):
        return 16

    def load(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return np.full((100, 3), i, "float32")

    def loads(self):
        with open(self.log) as f:
            return [int(line) for line in f]

    def augment(self, x):
        return x + kerasfeed.item_rng().normal(size=x.shape).astype("float32")


def test_the_items_auto_s_probe_loads_are_stored_not_loaded_again(tmp_path):
    """The probe of augment loads items 0-3 to augment them; pass 0 loaded them again (20 loads for 16 items,
    a helper's report). Now they are stored as they are loaded: 4 shuffled passes load each item once, and
    the batches are those of threads."""
    got = {}
    for executor in ("threads", "auto"):
        source = _Counted(str(tmp_path / f"{executor}-loads"))
        with kerasfeed.to_loader(source, cache="memory", executor=executor, shuffle=True, seed=0) as loader:
            got[executor] = [np.concatenate([b for b in loader]) for _ in range(4)]
        assert sorted(source.loads()) == list(range(16)), (executor, sorted(source.loads()))
    assert all(np.array_equal(a, b) for a, b in zip(got["threads"], got["auto"]))


@pytest.mark.parametrize("kept", [False, True])
def test_a_shard_s_probe_and_check_load_its_own_items_once(tmp_path, kept):
    """With a shard's store, the probe and the split check loaded items 0, 1, 2 (other shards') and did not store
    them: 12 loads for 8 own items, and a kept shard, full, still loaded item 0 (a helper's report). Now they make
    the shard's own first items, stored: each own item loaded once, and of the other shard's only the last item
    (the signature probe's: a last batch's shape); a kept shard's second run loads nothing."""
    order = kerasfeed.IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=0, fixed_shards=True)
    own = sorted(int(i) for i in order.indices(0))
    assert 15 not in own
    cache = str(tmp_path / "kept") if kept else "memory"
    log = str(tmp_path / "loads").encode()  # bytes: not a file the kept cache's key watches
    open(log, "w").close()
    runs, before = [], 0
    for run in range(2 if kept else 1):
        source = _Counted(log)
        with kerasfeed.to_loader(source, order=order, cache=cache, executor="auto") as loader:
            runs.append([np.concatenate(list(loader)) for _ in range(3)])
        loads, before = sorted(source.loads()[before:]), len(source.loads())
        assert loads == (sorted(own + [15]) if run == 0 else []), (run, loads)  # then nothing at all
    with kerasfeed.to_loader(_Counted(str(tmp_path / "threads-loads")), order=order, executor="threads") as loader:
        want = [np.concatenate(list(loader)) for _ in range(3)]
    for got in runs:
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
