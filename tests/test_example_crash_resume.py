"""``examples/crash_resume.py`` as its docstring runs it: killed mid-epoch, started again, checked bit for bit."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "crash_resume.py"


def _run(*args: str, workdir: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, str(EXAMPLE), "--dir", str(workdir), *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_the_example_killed_at_epoch_1_batch_3_resumes_there_and_ends_on_the_uninterrupted_weights(tmp_path):
    killed = _run("--kill-at", "1", "3", workdir=tmp_path)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    assert "killing this process after epoch 1, batch 3" in killed.stdout, killed.stdout
    assert not (tmp_path / "final.npz").exists()

    resumed = _run(workdir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Backed up every 4 batches: the last backup before the kill was after batch 3 of epoch 1.
    assert "backup found: resuming at epoch 1, batch 4" in resumed.stdout, resumed.stdout
    assert "first batch trained: epoch 1, batch 4" in resumed.stdout, resumed.stdout
    assert "ran out of data" not in resumed.stderr, resumed.stderr[-3000:]
    assert not (tmp_path / "backup").exists(), "the backup outlived the finished fit"

    checked = _run("--check", workdir=tmp_path)
    assert checked.returncode == 0, (checked.stdout, checked.stderr[-3000:])
    assert "final weights equal an uninterrupted run's, bit for bit" in checked.stdout, checked.stdout
