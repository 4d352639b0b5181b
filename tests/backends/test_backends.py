"""kerasfeed.to_loader under every Keras 3 backend, each in its own process.

``scenario.py`` does the work (fit/evaluate/predict, batch parity with the
to_dataset batches saved here, shuffle per epoch, exact resume, an error in
``__getitem__``); these tests run it under each backend. The JAX run uses a
virtualenv without TensorFlow (``make test`` builds ``.venv-notf``); the
PyTorch run blocks any TensorFlow import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _util import notf_python

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIO = HERE / "scenario.py"
# fit/evaluate arguments Keras would drop beside a loader, refused on every backend.
REFUSED = ["fit:y", "fit:sample_weight", "fit:class_weight", "evaluate:y"]


def _notf_python() -> str:
    return notf_python("The JAX backend test")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The batches to_dataset yields (TensorFlow), saved as arrays."""
    spec = importlib.util.spec_from_file_location("kerasfeed_backend_scenario", SCENARIO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path_factory.mktemp("backends") / "reference.npz"
    module.write_reference(path)
    return path


def _run(python: str, backend: str, reference: Path, tmp_path: Path, **env_extra) -> dict:
    result = tmp_path / f"{backend}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    env.update(KERAS_BACKEND=backend, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", **env_extra)
    proc = subprocess.run(
        [python, str(SCENARIO), str(reference), str(result)], check=False, capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, f"{backend} scenario failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = json.loads(result.read_text())
    _check_scalars(out.pop("scalars"))
    return out


def _check_scalars(written: dict) -> None:
    """What InputStats and WorkerSummaries wrote during the scenario's fit (2 epochs of 8 steps), read as
    TensorBoard reads it: tbparse over the event files, whichever writer made them."""
    from tbparse import SummaryReader

    log_dir = Path(written["log_dir"])
    frame = SummaryReader(str(log_dir / "input"), pivot=False).tensors
    steps = sorted(set(frame[frame["tag"] == "input/wait_ms_p95"]["step"]))
    assert steps == list(range(2, 17, 2)), steps  # every 2 steps (and at each epoch's end, steps 8 and 16)
    assert {"input/items_per_s", "input/wait_ms_per_step", "input/ready_fraction", "input/errors"} <= set(frame["tag"])
    worker = SummaryReader(str(log_dir / "worker_0"), pivot=False).tensors
    loss = worker[worker["tag"] == "epoch/loss"].sort_values("step")
    assert list(loss["step"]) == [0, 1], loss
    assert np.allclose(loss["value"], written["loss"], rtol=1e-6), (list(loss["value"]), written["loss"])
    assert sorted(set(worker[worker["tag"] == "batch/loss"]["step"])) == list(range(2, 17, 2))
    assert list(worker[worker["tag"] == "input/batches"]["value"]) == [8.0, 8.0]


def test_jax_without_tensorflow(reference, tmp_path):
    """JAX in an environment without TensorFlow: fit/evaluate/predict through
    to_loader on worker processes train on exactly the to_dataset batches,
    epoch k reads pass k, resume is exact, item errors name the index."""
    python = _notf_python()
    probe = subprocess.run([python, "-c", "import tensorflow"], check=False, capture_output=True, text=True)
    assert probe.returncode != 0, "the no-TensorFlow environment has TensorFlow installed"
    out = _run(python, "jax", reference, tmp_path)
    assert out == {"backend": "jax", "passes_begun": [0, 1, 2, 3], "error_type": "ItemError",
                   "to_dataset_error": "names the extra", "tensorflow_imported": False, "refused": REFUSED}


def test_torch(reference, tmp_path):
    """The same under PyTorch, with every TensorFlow import failing."""
    out = _run(sys.executable, "torch", reference, tmp_path, KERASFEED_BLOCK_TENSORFLOW="1")
    assert out == {"backend": "torch", "passes_begun": [0, 1, 2, 3], "error_type": "ItemError",
                   "to_dataset_error": "names the extra", "tensorflow_imported": False, "refused": REFUSED}


def test_tensorflow(reference, tmp_path):
    """The same under TensorFlow: the loader hands fit a to_dataset pipeline."""
    out = _run(sys.executable, "tensorflow", reference, tmp_path)
    assert out["backend"] == "tensorflow" and out["passes_begun"] == [0, 1, 2, 3] and "to_dataset_error" not in out
    assert out["refused"] == REFUSED
