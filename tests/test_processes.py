"""Worker processes with shared-memory transport (issue 3).

Most tests drive ``ProcessExecutor`` directly (as tf.data's map threads do:
many threads calling ``load`` at once); the ``to_dataset`` tests at the end
go through the real tf.data path. Pools are shared per module where a test
does not break them; each failure test gets its own pool.
"""

from __future__ import annotations

import _thread
import collections
import ctypes
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np
import psutil
import pytest
from tensorflow.core.framework import graph_pb2

import kerasfeed

from _util import wait_until
from kerasfeed.errors import ItemError, WorkerError
from kerasfeed.execution.processes import ProcessExecutor, WorkerPool, shm
from kerasfeed.execution.processes import pool as pool_module
from kerasfeed.execution.threads import ThreadExecutor

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

Point = collections.namedtuple("Point", ["xy", "label"])


def _record_init():
    info = kerasfeed.get_worker_info()
    os.environ["KF_TEST_INIT"] = json.dumps(
        {"id": info.id, "n": info.num_workers, "seed": info.seed, "np": int(np.random.randint(2**31)), "py": random.random()}
    )


class Kit(kerasfeed.SceneSequence):
    """Item i: x full of i; a dict describing the process that made it.
    Items whose index ends in 999 raise."""

    def __init__(self, n=64, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 1000 == 999:
            raise ValueError(f"bad item {i}")
        info = kerasfeed.get_worker_info()
        meta = {
            "pid": np.int64(os.getpid()),
            "worker": np.int64(-1 if info is None else info.id),
            "epoch": np.int64(self.epoch),
            "tensorflow": "tensorflow" in sys.modules,
            "keras": "keras" in sys.modules,
            "init": os.environ.get("KF_TEST_INIT", ""),
        }
        return np.full((4, 3), i, np.float32), meta


def _drive(ex, indices, epoch=0, threads=None):
    """What tf.data's ordered parallel map does: many concurrent loads, results in order."""
    with ThreadPoolExecutor(threads or ex.parallel_calls()) as tp:
        return list(tp.map(lambda i: ex.load(int(i), epoch), indices))



def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def kit():
    ex = ProcessExecutor(Kit(), workers=2, seed=1000, worker_init=_record_init)
    yield ex
    ex.close()


# ---------------------------------------------------------------- items and order


def test_items_are_getitem_and_epoch_reaches_workers(kit):
    import tensorflow  # noqa: F401 - the parent has TF; workers must not

    for epoch in (0, 3):
        for i, (x, meta) in enumerate(_drive(kit, range(20), epoch=epoch)):
            np.testing.assert_array_equal(x, np.full((4, 3), i, np.float32))
            assert meta["epoch"] == epoch
            assert meta["worker"] in (0, 1) and meta["pid"] in kit.pool.pids
            assert meta["pid"] != os.getpid()
            # Light workers: neither TensorFlow nor Keras, though this process has both
            # and the source is a SceneSequence (a keras.utils.PyDataset here).
            assert meta["tensorflow"] is False and meta["keras"] is False
    assert "tensorflow" in sys.modules
    assert kerasfeed.get_worker_info() is None  # main process
    stats = kit.stats()
    assert all(w["tensorflow_imported"] is False for w in stats["per_worker"])


def _import_tensorflow():
    import tensorflow  # noqa: F401


def test_a_worker_that_imports_tensorflow_is_reported(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        ex = ProcessExecutor(Kit(), workers=1, worker_init=_import_tensorflow)
        try:
            ex.wait_ready(120)
            stats = ex.stats()
        finally:
            ex.close()
    assert stats["per_worker"][0]["tensorflow_imported"] is True
    assert any("imported TensorFlow" in r.getMessage() for r in caplog.records)


class Structures:
    def __len__(self):
        return 3

    def __getitem__(self, i):
        base = np.arange(24, dtype=np.float64).reshape(4, 6) + i
        return {
            "f64": base,
            "strided": base[:, ::2],  # non-contiguous
            "fortran": np.asfortranarray(base),
            "bool": base > 10,
            "int8": np.arange(5, dtype=np.int8),
            "str": np.array(["a", "bcd", "é"]),
            "bytes": np.array([b"x", b"yz"]),
            "objects": np.array([b"var", b"length!"], dtype=object),
            "empty": np.zeros((0, 3), np.float32),
            "scalar": np.float32(1.5),
            "python": [i, "text", b"raw", None],
            "nested": (Point(np.ones(2) * i, np.int64(i)), [np.eye(2)]),
        }


def test_nested_structures_dtypes_and_fresh_aligned_arrays():
    src = Structures()
    ex = ProcessExecutor(src, workers=1, in_flight_per_worker=1)
    try:
        first = ex.load(0, 0)
        for _ in range(3):  # the same shared-memory slot carries later items
            ex.load(2, 0)
        want = src[0]
        assert list(first) == list(want)
        for key in ("f64", "strided", "fortran", "bool", "int8", "str", "bytes", "empty"):
            assert first[key].dtype == want[key].dtype and first[key].shape == want[key].shape, key
            np.testing.assert_array_equal(first[key], want[key])
            # a fresh, writable, 64-byte aligned array (TF wraps it without copying),
            # unchanged although its slot was rewritten since
            assert first[key].flags.c_contiguous and first[key].flags.writeable
            assert first[key].size == 0 or first[key].ctypes.data % 64 == 0
        assert first["objects"].tolist() == [b"var", b"length!"]
        assert first["scalar"] == np.float32(1.5) and type(first["scalar"]) is np.float32
        assert first["python"] == [0, "text", b"raw", None]
        point, eyes = first["nested"]
        assert isinstance(point, Point) and point.label == 0
        np.testing.assert_array_equal(eyes[0], np.eye(2))
    finally:
        ex.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_order_equals_threads_executor_for_any_worker_count(workers, kit):
    order = np.random.default_rng(5).permutation(40)
    want = [x for x, _ in _drive(ThreadExecutor(Kit()), order, threads=8)]
    ex = kit if workers == 2 else ProcessExecutor(Kit(), workers=workers)
    try:
        for ex_ in (ex, kit):
            got = [x for x, _ in _drive(ex_, order)]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    finally:
        if ex is not kit:
            ex.close()


def test_worker_init_worker_info_and_deterministic_seeds(kit):
    seen = {}
    for _, meta in _drive(kit, range(16)):
        info = json.loads(meta["init"])
        seen[info["id"]] = info
        assert meta["worker"] == info["id"]
    assert sorted(seen) == [0, 1]  # both workers ran items and their worker_init
    for wid, info in seen.items():
        assert info["n"] == 2
        assert info["seed"] == 1000 + wid
        # numpy / random were seeded with base seed + worker id before worker_init
        assert info["np"] == np.random.RandomState((1000 + wid) % 2**32).randint(2**31)
        assert info["py"] == random.Random(1000 + wid).random()


def test_item_error_carries_index_worker_type_message_traceback(kit):
    with pytest.raises(ItemError) as e:
        kit.load(999, 0)
    err = e.value
    assert err.index == 999
    assert err.exc_type == "ValueError" and err.exc_message == "bad item 999"
    assert err.worker_id in (0, 1) and err.pid in kit.pool.pids
    assert "raise ValueError(f\"bad item {i}\")" in err.traceback_text
    msg = str(err)
    assert "Kit[999] raised ValueError in worker" in msg and f"(pid {err.pid})" in msg
    assert "bad item 999" in msg and "__getitem__" in msg
    # an item error does not break the pool
    x, _ = kit.load(5, 0)
    assert x[0, 0] == 5


def test_in_flight_items_and_shared_memory_are_bounded():
    class Slow:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            time.sleep(0.02)
            return np.full(250_000, i, np.float32)  # 1 MB

    ex = ProcessExecutor(Slow(), workers=2, in_flight_per_worker=2)
    core = ex.pool._core
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            with core.lock:
                peak[0] = max(peak[0], sum(len(w.pending) for w in core.workers))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out = _drive(ex, range(40), threads=12)  # 12 callers, only 4 may be in flight
    finally:
        stop.set()
        sampler.join()
    try:
        # Every item intact although all 40 are held: a lent slot is never
        # written again while a view of it lives.
        assert [(int(a.min()), int(a.max())) for a in out] == [(i, i) for i in range(40)]
        assert ex.parallel_calls() == ex.pool.in_flight_limit == 4
        assert peak[0] == 4
        # Slots: the ones in flight plus the lent ones, whatever the consumer keeps.
        per_worker = core.k + pool_module._MAX_LENT_PER_WORKER
        assert ex.stats()["shm_bytes"] <= 2 * per_worker * shm.grown_size(1_000_000)
        assert 0 < ex.stats()["lent_bytes"] <= 2 * pool_module._MAX_LENT_PER_WORKER * 1_000_000
        lent = [a for a in out if isinstance(a.base, ctypes.Array)]  # views of a slot
        assert 0 < len(lent) <= 2 * pool_module._MAX_LENT_PER_WORKER < 40  # the rest were copied out
        shm_before = ex.stats()["shm_bytes"]
        del out, lent
        gc.collect()
        again = _drive(ex, range(40), threads=12)
        assert [(int(a.min()), int(a.max())) for a in again] == [(i, i) for i in range(40)]
        # Released slots were reused: without reuse the second pass would need
        # about as many new segments again; with it the per-worker bound holds.
        # (Not "unchanged": a worker may still add the one slot of that bound
        # the first pass happened not to need.)
        assert shm_before <= ex.stats()["shm_bytes"] <= 2 * per_worker * shm.grown_size(1_000_000)
        del again
        gc.collect()
        assert ex.stats()["lent_bytes"] == 0
    finally:
        ex.close()


def test_lent_items_reach_tensorflow_without_a_copy_and_their_slots_come_back():
    class Batches:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return np.full((128, 1024), i, np.float32), np.int64(i)  # 512 KB: lent

    ex = ProcessExecutor(Batches(), workers=2)
    try:
        ds = kerasfeed.to_dataset(Batches(), executor=ex, prefetch=0)
        for epoch in range(3):
            seen = [(int(x.numpy().min()), int(x.numpy().max()), int(y)) for x, y in ds]
            assert seen == [(i, i, i) for i in range(24)], epoch
        kept = list(ds)  # holding every element: lending stops at its budget, nothing blocks
        assert [int(y) for _, y in kept] == list(range(24))
        assert all(float(x[0, 0]) == float(x[-1, -1]) == i for i, (x, _) in enumerate(kept))
        assert ex.stats()["lent_bytes"] > 0
        del kept
        gc.collect()
        next(iter(ds))  # TensorFlow drops the arrays it wrapped on its next Python call

        def all_returned():
            import tensorflow as tf

            gc.collect()
            tf.constant(1.0) + 1.0  # an eager op: TensorFlow's deferred numpy decrefs run
            return ex.stats()["lent_bytes"] == 0

        assert wait_until(all_returned)
        # Slots in use are bounded: in flight plus the lending budget per worker.
        assert ex.stats()["shm_bytes"] <= 2 * (2 + pool_module._MAX_LENT_PER_WORKER) * shm.grown_size(128 * 1024 * 4 + 64)
    finally:
        ex.close()


# ---------------------------------------------------------------- sending the source


def test_unpicklable_source_names_the_attribute():
    class Holder:
        def __init__(self):
            self.path = __file__
            self.state = {"lock": threading.Lock()}

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return np.zeros(1)

    with pytest.raises(TypeError) as e:
        ProcessExecutor(Holder(), workers=1)
    msg = str(e.value)
    assert "`source.state['lock']`" in msg and "_thread.lock" in msg
    assert "lazily inside `__getitem__`" in msg and "Received: source=" in msg


def test_unpicklable_h5py_file_names_the_attribute(tmp_path):
    import h5py

    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(4)

    class Eager:
        def __init__(self):
            self.file = h5py.File(path, "r")

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return self.file["x"][i]

    src = Eager()
    try:
        with pytest.raises(TypeError, match=r"`source\.file` \(h5py\._hl\.files\.File\) cannot be pickled"):
            ProcessExecutor(src, workers=1)
    finally:
        src.file.close()


MAIN_SCRIPT = """
import sys
print("MAIN RAN", flush=True)  # a worker must not re-run this module
import numpy as np
from kerasfeed.execution.processes import ProcessExecutor

class Defined(object):  # lives only in __main__: must travel by value
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return np.full(2, i * 10), "tensorflow" in sys.modules

ex = ProcessExecutor(Defined(), workers=1)
print("ITEM", ex.load(2, 0)[0].tolist(), ex.load(1, 0)[1], flush=True)
"""


def test_class_defined_in_main_reaches_workers_by_value(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ITEM [20, 20] False" in out.stdout
    assert out.stdout.count("MAIN RAN") == 1
    # the script exited without close(): its worker went with it (checked by conftest too)


NOTEBOOK_CELL = """
import sys
import numpy as np
from kerasfeed.execution.processes import ProcessExecutor

class Cell:  # defined in a notebook cell: lives in the kernel's __main__
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return np.full(3, i * 2), "tensorflow" in sys.modules

ex = ProcessExecutor(Cell(), workers=2)
print("ITEM", ex.load(3, 0)[0].tolist(), ex.load(2, 0)[1])
ex.close()
"""


def test_class_defined_in_a_notebook_cell_reaches_workers():
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL)]
    out = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in out.cells[0].outputs)
    assert "ITEM [6, 6, 6] False" in text


# ---------------------------------------------------------------- failures


class Crashy:
    def __init__(self, how):
        self.how = how

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 5:
            if self.how == "segv":
                ctypes.string_at(0)
            elif self.how == "exit":
                os._exit(3)
            elif self.how == "sleep":
                time.sleep(60)
        return np.full(2, i)


@pytest.mark.parametrize(
    "how, expect",
    [("segv", r"was killed by signal SIGSEGV \(11\)"), ("exit", r"exited unexpectedly with exit code 3")],
)
def test_crashing_worker_fails_fast_with_pid_and_cause(how, expect):
    ex = ProcessExecutor(Crashy(how), workers=2)
    try:
        assert ex.load(1, 0)[0] == 1
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=expect) as e:
            ex.load(5, 0)
        assert time.monotonic() - t0 < 10
        err = e.value
        assert err.pid in ex.pool.pids and f"(pid {err.pid})" in str(err)
        assert "while loading Crashy[5]" in str(err) and "does not restart workers" in str(err)
        if how == "segv":  # the worker's Python stack at the crash is in the message
            assert "in __getitem__" in str(err) and "Segmentation fault" in str(err)
            assert err.exitcode == -signal.SIGSEGV
        else:
            assert err.exitcode == 3
        # the pass is over: later items fail at once too, they do not hang
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=expect):
            ex.load(2, 0)
        assert time.monotonic() - t0 < 10
    finally:
        ex.close()


def test_sigkilled_busy_worker_fails_pending_and_later_items():
    ex = ProcessExecutor(Crashy("sleep"), workers=1)
    try:
        ex.wait_ready(60)
        pid = ex.pool.pids[0]
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 0 \(pid {pid}\) of Crashy was killed by signal SIGKILL \(9\)"):
            ex.load(5, 0)  # sleeps 60 s in the worker
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerError, match="SIGKILL"):
            ex.load(1, 0)
    finally:
        ex.close()


def test_idle_worker_killed_between_items_is_reported():
    ex = ProcessExecutor(Crashy("none"), workers=2)
    try:
        assert ex.load(1, 0)[0] == 1
        victim = ex.pool.pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(WorkerError, match=rf"\(pid {victim}\) of Crashy was killed by signal SIGKILL"):
            while time.monotonic() < deadline:  # the next items fail, well within 10 s
                ex.load(2, 0)
    finally:
        ex.close()


def test_failing_worker_init_is_reported_with_its_traceback():
    def broken_init():
        raise RuntimeError("cannot reach the bucket")

    ex = ProcessExecutor(Kit(), workers=1, worker_init=broken_init)
    try:
        with pytest.raises(WorkerError) as e:
            ex.load(0, 0)
        msg = str(e.value)
        assert "failed to start: RuntimeError: cannot reach the bucket" in msg
        assert "in broken_init" in msg and "Worker traceback" in msg
    finally:
        ex.close()


def test_timeout_stops_a_stuck_item():
    ex = ProcessExecutor(Crashy("sleep"), workers=1, timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not return Crashy\[5\] within timeout=0.5 s"):
            ex.load(5, 0)
        assert time.monotonic() - t0 < 5
    finally:
        ex.close()


def test_bad_arguments_say_what_was_received():
    with pytest.raises(ValueError, match=r"`workers` must be a positive int. Received: workers=0"):
        ProcessExecutor(Kit(), workers=0)
    with pytest.raises(ValueError, match=r"Received: in_flight_per_worker=-1"):
        ProcessExecutor(Kit(), workers=1, in_flight_per_worker=-1)
    with pytest.raises(TypeError, match=r"`worker_init` must be a callable or None. Received: worker_init=3"):
        ProcessExecutor(Kit(), workers=1, worker_init=3)


# ---------------------------------------------------------------- lifetime


def test_close_is_idempotent_and_stops_workers():
    ex = ProcessExecutor(Kit(), workers=2)
    pids = ex.pool.pids
    assert ex.load(1, 0)[0][0, 0] == 1
    ex.close()
    ex.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(WorkerError, match="is closed"):
        ex.load(1, 0)


def test_garbage_collected_executor_stops_workers():
    ex = ProcessExecutor(Kit(), workers=2)
    ex.load(0, 0)
    pids = ex.pool.pids
    holder = {"ex": ex}
    holder["self"] = holder  # a reference cycle: only the cyclic GC frees it
    del ex, holder
    gc.collect()
    assert _wait_gone(pids, 5)


PARENT_SCRIPT = """
import os, signal, sys, time
import numpy as np
from kerasfeed.execution.processes import ProcessExecutor

class Src:
    def __len__(self):
        return 100
    def __getitem__(self, i):
        time.sleep(0.2)
        return np.full(2, i)

ex = ProcessExecutor(Src(), workers=2)
ex.wait_ready(60)
print("PIDS", *ex.pool.pids, flush=True)
mode = sys.argv[1]
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "exit":
    sys.exit(0)  # no close(): the interpreter's exit must stop the workers
elif mode == "interrupt":
    while True:
        ex.load(1, 0)
"""


def _run_parent(tmp_path, mode, interrupt=False):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        if interrupt:
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # like Ctrl-C in a terminal: the whole group
        _, err = proc.communicate(timeout=20)
        return proc, pids, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("mode", ["sigkill", "exit"])
def test_workers_exit_when_the_parent_dies_or_exits(tmp_path, mode):
    proc, pids, _ = _run_parent(tmp_path, mode)
    assert proc.returncode == (-signal.SIGKILL if mode == "sigkill" else 0)
    assert _wait_gone(pids, 5), "workers outlived their parent"


def test_ctrl_c_stops_the_consumer_and_its_workers(tmp_path):
    proc, pids, err = _run_parent(tmp_path, "interrupt", interrupt=True)
    # Python ends an uncaught KeyboardInterrupt by re-raising SIGINT: status -2
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    assert "Traceback" not in err.split("KeyboardInterrupt")[-1]  # workers printed nothing
    assert _wait_gone(pids, 5)


def test_interrupted_load_frees_its_slot_and_the_pool_stays_usable():
    class Slowish:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            time.sleep(0.6 if i == 0 else 0)
            return np.full(3, i)

    ex = ProcessExecutor(Slowish(), workers=1, in_flight_per_worker=2)
    try:
        ex.wait_ready(60)
        threading.Timer(0.2, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            ex.load(0, 0)
        core = ex.pool._core
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(core.workers[0].free) < 2:
            time.sleep(0.05)
        assert sorted(core.workers[0].free) == [0, 1]  # the late answer freed its slot
        assert ex.load(3, 0).tolist() == [3, 3, 3]
    finally:
        ex.close()


def _fd_count():
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _shm_mappings():
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum("kerasfeed" in line for line in f)


def test_fifty_epochs_do_not_grow_shm_fds_threads_or_children():
    class Varied:
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return np.full(1000 * (i + 1), i, np.float32), {"i": np.int64(i)}

    ex = ProcessExecutor(Varied(), workers=2)
    me = psutil.Process()

    def usage():
        # Threads of this pool only: other tests' thread executors may stop
        # theirs whenever their datasets are collected.
        threads = sum(not t.name.startswith("kerasfeed-thread-") for t in threading.enumerate())
        return (_shm_mappings(), _fd_count(), threads, len(me.children(recursive=True)))

    try:
        with ThreadPoolExecutor(ex.parallel_calls()) as tp:

            def epoch(e):
                return [int(d["i"]) for _, d in tp.map(lambda i: ex.load(i, e), range(12))]

            for e in range(3):
                assert epoch(e) == list(range(12))
            gc.collect()  # earlier tests' garbage (lent segments, thread pools) goes now, not mid-test
            base = usage()
            for e in range(3, 50):
                assert epoch(e) == list(range(12))
            after = usage()
        assert after[0] == base[0] and after[2:] == base[2:], (base, after)
        assert after[1] <= base[1] + 2, f"open fds grew from {base[1]} to {after[1]}"
        # segments are reused: at most one per slot, each at most the largest item
        assert ex.stats()["shm_bytes"] <= ex.pool.in_flight_limit * shm.grown_size(12 * 1000 * 4)
        assert all(w["alive"] for w in ex.stats()["per_worker"])
    finally:
        ex.close()


def test_worker_memory_does_not_grow_with_items():
    class MegaBatches:
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            return np.full((32, 64, 64, 3), i, np.float32), np.full(32, i % 10)  # 1.5 MB

    ex = ProcessExecutor(MegaBatches(), workers=1)
    try:
        for i in range(20):
            ex.load(i, 0)
        worker = psutil.Process(ex.pool.pids[0])
        before = worker.memory_info().rss
        for i in range(300):  # 450 MB through one worker
            assert ex.load(i, 0)[0][0, 0, 0, 0] == i
        grown = (worker.memory_info().rss - before) / 2**20
        assert grown < 30, f"worker RSS grew by {grown:.0f} MB over 300 items of 1.5 MB"
    finally:
        ex.close()


# ---------------------------------------------------------------- shared memory


@pytest.mark.parametrize("backend", ["memfd", "posix"])
def test_segments_are_private_and_never_named_in_dev_shm(backend, monkeypatch):
    monkeypatch.setenv(shm.BACKEND_ENV, backend)
    fd = shm.create_segment(4096, "t")
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
    finally:
        os.close(fd)

    class Big:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full((512, 1024), i, np.float32)  # 2 MB

    ex = ProcessExecutor(Big(), workers=1)
    try:
        assert ex.load(2, 0)[0, 0] == 2
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("kerasfeed")]
        # the worker's own mapping of its slot: mode 0600
        pid = ex.pool.pids[0]
        modes = []
        for fd_name in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd_name}")
            if "kerasfeed" in target or (backend == "posix" and target.startswith("/dev/shm/")):
                modes.append(os.stat(f"/proc/{pid}/fd/{fd_name}").st_mode & 0o777)
        assert modes and set(modes) == {0o600}
    finally:
        ex.close()


# ---------------------------------------------------------------- streams (for generator sources)


def count_up(n):
    for i in range(n):
        yield {"i": np.int64(i), "x": np.full(i + 1, i, np.int32)}


def broken_after_two(_):
    yield np.zeros(1)
    yield np.ones(1)
    raise OSError("disk went away")


def endless_with_times(_):
    n = 0
    while True:
        yield np.array([n, time.time()])
        n += 1


def test_stream_yields_generator_items_in_order(kit):
    items = list(kit.pool.stream(count_up, 5))
    assert [int(d["i"]) for d in items] == list(range(5))
    for i, d in enumerate(items):
        np.testing.assert_array_equal(d["x"], np.full(i + 1, i, np.int32))


def test_stream_error_names_item_and_worker_and_pool_survives(kit):
    it = kit.pool.stream(broken_after_two, None, name="reader('a.csv')")
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(ItemError) as e:
        next(it)
    assert e.value.index == 2 and e.value.exc_type == "OSError"
    assert "reader('a.csv')[2] raised OSError in worker" in str(e.value) and "disk went away" in str(e.value)
    assert kit.load(7, 0)[0][0, 0] == 7


def test_stream_is_bounded_and_closing_it_frees_the_worker(kit):
    k = kit.pool.options.in_flight_per_worker
    it = kit.pool.stream(endless_with_times, None)
    made, taken = [], []
    for _ in range(k + 3):
        item = next(it)
        taken.append(time.time())
        made.append(item[1])
        assert item[0] == len(made) - 1
        time.sleep(0.3)
    # At most k items wait in shared memory, plus the one being made: item
    # k+1 could only be made once item 0 was taken, item k+2 once item 1 was
    # (unbounded, all would be made at once).
    assert made[k + 1] >= taken[0] - 0.05 and made[k + 2] >= taken[1] - 0.05
    it.close()
    core = kit.pool._core
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(w.stream is not None for w in core.workers):
        time.sleep(0.05)
    assert all(w.stream is None and sorted(w.free) == list(range(k)) for w in core.workers)
    assert [int(x[0, 0]) for x, _ in _drive(kit, range(6))] == list(range(6))


def dies_after_one(_):
    yield np.zeros(1)
    os._exit(5)


def test_stream_worker_death_is_reported():
    pool = WorkerPool(None, workers=1)
    try:
        it = pool.stream(dies_after_one, None)
        assert next(it)[0] == 0
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"exited unexpectedly with exit code 5"):
            next(it)
        assert time.monotonic() - t0 < 10
    finally:
        pool.close()


def test_stats_report_startup_memory_and_consumer_cost(kit):
    _drive(kit, range(30))
    s = kit.stats()
    assert s["workers"] == 2 and s["in_flight_limit"] == 4
    assert 0 < s["startup_s"] < 60
    # a light worker: far below TensorFlow's ~500 MB
    assert 0 < s["rss_mb_per_worker"] < 300 and 0 < s["uss_mb_per_worker"] <= s["rss_mb_per_worker"]
    assert s["items"] >= 30 and s["consumer_us_per_item"] > 0
    print(f"\nworker start-up {s['startup_s']:.2f} s, RSS {s['rss_mb_per_worker']:.0f} MB "
          f"(USS {s['uss_mb_per_worker']:.0f} MB), consumer {s['consumer_us_per_item']:.0f} us/item")


def slow_start(_):
    time.sleep(30)
    yield np.zeros(1)


def test_stream_timeout_stops_a_stuck_task():
    pool = WorkerPool(None, workers=1, timeout=0.5)
    try:
        it = pool.stream(slow_start, None, name="stuck()")
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"produced no item of stuck\(\) within timeout=0.5 s"):
            next(it)
        assert time.monotonic() - t0 < 5
    finally:
        pool.close()


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
        assert procs._kerasfeed_executor.name == "processes"
        for _ in range(2):  # two passes: two different permutations, equal in both
            want, got = _batches(threads), _batches(procs)
            assert [int(x[0, 0]) for x, _ in got] == [int(x[0, 0]) for x, _ in want]
            assert sorted(int(x[0, 0]) for x, _ in got) == list(range(10))
            for (gx, gy), (wx, wy) in zip(got, want):
                np.testing.assert_array_equal(gx, wx)
                np.testing.assert_array_equal(gy, wy)
    finally:
        procs._kerasfeed_executor.close()


def _dataset_kinds(ds):
    kinds, stack = set(), [ds]
    while stack:
        d = stack.pop()
        kinds.add(type(d).__name__)
        stack.extend(d._inputs())
    return kinds


def test_a_planned_pass_requests_items_ahead_in_order_and_maps_sequentially(kit):
    core = kit.pool._core
    order = [5, 2, 9, 0, 7, 1]
    kit.plan(3, order)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and core.plan is not None and core.plan.next < len(order):
        time.sleep(0.01)
    with core.lock:  # requested before any load asked: the window covers the whole (short) pass
        assert core.plan.indices == order and core.plan.next == len(order)
    got = [kit.load(i, 3) for i in order]
    assert [int(x[0, 0]) for x, _ in got] == order
    assert {int(m["epoch"]) for _, m in got} == {3}
    assert core.plan is None  # finished once every item was taken
    assert all(w.waiting == 0 and not w.pending for w in core.workers)

    ds = kerasfeed.to_dataset(Kit(12), executor=kit, shuffle=True, seed=3)
    first = [int(x[0, 0]) for x, _ in ds]
    assert sorted(first) == list(range(12)) and first != list(range(12))
    kinds = _dataset_kinds(ds)
    assert "_MapDataset" in kinds and "_ParallelMapDataset" not in kinds, kinds
    # ... and inline: the pick-up runs on tf.data's own thread, not handed to
    # the inter-op pool (one thread wake-up less per element).
    graph = graph_pb2.GraphDef.FromString(ds._as_serialized_graph().numpy())
    maps = [n for n in graph.node if n.op == "MapDataset"]
    assert len(maps) == 1 and maps[0].attr["use_inter_op_parallelism"].b is False
    kinds = _dataset_kinds(kerasfeed.to_dataset(Kit(12), executor=kit, num_parallel_calls=4))
    assert "_ParallelMapDataset" in kinds, kinds  # asked for explicitly


def test_an_abandoned_plan_never_blocks_later_loads_or_leaks_slots(kit):
    core = kit.pool._core
    kit.plan(0, list(range(30)))
    assert int(kit.load(0, 0)[0][0, 0]) == 0
    # The pass is dropped here: answers sent ahead wait, unclaimed.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(w.waiting for w in core.workers):
        time.sleep(0.01)
    assert any(w.waiting for w in core.workers)
    # Direct loads (another epoch, many threads) do not wait for the stale plan.
    out = _drive(kit, range(20, 28), epoch=5, threads=8)
    assert [int(x[0, 0]) for x, _ in out] == list(range(20, 28))
    # A new plan drops the old one and frees its slots.
    kit.plan(1, [3, 4])
    assert [int(kit.load(i, 1)[0][0, 0]) for i in (3, 4)] == [3, 4]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(w.busy for w in core.workers):
        time.sleep(0.01)
    with core.lock:
        assert all(w.busy == 0 and w.waiting == 0 and not w.pending for w in core.workers)
        slots = sum(len(w.free) for w in core.workers)
        assert slots == sum(w.next_slot for w in core.workers)  # every slot is free again


def test_the_next_pass_is_started_ahead_and_kept_by_its_plan(kit):
    core = kit.pool._core
    first, second = [4, 0, 2, 6], [7, 1, 5, 3, 2]
    kit.plan(2, first, next_pass=(3, second))
    assert [int(kit.load(i, 2)[0][0, 0]) for i in first] == first
    # Pass 2 is all requested, so the workers went on with pass 3 (5 items,
    # within the window of 2 x 3) before anybody asked for it.
    assert wait_until(lambda: core.follow is not None and core.follow.all_started)
    follow = core.follow
    assert follow.epoch == 3 and follow.outstanding == len(second)
    assert wait_until(lambda: all(not w.pending for w in core.workers))  # made already
    kit.plan(3, second)
    assert core.plan is follow and core.follow is None  # kept, not requested again
    out = [kit.load(i, 3) for i in second]
    assert [int(x[0, 0]) for x, _ in out] == second
    assert {int(m["epoch"]) for _, m in out} == {3}  # the workers made them for pass 3
    assert core.plan is None
    assert wait_until(lambda: all(w.busy == 0 and w.waiting == 0 and not w.pending for w in core.workers))


def test_a_next_pass_that_does_not_come_is_dropped_without_leaking_slots(kit):
    core = kit.pool._core
    kit.plan(0, [1, 2], next_pass=(1, [10, 11, 12]))
    assert [int(kit.load(i, 0)[0][0, 0]) for i in (1, 2)] == [1, 2]
    assert wait_until(lambda: core.follow is not None and core.follow.all_started)
    kit.plan(1, [12, 11, 10])  # the same pass in another order: what was made ahead is dropped
    assert core.follow is None and core.plan.indices == [12, 11, 10]
    out = [kit.load(i, 1) for i in (12, 11, 10)]
    assert [int(x[0, 0]) for x, _ in out] == [12, 11, 10]
    assert {int(m["epoch"]) for _, m in out} == {1}
    kit.plan(7, [5], next_pass=(8, [6]))
    assert int(kit.load(5, 7)[0][0, 0]) == 5
    assert wait_until(lambda: core.follow is not None and core.follow.all_started)
    items = list(kit.pool.stream(count_up, 2))  # a stream needs an idle worker: the follow-up goes
    assert [int(d["i"]) for d in items] == [0, 1] and core.follow is None and core.follow_spec is None
    assert wait_until(lambda: all(w.busy == 0 and w.waiting == 0 and not w.pending for w in core.workers))
    with core.lock:
        assert sum(len(w.free) for w in core.workers) == sum(w.next_slot for w in core.workers)


def test_to_dataset_starts_each_next_epoch_ahead_in_its_own_order(kit):
    core = kit.pool._core
    ds = kerasfeed.to_dataset(Kit(10), executor=kit, shuffle=True, seed=5)
    previous = None
    for epoch in range(3):
        got = [(int(x[0, 0]), int(m["epoch"])) for x, m in ds]
        order = [i for i, _ in got]
        assert sorted(order) == list(range(10)) and {e for _, e in got} == {epoch}
        if previous is not None:
            assert order == previous.indices  # what was started ahead was this pass
        with core.lock:
            previous = core.follow
        assert previous is not None and previous.epoch == epoch + 1 and previous.outstanding > 0
        assert previous.indices != order  # a new permutation each epoch


def test_a_load_far_ahead_of_the_plan_is_requested_directly_and_not_twice(kit):
    core = kit.pool._core
    order = list(range(100, 140))
    kit.plan(4, order)
    result = {}
    t = threading.Thread(target=lambda: result.update(x=kit.load(130, 4)))
    t.start()
    t.join(10)
    assert not t.is_alive(), "a load ahead of the plan waited for it"
    assert int(result["x"][0][0, 0]) == 130
    rest = [i for i in order if i != 130]
    assert [int(kit.load(i, 4)[0][0, 0]) for i in rest] == rest
    assert core.plan is None  # complete: 130 was skipped, not requested again
    assert wait_until(lambda: all(w.busy == 0 and not w.pending for w in core.workers))


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
        ds._kerasfeed_executor.close()


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
            ds._kerasfeed_executor.close()
        return history.history["loss"], model.get_weights()

    loss_p, weights_p = fit("processes")
    loss_t, weights_t = fit("threads")
    assert len(loss_p) == 2 and all(np.isfinite(loss_p))
    np.testing.assert_allclose(loss_p, loss_t, rtol=1e-6)
    for a, b in zip(weights_p, weights_t):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_item_error_reaches_the_tf_data_consumer():
    ds = kerasfeed.to_dataset(Ramp(fail="raise"), executor="processes", workers=2)
    pids = ds._kerasfeed_executor.pool.pids
    try:
        with pytest.raises(Exception) as e:
            _batches(ds)
        msg = str(e.value)
        assert "Ramp[3] raised KeyError in worker" in msg and "scene 3 missing" in msg
        assert any(f"(pid {p})" in msg for p in pids)
        assert "Original traceback" in msg and "__getitem__" in msg
    finally:
        ds._kerasfeed_executor.close()


def test_worker_crash_reaches_the_tf_data_consumer_quickly():
    ds = kerasfeed.to_dataset(Ramp(fail="segv"), executor="processes", workers=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            _batches(ds)
        assert time.monotonic() - t0 < 10
        assert "was killed by signal SIGSEGV" in str(e.value) and "Ramp[3]" in str(e.value)
    finally:
        ds._kerasfeed_executor.close()


@pytest.mark.parametrize("how", ["break", "del_mid_epoch"])
def test_released_dataset_and_iterator_stop_the_workers(how):
    ds = kerasfeed.to_dataset(Ramp(n=50), executor="processes", workers=2)
    pids = ds._kerasfeed_executor.pool.pids
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
    assert _wait_gone(pids, 5), "workers still alive 5 s after the dataset and iterator were released"


FORK_SCRIPT = """
import gc, os, sys
import numpy as np
from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import ProcessExecutor

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
