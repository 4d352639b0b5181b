"""Bad setups and arguments get a message naming what was wrong and the remedy, not a dependency's bare error:
Keras on its default TensorFlow backend without TensorFlow, profile's chart without matplotlib, to_loader on
an infinite source, BackupAndRestore's argument types. The first two run in the environment without
TensorFlow (and without matplotlib), as tests/backends/test_backends.py does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _util import ROOT, notf_python

import kerasfeed

# Run in the no-TensorFlow environment: prints one JSON object of what each call raised.
NO_TENSORFLOW_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kerasfeed

    out = {"imported": sorted(m for m in sys.modules if m.split(".")[0] in ("keras", "tensorflow"))}

    def error(call):
        try:
            call()
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None

    out["to_loader"] = error(lambda: kerasfeed.to_loader([np.zeros(2)] * 3))
    for name in ("SceneSequence", "H5SliceSequence", "BackupAndRestore", "to_dataset", "from_generators"):
        out[name] = error(lambda: getattr(kerasfeed, name))
    print(json.dumps(out))
""")

PROFILE_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import kerasfeed

    out = {}
    for chart in ("x.png", 5):
        try:
            kerasfeed.profile([np.zeros(2)] * 3, items=2, chart=chart)
        except Exception as e:
            out[repr(chart)] = [type(e).__name__, str(e)]
    print(json.dumps(out))
""")


def _run_without_tensorflow(script: str, tmp_path, **env_extra) -> dict:
    python = notf_python("This message test")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    # A fresh KERAS_HOME: no keras.json of this machine's choosing another backend.
    env.update(PYTHONPATH=str(ROOT), KERAS_HOME=str(tmp_path / "keras_home"), **env_extra)
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env, timeout=240, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"the script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("keras_backend", [None, "tensorflow"])
def test_keras_on_tensorflow_without_tensorflow_says_to_set_the_backend(keras_backend, tmp_path):
    env = {} if keras_backend is None else {"KERAS_BACKEND": keras_backend}
    out = _run_without_tensorflow(NO_TENSORFLOW_SCRIPT, tmp_path, **env)
    assert out["imported"] == [], "import kerasfeed alone imported keras or tensorflow"
    why = "KERAS_BACKEND is unset" if keras_backend is None else "KERAS_BACKEND='tensorflow'"
    for name in ("to_loader", "SceneSequence", "H5SliceSequence", "BackupAndRestore"):
        kind, message = out[name]
        assert kind == "ModuleNotFoundError", (name, out[name])
        assert message.startswith(f"kerasfeed.{name}: Keras' backend is 'tensorflow' ({why}"), (name, message)
        assert "but TensorFlow is not installed. Set KERAS_BACKEND=jax or KERAS_BACKEND=torch" in message, message
        assert "pip install 'kerasfeed[tensorflow]'" in message, message
        assert message.endswith("Received: No module named 'tensorflow'"), message
    # to_dataset needs TensorFlow on every backend: its message stays the one that says so.
    kind, message = out["to_dataset"]
    assert kind == "ModuleNotFoundError" and message.startswith("kerasfeed.to_dataset needs TensorFlow"), message
    # A stream has no to_loader: it said "kerasfeed.to_loader feeds model.fit without TensorFlow" (a helper).
    kind, message = out["from_generators"]
    assert message.startswith("kerasfeed.from_generators needs TensorFlow") and "Streams are tf.data" in message


def test_profile_chart_without_matplotlib_checks_the_type_then_names_the_package(tmp_path):
    out = _run_without_tensorflow(PROFILE_SCRIPT, tmp_path, KERAS_BACKEND="jax")
    assert out["5"] == ["TypeError", "profile: `chart` must be a file path (or None). Received: chart=5"]
    kind, message = out["'x.png'"]
    assert kind == "ModuleNotFoundError", out
    assert message == ("profile: `chart` needs matplotlib, which is not installed: pip install matplotlib (or "
                       "'kerasfeed[dev]', which has it), or pass chart=None for the report alone. "
                       "Received: chart='x.png'")


def test_profile_report_plot_without_matplotlib_names_the_package(monkeypatch):
    report = kerasfeed.profile([np.zeros(2, "float32")] * 4, items=2, threads=[1], workers=[])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"^ProfileReport\.plot needs matplotlib, which is not installed: "
                       r"pip install matplotlib \(or 'kerasfeed\[dev\]', which has it\)\. Received: path='c\.png'$"):
        report.plot("c.png")


class Infinite:
    """A Keras 3 source of no length: ``num_batches`` is None."""

    @property
    def num_batches(self):
        return None

    def __getitem__(self, i):
        return np.full((2,), i, "float32")


def test_to_loader_on_an_infinite_source_points_at_to_dataset():
    with pytest.raises(ValueError, match=r"^to_loader needs a finite source: .*but Infinite\.num_batches is None "
                       r"\(an infinite source\)\. Give the source a length, or use kerasfeed\.to_dataset "
                       r"\(TensorFlow\), which takes infinite sources .*Received: .* of type Infinite$"):
        kerasfeed.to_loader(Infinite())


@pytest.mark.skipif(os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow", reason="to_dataset: TensorFlow")
def test_to_dataset_takes_the_infinite_source_to_loader_points_at():
    # What the to_loader message promises holds.
    import tensorflow as tf

    ds = kerasfeed.to_dataset(Infinite())
    assert ds.cardinality() == tf.data.INFINITE_CARDINALITY
    assert [float(x[0]) for x in ds.take(3)] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("bad", [5, 2.5, b"run/backup", ["run"]])
def test_backup_dir_of_a_wrong_type_names_the_type(bad):
    received = re.escape(f"Received: backup_dir={bad!r} of type {type(bad).__name__}")
    with pytest.raises(TypeError, match=rf"^BackupAndRestore: `backup_dir` must be a non-empty path \(a str or "
                       rf"os\.PathLike\)\. {received}$"):
        kerasfeed.BackupAndRestore(bad)


@pytest.mark.parametrize("empty", [None, ""])
def test_an_empty_backup_dir_keeps_keras_own_value_error(empty):
    # Keras' own BackupAndRestore tests check this text and type for None (tests/keras_upstream).
    with pytest.raises(ValueError, match=r"Empty `backup_dir` argument passed"):
        kerasfeed.BackupAndRestore(empty)


@pytest.mark.parametrize("name", ["double_checkpoint", "delete_checkpoint"])
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_backup_flags_must_be_bools(name, bad):
    with pytest.raises(TypeError, match=rf"^BackupAndRestore: `{name}` must be True or False\. "
                       rf"{re.escape(f'Received: {name}={bad!r}')}$"):
        kerasfeed.BackupAndRestore("run/backup", **{name: bad})


def test_backup_arguments_that_were_accepted_still_are(tmp_path):
    cbk = kerasfeed.BackupAndRestore(tmp_path / "backup", double_checkpoint=np.bool_(True), delete_checkpoint=False)
    assert cbk.backup_dir == str(tmp_path / "backup") and cbk.double_checkpoint is True
    assert cbk.delete_checkpoint is False
    with pytest.raises(ValueError, match=r"Empty `backup_dir` argument passed.*Received: backup_dir=''"):
        kerasfeed.BackupAndRestore("")  # Keras' own text and type


@pytest.mark.parametrize("dtype", ["datetime64[D]", "timedelta64[s]", "V4", [("a", "f4"), ("b", "i4")], "float128",
                                   "complex256"])
def test_to_loader_refuses_the_dtypes_to_dataset_refuses(dtype):
    """Under the TensorFlow backend Keras reads a loader through tf.data: a dtype it has no type for
    passed to_loader (a JAX loop trained) and failed only in a TF fit."""

    class Odd(kerasfeed.SceneSequence):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.zeros(2, dtype), np.float32(i)

    with pytest.raises(kerasfeed.SignatureError, match=r"Item 0, field x: Unsupported dtype .*to_loader takes"):
        kerasfeed.to_loader(Odd(), batch_size=2)
    with pytest.raises(kerasfeed.SignatureError, match=r"Item 0, field x: Unsupported dtype"):
        kerasfeed.to_dataset(Odd(), batch_size=2)


CLOSED_LOADER_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import keras
    import kerasfeed

    class Src(kerasfeed.SceneSequence):
        def __len__(self):
            return 4

        def load(self, i):
            return np.full((4, 3), i, "float32"), np.full((4, 1), i, "float32")

    out = {}
    for cache in (None, "memory"):
        loader = kerasfeed.to_loader(Src(), shuffle=True, seed=0, executor="threads", cache=cache)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(loader, epochs=1, verbose=0)
        trained = [w.tolist() for w in model.get_weights()]
        loader.close()
        try:
            model.fit(loader, epochs=1, verbose=0)
            error = None
        except Exception as e:
            error = [type(e).__name__, str(e)]
        out[str(cache)] = {"error": error, "kept": [w.tolist() for w in model.get_weights()] == trained}
    print(json.dumps(out))
""")


def test_fit_on_a_closed_loader_under_jax_is_refused_before_the_model_loses_its_weights(tmp_path):
    # Keras' JAX trainer moves the model's variables into its step state at the first step: the closed
    # loader's error came at that first batch, and the model was left without its weights (helper, 3 of 3).
    out = _run_without_tensorflow(CLOSED_LOADER_SCRIPT, tmp_path, KERAS_BACKEND="jax")
    for cache, got in out.items():
        assert got["error"] and got["error"][0] == "RuntimeError", (cache, got)
        assert "this loader was closed" in got["error"][1] and "make the loader again" in got["error"][1], got
        assert got["kept"], (cache, "the model lost its trained weights")
