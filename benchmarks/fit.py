"""kerasfeed fit benchmark: ``model.fit`` epoch time on the four workloads, against the in-memory limit.

``python benchmarks/fit.py`` (``--quick`` for tiny settings). Two views, both
printed as markdown tables with the machine, the date and the library
versions, and saved to ``benchmarks/results/fit_latest.json`` / ``.md``:

- **fit**: ``model.fit(x, epochs=E)`` on the TensorFlow backend with a tiny
  model (average over the inner axes, one Dense), so the train step is cheap
  and the input path sets the rate. Epoch 1 is untimed (start-up, tracing);
  the best of the later epochs is reported, measured between Keras'
  ``on_epoch_begin`` calls. The limit is ``fit`` on the same batches made
  before timing. Cells: batches/s and the ratio to that limit.
- **numpy**: a plain ``for batch in ...`` over numpy batches, touching one
  value of every array (the path a JAX or PyTorch loop takes; kerasfeed
  through ``to_loader``). Cells: batches/s and the ratio to Grain's best.

Every configuration runs in its own child process (``runner.isolated``), so
threads, worker processes and TensorFlow state of one never slow down the
next. The ways are ``benchmarks/ways.py``'s, timed by ``benchmarks/runner.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report, runner, ways, workloads  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402

VIEWS = ("fit", "numpy")
FIT_WAYS = ("memory", "keras-threads", "keras-processes", "grain-threads", "grain-mp", "torch",
            "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto", "kerasfeed-cached",
            "kerasfeed-cached-threads")
NUMPY_WAYS = ("serial", "grain-threads", "grain-mp", "torch", "kerasfeed-threads", "kerasfeed-processes",
              "kerasfeed-auto", "kerasfeed-tfdata", "kerasfeed-cached", "kerasfeed-cached-threads")
REFERENCES = {"fit": ("memory",), "numpy": ("grain-threads", "grain-mp")}
FULL_EPOCHS, QUICK_EPOCHS = 4, 2  # epoch 1 is never timed
TITLES = {"fit": "`model.fit` (TensorFlow backend, tiny model): batches/s (ratio to the in-memory limit)",
          "numpy": "plain `for batch in ...` over numpy batches: batches/s (ratio to Grain's best)"}


def run_fit_benchmark(*, quick: bool = False, workloads_: Sequence[str] = workloads.WORKLOADS,
                      only: Optional[Sequence[str]] = None, views: Sequence[str] = VIEWS,
                      batches: Optional[int] = None, epochs: Optional[int] = None, steps_per_execution: int = 1,
                      rounds: int = 1, workers: int = 2, output_dir: Optional[os.PathLike] = runner.DEFAULT_OUTPUT_DIR,
                      progress: runner.Progress = print) -> Dict[str, Any]:
    """Runs both views and returns the results (also saved under ``output_dir``).

    Args:
        quick: tiny sizes (each workload's ``quick`` batches, 2 epochs).
        workloads_: among ``cpu``, ``h5``, ``io``, ``big`` (or the image workloads).
        only: way names to run (the references, ``memory`` in fit and the
            Grain rows in numpy, always run); None runs every way.
        views: among ``fit`` and ``numpy``.
        batches: batches per epoch for every workload.
        epochs: epochs per configuration, the first untimed.
        steps_per_execution: passed to ``model.compile``.
        rounds: every configuration of a workload runs once per round, so each
            ratio is taken against the reference of its own round; the tables
            show the median rate, the median ratio and the ratios' range.
        workers: worker processes of the process-based ways.
        output_dir: where ``fit_latest.json`` / ``fit_latest.md`` go; None writes nothing.

    Returns:
        A JSON-able dict: ``machine``, ``date``, ``settings``, ``rows``, ``markdown``.
    """
    workloads.check_names(workloads_)
    for v in views:
        if v not in VIEWS:
            raise ValueError(f"Unknown view {v!r}; expected some of {VIEWS}. Received: {v!r}")
    ways.select([], only)  # refuses unknown names
    if int(rounds) < 1:
        raise ValueError(f"`rounds` must be at least 1. Received: rounds={rounds}")
    epochs = int(epochs or (QUICK_EPOCHS if quick else FULL_EPOCHS))
    if epochs < 2:
        raise ValueError(f"`epochs` must be at least 2 (the first is never timed). Received: epochs={epochs}")
    sizes = {w: int(batches or getattr(workloads.REGISTRY[w], "quick" if quick else "full")) for w in workloads_}
    cache_dir = pathlib.Path(output_dir or runner.DEFAULT_OUTPUT_DIR) / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed fit benchmark, {date}, {'quick' if quick else 'full'} run on {machine['cpu']} "
             f"({machine['cores_usable']} cores), load {machine['loadavg_start']}")
    rows: List[Dict[str, Any]] = []
    started = time.perf_counter()
    for view in views:
        chosen = ways.select(list(FIT_WAYS if view == "fit" else NUMPY_WAYS), only, always=REFERENCES[view])
        for wl in workloads_:
            workloads.prepare(wl, sizes[wl], cache_dir)  # made once, outside any timing
            for round_ in range(int(rounds)):
                for way in chosen:
                    config = {"way": way.name, "workload": wl, "batches": sizes[wl], "cache_dir": str(cache_dir),
                              "mode": "fit" if view == "fit" else "loop", "workers": workers, "round": round_,
                              "epochs": epochs, "steps_per_execution": steps_per_execution,
                              # the numpy view times epochs - 1 passes too, the best kept
                              "min_timed_s": float("inf"), "max_timed_epochs": epochs - 1}
                    (row,) = runner.isolated([config], {"KERAS_BACKEND": "tensorflow"}, progress=progress)
                    rows.append({**row, "view": view, "label": row.get("label") or way.title(ways.Context())})
    runner.add_ratios(rows, lambda r: r["way"] in REFERENCES[r["view"]])
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res = {"machine": machine, "date": date, "kind": "fit", "rows": rows, "total_s": time.perf_counter() - started,
           "settings": {"quick": quick, "batches": sizes, "epochs": epochs, "timed_epochs": epochs - 1,
                        "steps_per_execution": steps_per_execution, "rounds": int(rounds), "workers": workers,
                        "workloads": list(workloads_), "views": list(views), "only": list(only) if only else None}}
    res["markdown"] = to_markdown(res)
    if output_dir is not None:
        runner.save_results(output_dir, "fit_latest", res)
    return res


def to_markdown(res: Dict[str, Any]) -> str:
    s = res["settings"]
    lines = [report.machine_line(res["machine"], res["date"]),
             "", f"{'Quick' if s['quick'] else 'Full'} run: batches per epoch {s['batches']}, {s['timed_epochs']} "
                 f"timed epochs after an untimed one (best shown), steps_per_execution={s['steps_per_execution']}."
             + (f" {s['rounds']} rounds: median batches/s (median ratio; the ratios' range, each ratio against "
                "the reference of its own round)." if s.get("rounds", 1) > 1 else ""), ""]
    for view in s["views"]:
        rows = [r for r in res["rows"] if r["view"] == view]
        wls = [w for w in s["workloads"] if any(r["workload"] == w for r in rows)]
        lines += [f"**{TITLES[view]}**", ""] + report.table(rows, wls) + report.notes(rows) + [""]
    return "\n".join(lines)


def batch_dim_ab(steps: int = 300, rounds: int = 3) -> Dict[str, float]:
    """A/B: ``model.fit`` on ``to_dataset`` with the batch dimension open (None, the default when
    items are batches) against pinned by ``output_signature``; steps/s, best of ``rounds`` alternating runs."""
    import keras
    import numpy as np
    import tensorflow as tf

    import kerasfeed

    rng = np.random.default_rng(0)
    x, y = rng.random((steps, 32, 64), dtype=np.float32), rng.random((steps, 32, 1), dtype=np.float32)

    class Batches(kerasfeed.SceneSequence):
        def __len__(self):
            return steps

        def __getitem__(self, i):
            return x[i], y[i]

    best = {"open (None)": 0.0, "pinned": 0.0}
    for _ in range(int(rounds)):
        for name, signature in (("open (None)", None),
                                ("pinned", (tf.TensorSpec([32, 64], tf.float32), tf.TensorSpec([32, 1], tf.float32)))):
            ds = kerasfeed.to_dataset(Batches(), output_signature=signature)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, "relu"), keras.layers.Dense(1)])
            model.compile("adam", "mse")
            model.fit(ds, epochs=1, verbose=0)  # tracing and warm-up
            t0 = time.perf_counter()
            model.fit(ds, epochs=3, verbose=0)
            best[name] = max(best[name], 3 * steps / (time.perf_counter() - t0))
            kerasfeed.executor_of(ds).close()
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 epochs (one timed)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                        help=f"comma-separated among {','.join(workloads.REGISTRY)}")
    parser.add_argument("--only", default=None, help="comma-separated way names (fit.FIT_WAYS / NUMPY_WAYS)")
    parser.add_argument("--views", default=",".join(VIEWS), help="comma-separated among fit,numpy")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch for every workload")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per configuration (first untimed)")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, round after round; median and range")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the process-based ways")
    parser.add_argument("--output-dir", default=str(runner.DEFAULT_OUTPUT_DIR))
    parser.add_argument("--render", metavar="JSON", default=None, help="do not run: print a saved result's tables")
    parser.add_argument("--batch-dim", action="store_true", help="only the A/B of an open against a pinned batch "
                        "dimension (to_dataset, a Dense model; --batches steps, default 300; --rounds, default 3)")
    args = parser.parse_args(argv)
    if args.batch_dim:
        best = batch_dim_ab(args.batches or 300, args.rounds if args.rounds > 1 else 3)
        for name, rate in best.items():
            print(f"batch dimension {name:12s}: {rate:8.1f} steps/s")
        print(f"open / pinned: {best['open (None)'] / best['pinned']:.3f}")
        return 0
    if args.render:
        print(to_markdown(json.loads(pathlib.Path(args.render).read_text())))
        return 0
    try:
        res = run_fit_benchmark(quick=args.quick, workloads_=runner.split(args.workloads),
                                only=runner.split(args.only), views=runner.split(args.views), batches=args.batches,
                                epochs=args.epochs, steps_per_execution=args.steps_per_execution, rounds=args.rounds,
                                workers=args.workers, output_dir=args.output_dir)
    except ValueError as e:
        parser.error(str(e))
    print()
    print(res["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
