"""The process executor through ``to_dataset`` (tf.data): same batches as
threads, ``model.fit``, errors and crashes reaching the consumer, release.
"""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import time

import cloudpickle
import numpy as np
import pytest
from _kit import wait_gone

import kerasfeed

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------- through to_dataset (tf.data)


class Ramp(kerasfeed.SceneSequence):
    """Batch i: x = i + column offsets, y = i % 2; batch 3 can be made to fail."""

    def __init__(self, n=10, fail=None, **kwargs):
        super().__init__(**kwargs)
        self.n, self.fail = n, fail

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 3 and self.fail == "raise":
            raise KeyError(f"scene {i} missing")
        if i == 3 and self.fail == "segv":
            ctypes.string_at(0)
        x = np.full((4, 3), i, np.float32) + np.arange(3, dtype=np.float32)
        return x, np.full((4, 1), i % 2, np.float32)


def _batches(ds):
    return [(x.numpy(), y.numpy()) for x, y in ds]


def test_to_dataset_processes_equals_threads_over_shuffled_epochs():
    seq = Ramp()
    threads = kerasfeed.to_dataset(seq, shuffle=True, seed=7)
    procs = kerasfeed.to_dataset(seq, shuffle=True, seed=7, executor="processes", workers=2)
    try:
        assert kerasfeed.executor_of(procs).name == "processes"
        for _ in range(2):  # two passes: two different permutations, equal in both
            want, got = _batches(threads), _batches(procs)
            assert [int(x[0, 0]) for x, _ in got] == [int(x[0, 0]) for x, _ in want]
            assert sorted(int(x[0, 0]) for x, _ in got) == list(range(10))
            for (gx, gy), (wx, wy) in zip(got, want):
                np.testing.assert_array_equal(gx, wx)
                np.testing.assert_array_equal(gy, wy)
    finally:
        kerasfeed.executor_of(procs).close()


def test_two_passes_iterated_at_once_both_get_every_item_in_order():
    seq = Ramp()
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=2, shuffle=True, seed=5)
    try:
        pairs = list(zip(ds, ds))  # two passes interleaved: the second plan replaces the first
        a = [int(x[0, 0]) for (x, _), _ in pairs]
        b = [int(x[0, 0]) for _, (x, _) in pairs]
        assert sorted(a) == sorted(b) == list(range(10))
        assert a != b  # two passes, two permutations
        again = [int(x[0, 0]) for x, _ in ds]  # and a normal pass afterwards
        assert sorted(again) == list(range(10))
    finally:
        kerasfeed.executor_of(ds).close()


def test_model_fit_through_processes_trains_like_threads():
    import keras

    def fit(executor):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        kwargs = {"workers": 2} if executor == "processes" else {}
        ds = kerasfeed.to_dataset(Ramp(), executor=executor, **kwargs)
        try:
            history = model.fit(ds, epochs=2, verbose=0)
        finally:
            kerasfeed.executor_of(ds).close()
        return history.history["loss"], model.get_weights()

    loss_p, weights_p = fit("processes")
    loss_t, weights_t = fit("threads")
    assert len(loss_p) == 2 and all(np.isfinite(loss_p))
    np.testing.assert_allclose(loss_p, loss_t, rtol=1e-6)
    for a, b in zip(weights_p, weights_t):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_item_error_reaches_the_tf_data_consumer():
    ds = kerasfeed.to_dataset(Ramp(fail="raise"), executor="processes", workers=2)
    pids = kerasfeed.executor_of(ds).pids
    try:
        with pytest.raises(Exception) as e:
            _batches(ds)
        msg = str(e.value)
        assert "Ramp[3] raised KeyError in worker" in msg and "scene 3 missing" in msg
        assert any(f"(pid {p})" in msg for p in pids)
        assert "Original traceback" in msg and "__getitem__" in msg
    finally:
        kerasfeed.executor_of(ds).close()


def test_worker_crash_reaches_the_tf_data_consumer_quickly():
    ds = kerasfeed.to_dataset(Ramp(fail="segv"), executor="processes", workers=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            _batches(ds)
        assert time.monotonic() - t0 < 10
        assert "was killed by signal SIGSEGV" in str(e.value) and "Ramp[3]" in str(e.value)
    finally:
        kerasfeed.executor_of(ds).close()


@pytest.mark.parametrize("how", ["break", "del_mid_epoch"])
def test_released_dataset_and_iterator_stop_the_workers(how):
    ds = kerasfeed.to_dataset(Ramp(n=50), executor="processes", workers=2)
    pids = kerasfeed.executor_of(ds).pids
    if how == "break":
        for _ in ds:
            break
        del _
    else:
        it = iter(ds)
        next(it)
        next(it)
        del it
    del ds
    gc.collect()
    assert wait_gone(pids, 5), "workers still alive 5 s after the dataset and iterator were released"


FORK_SCRIPT = """
import gc, os, sys
import numpy as np
from kerasfeed.errors import WorkerError
from kerasfeed import ProcessExecutor

class Src:
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return np.full(2, i)

ex = ProcessExecutor(Src(), workers=1)
assert ex.load(1, 0).tolist() == [1, 1]
pid = os.fork()
if pid == 0:  # e.g. a fork-based multiprocessing worker of the user
    try:
        ex.load(2, 0)
        code = 1
    except WorkerError as e:
        code = 0 if "cannot be used from the forked process" in str(e) else 2
    del ex
    gc.collect()  # the copy's finalizer must not shut the parent's pool down
    os._exit(code)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status), "PARENT", ex.load(3, 0).tolist(), flush=True)
"""


def test_forked_copy_cannot_use_or_close_the_parents_pool(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(FORK_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CHILD 0 PARENT [3, 3]" in out.stdout
