"""The per-item pick-up of ``to_dataset``: a sequential map that keeps the pass's position, the
checker's fast path for flat items, the thread executor's one-shot task flag."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.errors import SignatureError
from kerasfeed.execution.thread_tasks import Done
from kerasfeed.loading.in_order import MAX_OPEN_PASSES, PassInOrder
from kerasfeed.tfdata.structure import ItemChecker


class Large(kerasfeed.SceneSequence):
    """Item i: a (rows, 128, 128) float32 batch of i (64 KB and more: not grouped), and its labels;
    ``bad`` indices raise."""

    def __init__(self, n=12, bad=(), rows=2):
        super().__init__()
        self.n, self.bad, self.rows = n, set(bad), rows
        self.events = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"scene {i} is unreadable")
        rows = self.rows if i < self.n - 1 else 1  # a short last batch
        return np.full((rows, 128, 128), i, np.float32), np.full((rows,), i, np.int64)

    def on_epoch_end(self):
        super().on_epoch_end()
        self.events.append("end")


def _labels(ds):
    return [int(y[0]) for _, y in ds]


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_large_items_go_one_per_call_in_order_with_the_position_kept_in_python(executor):
    seq = Large(n=12)
    ds = kerasfeed.to_dataset(seq, shuffle=True, seed=3, executor=executor, workers=2 if executor == "processes" else None)
    assert ds._kerasfeed_group_items == 1 and isinstance(ds._kerasfeed_groups, PassInOrder)
    # The same passes as the parallel map, which still gets each index through tf.data.
    parallel = kerasfeed.to_dataset(Large(n=12), shuffle=True, seed=3, num_parallel_calls=2)
    assert parallel._kerasfeed_groups is None
    for _ in range(3):
        got, want = _labels(ds), _labels(parallel)
        assert got == want and sorted(got) == list(range(12)) and got != list(range(12))
    assert seq.events == ["end"] * 3
    assert ds.cardinality().numpy() == 12


def test_an_item_error_fails_its_own_element_and_the_pass_goes_on():
    ds = kerasfeed.to_dataset(Large(n=8, bad=(3,)))
    it = iter(ds)
    got = [int(next(it)[1][0]) for _ in range(3)]
    with pytest.raises(tf.errors.OpError, match=r"Large\[3\] raised ValueError: scene 3 is unreadable"):
        next(it)
    got += [int(next(it)[1][0]) for _ in range(4)]
    assert got == [0, 1, 2, 4, 5, 6, 7]  # as with a parallel map (then tf.data's count check fails the pass)


def test_two_passes_read_at_once_and_a_resumed_pass_keep_their_own_positions():
    ref = kerasfeed.to_dataset(Large(n=6), shuffle=True, seed=1)
    passes = [tuple(_labels(ref)) for _ in range(3)]
    ds = kerasfeed.to_dataset(Large(n=6), shuffle=True, seed=1)
    pairs = [(int(a[1][0]), int(b[1][0])) for a, b in zip(ds, ds)]  # two passes, interleaved item by item
    assert sorted(zip(*pairs)) == sorted(passes[:2])
    resumed = kerasfeed.to_dataset(Large(n=6), shuffle=True, seed=1, initial_state={"epoch": 1, "batches": 2})
    assert tuple(_labels(resumed)) == passes[1][2:]  # the rest of pass 1
    assert tuple(_labels(resumed)) == passes[2]  # then whole passes


def test_pass_in_order_moves_on_past_a_failing_item_and_forgets_passes_given_up():
    begun = []

    def begin():
        epoch = len(begun)
        begun.append(epoch)
        return np.array([5, 3, 9]) + 10 * epoch, np.int64(epoch)

    def load(index, epoch):
        if index == 3:
            raise KeyError(index)
        return [np.array(index)]

    items = PassInOrder(begin, load)
    assert items.begin() == (3, 0)
    assert items.load(0)[0] == 5
    with pytest.raises(KeyError):
        items.load(0)
    assert items.load(0)[0] == 9  # the position moved on past the failure
    with pytest.raises(RuntimeError, match=r"pass 0 is no longer read.*Received: epoch=0"):
        items.load(0)  # past its end
    for _ in range(MAX_OPEN_PASSES + 1):
        items.begin()
    with pytest.raises(RuntimeError, match=r"pass 1 is no longer read"):
        items.load(1)  # given up: more than MAX_OPEN_PASSES newer passes began
    assert items.load(MAX_OPEN_PASSES + 1)[0] == 10 * (MAX_OPEN_PASSES + 1) + 5


def test_the_checker_fast_path_takes_flat_items_and_leaves_the_rest_to_the_full_check():
    spec = (tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int64))
    checker = ItemChecker(spec)
    x, y = np.zeros((2, 3), np.float32), np.zeros(2, np.int64)
    for item in ((x, y), [x, y]):
        out = checker.flat_arrays(0, item)
        assert out[0] is x and out[1] is y
    # Not for the fast path: the full check converts, or refuses with its own message.
    with pytest.raises(SignatureError, match=r"Item 2, field y: expected dtype int64, received int32"):
        checker.flat_arrays(2, (x, y.astype(np.int32)))
    with pytest.raises(SignatureError, match=r"Item 3, field x: expected shape \(None, 3\), received shape \(2, 4\)"):
        checker.flat_arrays(3, (np.zeros((2, 4), np.float32), y))
    with pytest.raises(SignatureError, match=r"Item 4 does not match the dataset's structure"):
        checker.flat_arrays(4, (x, y, y))
    memmap_like = x.view(np.memmap)  # a subclass: converted by the full check, as before
    assert type(checker.flat_arrays(5, (memmap_like, y))[0]) is np.ndarray
    strings = ItemChecker((tf.TensorSpec([], tf.string),))
    assert strings.flat_arrays(6, ("a",))[0].dtype == object  # strings always take the full check


def test_done_is_a_one_shot_event():
    done = Done()
    assert not done.is_set() and not done.wait(0.01)
    t0 = time.perf_counter()
    threading.Timer(0.05, done.set).start()
    assert done.wait(5) and time.perf_counter() - t0 < 4
    assert done.is_set() and done.wait(0) and done.wait()
    done.set()  # setting again changes nothing
    assert done.wait(0)
    waiters = []
    other = Done()
    threads = [threading.Thread(target=lambda: waiters.append(other.wait(5))) for _ in range(3)]
    for t in threads:
        t.start()
    other.set()
    for t in threads:
        t.join()
    assert waiters == [True] * 3
