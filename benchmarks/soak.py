"""Soak test: ``model.fit`` on worker processes for a long time, with workers
killed from outside and the run resumed each time from its TrainingProgress.

    python benchmarks/soak.py                      # 30 minutes, a kill every 3 minutes
    python benchmarks/soak.py --minutes 3 --kill-every 40

What it does: a source whose item ``i`` carries ``i`` in its first value is
fed with ``to_dataset(executor="processes", workers=2, shuffle=True, seed=0)``
to a small model whose train step records the item it trains on. A killer
thread SIGKILLs one worker process (as the OOM killer would) every
``--kill-every`` seconds. ``fit`` then fails with ``WorkerError``; the run
builds the dataset again from ``TrainingProgress.state()`` and goes on, each
``fit`` call covering one epoch (or the rest of one).

Reports (JSON on the last line):
- ``lost`` / ``repeated``: items of completed epochs never trained / trained
  twice (both must be 0), and ``order_ok``: every epoch trained in exactly
  ``IndexOrder(seed=0)``'s order despite the kills;
- ``recover_s``: per kill, seconds from the kill to the first batch trained
  after resuming;
- ``rss_mb_per_min``, ``fds_per_min``, ``threads_per_min``: least-squares
  slopes of the main process's RSS, open fds and threads over the run
  (after the first minute of warm-up), with the first and last samples.

Not part of the unit suite. Takes ``--minutes`` plus start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402


class Items:
    """Item ``i``: a (8, 16) float32 batch whose [0, 0] is ``i``, after ~2 ms of Python."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        acc = 0
        for k in range(3000):  # pure-Python work, as a real decoder would do
            acc += k * k
        x = np.full((8, 16), 0.001, np.float32)
        x[0, 0] = i
        return x, np.zeros((8, 1), np.float32)


def slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    if len(samples) < 3:
        return None
    t = np.array([s[0] for s in samples]) / 60.0
    v = np.array([s[1] for s in samples])
    return float(np.polyfit(t, v, 1)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every", type=float, default=180.0, help="seconds between worker kills")
    ap.add_argument("--items", type=int, default=400, help="items (batches) per epoch")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sample-every", type=float, default=5.0)
    args = ap.parse_args(argv)

    import keras
    import tensorflow as tf

    import kerasfeed
    from kerasfeed.sampling.order import IndexOrder

    trained: list[tuple[int, int, float]] = []  # (epoch, item, time)
    resumed_at: list[float] = []  # first batch trained by each fit call after a failure
    current_epoch = [0]
    after_failure = [False]

    def record(x0):
        now = time.monotonic()
        if after_failure[0]:
            resumed_at.append(now)
            after_failure[0] = False
        trained.append((current_epoch[0], int(round(float(x0))), now))
        return np.int64(0)

    class Recording(keras.Model):
        def train_step(self, data):
            x, _ = data
            tf.numpy_function(record, [x[0, 0]], tf.int64, stateful=True)
            return super().train_step(data)

    inputs = keras.Input((16,))
    model = Recording(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", jit_compile=False)

    class EpochMark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            current_epoch[0] = epoch

    source = Items(args.items)
    live = {"ds": None}
    kills: list[dict] = []
    stop = threading.Event()

    def killer():
        # A kill is due every --kill-every seconds; when no live worker can be
        # killed at that moment (between two fit calls), retry every second
        # rather than skipping a whole interval, and say why.
        wait = args.kill_every
        while not stop.wait(wait):
            wait = 1.0
            ds = live["ds"]
            if ds is None:
                continue
            try:
                pids = kerasfeed.executor_of(ds).pool.pids
                pid = random.choice(pids)
                os.kill(pid, signal.SIGKILL)
            except Exception as e:  # noqa: BLE001 - between datasets, or the worker already gone
                print(f"killer: no worker to kill now ({type(e).__name__}: {e}); retrying", file=sys.stderr, flush=True)
                continue
            kills.append({"pid": pid, "at": time.monotonic()})
            print(f"killer: SIGKILLed worker {pid}", file=sys.stderr, flush=True)
            wait = args.kill_every

    me = psutil.Process()
    samples: dict[str, list] = {"rss_mb": [], "fds": [], "threads": []}
    t_start = time.monotonic()

    def sampler():
        while not stop.wait(args.sample_every):
            t = time.monotonic() - t_start
            samples["rss_mb"].append((t, me.memory_info().rss / 2**20))
            samples["fds"].append((t, me.num_fds()))
            samples["threads"].append((t, me.num_threads()))

    threading.Thread(target=killer, daemon=True).start()
    threading.Thread(target=sampler, daemon=True).start()
    end = t_start + args.minutes * 60
    state = {"epoch": 0, "batches": 0}
    failures = 0
    while time.monotonic() < end:
        ds = kerasfeed.to_dataset(
            source, executor="processes", workers=args.workers, shuffle=True, seed=0, initial_state=state
        )
        live["ds"] = ds
        progress = kerasfeed.TrainingProgress(state)
        epoch = state["epoch"]
        try:
            model.fit(
                ds, initial_epoch=epoch, epochs=epoch + 1, callbacks=[progress, EpochMark()], verbose=0, shuffle=False
            )
        except Exception as e:  # noqa: BLE001 - a killed worker: resume
            failures += 1
            after_failure[0] = True
            print(f"fit failed ({type(e).__name__}); resuming from {progress.state()}", file=sys.stderr, flush=True)
        state = {k: v for k, v in progress.state().items() if k in ("epoch", "batches")}
        live["ds"] = None
        kerasfeed.executor_of(ds).close()
        del ds
    stop.set()

    # Items of every completed epoch: exactly once, in the seeded order.
    order = IndexOrder(args.items, shuffle=True, seed=0)
    by_epoch: dict[int, list[int]] = {}
    for ep, item, _ in trained:
        by_epoch.setdefault(ep, []).append(item)
    complete = [ep for ep in by_epoch if ep < state["epoch"]]
    lost = repeated = 0
    order_ok = True
    for ep in complete:
        got = by_epoch[ep]
        lost += len(set(range(args.items)) - set(got))
        repeated += len(got) - len(set(got))
        order_ok &= got == order.indices(ep).tolist()
    for k in kills:  # from the kill to the first batch of the resumed run
        after = [t for t in resumed_at if t > k["at"]]
        k["recover_s"] = (min(after) - k["at"]) if after else None
    warm = [s for s in samples["rss_mb"] if s[0] > 60] or samples["rss_mb"]
    report = {
        "minutes": args.minutes,
        "epochs_completed": len(complete),
        "batches_trained": len(trained),
        "kills": len(kills),
        "fit_failures": failures,
        "lost": lost,
        "repeated": repeated,
        "order_ok": order_ok,
        "recover_s": [None if k["recover_s"] is None else round(k["recover_s"], 2) for k in kills],
        "rss_mb_per_min": slope_per_min(warm),
        "fds_per_min": slope_per_min([s for s in samples["fds"] if s[0] > 60] or samples["fds"]),
        "threads_per_min": slope_per_min([s for s in samples["threads"] if s[0] > 60] or samples["threads"]),
        "rss_mb_first_last": (
            [round(samples["rss_mb"][0][1], 1), round(samples["rss_mb"][-1][1], 1)] if samples["rss_mb"] else None
        ),
        "fds_first_last": [samples["fds"][0][1], samples["fds"][-1][1]] if samples["fds"] else None,
        "threads_first_last": [samples["threads"][0][1], samples["threads"][-1][1]] if samples["threads"] else None,
    }
    print(json.dumps(report))
    ok = lost == 0 and repeated == 0 and order_ok and len(complete) > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
