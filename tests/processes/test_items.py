"""Items made by worker processes: values, order, seeds, item errors, and the
source sent to the workers by value.

Most tests drive ``ProcessExecutor`` directly, as tf.data's map threads do
(many threads calling ``load`` at once).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import cloudpickle
import numpy as np
import pytest
from _kit import Kit, Point, drive

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.errors import ItemError
from kerasfeed.execution.threads import ThreadExecutor

# Classes and functions below reach the workers by value, exactly like code
# defined in a notebook cell or in `__main__` (the worker never imports this
# module, its pytest or its TensorFlow import).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# ---------------------------------------------------------------- items and order


def test_items_are_getitem_and_epoch_reaches_workers(kit):
    import tensorflow  # noqa: F401 - the parent has TF; workers must not

    for epoch in (0, 3):
        for i, (x, meta) in enumerate(drive(kit, range(20), epoch=epoch)):
            np.testing.assert_array_equal(x, np.full((4, 3), i, np.float32))
            assert meta["epoch"] == epoch
            assert meta["worker"] in (0, 1) and meta["pid"] in kit.pids
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
    assert any("loaded TensorFlow while starting" in r.getMessage() for r in caplog.records)


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


class Buffers:
    """Slices of np.load(mmap_mode="r") (np.memmap) and memoryviews: arrays to every consumer."""

    def __init__(self, path):
        self.path, self.a = path, None

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if self.a is None:
            self.a = np.load(self.path, mmap_mode="r")
        return memoryview(np.full((4, 3), i, np.float32)), self.a[4 * i : 4 * i + 4]

    def __getstate__(self):
        return {**self.__dict__, "a": None}


def test_memmap_slices_and_memoryviews_arrive_as_the_arrays_they_are_on_every_executor(tmp_path):
    """A memoryview came out of worker processes (and of cache=, on any executor) as a 0-d object array of its
    bytes, where threads gave float32 (4, 3); memmap slices were pickled through the socket, not lent."""
    np.save(tmp_path / "a.npy", np.arange(24 * 8192, dtype=np.float64).reshape(24, 8192))  # 256 KB items: lent
    want = [(np.full((4, 3), i, np.float32), np.load(tmp_path / "a.npy")[4 * i : 4 * i + 4]) for i in range(6)]
    for executor, cache in (("threads", None), ("processes", None), ("threads", "memory"), ("processes", "memory")):
        kw = {"workers": 2} if executor == "processes" else {}
        with kerasfeed.to_loader(Buffers(str(tmp_path / "a.npy")), batch_size=None, executor=executor, cache=cache,
                                 **kw) as loader:
            for _ in range(2):  # with cache=, the second pass is read from the cache
                got = list(loader)
            lent = kerasfeed.executor_of(loader).stats().get("lent_items") if executor == "processes" else None
        for (x, y), (wx, wy) in zip(got, want):
            assert x.dtype == wx.dtype and x.shape == wx.shape and y.dtype == wy.dtype and y.shape == wy.shape, (
                executor, cache, x.dtype, x.shape)
            np.testing.assert_array_equal(x, wx)
            np.testing.assert_array_equal(y, wy)
        assert len(got) == 6
        if executor == "processes" and cache is None:
            assert lent >= 6, lent  # through shared memory


@pytest.mark.parametrize("workers", [1, 3])
def test_order_equals_threads_executor_for_any_worker_count(workers, kit):
    order = np.random.default_rng(5).permutation(40)
    want = [x for x, _ in drive(ThreadExecutor(Kit()), order, threads=8)]
    ex = kit if workers == 2 else ProcessExecutor(Kit(), workers=workers)
    try:
        for ex_ in (ex, kit):
            got = [x for x, _ in drive(ex_, order)]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    finally:
        if ex is not kit:
            ex.close()


def test_worker_init_worker_info_and_deterministic_seeds(kit):
    seen = {}
    for _, meta in drive(kit, range(16)):
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
    assert err.worker_id in (0, 1) and err.pid in kit.pids
    assert 'raise ValueError(f"bad item {i}")' in err.traceback_text
    msg = str(err)
    assert "Kit[999] raised ValueError in worker" in msg and f"(pid {err.pid})" in msg
    assert "bad item 999" in msg and "__getitem__" in err.full_message
    # an item error does not break the pool
    x, _ = kit.load(5, 0)
    assert x[0, 0] == 5


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
            self.file = h5py.File(path, "a")  # read-only handles travel (tests/processes/test_byo_sequence.py)

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
from kerasfeed import ProcessExecutor

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
from kerasfeed import ProcessExecutor

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


class References:
    """Items holding an object array of h5py object references (an HDF5 reference dataset's rows)."""

    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 2

    def __getitem__(self, i):
        import h5py

        with h5py.File(self.path, "r") as f:
            return f["x"][i : i + 2], np.float32(i)


def test_an_item_that_cannot_leave_the_worker_names_what_it_holds(tmp_path):
    """A bare ``no default __reduce__ due to non-trivial __cinit__`` named neither the dtype nor the remedy."""
    import h5py

    path = str(tmp_path / "refs.h5")
    with h5py.File(path, "w") as f:
        f["y"] = np.arange(4)
        f.create_dataset("x", shape=(4,), dtype=h5py.ref_dtype)[...] = [f["y"].ref] * 4
    with ProcessExecutor(References(path), workers=1) as ex:
        with pytest.raises(ItemError, match=r"References\[0\] raised TypeError .*the item holds an object array of "
                                            r"Reference, which cannot be pickled to leave a worker process .*"
                                            r"Return numeric arrays"):
            ex.load(0, 0)
