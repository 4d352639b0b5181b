"""A/B: ``model.fit`` on ``to_dataset`` with the batch dimension open (None,
the default when items are batches) against pinned by ``output_signature``.

Run ``python benchmarks/open_batch_dim.py`` (``--steps 50 --rounds 2`` for a
quick run); it prints steps/s of each, best of ``--rounds`` alternating runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kerasfeed


class Batches(kerasfeed.SceneSequence):
    def __init__(self, steps: int, batch: int = 32, features: int = 64):
        super().__init__()
        rng = np.random.default_rng(0)
        self.x = rng.random((steps, batch, features), dtype=np.float32)
        self.y = rng.random((steps, batch, 1), dtype=np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def steps_per_s(pinned: bool, steps: int, epochs: int = 3) -> float:
    import keras
    import tensorflow as tf

    seq = Batches(steps)
    signature = None
    if pinned:
        b, f = seq.x.shape[1:]
        signature = (tf.TensorSpec([b, f], tf.float32), tf.TensorSpec([b, 1], tf.float32))
    ds = kerasfeed.to_dataset(seq, output_signature=signature)
    model = keras.Sequential([keras.Input((seq.x.shape[2],)), keras.layers.Dense(256, "relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    model.fit(ds, epochs=1, verbose=0)  # tracing and warm-up
    t0 = time.perf_counter()
    model.fit(ds, epochs=epochs, verbose=0)
    return epochs * steps / (time.perf_counter() - t0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    best = {"open (None)": 0.0, "pinned": 0.0}
    for _ in range(args.rounds):
        best["open (None)"] = max(best["open (None)"], steps_per_s(False, args.steps))
        best["pinned"] = max(best["pinned"], steps_per_s(True, args.steps))
    for name, rate in best.items():
        print(f"batch dimension {name:12s}: {rate:8.1f} steps/s")
    print(f"open / pinned: {best['open (None)'] / best['pinned']:.3f}")


if __name__ == "__main__":
    main()
