"""A user's own Keras ``Sequence`` on worker processes, as it is, and light (issue 42).

Workers unpickle with light stand-ins for ``keras``/``tensorflow``
(``kerasfeed/execution/processes/light_modules.py``) and reopen read-only h5py
handles (``h5_handles.py``). The sources ask the worker what it imported:
``byo_sources._flags.framework_flags`` looks ``tensorflow``, ``keras``, ``jax``
and ``torch`` up in ``sys.modules`` without importing anything.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import cloudpickle
import h5py
import keras
import numpy as np
import pytest

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.errors import ItemError

TESTS = pathlib.Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # byo_sources: real module files the workers import

from byo_sources import (  # noqa: E402
    bound_names,
    eager_h5,
    from_imports,
    keras_utils_pydataset,
    plain_keras,
    tf_keras_utils,
)

# Classes defined below travel by value, like a notebook cell's or __main__'s.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NO_FRAMEWORK = [False, False, False, False]


def _flags_of(batch):
    return batch["flags"] if isinstance(batch, dict) else batch[-1]


def _without_flags(batch):
    return {k: v for k, v in batch.items() if k != "flags"} if isinstance(batch, dict) else batch[:-1]


def _passes(source, executor, passes=2, **kwargs):
    with kerasfeed.to_loader(source, executor=executor, **kwargs) as loader:
        return [[b for b in loader] for _ in range(passes)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(keras.tree.flatten(x), keras.tree.flatten(y)):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "make",
    [
        plain_keras.KerasSequence,  # import keras; keras.utils.Sequence; on_epoch_end changes state
        keras_utils_pydataset.Rows,  # from keras.utils import PyDataset
        tf_keras_utils.TfSequence,  # from tensorflow.keras.utils import Sequence
        tf_keras_utils.TfKerasSequence,  # from tensorflow import keras; keras.utils.Sequence
        from_imports.OneHot,  # from tensorflow.keras.utils import Sequence, to_categorical (unused)
    ],
)
def test_keras_sequence_from_a_module_runs_without_a_framework(make):
    threads = _passes(make(), "threads")
    source = make(workers=3, use_multiprocessing=True, max_queue_size=7)
    processes = _passes(source, "processes", workers=2)
    for t, p in zip(threads, processes):
        _assert_same([_without_flags(b) for b in t], [_without_flags(b) for b in p])
        assert all(_flags_of(b).tolist() == NO_FRAMEWORK for b in p), [_flags_of(b) for b in p]
    assert (source.workers, source.use_multiprocessing, source.max_queue_size) == (3, True, 7)


class ByValue(keras.utils.Sequence):
    """Travels by value (this module is registered with cloudpickle), as from a notebook."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = 2

    def __len__(self):
        return 3

    def __getitem__(self, i):
        seen = np.array([m in sys.modules for m in ("tensorflow", "keras", "jax", "torch")])
        attrs = np.array([self.workers, self.max_queue_size, isinstance(self, keras.utils.Sequence)])
        return np.full((2, 2), i * self.scale, np.float32), attrs, seen

    def on_epoch_end(self):
        self.scale += 1


def test_keras_sequence_by_value_runs_without_a_framework():
    threads = _passes(ByValue(workers=2, max_queue_size=5), "threads")
    processes = _passes(ByValue(workers=2, max_queue_size=5), "processes", workers=2)
    _assert_same([b[:2] for p in threads for b in p], [b[:2] for p in processes for b in p])
    assert processes[1][0][1].tolist() == [2, 5, 1]  # attributes; isinstance of the (light) base
    assert all(b[2].tolist() == NO_FRAMEWORK for p in processes for b in p)


class ReducedByValue(ByValue):
    """Its own ``__reduce__``: its changed state is sent whole (the class by value) at each pass boundary."""

    def __init__(self, scale=2):
        super().__init__()
        self.scale = scale

    def __reduce__(self):
        return (ReducedByValue, (self.scale,))


def test_a_sequence_sent_whole_stays_light_after_its_state_changes():
    """The first change unpickled the class by value without the stand-ins: every worker imported the real
    Keras with TensorFlow (+6 s, +339 MB each; helper, 3 of 3), blamed on kerasfeed's own line."""
    processes = _passes(ReducedByValue(), "processes", passes=3, workers=2)
    assert [[int(b[0][0, 0]) for b in p] for p in processes] == [[0, 2, 4], [0, 3, 6], [0, 4, 8]]
    assert all(b[2].tolist() == NO_FRAMEWORK for p in processes for b in p)


MAIN_SCRIPT = """
import json, sys
import numpy as np
import keras
from keras.utils import PyDataset
from tensorflow.keras.utils import Sequence as TfSequence
import kerasfeed

def flags():
    return [m in sys.modules for m in ("tensorflow", "keras", "jax", "torch")]

class A(keras.utils.Sequence):
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return np.full(2, i, np.float32), np.array(flags())

class B(PyDataset):
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return np.full(2, i + 10, np.float32), np.array(flags())

class C(TfSequence):
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return np.full(2, i + 20, np.float32), np.array(flags())

import keras.ops as kops

class D(keras.utils.Sequence):  # keras.ops (a submodule cloudpickle imports) and an alias, in a branch not taken
    flip = False
    def __len__(self):
        return 3
    def __getitem__(self, i):
        x = np.full(2, i + 30, np.float32)
        if self.flip:
            x = keras.ops.convert_to_numpy(kops.flip(x))
        return x, np.array(flags())

out = {}
for cls in (A, B, C, D):
    with kerasfeed.to_loader(cls(), executor="processes", workers=2) as loader:
        made = list(loader)
    out[cls.__name__] = {"x": [b[0].tolist() for b in made], "flags": [b[1].tolist() for b in made]}
print("RESULT " + json.dumps(out))
"""


def test_keras_sequences_defined_in_main_run_without_a_framework(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    for name, offset in (("A", 0), ("B", 10), ("C", 20), ("D", 30)):
        assert result[name]["x"] == [[i + offset] * 2 for i in range(3)]
        assert result[name]["flags"] == [NO_FRAMEWORK] * 3, name
    assert "loaded" not in out.stderr  # no framework-load warning


STAND_INS_CHECK = """
import inspect, pickle, sys
from kerasfeed.execution.processes import light_modules
(source, _), _ = light_modules.loads(open(sys.argv[1], "rb").read())
m, p = sys.modules["byo_sources.from_imports"], sys.modules["byo_sources.plain_keras"]  # imported to unpickle
inspect.getmodule(m.OneHot)  # reads __file__ of every module in sys.modules: must not load TensorFlow
print(sorted(k for k in ("tensorflow", "keras", "jax", "torch") if k in sys.modules),
      type(m.to_categorical).__name__, type(p.keras).__name__, type(source).__mro__[1].__module__,
      source.workers, source.max_queue_size)
"""


def test_stand_ins_leave_sys_modules_and_imported_names_wait(tmp_path):
    from kerasfeed.execution.pickling import dumps_for_workers

    payload = tmp_path / "payload.pkl"
    payload.write_bytes(dumps_for_workers((from_imports.OneHot(workers=4, max_queue_size=9), plain_keras.KerasSequence())))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    out = subprocess.run([sys.executable, "-c", STAND_INS_CHECK, str(payload)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "LazyName", "StandIn", "kerasfeed.sources._light_pydataset", "4", "9"]


def test_this_keras_is_the_one_the_light_stand_in_copies():
    from kerasfeed.sources._light_pydataset import differences

    assert differences(keras.utils.PyDataset) == []  # a Keras that moved it fails here first (make keras-matrix)


def test_a_keras_whose_pydataset_differs_sends_sources_without_the_stand_ins(monkeypatch, capfd):
    """A Keras that renames PyDataset's private attributes: the stand-in's properties would read their
    defaults in the workers (``workers`` 1 where the source says 2), silently. Now a KerasStructureWarning,
    and the workers import Keras, whose own class reads them."""
    from kerasfeed import _keras_fit
    from kerasfeed.errors import KerasStructureWarning
    from kerasfeed.execution.processes import light_modules

    real_init = keras.utils.PyDataset.__init__

    def renamed(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        real_init(self, workers, use_multiprocessing, max_queue_size)
        self._num_workers = self.__dict__.pop("_workers")

    monkeypatch.setattr(keras.utils.PyDataset, "__init__", renamed)
    monkeypatch.setattr(light_modules, "_fits", None)
    monkeypatch.setattr(_keras_fit, "_REPORTED", set())
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # the workers' Keras: the cheapest to load here
    with pytest.warns(KerasStructureWarning, match=r"PyDataset\(\) holds .*'_num_workers'.*without the stand-ins"):
        processes = _passes(ByValue(workers=2, max_queue_size=5), "processes", passes=1, workers=1)
    assert all(b[2].tolist()[1] for b in processes[0])  # keras in the worker: unpickled without the stand-ins
    err = capfd.readouterr().err
    assert "stand-ins for `keras` and `tensorflow` were off in this worker" in err, err
    monkeypatch.setattr(light_modules, "_fits", None)
    monkeypatch.setattr(keras.utils.PyDataset, "__module__", "keras.src.moved")
    with pytest.warns(KerasStructureWarning, match="is keras.src.moved.PyDataset, not keras.src.trainers"):
        assert not light_modules.stand_ins_fit()
    assert light_modules.worker_environment()["KERASFEED_LIGHT_FRAMEWORKS"] == "0"


def test_getitem_that_calls_keras_loads_it_then_and_says_so(monkeypatch, capfd):
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # the workers' Keras: the cheapest to load here
    threads = _passes(plain_keras.ToCategorical(), "threads", passes=1)
    processes = _passes(plain_keras.ToCategorical(), "processes", passes=1, workers=1)
    _assert_same([_without_flags(b) for b in threads[0]], [_without_flags(b) for b in processes[0]])
    assert processes[0][0]["y"].shape == (4, 3)
    assert processes[0][0]["flags"].tolist()[1]  # keras is loaded now, in the worker
    err = capfd.readouterr().err
    assert "kerasfeed: worker process 0" in err and "loaded keras" in err, err
    assert "plain_keras.py:" in err and "in `__getitem__`" in err and "`keras.utils.to_categorical`" in err
    assert " s, +" in err and "MB PSS per worker" in err and "np.eye(num_classes" in err


def test_names_bound_at_import_stay_lazy_in_the_worker_and_work_as_the_real_ones():
    """A dtype read at module level (``DTYPE = tf.float32``), one imported by name and an imported
    function: TensorFlow loads at the first item, not at the import, and takes them as they are."""
    threads = _passes(bound_names.Bound(), "threads", passes=1)[0]
    processes = _passes(bound_names.Bound(), "processes", passes=1, workers=1)[0]
    _assert_same([b[:4] for b in threads], [b[:4] for b in processes])
    assert [b[0].tolist() for b in processes] == [[0.0, 1.0], [1.0, 2.0]] and processes[1][3].tolist() == [True, True]
    assert processes[0][4].tolist() == [True] * 3  # bound in the worker's module: forwarding names
    assert threads[0][4].tolist() == [False] * 3


def test_module_that_uses_tensorflow_at_import_warns_with_the_line(capfd):
    from byo_sources import tf_at_import

    ex = ProcessExecutor(tf_at_import.Scaled(), workers=1)
    try:
        np.testing.assert_array_equal(ex.load(2, 0), tf_at_import.Scaled()[2])
    finally:
        ex.close()
    err = capfd.readouterr().err
    assert "loaded tensorflow" in err, err
    assert "`SCALE = float(tf.constant(2.0))" in err and "tf_at_import.py:6" in err
    assert "module level of `byo_sources.tf_at_import`" in err and "`tensorflow.constant`" in err
    assert "keep framework calls out of module level" in err


def test_the_framework_warning_says_what_to_do_for_each_kind_of_use(tmp_path):
    """An import line, a call while unpickling and an object held in the state each got another use's advice
    (an import line was named and then called free; ``__setstate__`` was "at its first item")."""
    from kerasfeed.execution.processes import frameworks

    path = tmp_path / "user_module.py"
    # The module's frame stays at its last line: the import line is last.
    path.write_text("def __setstate__(): return sys._getframe()\nimport sys; FRAME = sys._getframe()\n")
    namespace: dict = {"__name__": "user_module"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    text, when = frameworks.describe_use(namespace["FRAME"], "keras.ops", unpickling=True)
    assert when == "import line" and "module level of `user_module`" in text
    advice = frameworks.advice(when, ["keras"], "keras.ops")
    assert "importing another submodule at module level loads the framework" in advice
    assert "`from keras import ops`" in advice and "are free" not in advice
    text, when = frameworks.describe_use(namespace["__setstate__"](), "keras.utils.to_categorical", unpickling=True)
    assert when == "start-up" and "in `__setstate__`" in text
    assert "at start-up, as it unpickles the source or runs worker_init" in frameworks.advice(when, ["keras"])
    with frameworks.starting():  # worker_init
        assert frameworks.describe_use(namespace["__setstate__"](), None, unpickling=False)[1] == "start-up"
    assert frameworks.describe_use(namespace["__setstate__"](), None, unpickling=False)[1] == "call"
    held = frameworks.advice("unpickle", ["keras"], "keras.src.layers.preprocessing.rescaling.Rescaling")
    assert "the source's state holds a framework object (a Keras layer or model" in held


# ---------------------------------------------------------------- HDF5 handles opened in __init__


def _scene_file(path):
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(48, dtype=np.float32).reshape(24, 2)
        f["y"] = np.arange(24) % 3
        f.create_group("meta").attrs["scale"] = 0.5
    return str(path)


class Checks(eager_h5.EagerH5):
    """Also reports, from the worker, that its handles still look like h5py's."""

    def __getitem__(self, i):
        kinds = [isinstance(self.f, h5py.File), isinstance(self.parts[0], h5py.Dataset), self.f.mode == "r"]
        return super().__getitem__(i) + (np.array(kinds),)


def test_hdf5_file_opened_in_init_gives_the_same_batches(tmp_path):
    source = Checks(_scene_file(tmp_path / "scenes.h5"))
    threads = _passes(source, "threads")
    processes = _passes(source, "processes", workers=2)
    for t, p in zip(threads, processes):
        _assert_same(t, p)
    assert processes[0][0][-1].tolist() == [True, True, True]
    assert source.f["x"][1].tolist() == [2.0, 3.0] and source.parts[1]["labels"][2] == 2  # the parent's still open
    source.f.close()


def test_hdf5_files_opened_in_on_epoch_end_reach_the_workers_for_the_next_pass(tmp_path):
    """The source's state after on_epoch_end travels to the workers like the source itself: its new
    read-only handles as references each worker reopens (not an unpicklable h5py object)."""
    first = _scene_file(tmp_path / "a.h5")
    second = str(tmp_path / "b.h5")
    with h5py.File(second, "w") as f:
        f["x"] = -np.arange(48, dtype=np.float32).reshape(24, 2)
        f["y"] = np.arange(24) % 2
        f.create_group("meta").attrs["scale"] = 2.0
    threads = _passes(eager_h5.RotatingH5([first, second]), "threads", passes=3)
    processes = _passes(eager_h5.RotatingH5([first, second]), "processes", passes=3, workers=2)
    for t, p in zip(threads, processes):
        _assert_same(t, p)
    assert processes[0][1][0].tolist() == [[4.0, 4.5], [5.0, 5.5], [6.0, 6.5], [7.0, 7.5]]  # a.h5, scale 0.5
    assert processes[1][1][0].tolist() == [[-16.0, -18.0], [-20.0, -22.0], [-24.0, -26.0], [-28.0, -30.0]]  # b.h5
    assert processes[2][1][0].tolist() == processes[0][1][0].tolist()


def test_hdf5_handle_open_for_writing_is_refused_naming_the_attribute(tmp_path):
    source = eager_h5.EagerH5(_scene_file(tmp_path / "scenes.h5"), mode="r+")
    try:
        with pytest.raises(TypeError) as e:
            ProcessExecutor(source, workers=1)
    finally:
        source.f.close()
    msg = str(e.value)
    assert "`source.f` (h5py._hl.files.File) cannot be pickled" in msg
    assert "open for writing (mode 'r+')" in msg and "Received: source=" in msg


def test_in_memory_hdf5_files_are_refused(tmp_path):
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        f["x"] = np.arange(3)

    class InMemory:
        def __init__(self, f):
            self.handles = {"x": f["x"]}

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return self.handles["x"][i]

    core = h5py.File(tmp_path / "mem.h5", "w", driver="core", backing_store=False)
    core["x"] = np.arange(3)
    from_bytes = h5py.File(image, "r")
    try:
        for f, why in ((core, r"open for writing \(mode 'r\+'\)"), (from_bytes, "uses driver 'fileobj'")):
            with pytest.raises(TypeError, match=rf"`source\.handles\['x'\]` \(h5py\._hl\.dataset\.Dataset\) cannot.*{why}"):
                ProcessExecutor(InMemory(f), workers=1)
    finally:
        core.close()
        from_bytes.close()


def test_hdf5_file_replaced_on_disk_is_detected_in_the_worker(tmp_path):
    path = _scene_file(tmp_path / "scenes.h5")
    source = eager_h5.EagerH5(path)
    ex = ProcessExecutor(source, workers=1)
    try:
        other = _scene_file(tmp_path / "other.h5")
        os.replace(other, path)  # a writer renames a new file over it: workers open lazily, after this
        with pytest.raises(ItemError, match=r"raised FileChangedError.*changed on disk after the source was sent"):
            ex.load(0, 0)
    finally:
        ex.close()
        source.f.close()


def test_hdf5_file_replaced_on_disk_between_passes_is_named_as_such(tmp_path):
    """The state check at a pass's start pickles the handle again: a file replaced since is a
    FileChangedError naming the attribute, not "changed in this process ... cannot be pickled"."""
    path = _scene_file(tmp_path / "scenes.h5")
    source = eager_h5.EagerH5(path)
    loader = kerasfeed.to_loader(source, executor="processes", workers=1)
    try:
        assert len(list(loader)) == 6
        os.replace(_scene_file(tmp_path / "other.h5"), path)
        with pytest.raises(kerasfeed.FileChangedError) as e:
            list(loader)
        msg = str(e.value)
        assert "`source.f`" in msg and f"'{path}' was replaced on disk after this handle opened it" in msg, msg
        assert "changed in this process" not in msg
    finally:
        loader.close()
        source.f.close()


def test_a_submodule_named_by_a_pickle_is_a_module_that_loads_on_first_use():
    """``import keras.ops as kops`` in a ``__main__`` class: a module in the worker (``inspect.ismodule``), whose
    attributes are the real module's."""
    import inspect

    from kerasfeed.execution.processes import light_modules

    lazy = light_modules._LazySubmodule("keras.ops")
    assert inspect.ismodule(lazy) and lazy.__name__ == "keras.ops"
    assert lazy.flip is keras.ops.flip and "flip" in dir(lazy)
    with pytest.raises(AttributeError, match="kerasfeed's lazy stand-in"):
        lazy.__wrapped__
