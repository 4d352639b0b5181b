"""Worker lifetime: close, garbage collection, parent death, Ctrl-C, interrupted
loads, and no growth of fds, shared memory, threads or memory over epochs.
"""

from __future__ import annotations

import _thread
import gc
import os
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
from _kit import Kit, alive, free_slots, wait_gone
from _util import wait_until

from kerasfeed import ProcessExecutor
from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import shm

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------- lifetime


def test_close_is_idempotent_and_stops_workers():
    ex = ProcessExecutor(Kit(), workers=2)
    pids = ex.pids
    assert ex.load(1, 0)[0][0, 0] == 1
    ex.close()
    ex.close()
    assert not any(alive(p) for p in pids)
    with pytest.raises(WorkerError, match="is closed"):
        ex.load(1, 0)


def test_an_executor_is_a_context_manager_and_load_takes_int_indices_only():
    with ProcessExecutor(Kit(), workers=1) as ex:
        pids = ex.pids
        assert ex.load(np.int64(2), np.int32(0))[0][0, 0] == 2
        for index in ("1", 2.7, True, None):  # int() made '1' item 1 and 2.7 item 2
            with pytest.raises(TypeError, match=rf"ProcessExecutor.load: `index` must be an int. Received: index={index!r}$"):
                ex.load(index, 0)
        with pytest.raises(TypeError, match=r"`epoch` must be an int. Received: epoch=0.5"):
            ex.load(1, 0.5)
        for name, args in (("index", (-1, 0)), ("epoch", (1, -1))):  # the worker passed -1 on to source[-1]
            with pytest.raises(ValueError, match=rf"`{name}` must be >= 0. Received: {name}=-1$"):
                ex.load(*args)
        assert ex.load(3, 0)[0][0, 0] == 3  # the executor still works after the refusals
    assert not any(alive(p) for p in pids)


def test_garbage_collected_executor_stops_workers():
    ex = ProcessExecutor(Kit(), workers=2)
    ex.load(0, 0)
    pids = ex.pids
    holder = {"ex": ex}
    holder["self"] = holder  # a reference cycle: only the cyclic GC frees it
    del ex, holder
    gc.collect()
    assert wait_gone(pids, 5)


def test_workers_started_again_after_parking_stop_with_the_collected_executor():
    """One handle owns whichever workers run now: those started after parking die with it too."""
    ex = ProcessExecutor(Kit(), workers=1)
    first = ex.pids
    assert ex.park()  # as after a failed pass that was left
    assert wait_gone(first, 5)
    assert ex.load(3, 0)[0][0, 0] == 3  # starts new workers
    second = ex.pids
    assert second != first and all(alive(p) for p in second)
    del ex
    gc.collect()
    assert wait_gone(second, 5)


PARENT_SCRIPT = """
import os, signal, sys, time
import numpy as np
from kerasfeed import ProcessExecutor

class Src:
    def __len__(self):
        return 100
    def __getitem__(self, i):
        time.sleep(0.2)
        return np.full(2, i)

ex = ProcessExecutor(Src(), workers=2)
ex.wait_ready(60)
print("PIDS", *ex.pids, flush=True)
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
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
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
    assert wait_gone(pids, 5), "workers outlived their parent"


def test_ctrl_c_stops_the_consumer_and_its_workers(tmp_path):
    proc, pids, err = _run_parent(tmp_path, "interrupt", interrupt=True)
    # Python ends an uncaught KeyboardInterrupt by re-raising SIGINT: status -2
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    assert "Traceback" not in err.split("KeyboardInterrupt")[-1]  # workers printed nothing
    assert wait_gone(pids, 5)


FIRST_LOADER_SCRIPT = """
import gc, sys, time
import numpy as np
import kerasfeed

class Src:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return np.full(2, i)

gc.disable()  # only reference counting: what `del` frees at once
assert "keras" not in sys.modules  # the first to_loader imports Keras
loader = kerasfeed.to_loader(Src(), executor="processes", workers=1)
next(iter(loader))
print("PIDS", *loader.executor.pids, flush=True)
del loader
time.sleep(30)
"""


_SLOW_SITE = """
import os, time
if os.environ.get("KERASFEED_LIGHT_WORKER"):  # a worker's interpreter, still importing `site`
    open(os.path.join(os.path.dirname(__file__), f"started-{os.getpid()}"), "w").close()
    time.sleep(1.5)
"""


def test_a_ctrl_c_while_a_worker_s_interpreter_starts_does_not_end_it(tmp_path, monkeypatch):
    """A Ctrl-C to the process group reaches the workers too; before ``main`` ignores it, one that was still
    starting died ("Fatal Python error: init_import_site", or the pool's WorkerError: exited before it was
    ready). Workers are born with SIGINT blocked."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))

    def interrupt():
        assert wait_until(lambda: any(p.name.startswith("started-") for p in tmp_path.iterdir()), timeout=30)
        for p in tmp_path.glob("started-*"):
            os.kill(int(p.name.split("-")[1]), signal.SIGINT)

    t = threading.Thread(target=interrupt)
    t.start()
    with ProcessExecutor(Kit(), workers=1) as ex:
        t.join()
        assert ex.load(2, 0)[0][0, 0] == 2
        pid = ex.pids[0]
        with open(f"/proc/{pid}/status") as f:  # after start-up: ignored, no longer blocked
            masks = dict(line.split(":\t") for line in f.read().splitlines() if line.startswith("Sig"))
        bit = 1 << (signal.SIGINT - 1)
        assert int(masks["SigIgn"], 16) & bit and not int(masks["SigBlk"], 16) & bit, masks


def test_the_first_loader_is_freed_by_del(tmp_path):
    # The first `import keras` (under TensorFlow) kept the frames on the stack then in a reference
    # cycle: made inside to_loader's make(), it held the first loader and its workers until the cyclic GC.
    script = tmp_path / "first.py"
    script.write_text(FIRST_LOADER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        assert wait_gone(pids, 10), "the first loader's worker outlived `del loader`"
        assert proc.poll() is None  # the parent still runs: freed by reference counting, not by exit
    finally:
        proc.kill()
        proc.communicate()


def test_interrupted_load_frees_its_slot_and_the_pool_stays_usable(tmp_path):
    go = tmp_path / "go"  # item 0 is answered once the interrupt came (a sleep raced it on a busy machine)

    class Held:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            deadline = time.monotonic() + 30
            while i == 0 and not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return np.full(3, i)

    ex = ProcessExecutor(Held(), workers=1, in_flight_per_worker=2)
    try:
        ex.wait_ready(60)
        try:
            with pytest.raises(KeyboardInterrupt):
                threading.Timer(0.2, _thread.interrupt_main).start()
                ex.load(0, 0)
        finally:
            go.touch()
        assert wait_until(lambda: len(free_slots(ex, 0)) >= 2, timeout=5)
        assert free_slots(ex, 0) == [0, 1]  # the late answer freed its slot
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
        assert ex.stats()["shm_bytes"] <= ex.parallel_calls() * shm.grown_size(12 * 1000 * 4)
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
        worker = psutil.Process(ex.pids[0])
        before = worker.memory_info().rss
        for i in range(300):  # 450 MB through one worker
            assert ex.load(i, 0)[0][0, 0, 0, 0] == i
        grown = (worker.memory_info().rss - before) / 2**20
        assert grown < 30, f"worker RSS grew by {grown:.0f} MB over 300 items of 1.5 MB"
    finally:
        ex.close()
