"""Random augmentation is exact: an item's draws are a function of (seed, pass, index).

On worker processes of a seeded pipeline the global ``random``/``numpy.random``
are reseeded before each item; ``kerasfeed.item_rng()`` gives the item's own
generator on every executor (NOTE [ Random augmentation is a function of
(seed, pass, index) ] in ``kerasfeed/sources/item_random.py``).
"""

from __future__ import annotations

import random
import re
import sys
import threading

import cloudpickle
import numpy as np
import pytest

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.execution.threads import ThreadExecutor
from kerasfeed.sources.item_random import ItemSeeds, item_scope

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, BATCH, SEED = 12, 4, 7


class Noisy:
    """Item i draws from the globals and from item_rng() (twice: one stream per item)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        rng = kerasfeed.item_rng()
        first = rng.random(2)
        again = kerasfeed.item_rng()  # the same generator: its draws go on
        return {
            "i": np.int64(i),
            "np": np.random.rand(3),
            "py": np.float64(random.random()),
            "rng": np.concatenate([first, again.random(1)]),
            "same": np.bool_(again is rng),
        }


def _draws(executor, passes=2, **kwargs):
    """{(pass, index): (np draws, random draw, item_rng draws)} of a to_loader run."""
    out = {}
    with kerasfeed.to_loader(Noisy(), batch_size=BATCH, shuffle=True, seed=SEED, executor=executor, **kwargs) as ld:
        first = (kwargs.get("initial_state") or {}).get("epoch", 0)
        for epoch in range(first, first + passes):
            for batch in ld:
                assert batch["same"].all()
                for k, i in enumerate(batch["i"]):
                    out[(epoch, int(i))] = (tuple(batch["np"][k]), float(batch["py"][k]), tuple(batch["rng"][k]))
    return out


@pytest.fixture(scope="module")
def two_workers():
    return _draws("processes", workers=2)


def test_globals_and_item_rng_are_the_same_whatever_the_worker_count(two_workers):
    one = _draws("processes", workers=1)
    assert len(one) == 2 * N and one == two_workers
    # ... and differ between indices and between passes.
    assert len({v[0] for v in one.values()}) == 2 * N
    assert len({v[1] for v in one.values()}) == 2 * N
    assert len({v[2] for v in one.values()}) == 2 * N
    assert one[(0, 3)] != one[(1, 3)]


def test_a_resumed_run_draws_what_the_same_items_drew(two_workers):
    resumed = _draws("processes", passes=1, workers=2, initial_state={"epoch": 1, "batches": 2})
    assert len(resumed) == N - 2 * BATCH  # pass 1 from its third batch on
    assert all(resumed[key] == two_workers[key] for key in resumed)


def test_item_rng_is_the_same_on_threads_and_processes(two_workers):
    threads = _draws("threads")
    assert threads.keys() == two_workers.keys()
    assert all(threads[key][2] == two_workers[key][2] for key in threads)
    # The documented formula, reproducible outside kerasfeed.
    e, i = 1, 5
    expected = np.random.Generator(np.random.PCG64(np.random.SeedSequence(SEED, spawn_key=(e, 0, i, 0))))
    assert threads[(e, i)][2] == tuple(expected.random(3))


def test_item_rng_on_every_thread_executor_path():
    # Inline in the main thread, on the pool's threads, on an aside thread
    # (a load from another thread outside the plan): one answer per item.
    expected = tuple(ItemSeeds(SEED).generator(2, 5).random(3))
    ex = ThreadExecutor(Noisy(), parallelism=2, seed=SEED)
    try:
        inline = ex.load(5, 2)
        ex.plan(2, [5, 1])
        planned = ex.load(5, 2)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("aside", ex.load(5, 2)))
        t.start()
        t.join()
    finally:
        ex.close()
    for item in (inline, planned, got["aside"]):
        assert tuple(item["rng"]) == expected


def test_outside_an_item_item_rng_raises():
    with pytest.raises(RuntimeError, match=r"item_rng\(\) works only while kerasfeed makes an item.*Received: a call "):
        kerasfeed.item_rng()
    with item_scope(3, 1, ItemSeeds(SEED)):
        inside = kerasfeed.item_rng().random()
    assert inside == ItemSeeds(SEED).generator(1, 3).random()
    with pytest.raises(RuntimeError, match="no item is being made"):
        kerasfeed.item_rng()  # the scope ended


class Jittered(kerasfeed.SceneSequence):
    """``load`` + ``augment`` drawing from ``item_rng()``, as docs/cache.md splits an item; records what it made."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.made = {}

    def __len__(self):
        return 3

    def load(self, i):
        return np.full((2, 3), i, np.float32), np.zeros((2, 1), np.float32)

    def augment(self, item):
        x, y = item
        return x + kerasfeed.item_rng().normal(size=x.shape).astype(np.float32), y

    def __getitem__(self, i):  # an override calling super(): the item is still the pass's
        x, y = super().__getitem__(i)
        self.made[(self.epoch, i)] = x
        return x, y


def test_keras_own_fit_of_a_scene_sequence_draws_what_to_loader_with_its_item_seed_draws():
    """``item_rng()`` in ``augment`` raised under ``model.fit(seq)`` (no kerasfeed item there), so the split
    docs/cache.md shows trained only through kerasfeed."""
    import keras

    for item_seed in (None, 5):
        seq = Jittered(workers=2)
        if item_seed is not None:
            seq.item_seed = item_seed
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(seq, epochs=3, verbose=0)
        assert sorted(seq.made) == [(e, i) for e in range(3) for i in range(3)]
        with kerasfeed.to_loader(Jittered(), seed=item_seed or 0) as loader:
            for epoch in range(3):
                for i, (x, _) in enumerate(loader):
                    np.testing.assert_array_equal(seq.made[(epoch, i)], x)
        assert not np.array_equal(seq.made[(0, 1)], seq.made[(1, 1)])  # fresh each pass
    assert np.array_equal(Jittered()[2][0], Jittered()[2][0])  # seq[i] alone: pass 0, item_seed 0
    for seed in ("7", -1, 2**64, True):
        bad = Jittered()
        bad.item_seed = seed
        with pytest.raises(TypeError, match=rf"Jittered.item_seed must be an int in \[0, 2\*\*64\) .*Received: "
                                            rf"item_seed={re.escape(repr(seed))}$"):
            bad[0]


class OwnSeed(kerasfeed.SceneSequence):
    """Uses an attribute called ``item_seed`` for itself and never calls ``item_rng()``."""

    def __init__(self):
        super().__init__()
        self.item_seed = None

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.full(2, i, np.float32)


class DrawingMixin:
    def __getitem__(self, i):
        return np.full(2, i, np.float32) + kerasfeed.item_rng().random(2).astype(np.float32)


class Mixed(DrawingMixin, kerasfeed.SceneSequence):
    """``__getitem__`` from a mixin before SceneSequence in the MRO: it was not marked as an item."""

    def __len__(self):
        return 3


def test_item_seed_is_checked_only_where_item_rng_needs_it_and_a_mixin_getitem_is_an_item():
    assert OwnSeed()[1].tolist() == [1, 1]  # raised TypeError for item_seed=None, unused
    with kerasfeed.to_loader(Mixed(), seed=0) as loader:
        want = [x for x in loader]
    for i in range(3):
        np.testing.assert_array_equal(Mixed()[i], want[i])


class Drawn(kerasfeed.SceneSequence):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        value = np.float32(i + kerasfeed.item_rng().random())
        return np.full((2, 3), value, np.float32), np.zeros((2, 1), np.float32)


@pytest.mark.parametrize("use_multiprocessing", [False, True])
def test_the_first_epoch_of_a_resumed_keras_fit_draws_its_own_pass(use_multiprocessing):
    """Keras starts its workers before it calls on_epoch_begin: in a fit from initial_epoch=2 they made the
    epoch's items with pass 0's numbers (a forked pool for the whole epoch: 5 of 8 runs; threads: 1 in 3)."""
    import keras

    trained = []

    class Record(keras.layers.Layer):
        def call(self, x):
            trained.extend(np.asarray(x)[:, 0].tolist())
            return x

    passes = {round(float(np.float32(i + ItemSeeds(0).generator(e, i).random())), 4): e
              for e in range(3) for i in range(8)}  # fmt: skip
    for _ in range(2):
        trained.clear()
        model = keras.Sequential([keras.Input((3,)), Record(), keras.layers.Dense(1)])
        model.compile("sgd", "mse", run_eagerly=True)
        model.fit(Drawn(workers=4, use_multiprocessing=use_multiprocessing), epochs=3, initial_epoch=2, verbose=0)
        assert len(trained) == 16 and {passes.get(round(v, 4)) for v in trained} == {2}


def test_without_a_seed_item_rng_holds_within_a_pool_and_globals_are_per_worker():
    with ProcessExecutor(Noisy(), workers=2) as ex:
        ex.wait_ready()
        first = [ex.load(4, 0) for _ in range(4)]  # the two workers take turns
        assert len({tuple(item["rng"]) for item in first}) == 1  # one seed, drawn once for the pool
        # The globals are not reseeded per item: the same item draws anew.
        assert len({tuple(item["np"]) for item in first}) == 4


def test_auto_and_export_give_item_rng_from_their_probes_on(two_workers, tmp_path):
    # The probes (items made before the executor exists) have a generator too, and
    # whichever executor "auto" picks is seeded with the pipeline's seed.
    auto = _draws("auto", passes=1)
    assert len(auto) == N and all(auto[key][2] == two_workers[key][2] for key in auto)
    kerasfeed.export(Noisy(), tmp_path / "out", num_shards=2, executor="threads")
    assert (tmp_path / "out").is_dir()


def test_seeded_workers_reseed_before_each_item():
    # The same item made twice (by either worker) draws the same from the globals.
    with ProcessExecutor(Noisy(), workers=2, seed=SEED) as ex:
        ex.wait_ready()
        items = [ex.load(4, 1) for _ in range(4)]
    assert len({(tuple(it["np"]), float(it["py"])) for it in items}) == 1
    state = (np.random.get_state(), random.getstate())
    try:
        ItemSeeds(SEED).seed_globals(1, 4)  # what the workers did (this process's globals restored after)
        assert tuple(items[0]["np"]) == tuple(np.random.rand(3)) and float(items[0]["py"]) == random.random()
    finally:
        np.random.set_state(state[0])
        random.setstate(state[1])


class _Jitter(kerasfeed.SceneSequence):
    def __len__(self):
        return 8

    def load(self, i):
        return np.float32(i)

    def augment(self, x):
        return x + np.float32(kerasfeed.item_rng().random())


def test_a_seeded_order_seeds_item_rng_as_seed_does():
    """With order= a pipeline takes no seed=; a given order's seed seeds the items' random numbers (they
    were drawn anew by every pipeline: augmentation under BalancedOrder(seed=0) differed run to run)."""
    def two_passes(order_of, **kw):
        with kerasfeed.to_loader(_Jitter(), order=order_of(), **kw) as loader:
            return np.concatenate([np.atleast_1d(b) for _ in range(2) for b in loader])

    for order_of in (lambda: kerasfeed.BalancedOrder(np.arange(8) % 2, seed=0),
                     lambda: kerasfeed.IndexOrder(8, shuffle=True, seed=3)):
        first = two_passes(order_of, executor="threads")
        for kw in ({"executor": "threads"}, {"executor": "processes", "workers": 2}, {"cache": "memory"}):
            np.testing.assert_array_equal(two_passes(order_of, **kw), first)
        assert not np.array_equal(first[:8], first[8:])  # fresh numbers every pass
    drawn = [two_passes(lambda: kerasfeed.IndexOrder(8, shuffle=True)) for _ in range(2)]
    assert not np.array_equal(*drawn)  # an order without a seed: nothing to follow, as seed=None
