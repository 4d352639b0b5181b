"""Real crashes: a training process SIGKILLed mid-epoch (its workers with it) and started again.

Each run is ``tests/crash_scripts/train.py`` in a fresh process under one
Keras backend: 3 epochs of 12 batches, SGD with momentum, a shuffled source.
The process kills itself with SIGKILL after a given batch (or inside a
backup), and the same script started again must end with exactly the weights
of a run that was never interrupted, and leave no backup behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from _util import OLDEST_KERAS, oldest_keras_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "crash_scripts" / "train.py"
_REFERENCES: dict = {}


def _python(backend: str) -> str:
    if backend == "jax" and os.environ.get("KERASFEED_NOTF_PYTHON"):
        return os.environ["KERASFEED_NOTF_PYTHON"]  # JAX where TensorFlow cannot even be imported
    return sys.executable


def _train(tmp: pathlib.Path, backend: str, name: str, keras_path: str = "", **config) -> subprocess.CompletedProcess:
    config = {"front": "loader", "executor": "threads", "backup": str(tmp / "backup"),
              "out": str(tmp / f"{name}.npz"), **config}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    pythonpath = os.pathsep.join(p for p in (keras_path, str(ROOT)) if p)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=pythonpath, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([_python(backend), str(SCRIPT), str(path)], env=env, capture_output=True, text=True,
                          timeout=240)


def _weights(path: pathlib.Path) -> tuple[list, bool]:
    with np.load(path) as f:
        return [f[k] for k in f.files if k.startswith("arr_")], bool(f["backup_left"])


def _reference(tmp_path_factory, backend: str, front: str, augment: bool = False) -> list:
    key = (backend, front, augment)
    if key not in _REFERENCES:
        tmp = tmp_path_factory.mktemp("reference")
        done = _train(tmp, backend, "ref", front=front, augment=augment,
                      executor="processes" if augment else "threads")
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCES[key] = _weights(tmp / "ref.npz")[0]
    return _REFERENCES[key]


def _crash_and_resume(tmp_path, backend: str, kills: list, finish: dict, **config) -> list:
    """Runs the script once per entry of ``kills`` (each must die of SIGKILL), then once
    more with ``finish`` to the end; returns the final weights."""
    for i, kill in enumerate(kills):
        done = _train(tmp_path, backend, f"killed{i}", **config, **kill)
        assert done.returncode == -signal.SIGKILL, (kill, done.returncode, done.stderr[-3000:])
        assert any((tmp_path / "backup").iterdir()), "killed before any backup"
    done = _train(tmp_path, backend, "resumed", **{**config, **finish})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran out of data" not in done.stderr, done.stderr[-3000:]
    weights, backup_left = _weights(tmp_path / "resumed.npz")
    assert not backup_left and not (tmp_path / "backup").exists(), "the backup outlived the finished fit"
    return weights


def _assert_same(resumed: list, reference: list) -> None:
    assert len(resumed) == len(reference)
    for a, b in zip(resumed, reference):
        np.testing.assert_array_equal(a, b)


def test_jax_loader_on_processes_killed_twice_in_one_epoch(tmp_path, tmp_path_factory):
    """The resumed run makes only the items it trains on (and the probe's): Keras' model build, before the
    backup restores, reads the resumed pass, not pass 0 (NOTE [ The model build's pass under a resume ])."""
    config = dict(front="loader", executor="processes", workers=2, save_freq=5)
    kills = [{"kill_at": [1, 4]}, {"kill_at": [1, 9]}]  # the second in the epoch the first resumed
    calls = tmp_path / "calls.txt"
    resumed = _crash_and_resume(tmp_path, "jax", kills, {"calls_to": str(calls)}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "jax", "loader"))
    made = [tuple(map(int, line.split())) for line in calls.read_text().splitlines()]
    per_pass = {e: sorted(i for p, i in made if p == e) for e in (0, 1, 2)}
    assert len(per_pass[0]) <= 4, per_pass[0]  # the probe's calls; the whole pass (48) made for nothing before
    assert per_pass[2] == list(range(48))
    # The last backup: the 20th batch (save_freq counts on across epochs), 8 of epoch 1; 4 batches were left.
    assert len(per_pass[1]) == len(set(per_pass[1])) == 4 * 4, per_pass[1]


def test_tensorflow_dataset_resumed_on_another_executor(tmp_path, tmp_path_factory):
    """Killed on 2 worker processes, resumed on threads: elastic."""
    config = dict(front="dataset", executor="processes", workers=2, save_freq=5)
    resumed = _crash_and_resume(tmp_path, "tensorflow", [{"kill_at": [1, 6]}], {"executor": "threads"}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "tensorflow", "dataset"))


def test_tensorflow_dataset_with_a_kept_cache_killed_mid_epoch_resumes_exactly(tmp_path, tmp_path_factory):
    """cache=: the killed run filled part of a kept directory; the resumed run reads it (and fills the rest)."""
    config = dict(front="dataset", executor="processes", workers=2, save_freq=5, cache=str(tmp_path / "items"))
    resumed = _crash_and_resume(tmp_path, "tensorflow", [{"kill_at": [1, 6]}], {}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "tensorflow", "dataset"))
    assert (tmp_path / "items" / "key.json").exists()


def test_torch_loader_killed_at_an_epoch_end_and_again_early_in_the_next(tmp_path, tmp_path_factory):
    config = dict(front="loader", executor="threads", save_freq=3)
    resumed = _crash_and_resume(tmp_path, "torch", [{"kill_at": [0, 10]}, {"kill_at": [1, 2]}], {}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "torch", "loader"))


def test_torch_fit_on_ray_killed_mid_epoch_resumes_and_its_ray_goes_with_it(tmp_path, tmp_path_factory):
    """executor="ray" with no cluster: kerasfeed starts Ray on 127.0.0.1 in each run. Killed by SIGKILL
    mid-epoch, nothing of that Ray outlives the run (its GCS, raylet, agents and actors: NOTE [ Ray started by
    kerasfeed ends with its owner ]); the same script started again resumes to the uninterrupted weights."""
    import psutil

    config = dict(front="loader", executor="ray", workers=2, save_freq=5)
    children = tmp_path / "children.json"
    resumed = _crash_and_resume(tmp_path, "torch", [{"kill_at": [1, 4], "children_to": str(children)}], {}, **config)
    ray_procs = [(pid, created) for pid, created in json.loads(children.read_text())]
    assert len(ray_procs) >= 5  # GCS, raylet, 2 agents, 2 actors and more

    def alive(pid, created):
        try:
            return psutil.Process(pid).create_time() == created
        except psutil.Error:
            return False

    left = [pid for pid, created in ray_procs if alive(pid, created)]
    assert not left, [psutil.Process(pid).cmdline()[:3] for pid in left]
    _assert_same(resumed, _reference(tmp_path_factory, "torch", "loader"))


def test_tensorflow_loader_backed_up_every_epoch(tmp_path, tmp_path_factory):
    config = dict(front="loader", executor="threads", save_freq="epoch")
    resumed = _crash_and_resume(tmp_path, "tensorflow", [{"kill_at": [1, 4]}], {}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "tensorflow", "loader"))


@pytest.mark.parametrize("backend,front", [("jax", "loader"), ("tensorflow", "dataset")])
def test_keras_own_callback_at_epoch_ends_resumes_on_the_right_passes(tmp_path, tmp_path_factory, backend, front):
    """keras.callbacks.BackupAndRestore restores the epoch; the shuffled data follows it."""
    config = dict(front=front, executor="threads", save_freq="epoch", callback="keras")
    resumed = _crash_and_resume(tmp_path, backend, [{"kill_at": [2, 5]}], {}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, backend, front))


@pytest.mark.parametrize("where", ["weights", "commit"])
def test_a_crash_during_a_backup_resumes_from_the_one_before(tmp_path, tmp_path_factory, where):
    config = dict(front="loader", executor="threads", save_freq=4)
    kills = [{"crash_save": {"at": 5, "where": where}}]  # the 5th backup: batch 8 of epoch 1
    resumed = _crash_and_resume(tmp_path, "jax", kills, {}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "jax", "loader"))


def test_np_random_augmentation_on_workers_resumes_with_another_worker_count(tmp_path, tmp_path_factory):
    config = dict(front="loader", executor="processes", workers=2, save_freq=5, augment=True)
    resumed = _crash_and_resume(tmp_path, "jax", [{"kill_at": [1, 7]}], {"workers": 1}, **config)
    _assert_same(resumed, _reference(tmp_path_factory, "jax", "loader", augment=True))


def test_two_jax_processes_killed_resume_as_one_with_the_same_global_batch(tmp_path):
    """Elastic: 2 processes (batch 4 each, their own shards) killed mid-epoch, resumed by 1 process
    (batch 8): the same global batches, each item once per pass. Weights match the uninterrupted
    1-process run up to the order of the sum over a global batch (float32 rounding)."""
    from multiworker_launch import keras_jax_env, run_workers

    script = str(ROOT / "tests" / "crash_scripts" / "multihost_train.py")
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    python = _python("jax")
    ref = subprocess.run([python, script, str(tmp_path / "ref_backup"), str(tmp_path / "ref.npz"), "8"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    backup = str(tmp_path / "backup")
    with pytest.raises(AssertionError, match="worker"):  # process 0 killed itself; the launcher ends process 1
        run_workers(script, [backup, str(tmp_path / "killed.npz"), "8", "1", "4"], num_workers=2, timeout=240,
                    cwd=str(tmp_path), env_for=keras_jax_env)
    record = json.loads((tmp_path / "backup" / "latest.json").read_text())
    assert (record["epoch"], record["batch"], record["data"]["shards"], record["data"]["global_batch"]) == (1, 3, 2, 8)
    other = subprocess.run([python, script, backup, str(tmp_path / "other.npz"), "4"], env=env,  # batch 4 on 1
                           capture_output=True, text=True, timeout=240)
    assert other.returncode != 0  # refused, naming what the items per step were made of on both sides
    assert "saved 8 (4 x 2 processes), now 4 (4 x 1 process)" in other.stderr, other.stderr[-3000:]
    done = subprocess.run([python, script, backup, str(tmp_path / "resumed.npz"), "8"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, left = _weights(tmp_path / "resumed.npz")
    assert not left
    for a, b in zip(resumed, _weights(tmp_path / "ref.npz")[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def oldest_keras() -> str:
    """Keras OLDEST_KERAS (setup.cfg's lower bound) beside the environment's, for PYTHONPATH."""
    return oldest_keras_path()


@pytest.mark.parametrize("backend,front", [("tensorflow", "dataset"), ("torch", "loader")])
def test_the_oldest_keras_accepted_resumes_too(tmp_path, tmp_path_factory, oldest_keras, backend, front):
    """The fit frame and epoch iterator read (_keras_fit.py, integrations/fit_data.py) are
    Keras' private structure: the oldest version to_loader accepts resumes exactly as well. (Its JAX
    backend does not run on today's JAX at all, so JAX is tried on the current Keras only.)"""
    config = dict(front=front, executor="threads", save_freq=5, keras_path=oldest_keras)
    ref = _train(tmp_path, backend, "ref", **{**config, "backup": str(tmp_path / "ref_backup")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    resumed = _crash_and_resume(tmp_path, backend, [{"kill_at": [1, 4]}, {"kill_at": [1, 8]}], {}, **config)
    _assert_same(resumed, _weights(tmp_path / "ref.npz")[0])
    with np.load(tmp_path / "resumed.npz") as f:
        assert str(f["keras"]) == OLDEST_KERAS
