"""What to_loader's batches share: shared memory lent and given back, kept batches
never overwritten, copy=True, the samples written into one batch array, and
input_context sharding."""

from __future__ import annotations

import gc
import types
import weakref

import numpy as np
import pytest

import kerasfeed

SHAPE = (64, 64, 16)  # 256 KB of float32: large enough to be lent from shared memory


class Large(kerasfeed.SceneSequence):
    """Item i of pass e is filled with i + 1000 e (so a slot rewritten by a later pass shows)."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(SHAPE, i + 1000 * self.epoch, "float32"), np.int64(i)


def _mapped_segments() -> int:
    with open("/proc/self/maps") as f:
        return sum("kerasfeed" in line for line in f)


@pytest.fixture
def no_gc():
    """Reference cycles are not collected: what is freed is freed by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_worker_memory_goes_back_when_a_batch_is_dropped_and_never_under_a_kept_one(no_gc):
    """Processes, batch_size=None: every item is a view of shared memory (none copied) as
    long as the loop drops its batches, and the memory is back once they are gone, without
    the garbage collector. Batches kept past the lending budget stay intact while later
    passes reuse the slots (the excess is copied), and a mapping outlives close() only as
    long as a batch still views it."""
    n = 48  # more than the lending budget of 2 workers (16 items each)
    loader = kerasfeed.to_loader(Large(n), executor="processes", workers=2)
    try:
        for i, (x, y) in enumerate(loader):
            assert int(y) == i and float(x[0, 0, 0]) == i and float(x[-1, -1, -1]) == i
        del x, y
        stats = loader.executor.stats()
        assert stats["lent_items"] == stats["items"], stats  # nothing copied out
        assert stats["lent_bytes"] == 0, stats  # every slot given back

        kept = list(loader)  # pass 1, all kept
        for _ in loader:  # pass 2 rewrites every free slot
            pass
        assert [int(y) for _, y in kept] == list(range(n))
        for i, (x, _) in enumerate(kept):
            assert float(x.min()) == float(x.max()) == i + 1000, i
        stats = loader.executor.stats()
        assert stats["items"] - stats["lent_items"] >= n - 32, stats  # past the budget: copied
        lent_view = next(x for x, _ in kept if not isinstance(x.base, np.ndarray) and x.base is not None)
    finally:
        loader.close()
    del kept
    assert _mapped_segments() >= 1  # the one still viewed
    assert float(lent_view[0, 0, 0]) >= 1000  # still readable after close
    del lent_view
    assert _mapped_segments() == 0


def test_copy_true_hands_over_fresh_arrays_and_frees_the_slots_at_once():
    """copy=True: kept batches own their memory (nothing stays lent) with worker processes;
    with threads, the batch no longer shares memory with what the source returned."""
    with kerasfeed.to_loader(Large(6), executor="processes", workers=1, copy=True) as loader:
        kept = list(loader)
        assert all(isinstance(x.base, (np.ndarray, type(None))) for x, _ in kept)
        assert loader.executor.stats()["lent_bytes"] == 0
        assert [float(x[1, 2, 3]) for x, _ in kept] == [float(i) for i in range(6)]

    class Buffered(kerasfeed.SceneSequence):
        """Returns views of one buffer it keeps (and would change later)."""

        def __init__(self):
            super().__init__()
            self.buffer = np.arange(20, dtype="float32").reshape(10, 2)

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return self.buffer[2 * i : 2 * i + 2], np.int64(i)

    src = Buffered()
    shared = list(kerasfeed.to_loader(src))  # default: handed over as returned
    fresh = list(kerasfeed.to_loader(src, copy=True))
    assert np.shares_memory(shared[1][0], src.buffer)
    assert not any(np.shares_memory(x, src.buffer) for x, _ in fresh)
    src.buffer[:] = -1
    assert float(shared[1][0][0, 0]) == -1
    np.testing.assert_array_equal(np.concatenate([x for x, _ in fresh]), np.arange(20).reshape(10, 2))
    with pytest.raises(TypeError, match=r"to_loader: `copy` must be True or False. Received: copy='yes'"):
        kerasfeed.to_loader(src, copy="yes")


@pytest.mark.parametrize("how", [{}, {"batch_size": 4}, {"cache": "memory"}])
def test_copy_protects_a_source_that_reuses_one_buffer_per_thread(how):
    """The threads make items up to 64 ahead of the batch read: a per-thread buffer held a later item by the
    time the loader copied it (19 of 20 items wrong). With copy=True the thread copies as it makes the item."""
    import threading

    class Reusing(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.local = threading.local()

        def __len__(self):
            return 20

        def __getitem__(self, i):
            if not hasattr(self.local, "buffer"):
                self.local.buffer = np.zeros(3, np.float32)
            self.local.buffer[:] = i
            return self.local.buffer, np.int64(i)

    with kerasfeed.to_loader(Reusing(), copy=True, executor="threads", **how) as loader:
        for _ in range(2):
            pairs = [(np.asarray(x)[..., 0], np.asarray(y)) for x, y in loader]
            np.testing.assert_array_equal(np.concatenate([x.ravel() for x, _ in pairs]),
                                          np.concatenate([y.ravel() for _, y in pairs]))


def test_thread_batches_are_freed_by_reference_counting(no_gc):
    """Threads, batch_size=None: the arrays the source returned are the batch's (no copy),
    and a dropped batch is freed without the garbage collector (no reference cycle on the
    way) once the next one is read (the loader keeps a pass's first batch until then, for
    Keras' model-build replay)."""

    class Tracked(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.refs = {}

        def __len__(self):
            return 8

        def __getitem__(self, i):
            x = np.full((4, 3), i, "float32")
            self.refs[i] = weakref.ref(x)
            return x, np.int64(i)

    src = Tracked()
    with kerasfeed.to_loader(src, executor="threads") as loader:
        for x, y in loader:
            i = int(y)
            if i < 7:  # the pass's last item is handed over as a copy (the source's on_epoch_end runs then)
                assert src.refs[i]() is x
            del x, y
            assert all(src.refs[j]() is None for j in range(i)), i
    assert all(ref() is None for ref in src.refs.values())


def test_samples_are_written_into_one_array_per_leaf():
    """batch_size=n: fixed-shape leaves (strings included) are written into one array per
    batch that shares nothing with the samples; varying ones are padded."""

    class Samples(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.buffer = np.arange(30, dtype="float32").reshape(10, 3)

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": self.buffer[i], "name": f"s{i}", "seq": np.ones(i % 3 + 1, "int32") * i}, np.int64(i)

    src = Samples()
    batches = list(kerasfeed.to_loader(src, batch_size=4, padding_values=-1))
    assert [len(y) for _, y in batches] == [4, 4, 2]
    first, _ = batches[0]
    assert not np.shares_memory(first["x"], src.buffer)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b, _ in batches]), src.buffer)
    assert first["name"].tolist() == [b"s0", b"s1", b"s2", b"s3"]
    np.testing.assert_array_equal(first["seq"], [[0, -1, -1], [1, 1, -1], [2, 2, 2], [3, -1, -1]])


def test_input_context_shards_like_to_dataset():
    """input_context (duck-typed) gives disjoint halves that cover the pass, the same as
    to_dataset with that context and as num_shards/shard_index; bad contexts are named."""
    import tensorflow as tf

    def ctx(k):
        return types.SimpleNamespace(num_input_pipelines=2, input_pipeline_id=k)

    args = dict(batch_size=2, shuffle=True, seed=5)
    halves = []
    for k in range(2):
        with kerasfeed.to_loader(Large(10), input_context=ctx(k), **args) as loader:
            got = [[int(v) for v in y] for _, y in loader]
        tf_ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=k)
        want = [y.tolist() for _, y in kerasfeed.to_dataset(Large(10), input_context=tf_ctx, **args).as_numpy_iterator()]
        with kerasfeed.to_loader(Large(10), num_shards=2, shard_index=k, **args) as loader:
            explicit = [[int(v) for v in y] for _, y in loader]
        assert got == want == explicit, k
        halves.append(sum(got, []))
    assert not set(halves[0]) & set(halves[1])
    assert sorted(halves[0] + halves[1]) == list(range(10))
    with pytest.raises(ValueError, match="to_loader: Pass either `input_context` or `num_shards`"):
        kerasfeed.to_loader(Large(10), input_context=ctx(0), num_shards=2)
    with pytest.raises(ValueError, match="input_pipeline_id` must be below .*Received: input_pipeline_id=2"):
        kerasfeed.to_loader(Large(10), input_context=types.SimpleNamespace(num_input_pipelines=2, input_pipeline_id=2))
    with pytest.raises(TypeError, match="`input_context` must be a tf.distribute.InputContext"):
        kerasfeed.to_loader(Large(10), input_context=object())
