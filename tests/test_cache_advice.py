"""cache= around the stage it stores: profile's advice, sharded orders' probes, the HDF5 readers' passes."""

import time

import h5py
import numpy as np
import pytest

import kerasfeed


class CheapLoad(kerasfeed.SceneSequence):
    """``load`` is next to free; ``augment`` (run every pass, cache or not) costs the item's time."""

    def __len__(self):
        return 32

    def load(self, i):
        return np.full((64,), i, "float32")

    def augment(self, x):
        time.sleep(0.005)
        return x + 1


class BigLoad(kerasfeed.SceneSequence):
    """A costly ``load`` of 1 MiB (what cache= stores) cropped to 1 KiB by ``augment``."""

    def __len__(self):
        return 1000

    def load(self, i):
        time.sleep(0.02)  # well over augment's time even on a busy machine (the advice weighs their share)
        return np.full((512, 512), i, "float32")

    def augment(self, x):
        return x[:16, :16] + kerasfeed.item_rng().normal()


def test_profile_advises_no_cache_when_augment_costs_the_item():
    report = kerasfeed.profile(CheapLoad(), items=4, workers=[], threads=[1])
    assert report.cache.startswith("not worth it") and "augment(item)" in report.cache, report.cache


def test_profile_sizes_the_store_by_what_load_returns():
    report = kerasfeed.profile(BigLoad(), items=4, workers=[], threads=[1])
    # 1000 stored items of 1 MiB: 0.98 GB (the 1 KiB crops would be 0.00 GB)
    assert "0.98 GB" in report.cache or "1.0 GB" in report.cache, report.cache


class PassLoad(kerasfeed.SceneSequence):
    """A costly ``load`` that reads what depends on the pass (``how``): cache= refuses it."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def __len__(self):
        return 16

    def load(self, i):
        time.sleep(0.01)
        value = self.epoch if self.how == "epoch" else kerasfeed.item_rng().random()
        return np.full((4,), value, "float32")

    def augment(self, item):
        return item + 1


class PassItem(kerasfeed.SceneSequence):
    """A costly ``__getitem__`` (no ``load``) that draws from ``item_rng()``: the stage cache= would store."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.01)
        return np.full((4,), kerasfeed.item_rng().random(), "float32")


@pytest.mark.parametrize("how", ["rng", "epoch", "getitem"])
def test_profile_says_a_stage_that_reads_the_pass_cannot_be_cached_as_it_stands(how):
    """item_rng() inside load: profile raised the item_rng error (load was called outside an item); self.epoch
    inside load, or item_rng() in a plain __getitem__: it advised cache='memory', which then refused to run
    (a helper's report)."""
    report = kerasfeed.profile(PassItem() if how == "getitem" else PassLoad(how), items=4, workers=[], threads=[1])
    stage = "__getitem__" if how == "getitem" else "load"
    used = "PassLoad.epoch" if how == "epoch" else "kerasfeed.item_rng()"
    assert report.cache.startswith(f"not as it stands: {stage} uses {used}, which depends on the pass"), report.cache


def test_cache_advice_budgets_memory_as_the_cache_does(monkeypatch):
    from types import SimpleNamespace as Probe

    import kerasfeed.cache.options as options
    from kerasfeed.observe.cache_advice import cache_advice

    monkeypatch.setattr(options, "available_memory", lambda: 2**20)  # a container's limit, below the host's
    costly = Probe(wall_s=5e-3, copy_s=5e-5, nbytes=2**20)
    advice = cache_advice(costly, 100, CheapLoad(), disk=2**40)
    assert advice.startswith("cache='<a local directory>'"), advice


def test_cache_advice_weighs_times_not_size():
    """A large item (transport-bound) that is costly to make pays to store; a large, cheap one does not."""
    from types import SimpleNamespace as Probe

    from kerasfeed.observe.cache_advice import cache_advice

    costly = Probe(wall_s=0.135, copy_s=6e-4, nbytes=8 * 2**20)
    advice = cache_advice(costly, 8, CheapLoad(), memory=2**30, disk=2**40)
    assert advice.startswith("cache='memory'") and "135.00 ms to make" in advice, advice
    cheap = Probe(wall_s=2e-3, copy_s=6e-4, nbytes=8 * 2**20)
    assert cache_advice(cheap, 8, CheapLoad(), memory=2**30).startswith("not worth it")


class Counted(kerasfeed.SceneSequence):
    def __init__(self, n=16):
        super().__init__()
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def load(self, i):
        self.loaded.append(int(i))
        return np.full((3,), i, "float32")


def test_a_sharded_order_with_cache_makes_and_stores_only_its_shard():
    order = kerasfeed.IndexOrder(16, shuffle=True, seed=0, num_shards=2, shard_index=0, fixed_shards=True)
    own = set(order.indices(0).tolist())
    source = Counted()
    loader = kerasfeed.to_loader(source, batch_size=4, order=order, cache="memory")
    try:
        seen = sorted(int(v) for b in loader for v in np.asarray(b)[:, 0])
        assert seen == sorted(own)
        assert set(source.loaded) <= own, sorted(set(source.loaded) - own)  # no other host's item made
        assert kerasfeed.stats(loader)["cache_items"] == 8
    finally:
        loader.close()


@pytest.fixture
def h5_path(tmp_path):
    path = str(tmp_path / "rows.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(64 * 3, dtype="float32").reshape(64, 3)
        f["y"] = np.arange(64, dtype="int64")
    return path


def _passes(loader, n=2):
    return [np.concatenate([np.asarray(y) for _, y in loader]).tolist() for _ in range(n)]


@pytest.mark.parametrize("reader", ["rows", "slices"])
def test_unshuffled_hdf5_readers_cache_and_the_loader_shuffles_them(h5_path, reader):
    if reader == "rows":
        seq = kerasfeed.H5RowSequence(h5_path, ["x", "y"], batch_size=8, order=kerasfeed.IndexOrder(64))
    else:
        seq = kerasfeed.H5SliceSequence(h5_path, ["x", "y"], batch_size=8, shuffle=False)
    loader = kerasfeed.to_loader(seq, cache="memory", shuffle=True, seed=0)
    try:
        first, second = _passes(loader)
        assert sorted(first) == sorted(second) == list(range(64))
        assert first != second  # the loader's shuffle: a new batch order each pass
        assert kerasfeed.stats(loader)["cache_items"] == 8
    finally:
        loader.close()


def test_a_shuffling_hdf5_reader_with_cache_names_the_fix_it_allows(h5_path):
    seq = kerasfeed.H5SliceSequence(h5_path, ["x", "y"], batch_size=8, shuffle=True, seed=0)
    with pytest.raises(kerasfeed.ItemError, match=r"shuffle=True there\) and build the reader with shuffle=False") as e:
        loader = kerasfeed.to_loader(seq, cache="memory", shuffle=True, seed=0)  # its probes make items
        _passes(loader, 1)
    assert "augment" not in str(e.value)
