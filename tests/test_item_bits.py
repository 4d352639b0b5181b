"""Items arrive as the same bits on every path: subnormal floats are not flushed.

TensorFlow's threads flush subnormals to zero (FTZ/DAZ), and threads started
from them inherit that; kerasfeed's threads start with the default
floating-point environment (NOTE [ Threads that run the source start with the
default floating-point environment ] in ``kerasfeed/execution/fpenv.py``).
The reference is what the source makes in this test's (main) thread.
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution.threads import ThreadExecutor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 6


class Subnormals:
    """Subnormal float32/float64 values, from literals and from arithmetic."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {
            "i": np.int64(i),
            "literal": np.array([1e-45, 1e-40, 1.0 + i], np.float32),
            "divided": np.full(2, 1e-38, np.float32) / np.float32(1e4 + i),
            "double": np.full(2, 1e-300, np.float64) / np.float64(1e10 + i),
        }


def _bits(item):
    return {
        "literal": item["literal"].view(np.uint32).tolist(),
        "divided": item["divided"].view(np.uint32).tolist(),
        "double": item["double"].view(np.uint64).tolist(),
    }


@pytest.fixture(scope="module")
def reference():
    ref = {i: _bits(Subnormals()[i]) for i in range(N)}
    # The reference itself holds subnormals (no value flushed in this thread).
    assert all(bits != 0 for item in ref.values() for leaf in item.values() for bits in leaf)
    return ref


def _rows(batches):
    out = {}
    for b in batches:
        for k, i in enumerate(b["i"]):
            out[int(i)] = _bits({key: np.asarray(b[key])[k] for key in ("literal", "divided", "double")})
    return out


@pytest.mark.parametrize("executor", ["threads", "processes", "auto"])
def test_to_dataset_delivers_the_source_bits(reference, executor):
    ds = kerasfeed.to_dataset(Subnormals(), batch_size=3, shuffle=True, seed=1, executor=executor)
    try:
        for _ in range(2):  # a pass planned from TensorFlow's thread, then the next one
            assert _rows(ds.as_numpy_iterator()) == reference
    finally:
        kerasfeed.executor_of(ds).close()


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_to_loader_delivers_the_source_bits(reference, executor):
    with kerasfeed.to_loader(Subnormals(), batch_size=3, executor=executor) as ld:
        assert _rows(ld) == reference


def test_export_and_load_export_keep_the_source_bits(reference, tmp_path):
    kerasfeed.export(Subnormals(), tmp_path / "out", num_shards=2, executor="threads")
    ds = kerasfeed.load_export(tmp_path / "out")
    got = {}
    for item in ds.as_numpy_iterator():
        got[int(item["i"])] = _bits(item)
    assert got == reference


def test_threads_started_from_a_tensorflow_thread_keep_subnormals(reference):
    # The two ways a thread executor starts threads inside a tf.numpy_function
    # body: the pool (plan) and an aside thread (a load outside the plan).
    import tensorflow as tf

    ex = ThreadExecutor(Subnormals(), parallelism=2)
    got = {}

    def body(_):
        got["aside"] = ex.load(4, 0)  # no plan yet: an aside thread started here
        ex.plan(0, [1, 2])  # the pool's threads, started here
        got["planned"] = ex.load(1, 0)
        return np.int64(0)

    try:
        ds = tf.data.Dataset.range(1).map(lambda i: tf.numpy_function(body, [i], tf.int64))
        list(ds)
    finally:
        ex.close()
    assert _bits(got["aside"]) == reference[4]
    assert _bits(got["planned"]) == reference[1]


class HookScaled(Subnormals):
    """``on_epoch_end`` computes a subnormal scale that the next pass's items carry."""

    def __init__(self):
        self.scale = np.float32(1.0)
        self.passes = 0

    def on_epoch_end(self):
        self.passes += 1
        self.scale = np.float32(1e-38) / np.float32(1e3 * self.passes)

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item["scale"] = np.array([self.scale], np.float32)
        return item


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_epoch_hooks_under_to_dataset_compute_the_source_bits(executor):
    """The hooks run in TensorFlow's thread under to_dataset: what they compute for later items is not
    flushed either (execution/fpenv.py, default_fp_env)."""
    want = np.float32(1e-38) / np.float32(1e3)
    assert want != 0  # a subnormal here, in the main thread
    ds = kerasfeed.to_dataset(HookScaled(), batch_size=3, executor=executor)
    try:
        passes = [[b["scale"] for b in ds.as_numpy_iterator()] for _ in range(2)]
    finally:
        kerasfeed.executor_of(ds).close()
    assert {float(s) for p in passes[0] for s in np.ravel(p)} == {1.0}
    assert {int(s.view(np.uint32)) for p in passes[1] for s in np.ravel(p)} == {int(want.view(np.uint32))}
