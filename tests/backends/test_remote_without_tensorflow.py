"""An ``http://`` HDF5 file read where TensorFlow cannot be imported: the remote extra in the JAX-only
virtualenv (``make test`` builds ``.venv-notf`` with ``.[jax,remote]``), worker processes, ``model.fit``.

The remote readers' worker processes once aborted at exit in that environment ("terminate called
without an active exception", 3 of 45 closes: their load threads were cut off inside calls when Python
finalised; fixed in ``worker.py``, which now closes them; ``tests/processes/test_worker_threads.py`` tests
that fix deterministically). This runs the readers there, end to end: with the fix undone, 1 of 4 runs of
this test failed on the abort (2026-11-27, 2 cores), 0 of 9 with it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from _util import notf_python
from remote_scenario import digest
from remote_servers import http_server

from kerasfeed.datasets import make_synthetic_scenes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCENARIO = HERE / "remote_scenario.py"
ROUNDS = 4


def test_an_http_file_on_worker_processes_without_tensorflow(tmp_path):
    """Every pass of the URL on 2 worker processes, in the environment without TensorFlow, has the local
    file's batches bit for bit; ROUNDS loaders open and close cleanly (no abort, rc 0); a JAX fit trains."""
    import kerasfeed

    python = notf_python("The remote readers' test without TensorFlow")
    probe = subprocess.run([python, "-c", "import tensorflow"], check=False, capture_output=True, text=True)
    assert probe.returncode != 0, "the no-TensorFlow environment has TensorFlow installed"
    path = make_synthetic_scenes(tmp_path / "scenes.h5", num_scenes=40, points_per_scene=64, chunk_scenes=4,
                                 compression="gzip", seed=3)
    local = kerasfeed.H5SliceSequence(str(path), ("points", "labels"), 4)
    want = digest(local[i] for i in range(len(local)))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "PYTHONPATH"))}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=str(REPO))
    with http_server({"data/scenes.h5": str(path)}) as srv:
        proc = subprocess.run([python, str(SCENARIO), f"{srv.url}/data/scenes.h5", str(ROUNDS)], check=False,
                              capture_output=True, text=True, env=env, timeout=300)
        served = srv.counts()
    assert proc.returncode == 0, f"the scenario failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "terminate called" not in proc.stderr, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "jax" and out["tensorflow_imported"] is False, out
    assert out["passes"] == [want] * ROUNDS, out["passes"]
    assert len(out["loss"]) == 1 and out["loss"][0] == out["loss"][0], out  # one epoch, not NaN
    assert served[0] > 0, served  # the bytes came from the store
