"""Ctrl-C during ``model.fit`` never hangs (docs/reliability.md): a KeyboardInterrupt
that Python drops is raised again, one during the API's import of TensorFlow once
the import ended, a SIGINT that came between two waits still ends the next one, and
SIGINT to the process group of a training script ends it and its workers. ``make
soak-ctrl-c`` runs the last one hundreds of times beside CPU burners."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

from benchmarks.ctrl_c import SCRIPT, run_once
from kerasfeed.execution.interrupts import keep_interrupts

ROOT = Path(__file__).resolve().parents[1]
HARD_TIMEOUT_S = 150  # tells a hang from a slow start on a loaded machine


def _python(code: str, *args: str, timeout: float = HARD_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


# A Ctrl-C handled where Python ignores exceptions, after the first use of kerasfeed's API;
# then ordinary code (Python and C calls) that must not run to its end.
_DROPPED = """
import gc, signal, sys, time, weakref
import kerasfeed
kerasfeed.IndexOrder  # the first use of the API (light: no TensorFlow)

def sigint():
    signal.raise_signal(signal.SIGINT)  # the handler runs right after this call, in this frame

where = sys.argv[1]
if where == "gc-callback":  # as JAX's gc callback
    def callback(phase, info):
        if phase == "start" and callback in gc.callbacks:
            gc.callbacks.remove(callback)
            sigint()
    gc.callbacks.append(callback)
    gc.collect()
elif where == "__del__":
    class Dies:
        def __del__(self):
            sigint()
    Dies()
else:  # a weakref callback
    class Target:
        pass
    t = Target()
    weakref.finalize(t, sigint)
    del t
for k in range(50):
    time.sleep(0.01)
    str(k)
print("not interrupted", flush=True)
"""


@pytest.mark.parametrize("where", ["gc-callback", "__del__", "weakref.finalize"])
def test_a_ctrl_c_python_would_drop_is_raised_again(where):
    """Python prints "Exception ignored in ..." for a KeyboardInterrupt raised in
    a gc callback, ``__del__`` or a weakref callback, and goes on; kerasfeed
    raises it again in ordinary code (NOTE [ A Ctrl-C that Python swallows ])."""
    proc = _python(_DROPPED, where)
    assert "not interrupted" not in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr[-3000:])
    assert "KeyboardInterrupt" in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


_AT_EXIT = """
import atexit, signal, time
import kerasfeed
kerasfeed.IndexOrder  # the first use of the API: kerasfeed's unraisable hook and SIGINT handler in place

def late():
    signal.raise_signal(signal.SIGINT)  # a Ctrl-C as the script exits
    time.sleep(0.05)

atexit.register(late)
print("exiting", flush=True)
"""


def test_a_ctrl_c_while_the_script_exits_is_dropped_as_python_drops_it():
    """Before: kerasfeed raised the dropped KeyboardInterrupt again after the interpreter's exit began, where
    no handler was left, and the exit printed its own traceback ending in "OSError: Signal 2 ignored due to
    race condition"."""
    proc = _python(_AT_EXIT)
    assert proc.returncode == 0 and proc.stdout == "exiting\n", (proc.returncode, proc.stderr[-3000:])
    assert "Exception ignored in atexit callback" in proc.stderr, proc.stderr[-3000:]
    assert "race condition" not in proc.stderr and "interrupts.py" not in proc.stderr.split("in late")[0], \
        proc.stderr[-3000:]


_IMPORTED_MODULE = """
import signal, sys
signal.raise_signal(signal.SIGINT)  # a Ctrl-C while this module is imported
print("imported on after the first Ctrl-C", flush=True)
if "twice" in sys.argv:
    try:  # as TensorFlow's generated TFLite schema modules do around `from typing import List`
        signal.raise_signal(signal.SIGINT)
        print("the second Ctrl-C was held too", flush=True)
    except:  # noqa: E722
        print("the second Ctrl-C raised at once", flush=True)
thing = 1
"""


@pytest.mark.parametrize("times", ["once", "twice"])
def test_a_ctrl_c_during_a_lazy_import_is_raised_once_the_import_ended(tmp_path, times):
    """A lazy import of the public API (``kerasfeed.to_dataset`` imports TensorFlow, and
    JAX with it) holds a first Ctrl-C and raises it once the import ended; a second one
    raises at once, and if the import takes it (a bare ``except:``), the end of the import
    raises it again (NOTE [ Ctrl-C while TensorFlow is imported ])."""
    (tmp_path / "imported.py").write_text(_IMPORTED_MODULE)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import kerasfeed\n"
        "kerasfeed._LAZY['Imported'] = 'imported:thing'\n"
        "kerasfeed.Imported\n"
        "print('not interrupted', flush=True)\n"
    )
    proc = _python(code, times)
    out = proc.stdout.splitlines()
    assert "imported on after the first Ctrl-C" in out and "not interrupted" not in out, (out, proc.stderr[-3000:])
    if times == "twice":
        assert "the second Ctrl-C raised at once" in out, out
    assert proc.returncode == -signal.SIGINT and "raised once the import ended" in proc.stderr, proc.stderr[-3000:]


def test_other_unraisable_exceptions_reach_the_previous_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append((u.exc_type, u.object)))
    keep_interrupts()
    keep_interrupts()  # once is enough: not wrapped twice
    assert sys.unraisablehook.func.__name__ == "_redeliver_dropped_interrupts"
    assert not getattr(sys.unraisablehook.keywords["previous"], "_kerasfeed_keeps_interrupts", False)

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    Raises(ValueError("in __del__"))
    # A KeyboardInterrupt outside the main thread is not a Ctrl-C (SIGINT reaches the main thread only).
    worker = threading.Thread(target=lambda: Raises(KeyboardInterrupt("in a thread")))
    worker.start()
    worker.join()
    assert [t for t, _ in seen] == [ValueError, KeyboardInterrupt], seen


def test_the_hook_is_put_back_when_an_iterator_is_made_after_someone_replaced_it(monkeypatch):
    import numpy as np

    import kerasfeed

    class Items:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full(2, i, np.float32)

    ds = kerasfeed.to_dataset(Items())
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    it = iter(ds)
    assert getattr(sys.unraisablehook, "_kerasfeed_keeps_interrupts", False)
    assert [int(x[0]) for x in it] == [0, 1, 2, 3]


_BETWEEN_WAITS = """
import json, os, signal, sys, threading
from kerasfeed.execution import interrupts
from kerasfeed.execution.waits import WaitScope

assert interrupts.install_interrupts()
scope = WaitScope()
ended = []

def wait_once():
    wait = scope.begin()  # begun after the SIGINT below
    try:
        wait.check("Source[3]")
        ended.append(False)
    except KeyboardInterrupt:
        ended.append(True)

def in_a_thread():  # as a tf.data thread does
    t = threading.Thread(target=wait_once)
    t.start()
    t.join()

# What Python's C-level handler does on a SIGINT while the main thread is blocked inside
# TensorFlow (no wait in progress): the signal number in the wakeup pipe, the Python handler not run yet.
os.write(interrupts.sigints._write_fd, bytes([signal.SIGINT]))
in_a_thread()
in_a_thread()  # still not handled: ends a later wait too
try:
    signal.raise_signal(signal.SIGINT)  # the main thread handles it (a caught Ctrl-C)
    caught = False
except KeyboardInterrupt:
    caught = True
in_a_thread()  # handled: a later wait waits as usual
print(json.dumps({"ended": ended, "caught": caught}))
"""


def test_a_ctrl_c_the_main_thread_has_not_handled_ends_a_wait_begun_after_it():
    """A SIGINT that came while no wait was in progress, with the main thread
    blocked in C, ends the next wait (the item it waits for may never come);
    once the main thread handled it, later waits wait as usual (NOTE [ A Ctrl-C
    between two waits ])."""
    proc = _python(_BETWEEN_WAITS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"ended": [True, True, False], "caught": True}, got


# A Ctrl-C handled in the TensorShape.__len__ that TensorFlow's C++ calls for `next(it)`'s op (which
# clears what that call raises), on the 20th item of an endless dataset.
_IN_OP_ATTRIBUTES = """
import signal, sys
import numpy as np
import kerasfeed

class Endless:
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        return np.full(4, i, "float32")

class SigintOnLen(tuple):  # the dims of the iterator's output shape
    armed = False

    def __len__(self):
        if SigintOnLen.armed:
            SigintOnLen.armed = False
            signal.raise_signal(signal.SIGINT)  # handled right after this call: inside TensorShape.__len__
        return super().__len__()

executor = sys.argv[1]
ds = kerasfeed.to_dataset(Endless(), executor=executor, **({"workers": 2} if executor == "processes" else {}))
it = iter(ds)
shape = it._flat_output_shapes[0]
shape._dims = SigintOnLen(shape._dims)
for n in range(2000):
    if n == 20:
        SigintOnLen.armed = True
    next(it)
print("not interrupted", flush=True)
"""


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_ctrl_c_handled_inside_an_ops_attributes_is_not_cleared_by_tensorflow(executor):
    """TensorFlow's C++ fast path for ``next(it)`` calls ``TensorShape.__len__`` and clears
    what it raises: a Ctrl-C handled there was lost, and the loop read on (NOTE [ A Ctrl-C
    inside an op's attributes ]). It is raised as the op returns."""
    proc = _python(_IN_OP_ATTRIBUTES, executor)
    assert "not interrupted" not in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr[-3000:])
    assert "KeyboardInterrupt" in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


# A Ctrl-C handled inside an inner tf.device scope's __enter__, after it set the device and before it
# recorded that on its stack (as 1 of 116 SIGINTs mid-fit in the soak).
_IN_SCOPE_ENTER = """
import signal
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
import kerasfeed

next(iter(kerasfeed.to_dataset(np.arange(8.0), batch_size=2)))  # an iterator: kerasfeed's SIGINT handler
assert signal.getsignal(signal.SIGINT).__module__ == "kerasfeed.execution.interrupts"
set_device, armed = context.Context._set_device, [False]

def sigint_after_setting(self, *args):
    set_device(self, *args)
    if armed[0]:
        armed[0] = False
        signal.raise_signal(signal.SIGINT)  # handled right after this call, inside __enter__

context.Context._set_device = sigint_after_setting
try:
    with tf.device("/cpu:0"):
        armed[0] = True
        with tf.device("/cpu:0"):
            tf.constant(1.0)
        print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def test_a_ctrl_c_handled_inside_a_tensorflow_scopes_enter_is_raised_after_it():
    """NOTE [ A Ctrl-C inside a TensorFlow scope's enter or exit ]: raised inside the inner scope's
    ``__enter__``, the interrupt left the device set and unrecorded, and the outer scope's ``__exit__``
    raised "Exiting device scope without proper scope nesting" instead of it."""
    proc = _python(_IN_SCOPE_ENTER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["KeyboardInterrupt"], (proc.stdout, proc.stderr[-3000:])


def test_a_ctrl_c_dropped_in_a_gc_callback_during_fit_still_stops_fit():
    """The hang measured by ``benchmarks/ctrl_c.py``: a SIGINT handled inside a gc
    callback (JAX's) while ``fit`` runs over worker processes; before, fit trained on."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "gc-callback"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"fit went on after the dropped Ctrl-C (killed after {HARD_TIMEOUT_S} s): {err[-2000:]}")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {"training": True} in lines, (out, err[-3000:])
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err[-3000:]
    assert "fit returned" not in out


# A Ctrl-C taken inside fit without a trace, as C code that clears errors does (TensorFlow's
# graph optimiser once in 200 soak runs): here a callback's except clause. Then a second fit.
_TAKEN_IN_FIT = """
import json, os, signal, sys, time
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import keras
import kerasfeed

class Items(kerasfeed.SceneSequence):
    def __len__(self):
        return 20
    def __getitem__(self, i):
        return np.full((4, 3), i, "float32"), np.zeros((4, 1), "float32")

taken, begun_after = [], []

class TakesIt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if taken:
            begun_after.append(batch)
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and not taken:
            try:
                signal.raise_signal(signal.SIGINT)  # the handler runs right after this call, in this frame
                time.sleep(0.01)
            except KeyboardInterrupt:
                taken.append(batch)

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
ds = kerasfeed.to_dataset(Items(), executor="threads")
try:
    model.fit(ds, epochs=4, verbose=0, callbacks=[TakesIt()])
    print(json.dumps({"fit returned": True}))
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True, "taken": taken, "begun_after": begun_after,
                      "profile": repr(sys.getprofile())}), flush=True)
history = model.fit(ds, epochs=1, verbose=0)  # no watch left behind: the next fit trains whole
print(json.dumps({"second fit": len(history.history["loss"])}))
"""


def test_a_ctrl_c_taken_inside_fit_is_raised_again_when_fit_trains_on():
    """NOTE [ A Ctrl-C taken inside fit ]: a KeyboardInterrupt taken inside ``fit``
    (by C code that clears errors, here a callback's except clause) is raised again
    as soon as that fit begins another batch; before, fit trained its 4 epochs.
    Nothing stays watched: the next fit trains whole."""
    proc = _python(_TAKEN_IN_FIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"interrupted": True, "taken": [3], "begun_after": [], "profile": "None"}, lines
    assert lines[1] == {"second fit": 1}, lines
    assert "model.fit went on after Ctrl-C" in proc.stderr, proc.stderr[-3000:]


# Keras' own fit(seq) under TensorFlow (workers=1): tf.data's prefetch thread runs Keras' generator, here
# inside a slow item (GIL released) when the exit begins; the Ctrl-C to the group comes from a callback.
_KERAS_OWN_FIT = """
import atexit, os, signal, sys, threading, time
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import keras
import kerasfeed

exiting = threading.Event()

class Items(kerasfeed.SceneSequence):
    def __len__(self):
        return 20
    def __getitem__(self, i):
        if i >= 4:  # Keras' prefetch thread waits here until the exit begins (5 s at most: Keras shuffles), then sleeps
            exiting.wait(5)
            time.sleep(2)
        return np.full((2, 3), i, "float32"), np.zeros((2, 1), "float32")

class CtrlC(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            atexit.register(exiting.set)  # after kerasfeed's (the epoch's begin): runs before it
            print("ctrl-c", flush=True)
            os.killpg(os.getpgrp(), signal.SIGINT)  # as a terminal's Ctrl-C
            time.sleep(5)
            print("not interrupted", flush=True)

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(Items(), epochs=1, verbose=0, callbacks=[CtrlC()])
"""


def test_a_ctrl_c_in_keras_own_fit_of_a_scene_sequence_ends_the_exit():
    """NOTE [ Keras' own iterators at exit ]: Keras' ``model.fit(seq)`` under TensorFlow reads the sequence on
    tf.data's prefetch thread; after the KeyboardInterrupt the interpreter's exit destroyed that iterator after
    Python had stopped running other threads, and waited for ever for the prefetch thread's Python call (every
    run here; 4 of 20 interrupted runs of a plain training script). kerasfeed's exit hook retires it first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", _KERAS_OWN_FIT], stdout=out, stderr=err, text=True, env=env,
                                start_new_session=True)
        began, sigint = time.monotonic(), None
        while proc.poll() is None:
            time.sleep(0.1)
            if sigint is None and b"ctrl-c" in os.pread(out.fileno(), 1 << 16, 0):
                sigint = time.monotonic()
            if time.monotonic() - (sigint or began) > (30 if sigint else HARD_TIMEOUT_S):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode != -signal.SIGKILL, f"the exit hung after the KeyboardInterrupt: {stdout!r} {stderr[-2000:]}"
    assert stdout.split() == ["ctrl-c"], (stdout, stderr[-3000:])
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr, (proc.returncode, stderr[-3000:])


@pytest.mark.parametrize("stage, delay", [("start", 1.5), ("workers", 0.3), ("training", 0.4)])
def test_sigint_to_the_process_group_of_a_training_script_ends_it_and_its_workers(stage, delay):
    """SIGINT to the group (as a terminal's Ctrl-C) while the script starts, while
    ``fit`` begins, and mid-training: the script ends by KeyboardInterrupt and no
    process of its group is left, within 20 s (during start-up, after TensorFlow's import: a Ctrl-C
    in it is held until it ends, ``HELD_IMPORT_S``). ``make soak-ctrl-c`` draws the
    moment at random, hundreds of times beside CPU burners."""
    got = run_once(stage, delay)
    assert got["exit_s"] is not None, f"still running {got['limit_s']} s after the SIGINT: {got.get('left')}; {got['stderr'][-2000:]}"
    if not got["interrupted"] and _crashed_inside_tensorflow(got):
        # TensorFlow's own code, interrupted, crashed the script (its workers still ended, as asserted above):
        # once in several hundred SIGINTs (a SIGSEGV in convert_to_tensor, CI 2026-11-28). Not kerasfeed's to
        # fix; the soak (make soak-ctrl-c) counts them. A second run must end by KeyboardInterrupt.
        warnings.warn(f"the first run crashed inside TensorFlow (rc {got['returncode']}): {got['last_error']}")
        got = run_once(stage, delay)
        assert got["exit_s"] is not None, f"still running {got['limit_s']} s after the SIGINT: {got.get('left')}"
    assert not got["ended_early"] and got["interrupted"], (got["returncode"], got["stderr"][-3000:])
    assert stage in got["seen"], got["seen"]


def _crashed_inside_tensorflow(got: dict) -> bool:
    """Killed by a signal other than SIGINT, faulthandler's stack of the crashing thread in TensorFlow."""
    if got["returncode"] >= 0 or got["returncode"] == -signal.SIGINT:
        return False
    crash = got["stderr"].split("Fatal Python error", 1)[-1]
    current = crash.split("Current thread", 1)[-1].split("\n\n", 1)[0]
    return "tensorflow" in current


def test_a_ctrl_c_during_close_still_stops_every_worker(monkeypatch):
    """Ctrl-C inside close() after the first worker was asked to stop left the others running for good, and a
    second close() did nothing (helper, 3 of 30 with real SIGINTs). The shutdown now finishes, then raises."""
    import numpy as np

    import kerasfeed
    from kerasfeed.execution.processes.process import WorkerProcess

    asked, ask = [], WorkerProcess.ask_to_stop

    def interrupted_once(self):
        asked.append(self.pid)
        ask(self)
        if len(asked) == 1:
            raise KeyboardInterrupt  # as a Ctrl-C between the first lane and the next

    monkeypatch.setattr(WorkerProcess, "ask_to_stop", interrupted_once)
    loader = kerasfeed.to_loader(np.arange(400.0).reshape(40, 10), batch_size=8, executor="processes", workers=2)
    list(loader)
    procs = [lane.process.proc for lane in loader._pipeline.executor._dispatcher.lanes.every()]
    assert len(procs) == 2
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert all(p.poll() is not None for p in procs), [p.poll() for p in procs]  # every worker ended and reaped
