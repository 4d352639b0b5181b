"""to_dataset with cache=: a pass whose items are all stored is read in the graph, not through ``load``
(NOTE [ A stored pass runs in the graph ], kerasfeed/loading/stored_passes.py)."""

from __future__ import annotations

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution.cache_front import CacheFront
from kerasfeed.loading.stored_passes import StoredPasses

# Long enough passes to be read in the graph: MIN_PASS_ITEMS (50) + 44, checked against it by
# test_an_int32_leaf_needs_longer_passes_to_be_read_in_the_graph. A literal, not an import of
# kerasfeed.tfdata: worker processes import this module to unpickle its sources, and that import
# would load TensorFlow in each of them (4-10 s per start).
N = 94


class Mixed(kerasfeed.SceneSequence):
    """Batches of every dtype read from bytes; the last batch shorter (an open batch dimension)."""

    cache_ignores = ("ends",)

    def __init__(self, n: int = N, **kwargs):
        super().__init__(**kwargs)
        self.n, self.ends = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = 3 if i == self.n - 1 else 4
        rng = np.random.default_rng(i)
        return {
            "x": rng.random((k, 5, 3), dtype=np.float32),
            "mask": rng.random(k) < 0.5,
            "y": np.full((k,), i, np.int64),
            "z": np.array([i, -i], np.complex64) * 1j,
            "h": np.full((2,), i % 100, np.float16),
            "u": np.full((k, 1), i % 256, np.uint8),
        }

    def on_epoch_end(self):
        self.ends += 1


def _count_loads(monkeypatch) -> list:
    calls = [0]
    original = CacheFront.load

    def load(self, index, epoch):
        calls[0] += 1
        return original(self, index, epoch)

    monkeypatch.setattr(CacheFront, "load", load)
    return calls


def _numpy(ds) -> list:
    return [{k: v.numpy() for k, v in element.items()} for element in ds]


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), (i, key)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_stored_passes_are_read_in_the_graph_bit_identical_to_an_uncached_run(monkeypatch, executor):
    calls = _count_loads(monkeypatch)
    reference = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=3, executor="threads", group_items=1)
    source = Mixed()
    workers = {"workers": 2} if executor == "processes" else {}
    ds = kerasfeed.to_dataset(source, shuffle=True, seed=3, executor=executor, cache="memory", group_items=1,
                              **workers)
    assert isinstance(ds._kerasfeed_groups, StoredPasses)
    calls[0] = 0  # the probes' loads aside
    try:
        for epoch in range(3):
            _assert_same(_numpy(ds), _numpy(reference))
            if epoch == 0:
                first = calls[0]
                assert first == N  # pass 0 goes through load (every item a miss)
            else:
                assert calls[0] == first  # later passes: no load at all
            assert source.ends == epoch + 1  # on_epoch_end after each pass, once
        stats = kerasfeed.stats(ds)
        assert stats["cache_hits"] >= 2 * N and stats["cache_misses"] <= N
        assert stats["items"] == 3 * N
        assert [p["items"] for p in stats["passes"]][-3:] == [N, N, N]
    finally:
        kerasfeed.executor_of(ds).close()
        kerasfeed.executor_of(reference).close()


def test_a_pass_not_all_stored_goes_through_load_and_stays_correct(monkeypatch):
    calls = _count_loads(monkeypatch)
    item_bytes = sum(a.nbytes for a in Mixed()[0].values())
    budget = kerasfeed.Cache(max_bytes=(N // 2) * (item_bytes + 1024))  # about half the items fit
    reference = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=1, executor="threads", group_items=1)
    ds = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=1, executor="threads", cache=budget, group_items=1)
    calls[0] = 0  # the probes' loads aside
    try:
        for _ in range(2):
            _assert_same(_numpy(ds), _numpy(reference))
        assert calls[0] == 2 * N  # both passes item by item: the second had items not stored
        assert 0 < kerasfeed.stats(ds)["cache_items"] < N
    finally:
        kerasfeed.executor_of(ds).close()
        kerasfeed.executor_of(reference).close()


class Scalars(Mixed):
    def __getitem__(self, i):  # a Python scalar leaf: the checker makes an array of it (not a view of the store)
        return {"x": np.full((4, 2), i, np.float32), "label": i}


def test_a_leaf_that_is_not_a_view_of_the_store_keeps_every_pass_on_load(monkeypatch):
    calls = _count_loads(monkeypatch)
    ds = kerasfeed.to_dataset(Scalars(), executor="threads", cache="memory", group_items=1)
    calls[0] = 0  # the probes' loads aside
    try:
        for epoch in range(3):
            got = _numpy(ds)
            assert [int(e["label"]) for e in got] == list(range(N))
            assert all(np.array_equal(e["x"], np.full((4, 2), e["label"], np.float32)) for e in got)
        assert calls[0] == 3 * N
    finally:
        kerasfeed.executor_of(ds).close()


def test_strings_short_passes_and_augment_do_not_read_in_the_graph():
    class Text(Mixed):
        def __getitem__(self, i):
            return np.full((2,), i, np.float32), np.array([f"item {i}"])

    class Augmented(Mixed):
        def load(self, i):
            return np.full((2,), i, np.float32)

        def augment(self, item):
            return item + kerasfeed.item_rng().random(2).astype(np.float32)

        def __getitem__(self, i):  # Mixed's items are others: with cache= refused (cached_split.py)
            return self.augment(self.load(i))

    from kerasfeed.tfdata.stored_items import MIN_PASS_ITEMS

    for source in (Text(), Mixed(n=MIN_PASS_ITEMS - 1), Augmented()):
        ds = kerasfeed.to_dataset(source, executor="threads", cache="memory", group_items=1)
        try:
            assert not isinstance(ds._kerasfeed_groups, StoredPasses), type(source).__name__
            assert sum(1 for _ in ds) == len(source)
        finally:
            kerasfeed.executor_of(ds).close()
    # Batched, a pass of MIN_PASS_ITEMS - 1 items in 2 batches: its items counted as 2 full batches (it was read
    # in the graph, 98 items counted for 49).
    class Rows(kerasfeed.SceneSequence):
        def __len__(self):
            return MIN_PASS_ITEMS - 1

        def __getitem__(self, i):
            return np.full((3,), i, np.float32)

    ds = kerasfeed.to_dataset(Rows(), executor="threads", cache="memory", batch_size=MIN_PASS_ITEMS // 2, group_items=1)
    try:
        assert not isinstance(ds._kerasfeed_groups, StoredPasses)
    finally:
        kerasfeed.executor_of(ds).close()


def test_items_left_out_in_pass_0_are_made_again_and_later_passes_read_in_the_graph(monkeypatch):
    calls = _count_loads(monkeypatch)

    class Flaky(Mixed):
        failed: set = set()

        def __getitem__(self, i):
            if i % 50 == 7 and i not in Flaky.failed:  # fails once: left out of pass 0, made in pass 1
                Flaky.failed.add(i)
                raise OSError(f"flaky read of item {i}")
            return super().__getitem__(i)

    ds = kerasfeed.to_dataset(Flaky(), executor="threads", cache="memory", group_items=1, max_skipped=10)
    calls[0] = 0  # the probes' loads aside
    try:
        passes = [[int(e["y"][0]) for e in ds] for _ in range(3)]
        left_out = sorted(Flaky.failed)
        assert left_out and passes[0] == [i for i in range(N) if i not in left_out]
        assert passes[1] == passes[2] == list(range(N))
        assert calls[0] == 2 * N  # pass 1 made the items left out; pass 2 read in the graph
    finally:
        kerasfeed.executor_of(ds).close()


def test_model_fit_on_stored_passes_trains_as_on_an_uncached_dataset():
    import keras

    class Points(Mixed):
        def __getitem__(self, i):
            rng = np.random.default_rng(i)
            x = rng.random((4, 6), dtype=np.float32)
            return x, x.sum(axis=1, keepdims=True)

    losses = []
    for cache in (None, "memory"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        ds = kerasfeed.to_dataset(Points(), shuffle=True, seed=0, executor="threads", cache=cache, group_items=1)
        try:
            losses.append(model.fit(ds, epochs=3, verbose=0, shuffle=False).history["loss"])
            if cache is not None:
                assert kerasfeed.stats(ds)["cache_hits"] >= 2 * N
        finally:
            kerasfeed.executor_of(ds).close()
    assert losses[0] == losses[1]


def test_a_resumed_run_over_a_kept_cache_reads_its_passes_in_the_graph_as_an_uncached_resume(tmp_path, monkeypatch):
    """A second run (``initial_state`` inside pass 1) over the first run's kept directory: the resumed pass
    and the next are read in the graph, with the uncached resume's items, and nothing is loaded."""
    calls = _count_loads(monkeypatch)
    directory = str(tmp_path / "kept")
    first = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=5, executor="threads", cache=directory, group_items=1)
    assert sum(1 for _ in first) == N  # pass 0 stores every item
    kerasfeed.executor_of(first).close()
    state = {"epoch": 1, "batches": 37}
    reference = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=5, executor="threads", group_items=1,
                                     initial_state=state)
    second = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=5, executor="threads", cache=directory,
                                  group_items=1, initial_state=state)
    assert isinstance(second._kerasfeed_groups, StoredPasses)
    calls[0] = 0  # the probes' loads aside
    try:
        for expected_items in (N - 37, N):
            got, want = _numpy(second), _numpy(reference)
            assert len(got) == expected_items
            _assert_same(got, want)
        assert calls[0] == 0
    finally:
        kerasfeed.executor_of(second).close()
        kerasfeed.executor_of(reference).close()


def test_a_store_the_kernel_will_not_map_keeps_every_pass_on_load(monkeypatch):
    """``ItemStore.graph_view`` refused (a private mapping larger than memory): passes go item by item."""
    import errno

    from kerasfeed.cache.store import ItemStore

    def refused(self, length):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(ItemStore, "graph_view", refused)
    calls = _count_loads(monkeypatch)
    reference = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=2, executor="threads", group_items=1)
    ds = kerasfeed.to_dataset(Mixed(), shuffle=True, seed=2, executor="threads", cache="memory", group_items=1)
    calls[0] = 0  # the probes' loads aside
    try:
        for _ in range(3):
            _assert_same(_numpy(ds), _numpy(reference))
        assert calls[0] == 3 * N
    finally:
        kerasfeed.executor_of(ds).close()
        kerasfeed.executor_of(reference).close()


class Int32(Mixed):
    def __getitem__(self, i):
        return {"x": np.full((4, 3), i, np.float32), "label": np.full((4,), i, np.int32)}


def test_an_int32_leaf_needs_longer_passes_to_be_read_in_the_graph(monkeypatch):
    """The reader's functions stay multi-device with an int32 leaf (NOTE [ kerasfeed's functions are instantiated
    single-device ]): its iterator costs what it did, so such passes need ``MIN_PASS_ITEMS_INT32`` items."""
    import kerasfeed.tfdata.stored_items as stored_items

    assert stored_items.MIN_PASS_ITEMS < N < stored_items.MIN_PASS_ITEMS_INT32
    ds = kerasfeed.to_dataset(Int32(), executor="threads", cache="memory", group_items=1)
    try:
        assert not isinstance(ds._kerasfeed_groups, StoredPasses)
    finally:
        kerasfeed.executor_of(ds).close()
    monkeypatch.setattr(stored_items, "MIN_PASS_ITEMS_INT32", N)
    calls = _count_loads(monkeypatch)
    ds = kerasfeed.to_dataset(Int32(), shuffle=True, seed=2, executor="threads", cache="memory", group_items=1)
    reference = kerasfeed.to_dataset(Int32(), shuffle=True, seed=2, executor="threads", group_items=1)
    assert isinstance(ds._kerasfeed_groups, StoredPasses)
    calls[0] = 0
    try:
        for _ in range(3):
            _assert_same(_numpy(ds), _numpy(reference))
        assert calls[0] == N  # pass 0 only: the later passes were read in the graph, int32 labels and all
    finally:
        kerasfeed.executor_of(ds).close()
        kerasfeed.executor_of(reference).close()


def test_passes_read_in_the_graph_side_by_side_each_end_with_their_hook_and_counts():
    # With more than 8 passes open (zip or interleave of 9 iterators), the oldest were forgotten: read whole,
    # they lost their on_epoch_end and their counts in stats() (helper, 3 of 3).
    source = Mixed()
    ds = kerasfeed.to_dataset(source, executor="threads", cache="memory", group_items=1)
    try:
        assert sum(1 for _ in ds) == N  # pass 0 stores every item
        assert isinstance(ds._kerasfeed_groups, StoredPasses)
        iterators = [iter(ds) for _ in range(12)]
        for it in iterators:
            next(it)
        assert [1 + sum(1 for _ in it) for it in iterators] == [N] * 12
        assert source.ends == 13 and kerasfeed.stats(ds)["items"] == 13 * N
    finally:
        kerasfeed.executor_of(ds).close()
