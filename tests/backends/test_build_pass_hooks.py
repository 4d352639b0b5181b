"""Keras' JAX and torch trainers build the model from a batch of a throwaway iterator; with passes
the read-ahead loads whole during that build, the pass's end hook waits for the fit's own begin of it
(NOTE [ A model build's pass ends later ], loading/pipeline.py). The checks run in one process per backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_HOOKED = """
import json
import keras, numpy as np
import kerasfeed

class Hooked(kerasfeed.SceneSequence):
    def __init__(self, batches=4):
        super().__init__()
        self.batches, self.hooks, self.calls = batches, [], []

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        self.calls.append(self.epoch)  # on threads (worker processes count in their copy)
        return np.full((2, 3), i, "float32"), np.zeros((2, 1), "float32")

    def on_epoch_begin(self):
        self.hooks.append(["begin", self.epoch])

    def on_epoch_end(self):
        self.hooks.append(["end", self.epoch])

class Numbered(kerasfeed.SceneSequence):  # batch i of pass p holds scale * p + i: Rec shows which were read

    def __init__(self, length, rows, scale):
        super().__init__()
        self.length, self.rows, self.scale = length, rows, scale

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return np.full((self.rows, 1), self.scale * self.epoch + i, "float32"), np.zeros((self.rows, 1), "float32")

seen = []  # what Rec saw: the first value of each batch a model ran eagerly on

class Rec(keras.layers.Layer):
    def call(self, x):
        try:
            seen.append(int(keras.ops.convert_to_numpy(x)[0, 0]))
        except Exception:
            pass  # symbolic: the model build's call
        return x

"""


def _run(backend: str, parts: dict[str, str]):
    """Each part's ``got`` (JSON), or its traceback; the parts run one after the other under ``backend`` in one
    process of its own (a backend's import costs seconds; each part's classes stay in ``__main__`` for the
    worker processes)."""
    script = _HOOKED + "_out = {}\n" + "".join(
        f"try:\n{textwrap.indent(source, '    ')}\n    _out[{name!r}] = got\n"
        f"except Exception:\n    import traceback\n    _out[{name!r}] = {{'error': traceback.format_exc()}}\n"
        for name, source in parts.items()) + "print(json.dumps(_out))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    env.update(KERAS_BACKEND=backend, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_SCRIPT = """
got = {}
for front, executor, batches, epochs in [("to_dataset", "threads", 4, 3), ("to_dataset", "processes", 4, 3),
                                         ("to_loader", "processes", 4, 3), ("to_dataset", "threads", 200, 3),
                                         ("to_dataset", "threads", 4, 1), ("to_loader", "threads", 200, 1)]:
    if front == "to_dataset" and keras.backend.backend() == "torch" and executor == "processes":
        continue  # one torch to_dataset run is enough for the time it takes
    seq = Hooked(batches)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(getattr(kerasfeed, front)(seq, executor=executor), epochs=epochs, verbose=0)
    got[f"{front}/{executor}/{batches} batches/{epochs} epochs"] = seq.hooks
"""


def _the_model_build_s_pass_runs_each_epoch_hook_once(got, backend):
    """Passes of 4 batches: the build's iterator read pass 0 whole, its end hook ran, and the fit's
    epoch 0 ran the begin and end hooks of pass 0 again (``on_epoch_end`` twice for pass 0). Now each
    hook runs once per epoch, in order, on both front ends, as with long passes and under TensorFlow; a
    fit of one epoch runs its end hook too."""
    assert len(got) == (6 if backend == "jax" else 5), got
    for run, hooks in got.items():
        epochs = int(run.split("/")[-1].split()[0])
        assert hooks == [[hook, epoch] for epoch in range(epochs) for hook in ("begin", "end")], (run, hooks)


_TAKE_OVER = """
import json
import keras, numpy as np
import kerasfeed

class Counted(kerasfeed.SceneSequence):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        calls.append(i)
        return np.full((100_000, 3), i, "float32"), np.zeros((100_000, 1), "float32")  # 1.6 MB: not grouped

calls = []
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(kerasfeed.to_dataset(Counted(), executor="threads"), epochs=1, verbose=0)
got = sorted(calls)
"""


def _the_fit_takes_over_what_the_model_build_made(got, backend):
    """The build's throwaway iterator begins pass 0 and the threads make a window of it ahead; the fit's
    own iterator begins pass 0 again and takes those items over (NOTE [ A pass begun again keeps what was
    made ]). 170 calls for 100 batches before (the window made twice); now each item once, but the probe's
    (4) and what the build's iterator took."""
    assert set(got) == set(range(100)) and len(got) <= 110, (len(got), got)


_EVALUATE = """
got = {}
for executor, fit_first in [("threads", False), ("processes", False), ("threads", True)]:
    seq = Hooked(4)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = kerasfeed.to_dataset(seq, executor=executor)
    if fit_first:
        model.fit(data, epochs=1, verbose=0)
    model.evaluate(data, verbose=0)
    model.evaluate(data, verbose=0)
    got[f"{executor}{', fit first' if fit_first else ''}"] = [seq.hooks, sorted(set(seq.calls))]
"""


def _an_evaluation_that_builds_the_model_reads_one_pass(got, backend):
    """``evaluate`` of a model just compiled builds it from a throwaway iterator (NOTE [ An evaluation's model
    build ], kerasfeed/_keras_build.py). Two evaluations read passes 0 and 1, each hook once, as under
    TensorFlow; they read passes 0, 1 and 2 before (pass 0 for the build alone, its hooks run). After a
    fit (the model built), the evaluations read the passes after the fit's."""
    passes = {"threads": [0, 1], "processes": [0, 1], "threads, fit first": [0, 1, 2]}
    for run, (hooks, read) in got.items():
        assert hooks == [[hook, p] for p in passes[run] for hook in ("begin", "end")], (run, hooks)
        if run.startswith("threads"):
            assert read == passes[run], (run, read)


_RESUMED = """
import json
import keras, numpy as np
import kerasfeed

def model(width=1):
    m = keras.Sequential([keras.Input((width,)), Rec(), keras.layers.Dense(1)])
    m.compile("sgd", "mse", run_eagerly=True)
    return m

got = {}
model().fit(kerasfeed.to_dataset(Numbered(3, 4, 10), initial_state={"epoch": 1, "batches": 1}), initial_epoch=1,
            epochs=3, verbose=0)
got["resumed fit"], seen[:] = list(seen), []
ds = kerasfeed.to_dataset(Numbered(3, 4, 10))
try:
    model(5).evaluate(ds, verbose=0)  # fails in its build, after the build's iterator began a pass
except Exception:
    pass
seen.clear()
model().evaluate(ds, verbose=0)
got["evaluate after a failed one"] = list(seen)
"""


def _a_resumed_fit_and_an_evaluation_after_a_failed_build_read_the_right_pass(got, backend):
    """A dataset made with ``initial_state`` does not follow the fit's frame, and its fit's model build read the
    resumed pass: the loop trained on the next one ([20, 21, 22], where TensorFlow trains on [11, 12]). An
    evaluation whose build failed left its pass begun: the next evaluation read pass 1. Items are
    ``10 * pass + index``; the same as under TensorFlow now (a helper's report)."""
    assert got == {"resumed fit": [11, 12, 20, 21, 22], "evaluate after a failed one": [0, 1, 2]}, got


_STOPPED = """
import json
import keras, numpy as np
import kerasfeed

class Stop(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            self.model.stop_training = True

got = {}
for at in (0, 1):
    loader = kerasfeed.to_loader(Numbered(6, 2, 100), executor="threads")
    model = keras.Sequential([keras.Input((1,)), Rec(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    model.fit(loader, epochs=2, verbose=0, callbacks=[Stop(at)])
    seen.clear()
    model.evaluate(loader, verbose=0)
    got[f"stopped after batch {at}"] = list(seen)
    loader.close()
"""


def _an_evaluation_after_a_fit_stopped_early_reads_the_next_pass(got, backend):
    """A fit stopped after a batch or two left its pass as a model build leaves one: the evaluation's epoch
    iterator reset (after its build, the model built already) handed it over, and the evaluation read pass 0
    again (its first batches replayed), where TensorFlow reads pass 1 (a helper's report)."""
    want = [100 + i for i in range(6)]
    assert got == {"stopped after batch 0": want, "stopped after batch 1": want}, got


_STREAMS = """
rows = []  # the first column of every batch a model ran eagerly on

class Rows(keras.layers.Layer):
    def call(self, x):
        try:
            rows.append(keras.ops.convert_to_numpy(x)[:, 0].astype(int).tolist())
        except Exception:
            pass  # symbolic: the model build's call
        return x

def producer(put):  # 3 epochs of 8 items: epoch e's items are 10 * e + k
    for e in range(3):
        for k in range(8):
            put((np.array([10 * e + k], np.float32), np.float32(0)))
        put(kerasfeed.END_OF_EPOCH)

def shard(i):
    for k in range(4):
        yield np.array([10 * i + k], np.float32), np.float32(0)

def read(path):
    return [(np.array([int(path)], np.float32), np.float32(0))] * 4

def trained(make, how, epochs=3):
    rows.clear()
    inp = keras.Input((1,))
    model = keras.Model(inp, keras.layers.Dense(1)(Rows()(inp)))
    model.compile("sgd", "mse", run_eagerly=True)
    if how == "fit":
        model.fit(make(), epochs=epochs, verbose=0, shuffle=False)
    else:
        model.evaluate(make(), verbose=0)
    return [v for batch in rows for v in batch]

def passes(make, count):
    ds = make()
    return [[int(v) for x, _ in ds for v in x.numpy()[:, 0]] for _ in range(count)]

queue = lambda: kerasfeed.from_queue(producer, batch_size=4, items_per_epoch=8)
gens = lambda: kerasfeed.from_generators(shard, 3, batch_size=4, executor="processes", workers=2)
files = lambda: kerasfeed.from_files([str(i) for i in range(6)], read, batch_size=24, shuffle_files=True, seed=0)
def failing_queue():  # epoch 0 holds an error after its first batch: the build's read-ahead met it
    import queue as queue_module
    q = queue_module.Queue(maxsize=16)
    for i in range(2):
        q.put((np.array([i], np.float32), np.float32(0)))
    q.put(ValueError("bad item in epoch 0"))
    for i in (3, 4, 5, kerasfeed.END_OF_EPOCH, 100, 101, 102, 103, kerasfeed.END_OF_EPOCH):
        q.put(i if i is kerasfeed.END_OF_EPOCH else (np.array([i], np.float32), np.float32(0)))
    return kerasfeed.from_queue(q, batch_size=2, timeout=5)

try:
    trained(failing_queue, "fit", epochs=1)
    queue_error = "no error, trained " + str(rows)
except Exception as e:
    queue_error = "bad item in epoch 0" in str(e)
def predicted(make):
    model = keras.Sequential([keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])  # unbuilt
    ds = make()
    return [model.predict(ds, verbose=0)[:, 0].astype(int).tolist() for _ in range(2)]

class Passes(kerasfeed.SceneSequence):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return np.full((2, 1), 10 * self.epoch + i, np.float32)

got = {"predict queue": predicted(lambda: kerasfeed.from_queue(lambda put: [put(x) for e in range(3) for x in [
           *(np.array([10 * e + k], np.float32) for k in range(5)), kerasfeed.END_OF_EPOCH]], batch_size=2)),
       "predict dataset": predicted(lambda: kerasfeed.to_dataset(Passes())),
       "queue error": queue_error, "queue fit": trained(queue, "fit"), "queue evaluate": trained(queue, "evaluate"),
       "generators fit": trained(gens, "fit"), "generators passes": passes(gens, 3),
       "files fit": trained(files, "fit"), "files passes": passes(files, 3)}
"""


def _a_fit_on_a_stream_reads_its_first_pass_first(got, backend):
    """A stream's model build began a pass that counted: from_queue's fit lost the producer's first epoch and
    failed at its last ("epoch 3 has no data"); from_generators/from_files trained pass k + 1 in epoch k, so
    the same seed gave other orders than on TensorFlow (helper, 4 of 4)."""
    # JAX's predict builds from a throwaway iterator of its own: the queue's first epoch was lost, and a
    # to_dataset's predictions were of pass 1 (helper).
    assert got["predict queue"] == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]], got["predict queue"]
    assert got["predict dataset"] == [[0, 0, 1, 1, 2, 2], [10, 10, 11, 11, 12, 12]], got["predict dataset"]
    assert got["queue error"] is True, got["queue error"]  # was dropped with the rest of epoch 0, silently
    assert got["queue fit"] == list(range(8)) + list(range(10, 18)) + list(range(20, 28))
    assert got["queue evaluate"] == list(range(8))
    assert got["generators fit"] == [v for p in got["generators passes"] for v in p]
    assert sorted(got["generators passes"][0]) == sorted(10 * i + k for i in range(3) for k in range(4))
    assert got["files fit"] == [v for p in got["files passes"] for v in p]


_STEPS = """
got = {}
for front in ("to_dataset", "to_loader"):
    seq = Numbered(4, 2, 100)
    model = keras.Sequential([keras.Input((1,)), Rec(), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    seen.clear()
    model.fit(getattr(kerasfeed, front)(seq), epochs=3, steps_per_epoch=3, verbose=0, shuffle=False)
    got[front] = list(seen)
"""


def _epochs_that_are_not_passes_read_pass_0_first(got, backend):
    """steps_per_epoch=3 over passes of 4 batches: the passes are read on across epochs. to_dataset's model
    build began pass 0 and the fit's loop pass 1 (a helper found it under a MirroredStrategy, whose TensorFlow
    fit peeks too); to_loader hands the build's pass over."""
    want = [0, 1, 2, 3, 100, 101, 102]  # epoch 1 ends with pass 0 (Keras stops an epoch where its data ends)
    assert got == {"to_dataset": want, "to_loader": want}, json.dumps(got)


_CHECKS = {"hooks": (_SCRIPT, _the_model_build_s_pass_runs_each_epoch_hook_once),
           "take over": (_TAKE_OVER, _the_fit_takes_over_what_the_model_build_made),
           "evaluate": (_EVALUATE, _an_evaluation_that_builds_the_model_reads_one_pass),
           "resumed": (_RESUMED, _a_resumed_fit_and_an_evaluation_after_a_failed_build_read_the_right_pass),
           "stopped": (_STOPPED, _an_evaluation_after_a_fit_stopped_early_reads_the_next_pass),
           "streams": (_STREAMS, _a_fit_on_a_stream_reads_its_first_pass_first),
           "steps": (_STEPS, _epochs_that_are_not_passes_read_pass_0_first)}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_the_model_build_s_pass_under_jax_and_torch(backend):
    """The checks above, in one process per backend; each check's failure is reported by name."""
    got = _run(backend, {name: script for name, (script, _) in _CHECKS.items()})
    failed = []
    for name, (_, check) in _CHECKS.items():
        if isinstance(got[name], dict) and "error" in got[name]:
            failed.append(f"{name} raised:\n{got[name]['error']}")
            continue
        try:
            check(got[name], backend)
        except AssertionError as e:
            failed.append(f"{name} ({check.__name__}): {e}")
    assert not failed, "\n\n".join(failed)
