"""kerasfeed fit benchmark: ``model.fit`` epoch time on the four workloads, against the in-memory limit.

``python benchmarks/fit.py`` (``--quick`` for tiny settings). Two views, both
printed as markdown tables with the machine, the date and the library
versions, and saved to ``benchmarks/results/fit_latest.json`` / ``.md``:

- **fit**: ``model.fit(x, epochs=E)`` on the TensorFlow backend with a tiny
  model (average over the inner axes, one Dense), so the train step is cheap
  and the input path sets the rate. Epoch 1 is untimed (start-up, tracing);
  the best of the later epochs is reported, measured between Keras'
  ``on_epoch_begin`` calls, so per-epoch costs (pools rebuilt each epoch,
  iterators) stay in. The limit is ``fit`` on the same batches made before
  timing (``from_tensor_slices`` of them). Cells: batches/s and the ratio to
  that limit.
- **numpy**: a plain ``for batch in ...`` over numpy batches, touching one
  value of every array (the path a JAX or PyTorch loop takes). Cells:
  batches/s and the ratio to Grain's best configuration on that workload.

Every configuration runs in its own subprocess (this file with ``--child``),
so threads, worker processes and TensorFlow state of one never slow down the
next. This is a different view from ``benchmarks/run.py``, which drains each
dataset in a compiled loop with no model (the pipeline's own rate).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

from benchmarks import fit_ways, harness, workloads  # noqa: E402

DEFAULT_OUTPUT_DIR = ROOT / "benchmarks" / "results"
VIEWS = ("fit", "numpy")
FULL_EPOCHS, QUICK_EPOCHS = 4, 2  # epoch 1 is never timed
CHILD_TIMEOUT_S = 900
_MARK = "FITBENCH-RESULT "


# --- one configuration, in a child process ------------------------------------------------


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Runs one configuration here and returns its result (never raises)."""
    before = {p.pid for p in harness.descendants()}
    result: Dict[str, Any] = {"view": spec["view"], "way": spec["way"], "workload": spec["workload"]}
    try:
        seq = workloads.make_workload(spec["workload"], spec["batches"], spec["cache_dir"])
        if spec["view"] == "fit":
            result.update(fit_ways.run_fit(spec["way"], seq, spec["epochs"], spec["steps_per_execution"]))
        else:
            result.update(fit_ways.run_numpy(spec["way"], seq, spec["epochs"]))
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others
        result.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    seq = None
    killed = harness.wait_for_exit(before)
    if killed:
        result["killed_after_close"] = killed
    return result


def run_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    env = dict(os.environ)
    # Worker processes import the workload classes by module name.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(spec)],
                              env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "error", "note": f"error: timed out after {CHILD_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {**spec, "status": "error", "note": f"error: child exited {proc.returncode}: {' | '.join(tail)[:300]}"}


# --- the run -------------------------------------------------------------------------------


def machine_info() -> Dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": harness._cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "python": sys.version.split()[0],
        "tensorflow": harness._version("tensorflow", "tensorflow-cpu"),
        "keras": harness._version("keras"),
        "grain": harness._version("grain"),
        "torch": harness._version("torch"),
        "numpy": harness._version("numpy"),
        "kerasfeed": harness._version("kerasfeed"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def run_fit_benchmark(*, quick: bool = False, workloads_: Sequence[str] = workloads.WORKLOADS,
                      only: Optional[Sequence[str]] = None, views: Sequence[str] = VIEWS,
                      batches: Optional[int] = None, epochs: Optional[int] = None,
                      steps_per_execution: int = 1, rounds: int = 1,
                      output_dir: Optional[os.PathLike] = DEFAULT_OUTPUT_DIR,
                      progress=print) -> Dict[str, Any]:
    """Runs both views and returns the results (also saved under ``output_dir``).

    Args:
        quick: tiny sizes (``run.QUICK_BATCHES``, 2 epochs) instead of the full run.
        workloads_: among ``cpu``, ``h5``, ``io``, ``big``.
        only: way names to run (the references, ``memory`` in fit and the
            Grain rows in numpy, always run); None runs every way.
        views: among ``fit`` and ``numpy``.
        batches: batches per epoch for every workload (default: ``run.py``'s sizes).
        epochs: epochs per configuration, the first untimed.
        steps_per_execution: passed to ``model.compile``.
        rounds: every configuration of a workload runs once per round, the
            rounds one after another, so each ratio is taken against the
            reference of its own round; the tables show the median rate, the
            median ratio and the ratios' range (shared machines drift by tens
            of percent within minutes).
        output_dir: where ``fit_latest.json`` / ``fit_latest.md`` go; None writes nothing.

    Returns:
        A JSON-able dict: ``machine``, ``date``, ``settings``, ``rows``, ``markdown``.
    """
    for w in workloads_:
        if w not in workloads.WORKLOADS:
            raise ValueError(f"Unknown workload {w!r}; expected some of {workloads.WORKLOADS}. Received: {w!r}")
    for v in views:
        if v not in VIEWS:
            raise ValueError(f"Unknown view {v!r}; expected some of {VIEWS}. Received: {v!r}")
    known = set(fit_ways.FIT_WAYS) | set(fit_ways.NUMPY_WAYS)
    for name in only or ():
        if name not in known:
            raise ValueError(f"Unknown way {name!r}; expected some of {sorted(known)}. Received: {name!r}")
    if int(rounds) < 1:
        raise ValueError(f"`rounds` must be at least 1. Received: rounds={rounds}")
    epochs = int(epochs or (QUICK_EPOCHS if quick else FULL_EPOCHS))
    if epochs < 2:
        raise ValueError(f"`epochs` must be at least 2 (the first is never timed). Received: epochs={epochs}")
    sizes = dict(harness.QUICK_BATCHES if quick else harness.FULL_BATCHES)
    if batches is not None:
        sizes = {k: int(batches) for k in sizes}
    cache_dir = pathlib.Path(output_dir or DEFAULT_OUTPUT_DIR) / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed fit benchmark, {date}, {'quick' if quick else 'full'} run on {machine['cpu']} "
             f"({machine['cores_usable']} cores), load {machine['loadavg_start']}")
    references = {"fit": ("memory",), "numpy": ("grain-threads", "grain-mp")}
    rows: List[Dict[str, Any]] = []
    started = time.perf_counter()
    for view in views:
        names = fit_ways.FIT_WAYS if view == "fit" else fit_ways.NUMPY_WAYS
        chosen = [w for w in names if not only or w in only or w in references[view]]
        for wl in workloads_:
            if wl == "h5":
                workloads.scene_file(cache_dir, sizes[wl])  # made once, outside any timing
            for round_, way in ((k, w) for k in range(int(rounds)) for w in chosen):
                spec = {"view": view, "way": way, "workload": wl, "batches": sizes[wl], "epochs": epochs,
                        "steps_per_execution": steps_per_execution, "cache_dir": str(cache_dir), "round": round_}
                if view == "fit" and way == "torch":
                    row = {**spec, "status": "n/a", "note": fit_ways.TORCH_FIT_NA}
                else:
                    row = run_child(spec)
                row["label"] = fit_ways.LABELS[view][way]
                rows.append(row)
                row["round"] = round_
                if row["status"] == "ok":
                    progress(f"  [{view}] {wl:4s} {way:20s} {row['batches_per_s']:8.1f} batches/s"
                             f"  main CPU {row['main_cpu_us_per_batch']:.0f} µs/batch")
                else:
                    progress(f"  [{view}] {wl:4s} {way:20s} {row['note']}")
    _ratios(rows)
    res = {"machine": machine, "date": date, "kind": "fit",
           "settings": {"quick": quick, "batches": sizes, "epochs": epochs, "timed_epochs": epochs - 1,
                        "steps_per_execution": steps_per_execution, "rounds": int(rounds),
                        "workloads": list(workloads_),
                        "views": list(views), "only": list(only) if only else None},
           "rows": rows, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "total_s": time.perf_counter() - started}
    res["markdown"] = to_markdown(res)
    if output_dir is not None:
        harness.save_results(output_dir, "fit_latest", res)
    return res


def _ratios(rows: List[Dict[str, Any]]) -> None:
    """fit: ratio to ``memory`` of the same workload and round; numpy: to the best Grain row."""
    for r in rows:
        if r.get("status") != "ok":
            continue
        same = [
            o for o in rows if o["view"] == r["view"] and o["workload"] == r["workload"] and o.get("status") == "ok"
            and o.get("round", 0) == r.get("round", 0)
        ]
        if r["view"] == "fit":
            ref = [o["batches_per_s"] for o in same if o["way"] == "memory"]
        else:
            ref = [o["batches_per_s"] for o in same if o["way"].startswith("grain-")]
        if ref:
            r["ratio"] = r["batches_per_s"] / max(ref)


# --- markdown -------------------------------------------------------------------------------


def _cell(runs: List[Dict[str, Any]]) -> str:
    """One run: ``rate (ratio)``; several rounds: ``median rate (median ratio, min–max)``."""
    if not runs:
        return ""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return "n/a" if runs[0].get("status") == "n/a" else "error"
    rate = statistics.median(r["batches_per_s"] for r in ok)
    ratios = [r["ratio"] for r in ok if "ratio" in r]
    failed = f", {len(runs) - len(ok)} failed" if len(ok) < len(runs) else ""
    if not ratios:
        return f"{rate:.0f}{failed}"
    if len(ratios) == 1:
        return f"{rate:.0f} ({ratios[0]:.2f}{failed})"
    return f"{rate:.0f} ({statistics.median(ratios):.2f}; {min(ratios):.2f}–{max(ratios):.2f}{failed})"


def to_markdown(res: Dict[str, Any]) -> str:
    m, s = res["machine"], res["settings"]
    lines = [f"Machine: {m['cpu']}, {m['cores_usable']} cores; {res['date']}; Python {m['python']}, "
             f"TensorFlow {m['tensorflow']}, Keras {m['keras']}, Grain {m['grain']}, torch {m['torch']}, "
             f"numpy {m['numpy']}. Load average {m['loadavg_start']} at the start, {res['loadavg_end']} at the end. "
             f"{'Quick' if s['quick'] else 'Full'} run: batches per epoch {s['batches']}, {s['timed_epochs']} "
             f"timed epochs after an untimed one (best shown), steps_per_execution={s['steps_per_execution']}."
             + (f" {s['rounds']} rounds: median batches/s (median ratio; the ratios' range, each ratio against "
                "the reference of its own round)." if s.get("rounds", 1) > 1 else ""), ""]
    titles = {"fit": "`model.fit` (TensorFlow backend, tiny model): batches/s (ratio to the in-memory limit)",
              "numpy": "plain `for batch in ...` over numpy batches: batches/s (ratio to Grain's best)"}
    for view in s["views"]:
        rows = [r for r in res["rows"] if r["view"] == view]
        wls = [w for w in s["workloads"] if any(r["workload"] == w for r in rows)]
        ways = list(dict.fromkeys(r["way"] for r in rows))
        lines += [f"**{titles[view]}**", "", "| way | " + " | ".join(wls) + " |",
                  "| --- |" + " --- |" * len(wls)]
        for way in ways:
            label = fit_ways.LABELS[view][way]
            cells = [_cell([r for r in rows if r["way"] == way and r["workload"] == w]) for w in wls]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        notes = sorted({f"{r['way']}: {r['note']}" for r in rows if r.get("status") != "ok" and r.get("note")})
        lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 epochs (one timed)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                        help="comma-separated among cpu,h5,io,big")
    parser.add_argument("--only", default=None, help="comma-separated way names (see fit_ways.FIT_WAYS/NUMPY_WAYS)")
    parser.add_argument("--views", default=",".join(VIEWS), help="comma-separated among fit,numpy")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch for every workload")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per configuration (first untimed)")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, round after round; median and range")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--render", metavar="JSON", default=None, help="do not run: print a saved result's tables")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        result = child(json.loads(args.child))
        print(_MARK + json.dumps(result, default=str), flush=True)
        return 0
    if args.render:
        print(to_markdown(json.loads(pathlib.Path(args.render).read_text())))
        return 0
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    res = run_fit_benchmark(quick=args.quick, workloads_=split(args.workloads),
                            only=split(args.only) if args.only else None, views=split(args.views),
                            batches=args.batches, epochs=args.epochs,
                            steps_per_execution=args.steps_per_execution, rounds=args.rounds,
                            output_dir=args.output_dir)
    print()
    print(res["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
