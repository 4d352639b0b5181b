"""A/B: ``model.fit`` on cached passes read in the graph against the same passes through ``load``.

NOTE [ A stored pass runs in the graph ] (``kerasfeed/loading/stored_passes.py``) reads a pass whose
items are all stored without a Python call per item, for passes of ``MIN_PASS_ITEMS`` or more. This
times ``fit`` (the ``tiny`` model, ``to_dataset(..., executor="processes", workers=2, cache="memory")``)
with that threshold at 0 (always in the graph) and out of reach (always through ``load``), and the same
batches in memory, each configuration in a fresh process, round after round (best of 3 epochs after an
untimed one, batches/s)::

    python benchmarks/graph_passes.py --workload h5 --batches 200,500,1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

MODES = ("memory", "load", "graph")


def one(workload: str, batches: int, mode: str, cache_dir: str) -> float:
    """Batches/s of the best of 3 epochs after an untimed one (this process)."""
    import numpy as np
    import tensorflow as tf

    import kerasfeed
    import kerasfeed.tfdata.stored_items as stored_items
    from benchmarks import runner, workloads

    stored_items.MIN_PASS_ITEMS = stored_items.MIN_PASS_ITEMS_INT32 = 0 if mode == "graph" else 10**12
    seq = workloads.make_workload(workload, batches, cache_dir)
    if mode == "memory":
        items = [seq[i] for i in range(batches)]
        ds = tf.data.Dataset.from_tensor_slices(tuple(np.stack(c) for c in zip(*items))).prefetch(tf.data.AUTOTUNE)
    else:
        ds = kerasfeed.to_dataset(seq, executor="processes", workers=2, cache="memory")
    model = runner.build_model("tiny", np.asarray(seq[0][0]), 10)
    model.fit(ds, epochs=1, verbose=0)  # pass 0 (the store fills), tracing
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        model.fit(ds, epochs=1, verbose=0)
        best = max(best, batches / (time.perf_counter() - t0))
    if mode != "memory":
        kerasfeed.executor_of(ds).close()
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="h5")
    parser.add_argument("--batches", default="200,500,1000", help="comma-separated batches per epoch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "kerasfeed-bench"))
    parser.add_argument("--one", nargs=2, metavar=("BATCHES", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.workload, int(args.one[0]), args.one[1], args.cache_dir)))
        return 0
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rates: dict = {}
    for batches in (int(b) for b in args.batches.split(",")):
        for _ in range(args.rounds):
            for mode in MODES:
                out = subprocess.run([sys.executable, "-m", "benchmarks.graph_passes", "--workload", args.workload,
                                      "--cache-dir", args.cache_dir, "--one", str(batches), mode],
                                     cwd=root, env=env, capture_output=True, text=True, check=True)
                rates.setdefault((batches, mode), []).append(float(out.stdout.strip().splitlines()[-1]))
    print(f"`{args.workload}`, `model.fit` batches/s (range of {args.rounds} rounds)\n")
    print("| items a pass | " + " | ".join(MODES) + " |\n| --- |" + " --- |" * len(MODES))
    for batches in sorted({b for b, _ in rates}):
        cells = [f"{min(rates[batches, m]):,.0f}-{max(rates[batches, m]):,.0f}" for m in MODES]
        print(f"| {batches:,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
