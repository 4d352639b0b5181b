"""Reliability under stress (not part of the unit suite; the suite runs lean versions). Two subcommands:

- ``soak``: ``model.fit`` on worker processes for a long time, a worker SIGKILLed from outside
  every ``--kill-every`` seconds (as the OOM killer would), the run resumed each time from its
  ``TrainingProgress``. A source whose item ``i`` carries ``i`` in its first value is fed with
  ``to_dataset(executor="processes", workers=2, shuffle=True, seed=0)`` to a model whose train
  step records the item it trains on. Reports (JSON, last line): ``lost`` / ``repeated`` items of
  completed epochs (both must be 0) and ``order_ok`` (every epoch in ``IndexOrder(seed=0)``'s
  order despite the kills); ``recover_s`` per kill (from the kill to the first batch trained
  after resuming); least-squares slopes per minute of the main process's RSS, open fds and threads.
- ``exit``: ``tests/reliability_scripts/every_dataset.py exit`` (every kind of kerasfeed dataset,
  3 elements taken from a live iterator of each, then the script ends without closing anything)
  ``--runs`` times, ``--parallel`` at a time, while ``--burners`` processes keep the CPUs busy;
  per run, the seconds from the script's last line to the process's end (passing under ``--limit``).

    python benchmarks/reliability.py soak                 # 30 minutes, a kill every 3 minutes
    python benchmarks/reliability.py soak --minutes 3 --kill-every 40
    python benchmarks/reliability.py exit                 # 50 runs, 5 at a time, 2 burners
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

EXIT_SCRIPT = ROOT / "tests" / "reliability_scripts" / "every_dataset.py"


# --- soak ---------------------------------------------------------------------------------------------


class Items:
    """Item ``i``: a (8, 16) float32 batch whose [0, 0] is ``i``, after ~2 ms of Python."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        acc = 0
        for k in range(3000):  # pure-Python work, as a real decoder would do
            acc += k * k
        x = np.full((8, 16), 0.001, np.float32)
        x[0, 0] = i
        return x, np.zeros((8, 1), np.float32)


def slope_per_min(samples: List[Tuple[float, float]]) -> Optional[float]:
    if len(samples) < 3:
        return None
    return float(np.polyfit(np.array([s[0] for s in samples]) / 60.0, np.array([s[1] for s in samples]), 1)[0])


def _recording_model(trained: list, current_epoch: list, after_failure: list) -> Any:
    """A small model whose train step appends ``(epoch, item, time)`` for every batch it trains on."""
    import keras
    import tensorflow as tf

    def record(x0):
        now = time.monotonic()
        trained.append((current_epoch[0], int(round(float(x0))), now, after_failure[0]))
        after_failure[0] = False
        return np.int64(0)

    class Recording(keras.Model):
        def train_step(self, data):
            x, _ = data
            tf.numpy_function(record, [x[0, 0]], tf.int64, stateful=True)
            return super().train_step(data)

    inputs = keras.Input((16,))
    model = Recording(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", jit_compile=False)
    return model


def _killer(live: dict, kills: list, stop: threading.Event, every: float) -> None:
    """SIGKILLs a live worker every ``every`` s; retries each second while none can be killed."""
    import kerasfeed

    wait = every
    while not stop.wait(wait):
        wait = 1.0
        if live["ds"] is None:  # between two fit calls
            continue
        try:
            pid = random.choice(kerasfeed.executor_of(live["ds"]).pids)
            os.kill(pid, signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - between datasets, or the worker already gone
            print(f"killer: no worker to kill now ({type(e).__name__}: {e}); retrying", file=sys.stderr, flush=True)
            continue
        kills.append({"pid": pid, "at": time.monotonic()})
        print(f"killer: SIGKILLed worker {pid}", file=sys.stderr, flush=True)
        wait = every


def _sampler(samples: Dict[str, list], stop: threading.Event, every: float, t_start: float) -> None:
    me = psutil.Process()
    while not stop.wait(every):
        t = time.monotonic() - t_start
        samples["rss_mb"].append((t, me.memory_info().rss / 2**20))
        samples["fds"].append((t, me.num_fds()))
        samples["threads"].append((t, me.num_threads()))


def soak(minutes: float, kill_every: float, items: int, workers: int, sample_every: float) -> Dict[str, Any]:
    import keras

    import kerasfeed
    from kerasfeed.sampling.order import IndexOrder

    trained: list = []  # (epoch, item, time, first after a failure)
    current_epoch, after_failure = [0], [False]
    model = _recording_model(trained, current_epoch, after_failure)

    class EpochMark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            current_epoch[0] = epoch

    source, live, kills, stop = Items(items), {"ds": None}, [], threading.Event()
    samples: Dict[str, list] = {"rss_mb": [], "fds": [], "threads": []}
    t_start = time.monotonic()
    threading.Thread(target=_killer, args=(live, kills, stop, kill_every), daemon=True).start()
    threading.Thread(target=_sampler, args=(samples, stop, sample_every, t_start), daemon=True).start()
    state, failures = {"epoch": 0, "batches": 0}, 0
    while time.monotonic() < t_start + minutes * 60:
        ds = kerasfeed.to_dataset(source, executor="processes", workers=workers, shuffle=True, seed=0,
                                  initial_state=state)
        live["ds"], progress = ds, kerasfeed.TrainingProgress(state)
        try:
            model.fit(ds, initial_epoch=state["epoch"], epochs=state["epoch"] + 1,
                      callbacks=[progress, EpochMark()], verbose=0, shuffle=False)
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
    order, by_epoch = IndexOrder(items, shuffle=True, seed=0), {}
    for ep, item, _, _ in trained:
        by_epoch.setdefault(ep, []).append(item)
    complete = [ep for ep in by_epoch if ep < state["epoch"]]
    lost = sum(len(set(range(items)) - set(by_epoch[ep])) for ep in complete)
    repeated = sum(len(by_epoch[ep]) - len(set(by_epoch[ep])) for ep in complete)
    order_ok = all(by_epoch[ep] == order.indices(ep).tolist() for ep in complete)
    resumed_at = [t for _, _, t, first in trained if first]
    recover = [min((t for t in resumed_at if t > k["at"]), default=None) for k in kills]
    warm = {k: [s for s in v if s[0] > 60] or v for k, v in samples.items()}  # after the first minute
    return {
        "minutes": minutes, "epochs_completed": len(complete), "batches_trained": len(trained), "kills": len(kills),
        "fit_failures": failures, "lost": lost, "repeated": repeated, "order_ok": order_ok,
        "recover_s": [None if t is None else round(t - k["at"], 2) for t, k in zip(recover, kills)],
        **{f"{k}_per_min": slope_per_min(warm[k]) for k in ("rss_mb", "fds", "threads")},
        **{f"{k}_first_last": [round(v[0][1], 1), round(v[-1][1], 1)] if v else None for k, v in samples.items()},
    }


# --- exit -----------------------------------------------------------------------------------------------


def _one(env: dict, hard_timeout: float, out: dict) -> None:
    p = subprocess.Popen([sys.executable, str(EXIT_SCRIPT), "exit"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, text=True)
    out["pid"] = p.pid
    line = p.stdout.readline()  # the script's last line: every iterator is live
    printed = time.monotonic()
    try:
        p.wait(timeout=hard_timeout)
        out["exit_s"] = time.monotonic() - printed
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        out["exit_s"] = None
    out["returncode"] = p.returncode
    out["printed"] = bool(line.strip()) and p.returncode == 0


def run_batch(count: int, hard_timeout: float) -> List[Dict[str, Any]]:
    """Starts ``count`` runs of the exit script at once, each watched by its own thread."""
    results: List[Dict[str, Any]] = [{} for _ in range(count)]
    # The runs' files (every_dataset.py's scene file, export, text files) go into one folder removed here.
    with tempfile.TemporaryDirectory(prefix="kerasfeed-exit-") as workdir:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "KERASFEED_TEST_WORKDIR": workdir}
        threads = [threading.Thread(target=_one, args=(env, hard_timeout, r)) for r in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def exit_check(runs: int, parallel: int, burners: int, limit: float, hard_timeout: float) -> Dict[str, Any]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    results: List[Dict[str, Any]] = []
    try:
        while len(results) < runs:
            results.extend(run_batch(min(parallel, runs - len(results)), hard_timeout))
            print(f"{len(results)}/{runs} runs done", file=sys.stderr, flush=True)
    finally:
        for b in procs:
            b.kill()
            b.wait()
    times = sorted(r["exit_s"] for r in results if r["exit_s"] is not None)
    return {"runs": len(results), "limit_s": limit, "burners": burners, "parallel": parallel,
            "passed": sum(1 for r in results if r["printed"] and r["exit_s"] is not None and r["exit_s"] < limit),
            "hung": sum(1 for r in results if r["exit_s"] is None),
            "failed_to_run": sum(1 for r in results if not r["printed"]),
            "exit_s_max": times[-1] if times else None, "exit_s_median": times[len(times) // 2] if times else None,
            "exit_s_sorted": [round(t, 2) for t in times]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("soak", help="long fit with workers killed, resumed each time")
    s.add_argument("--minutes", type=float, default=30.0)
    s.add_argument("--kill-every", type=float, default=180.0, help="seconds between worker kills")
    s.add_argument("--items", type=int, default=400, help="items (batches) per epoch")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--sample-every", type=float, default=5.0)
    e = sub.add_parser("exit", help="interpreter exit with live iterators, under CPU load")
    e.add_argument("--runs", type=int, default=50)
    e.add_argument("--parallel", type=int, default=5)
    e.add_argument("--burners", type=int, default=2, help="busy-loop processes (default: 2, both cores)")
    e.add_argument("--limit", type=float, default=5.0, help="seconds an exit may take")
    e.add_argument("--hard-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.what == "soak":
        report = soak(args.minutes, args.kill_every, args.items, args.workers, args.sample_every)
        ok = report["lost"] == 0 and report["repeated"] == 0 and report["order_ok"] and report["epochs_completed"]
    else:
        report = exit_check(args.runs, args.parallel, args.burners, args.limit, args.hard_timeout)
        ok = report["passed"] == report["runs"]
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
