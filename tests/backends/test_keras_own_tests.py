"""Keras' own BackupAndRestore tests (vendored in tests/keras_upstream/, only the class under test
changed to kerasfeed.BackupAndRestore) under each backend, each in its own pytest process.

The suite's own process runs them under TensorFlow (they are collected there too); here JAX and
PyTorch, whose trainers kerasfeed reads apart (their ``fit`` frames and epoch iterators), and the
oldest Keras setup.cfg accepts under TensorFlow and PyTorch (its JAX backend does not run on today's
JAX; ``make keras-matrix`` gives it an older one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _util import OLDEST_KERAS, oldest_keras_path

REPO = Path(__file__).resolve().parents[2]
VENDORED = REPO / "tests" / "keras_upstream" / "backup_and_restore_test.py"
KERAS_TESTS = 7  # the tests in Keras 3.15.1's backup_and_restore_test.py


@pytest.mark.parametrize("backend,keras", [("jax", "installed"), ("torch", "installed"),
                                           ("tensorflow", OLDEST_KERAS), ("torch", OLDEST_KERAS)])
def test_keras_own_backup_and_restore_tests_pass_against_kerasfeeds(backend, keras, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH", "PYTEST_"))}
    path = [str(REPO)] if keras == "installed" else [oldest_keras_path(), str(REPO)]
    env.update(KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(VENDORED)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{backend}:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert re.search(rf"\b{KERAS_TESTS} passed\b", summary) and "skipped" not in summary, summary
    if keras != "installed":  # the Keras under test, not the environment's
        version = subprocess.run([sys.executable, "-c", "import keras; print(keras.version())"], env=env,
                                 capture_output=True, text=True, timeout=120, check=True).stdout.strip()
        assert version == keras
