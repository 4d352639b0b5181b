"""A pass begun again keeps what was made (NOTE [ A pass begun again keeps what was made ] in
``kerasfeed/execution/plan.py``): Keras' JAX and torch trainers build the model from one batch of a
throwaway iterator, then the fit's own iterator begins the same pass. The executors' new plan of it takes
over the items made and not taken; a hook run in between makes them again (they may hold what it changed).
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import numpy as np
import pytest

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.execution.threads import ThreadExecutor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 30
ORDER = np.random.default_rng(3).permutation(N)


class Logged:
    """Item i is ``i + offset``; each call appends its index to a file (worker processes write it too)."""

    def __init__(self, path):
        self.path, self.offset = str(path), 0

    def __len__(self):
        return N

    def __getitem__(self, i):
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return np.full((3,), i + self.offset, "int64")


def _calls(path) -> list[int]:
    return [int(line) for line in open(path).read().split()] if os.path.exists(path) else []


def _wait_made(path, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_calls(path)) < count:
        assert time.monotonic() < deadline, f"{len(_calls(path))} of {count} items made in 60 s"
        time.sleep(0.01)
    time.sleep(0.2)  # the last ones' replies reach the consumer


@pytest.fixture(params=["threads", "processes"])
def make_executor(request):
    made = []

    def make(source):
        ex = ThreadExecutor(source, parallelism=8) if request.param == "threads" else ProcessExecutor(
            source, workers=2, in_flight_per_worker=3, seed=0)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


def test_the_same_pass_begun_again_makes_only_the_items_taken_again(tmp_path, make_executor):
    """The first plan makes its window ahead (8 items), a load takes two; the same pass begun again
    makes those two again and every other item once: 32 calls, where dropping the first plan made
    its six others twice (38)."""
    path = tmp_path / "calls"
    ex = make_executor(Logged(path))
    ex.plan(0, ORDER)
    first = [ex.load(int(i), 0) for i in ORDER[:2]]
    _wait_made(path, 8)
    ex.plan(0, ORDER)  # the fit's own iterator: the same pass, the same order
    items = [ex.load(int(i), 0) for i in ORDER]
    assert [int(a[0]) for a in first + items] == ORDER[:2].tolist() + ORDER.tolist()
    calls = _calls(path)
    counts = np.bincount(calls, minlength=N)
    assert sorted(np.flatnonzero(counts == 2).tolist()) == sorted(ORDER[:2].tolist()), counts
    assert len(calls) == N + 2 and counts.min() == 1, counts


def test_a_hook_between_the_two_begins_makes_the_items_again(tmp_path, make_executor):
    """A hook that changes the source between the two begins: items made before it are not kept, every
    item has the new offset (kept, six would be stale)."""
    path = tmp_path / "calls"
    source = Logged(path)
    ex = make_executor(source)
    ex.plan(0, ORDER)
    ex.load(int(ORDER[0]), 0)
    _wait_made(path, 8)
    ex.before_hook("on_epoch_begin")
    source.offset = 100
    ex.plan(0, ORDER)
    assert [int(ex.load(int(i), 0)[0]) for i in ORDER] == (ORDER + 100).tolist()


def test_another_order_of_the_pass_keeps_nothing(tmp_path, make_executor):
    """A begin of the pass in another order (a resume that skips its first items) is another pass."""
    path = tmp_path / "calls"
    ex = make_executor(Logged(path))
    ex.plan(0, ORDER)
    _wait_made(path, 8)
    ex.plan(0, ORDER[1:])
    assert [int(ex.load(int(i), 0)[0]) for i in ORDER[1:]] == ORDER[1:].tolist()
    assert len(_calls(path)) >= N - 1 + 8 - 1


class _Tagged(kerasfeed.SceneSequence):
    """Item = ``(self.epoch, self.tag)`` where it is made; ``on_epoch_begin`` sets the tag, ``on_epoch_end``
    changes the state too (so the pass begun again sends it to the workers)."""

    def __init__(self):
        super().__init__()
        self.tag, self.ends = -1, 0

    def __len__(self):
        return 3

    def on_epoch_begin(self):
        self.tag = self.epoch

    def on_epoch_end(self):
        self.ends += 1

    def __getitem__(self, i):
        return np.array([[self.epoch, self.tag]], "float32"), np.zeros((1, 1), "float32")


def test_a_pass_begun_again_on_worker_processes_reads_its_own_epoch():
    """An evaluation reads pass 0, and the fit's epoch 0 reads pass 0 again. The workers had made pass 1's
    first items ahead (their copy's epoch 1), and the state sent for pass 0 did not carry the epoch
    (each process keeps its own): the fit trained on items with ``epoch`` 1 and pass 0's tag (a helper's
    report, on every backend)."""
    import keras

    seen = []

    class Rec(keras.layers.Layer):
        def call(self, x):
            seen.append(tuple(int(v) for v in keras.ops.convert_to_numpy(x)[0]))
            return x

    ds = kerasfeed.to_dataset(_Tagged(), executor="processes", workers=2)
    model = keras.Sequential([keras.Input((2,)), Rec(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    try:
        model.evaluate(ds, verbose=0)
        assert seen == [(0, 0)] * 3, seen
        seen.clear()
        model.fit(ds, epochs=2, verbose=0)
        assert seen == [(0, 0)] * 3 + [(1, 1)] * 3, seen
    finally:
        kerasfeed.executor_of(ds).close()
