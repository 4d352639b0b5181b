"""kerasfeed.to_loader in this process: passes, batching, arguments, the Keras hooks."""

from __future__ import annotations

import numpy as np
import pytest
from _util import keras_reset

import kerasfeed
from kerasfeed.loader.keras_adapter import check_keras_version


class Items(kerasfeed.SceneSequence):
    def __init__(self, n=10, bad=None):
        super().__init__()
        self.n, self.bad, self.hooks = n, bad, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"no item {i}")
        return np.full((2,), i, "int64"), np.float32(self.epoch)

    def on_epoch_begin(self):
        self.hooks.append(("begin", self.epoch))

    def on_epoch_end(self):
        self.hooks.append(("end", self.epoch))


def _firsts(batches):
    return [int(x[0]) for x, _ in batches]


def test_passes_follow_the_index_order_and_run_the_hooks_once():
    """Each iter() reads the next pass in IndexOrder's order; hooks once per pass."""
    src = Items()
    with kerasfeed.to_loader(src, shuffle=True, seed=3) as loader:
        passes = [list(loader) for _ in range(3)]
    for e, batches in enumerate(passes):
        assert _firsts(batches) == kerasfeed.IndexOrder(10, True, 3).indices(e).tolist()
        assert all(float(y) == e for _, y in batches)
    assert src.hooks == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]


def test_samples_are_stacked_padded_and_the_remainder_dropped():
    """batch_size stacks samples; varying shapes are padded; drop_remainder drops the short batch."""

    class Varying(kerasfeed.SceneSequence):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return np.arange(1, i + 2, dtype="float32"), np.int64(i)

    loader = kerasfeed.to_loader(Varying(), batch_size=2, padding_values=-1.0)
    (x0, _), (_, y1), (x2, _) = list(loader)
    np.testing.assert_array_equal(x0, [[1, -1], [1, 2]])
    np.testing.assert_array_equal(x2, [[1, 2, 3, 4, 5]])
    assert y1.tolist() == [2, 3] and loader.num_batches == 3 and loader.partial_batch_size == 1
    dropped = kerasfeed.to_loader(Varying(), batch_size=2, drop_remainder=True)
    assert [y.tolist() for _, y in dropped] == [[0, 1], [2, 3]] and dropped.num_batches == 2
    assert [y.tolist() for _, y in dropped] == [[0, 1], [2, 3]]  # the dropped sample ended pass 0


def test_resume_starts_inside_the_pass_then_reads_whole_passes():
    """initial_state: pass e from batch b, then whole passes; num_batches follows."""
    loader = kerasfeed.to_loader(Items(), batch_size=3, shuffle=True, seed=1, initial_state={"epoch": 2, "batches": 2})
    assert loader.num_batches == 2
    first = list(loader)
    order = kerasfeed.IndexOrder(10, True, 1)
    assert [int(x[0, 0]) for x, _ in first] == order.indices(2)[6::3].tolist()
    assert loader.num_batches == 4 and len(list(loader)) == 4


def test_keras_reset_after_one_batch_replays_that_batch():
    """The build batch Keras takes is served again by the next iterator (no pass lost);
    without Keras' reset, every iterator reads a new pass."""
    src = Items()
    loader = kerasfeed.to_loader(src, shuffle=True, seed=0)
    build = iter(loader)
    peeked = next(build)
    keras_reset(loader)  # Keras' EpochIterator.reset() after the build
    epoch0 = list(loader)
    assert np.array_equal(epoch0[0][0], peeked[0]) and len(epoch0) == 10
    assert _firsts(epoch0) == kerasfeed.IndexOrder(10, True, 0).indices(0).tolist()
    with pytest.raises(RuntimeError, match="superseded"):
        next(build)
    one = next(iter(loader))  # no reset in between: a new pass each time
    two = next(iter(loader))
    assert (float(one[1]), float(two[1])) == (1.0, 2.0)
    assert [h for h in src.hooks if h[0] == "begin"] == [("begin", 0), ("begin", 1), ("begin", 2)]


def test_one_batch_passes_replay_only_an_unfinished_read():
    """With one batch per pass, Keras' build (one next(), then a reset) is replayed, but a
    pass read to its end (StopIteration) is not, even when on_epoch_end follows."""
    loader = kerasfeed.to_loader(Items(n=3), batch_size=3)
    peeked = next(iter(loader))
    keras_reset(loader)
    assert [float(y[0]) for _, y in loader] == [float(peeked[1][0])] == [0.0]
    keras_reset(loader)
    assert [float(y[0]) for _, y in loader] == [1.0]


def test_an_epoch_s_end_after_one_batch_hands_nothing_over():
    """A Keras call of one step (evaluate/predict(steps=1)) ends its epoch with on_epoch_end, not
    reset: the next call reads the next pass, as under TensorFlow, not the same batch again."""
    loader = kerasfeed.to_loader(Items(), shuffle=True, seed=0)
    first = next(iter(loader))
    loader.on_epoch_end()  # the epoch's own end
    again = next(iter(loader))
    assert float(first[1]) == 0.0 and float(again[1]) == 1.0


def test_item_error_names_the_index():
    """An exception in __getitem__ reaches the loop as ItemError naming the index."""
    loader = kerasfeed.to_loader(Items(bad=6))
    with pytest.raises(kerasfeed.ItemError, match=r"Items\[6\] raised KeyError") as info:
        list(loader)
    assert info.value.index == 6


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"ragged": True}, ValueError, "no ragged arrays"),
        ({"batch_size": 0}, ValueError, "to_loader: `batch_size` must be a positive int"),
        ({"drop_remainder": True}, ValueError, "needs `batch_size`"),
        ({"padding_values": -1.0}, ValueError, "to_loader: `padding_values` needs `batch_size`.*padding_values=-1.0"),
        ({"initial_state": {"epoch": 0, "batches": 10}}, ValueError, "a pass has only 10"),
        ({"executor": "gpu"}, ValueError, "`executor` must be one of"),
        ({"batch_size": 2, "padding_values": (1, 2, 3)}, ValueError, "`padding_values` must be one scalar"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        kerasfeed.to_loader(Items(), **kwargs)


class _NoneAt:
    """Item ``at`` has None for its label: a leaf no front end can hold."""

    def __init__(self, at):
        self.at = at

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.zeros(2, np.float32), None if i == self.at else np.float32(i)


@pytest.mark.parametrize("executor", ["threads", "processes"])
@pytest.mark.parametrize("at", [1, 5], ids=["probed", "mid-pass"])
def test_a_leaf_no_front_end_can_hold_is_named_with_item_and_field(executor, at):
    # It was a bare internal UnsupportedLeaf(('is None', None)), without index or field.
    # A probed item fails in to_loader itself, a later one where the pass reaches it.
    extra = {"workers": 2} if executor == "processes" else {}
    with pytest.raises(kerasfeed.SignatureError, match=rf"^Item {at}, field y is None\. .* Received: None$"):
        loader = kerasfeed.to_loader(_NoneAt(at), executor=executor, batch_size=2, **extra)
        try:
            list(loader)
        finally:
            loader.close()


def test_a_torch_tensor_numpy_cannot_take_is_named_with_item_and_field():
    # A bare torch RuntimeError/TypeError, naming neither the item nor the field.
    import torch

    class Grad(kerasfeed.SceneSequence):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.zeros(2, np.float32), torch.ones(2, requires_grad=i == 2)

    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 2, field y cannot become a numpy array "
                       r"\(RuntimeError: Can't call numpy\(\) on Tensor that requires grad.*\.detach\(\)"):
        kerasfeed.to_loader(Grad(), batch_size=3)  # item 2 is probed


def test_keras_version_guard():
    """Keras < 3.7 cannot take a data adapter: a clear error, not Keras' 'Unrecognized data type'."""
    check_keras_version("3.7.0")
    check_keras_version("3.15.1")
    with pytest.raises(RuntimeError, match=r"needs Keras >= 3.7.*Received: keras 3.6.0"):
        check_keras_version("3.6.0")


class Large(kerasfeed.SceneSequence):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.full((64, 64, 16), i, "float32"), np.int64(i)  # 256 KB: lent from shared memory


def test_worker_arrays_are_handed_over_without_a_copy():
    """With worker processes and batch_size=None, large arrays are views of the
    shared memory the worker wrote (no copy in this process), and the workers
    stop when the loader is closed."""
    with kerasfeed.to_loader(Large(), executor="processes", workers=2) as loader:
        batches = list(loader)
        assert [int(y) for _, y in batches] == list(range(6))
        assert all(float(x[0, 0, 0]) == i for i, (x, _) in enumerate(batches))
        owner = batches[0][0].base
        assert owner is not None and not isinstance(owner, np.ndarray), type(owner)  # a shared-memory buffer
        assert len(loader.executor.stats()["per_worker"]) == 2
    assert loader.executor.closed


def test_order_gives_the_batches_of_to_dataset_and_is_checked_on_resume():
    """order= (a BalancedOrder): the same batches as to_dataset with that order;
    a resume state saved with another order's fingerprint is refused."""
    labels = [0] * 8 + [1] * 2
    order = kerasfeed.BalancedOrder(labels, seed=4)
    loader = kerasfeed.to_loader(Items(), batch_size=4, order=order)
    ds = kerasfeed.to_dataset(Items(), batch_size=4, order=order)
    for _ in range(2):
        got, want = list(loader), list(ds)
        assert [x.tolist() for x, _ in got] == [x.numpy().tolist() for x, _ in want]
    with pytest.raises(ValueError, match="not both"):
        kerasfeed.to_loader(Items(), order=order, shuffle=True)
    other = kerasfeed.BalancedOrder(labels, seed=5)
    state = {"epoch": 1, "batches": 1, "order": order.fingerprint}
    kerasfeed.to_loader(Items(), batch_size=4, order=order, initial_state=state).close()
    with pytest.raises(ValueError, match="different order"):
        kerasfeed.to_loader(Items(), batch_size=4, order=other, initial_state=state)


def test_stats_and_executor_of_find_the_loader_pipeline():
    """kerasfeed.stats(loader) and executor_of(loader) work as for a dataset."""
    with kerasfeed.to_loader(Items(), batch_size=5) as loader:
        list(loader)
        assert kerasfeed.executor_of(loader) is loader.executor
        s = kerasfeed.stats(loader)
        assert s["kind"] == "to_loader" and s["items"] == 10 and s["batches"] == 2, s


def test_under_tensorflow_stats_follow_the_dataset_keras_drains():
    """Keras' TensorFlow backend reads a loader through a tf.data dataset of its
    own: stats(loader) and InputStats(dataset=loader) read that one's figures
    (they read the loader's own, idle there: always zero)."""
    import keras

    assert keras.backend.backend() == "tensorflow"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with kerasfeed.to_loader(Items(8), batch_size=4) as loader:
        callback = kerasfeed.InputStats(dataset=loader)  # made before Keras makes the dataset
        history = model.fit(loader, epochs=2, verbose=0, callbacks=[callback])
        s = kerasfeed.stats(loader)
        assert s["items"] == 16 and [(p["epoch"], p["items"]) for p in s["passes"]] == [(0, 8), (1, 8)], s
        assert callback._collector is kerasfeed.observe.api.collector_of(loader)
        assert len(history.history["input_wait_ms"]) == 2


class Flipped(kerasfeed.SceneSequence):
    """Items with negative strides (a flip augmentation); on threads the batch is the item itself."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.flip(np.arange(6, dtype="float32").reshape(2, 3) + i, axis=1), np.float32([i, i])


def test_a_flipped_item_becomes_a_torch_tensor_on_threads():
    # torch.from_numpy refuses negative strides: loader.torch() and a PyTorch fit failed on threads.
    import torch

    with kerasfeed.to_loader(Flipped()) as loader:
        got = [x for x, _ in loader.torch()]
    assert all(isinstance(x, torch.Tensor) for x in got)
    assert [x.tolist() for x in got] == [np.flip(np.arange(6.0).reshape(2, 3) + i, 1).tolist() for i in range(2)]
