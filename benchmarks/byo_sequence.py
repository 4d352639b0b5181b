"""A user's own Keras ``Sequence`` on worker processes (issue 42): first batch, worker memory, frameworks.

```bash
.venv/bin/python benchmarks/byo_sequence.py                  # every row, both front ends (a few minutes)
.venv/bin/python benchmarks/byo_sequence.py --rows keras-tf,scene --fronts to_loader --json out.json
```

Each row is a 4-line source class in a module file of its own (written to a temporary folder,
imported by the workers when they unpickle the source, as a user's module is), in one of the ways
users write it. One fresh child process per row and front end: it imports the module (and so
Keras and its backend: not measured), then measures from the ``to_loader``/``to_dataset`` call
(``executor="processes", workers=2``) to the first batch, reads the rest of the pass (so both
workers made items), and then each worker's PSS (``psutil``'s ``memory_full_info().pss``) and the
frameworks in the workers' ``sys.modules`` (every item carries them: a look-up, never an import).
The ``... stand-ins off`` rows set ``KERASFEED_LIGHT_FRAMEWORKS=0``: the workers as they were before
issue 42. Figures move with other work on the machine: run it on a quiet one.

Depends on kerasfeed, Keras and its backends, numpy and psutil.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("tensorflow", "keras", "jax", "torch")
MB = 2**20

_ITEM = """
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import sys
        import numpy as np
        seen = [m in sys.modules for m in ("tensorflow", "keras", "jax", "torch")]
        return np.full((32, 16), i, np.float32), np.array(seen)
"""
MODULES = {
    "byo_scene": "import kerasfeed\n\n\nclass Source(kerasfeed.SceneSequence):" + _ITEM,
    "byo_keras": "import keras\n\n\nclass Source(keras.utils.Sequence):" + _ITEM,
    "byo_tfkeras": "from tensorflow.keras.utils import Sequence\n\n\nclass Source(Sequence):" + _ITEM,
    "byo_from_tf": "from tensorflow import keras\n\n\nclass Source(keras.utils.PyDataset):" + _ITEM,
}
# name: (label, module, KERAS_BACKEND, stand-ins on)
ROWS = {
    "scene": ("`kerasfeed.SceneSequence` subclass", "byo_scene", "tensorflow", True),
    "keras-tf": ("`import keras`, `keras.utils.Sequence`, TensorFlow backend", "byo_keras", "tensorflow", True),
    "keras-jax": ("`import keras`, `keras.utils.Sequence`, JAX backend", "byo_keras", "jax", True),
    "keras-torch": ("`import keras`, `keras.utils.Sequence`, PyTorch backend", "byo_keras", "torch", True),
    "tfkeras": ("`from tensorflow.keras.utils import Sequence`", "byo_tfkeras", "tensorflow", True),
    "from-tf": ("`from tensorflow import keras`, `keras.utils.PyDataset`", "byo_from_tf", "tensorflow", True),
    "keras-tf-off": ("`import keras`, TensorFlow backend, stand-ins off (before)", "byo_keras", "tensorflow", False),
    "keras-jax-off": ("`import keras`, JAX backend, stand-ins off (before)", "byo_keras", "jax", False),
}
FRONTS = ("to_loader", "to_dataset")


def measure_one(module: str, front: str) -> dict:
    """In this fresh process: the module imported first, then the front end measured."""
    import importlib

    import numpy as np
    import psutil

    importlib.import_module(module)  # the user's imports (Keras, its backend): not measured
    import kerasfeed

    if front == "to_dataset":
        import tensorflow as tf  # noqa: F401 - tf.data's own import is not what is measured
    source = importlib.import_module(module).Source()
    make = kerasfeed.to_loader if front == "to_loader" else kerasfeed.to_dataset
    t0 = time.perf_counter()
    feed = make(source, executor="processes", workers=2)
    it = iter(feed)
    first = next(it)
    first_s = time.perf_counter() - t0
    batches = [first] + list(it)
    seen = np.zeros(len(FRAMEWORKS), bool)
    for _, flags in batches:
        seen |= np.asarray(flags, bool).reshape(-1, len(FRAMEWORKS)).any(axis=0)
    workers = [p for p in psutil.Process().children(recursive=True) if "kerasfeed" in " ".join(p.cmdline())]
    pss = [p.memory_full_info().pss / MB for p in workers]
    executor = kerasfeed.executor_of(feed) if front == "to_dataset" else feed.executor
    ready = executor.stats()["per_worker"]
    executor.close()
    return {
        "first_batch_s": first_s,
        "worker_pss_mb": pss,
        "worker_startup_s": [w.get("startup_s") for w in ready],
        "frameworks_in_workers": [m for m, s in zip(FRAMEWORKS, seen) if s],
    }


def run_one(row: str, front: str, folder: str, timeout: float) -> dict:
    label, module, backend, light = ROWS[row]
    env = dict(os.environ, KERAS_BACKEND=backend, KERASFEED_LIGHT_FRAMEWORKS="1" if light else "0",
               PYTHONPATH=os.pathsep.join([folder, ROOT, os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", module, front]
    out = {"row": row, "source": label, "front": front}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(out, error=f"timed out after {timeout} s")
    if done.returncode != 0:
        return dict(out, error=(done.stderr.strip().splitlines() or ["failed"])[-1])
    return dict(out, **json.loads(done.stdout.strip().splitlines()[-1]))


def _machine() -> str:
    import psutil

    sys.path.insert(0, ROOT)
    from benchmarks.machine import cpu_model, version

    tf = version("tensorflow", "tensorflow-cpu")
    return (f"{cpu_model()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GB; Python "
            f"{sys.version.split()[0]}, TensorFlow {tf}, Keras {version('keras')}, JAX {version('jax')}, "
            f"PyTorch {version('torch')}; load average {os.getloadavg()[0]:.1f} at the start")


def table(results: list) -> str:
    lines = ["| source class | front end | first batch s | per-worker PSS MB | framework modules in the workers |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['source']} | `{r['front']}` | error: {r['error']} | | |")
            continue
        pss = " / ".join(f"{p:.0f}" for p in r["worker_pss_mb"])
        seen = ", ".join(r["frameworks_in_workers"]) or "none"
        lines.append(f"| {r['source']} | `{r['front']}` | {r['first_batch_s']:.2f} | {pss} | {seen} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"any of {', '.join(ROWS)}")
    p.add_argument("--fronts", default=",".join(FRONTS))
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--one", nargs=2, metavar=("MODULE", "FRONT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(*args.one)))
        return 0
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}. Received: --rows {args.rows}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = _machine()
    results = []
    with tempfile.TemporaryDirectory(prefix="kerasfeed-byo-") as folder:
        for name, text in MODULES.items():
            with open(os.path.join(folder, f"{name}.py"), "w") as f:
                f.write(text)
        for row in rows:
            for front in args.fronts.split(","):
                results.append(run_one(row, front, folder, args.timeout))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print(f"\n### Your own `Sequence` on worker processes ({started})\n\n{machine}\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": started, "machine": machine, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
