"""CPU an input path spends per batch when consumed at a fixed pace, split by thread.

Under ``model.fit`` on a small machine the input path's CPU competes with the training loop for the
same cores (and the loop's own Python for the GIL): at the same delivered rate, a path that costs less
CPU per batch leaves more to the train step. ``benchmarks/fit.py`` shows the resulting epoch times;
this shows where the input path's CPU goes, in figures that move much less with machine load than
wall-clock rates do:

- each way is consumed by a plain Python loop at ``--rate`` batches/s (``next(it)`` then a sleep to
  the next tick), in its own process, after ``--warmup`` batches;
- the CPU of every thread of that process (``/proc/self/task/*/schedstat``, ns resolution) and of its
  worker processes is read before and after, and reported per batch by group: the pacing loop
  (``main``), kerasfeed's pool threads, tf.data's threads, other Python threads (Grain's), worker
  processes.

``PYTHONPATH=/other/tree python benchmarks/paced_cost.py ...`` measures another tree's kerasfeed.
Run: ``python benchmarks/paced_cost.py [--workload io] [--rate 1000] [--batches 3000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import runner, ways, workloads  # noqa: E402

WAYS = ("memory", "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto", "grain-threads")
GROUPS = ("main", "kerasfeed threads", "tf.data threads", "other threads", "worker processes")


def _thread_cpu_us() -> Dict[str, float]:
    """CPU so far (µs) of this process's threads, summed by group."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Dict[str, float] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        name = names.get(int(tid))
        if name == "MainThread":
            group = "main"
        elif name is None:
            group = "tf.data threads"  # threads Python did not start: TensorFlow's
        elif name.startswith("kerasfeed"):
            group = "kerasfeed threads"
        else:
            group = "other threads"
        out[group] += ns / 1e3
    return out


def _workers_cpu_us() -> float:
    total = 0.0
    for p in runner.descendants():
        try:
            t = p.cpu_times()
            total += (t.user + t.system) * 1e6
        except Exception:  # noqa: BLE001 - a worker that ended meanwhile
            pass
    return total


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Consumes ``spec["way"]`` (built as ``model.fit`` on TensorFlow would get it) at a fixed pace; CPU by group."""
    n, warmup, rate = spec["batches"], spec["warmup"], float(spec["rate"])
    seq = workloads.make_workload(spec["workload"], n + warmup, spec["cache_dir"])
    feed = ways.REGISTRY[spec["way"]].make(seq, ways.Context("fit", "tensorflow"))
    it = iter(feed.x)
    try:
        for _ in range(warmup):
            next(it)
        threads0, workers0 = _thread_cpu_us(), _workers_cpu_us()
        t0 = time.perf_counter()
        for k in range(n):
            next(it)
            ahead = t0 + (k + 1) / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
        wall = time.perf_counter() - t0
        threads1, workers1 = _thread_cpu_us(), _workers_cpu_us()
    finally:
        feed.close()
    per_batch = {g: (threads1.get(g, 0.0) - threads0.get(g, 0.0)) / n for g in GROUPS[:-1]}
    per_batch["worker processes"] = (workers1 - workers0) / n
    return {"way": spec["way"], "status": "ok", "delivered_per_s": n / wall, "cpu_us_per_batch": per_batch,
            "total_us_per_batch": sum(per_batch.values())}


def run(workload: str = "io", rate: float = 1000.0, batches: int = 3000, warmup: int = 300, rounds: int = 1,
        ways: Sequence[str] = WAYS, cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """Runs every way ``rounds`` times (round after round); returns the runs and a markdown table."""
    if workload not in workloads.WORKLOADS:
        raise ValueError(
            f"Unknown workload {workload!r}; expected one of {workloads.WORKLOADS}. Received: {workload!r}")
    if not rate > 0 or int(batches) < 1 or int(warmup) < 0 or int(rounds) < 1:
        raise ValueError(
            "`rate` must be > 0, `batches` and `rounds` at least 1, `warmup` at least 0. "
            f"Received: rate={rate}, batches={batches}, warmup={warmup}, rounds={rounds}"
        )
    for way in ways:
        if way not in WAYS:
            raise ValueError(f"Unknown way {way!r}; expected some of {WAYS}. Received: {way!r}")
    cache = cache_dir or str(ROOT / "benchmarks" / "results" / "cache")
    pathlib.Path(cache).mkdir(parents=True, exist_ok=True)
    if workload == "h5":
        workloads.scene_file(pathlib.Path(cache), batches + warmup)
    runs: List[Dict[str, Any]] = []
    for round_ in range(int(rounds)):
        for way in ways:
            spec = {"way": way, "workload": workload, "rate": rate, "batches": batches, "warmup": warmup,
                    "cache_dir": cache}
            (r,) = runner.isolated([{**spec, "call": "benchmarks.paced_cost:child"}], timeout_s=600,
                                   progress=lambda line: None)
            r["round"] = round_
            runs.append(r)
            if r["status"] == "ok":
                print(f"  {way:20s} {r['delivered_per_s']:7.0f}/s  {r['total_us_per_batch']:6.0f} µs CPU per batch",
                      flush=True)
            else:
                print(f"  {way:20s} {r['note']}", flush=True)
    return {"workload": workload, "rate": rate, "batches": batches, "rounds": rounds, "runs": runs,
            "markdown": to_markdown(runs, workload, rate)}


def to_markdown(runs: List[Dict[str, Any]], workload: str, rate: float) -> str:
    lines = [f"CPU µs per batch at {rate:.0f} batches/s (`{workload}`; median over rounds, total's range)", "",
             "| way | delivered/s | total | " + " | ".join(GROUPS) + " |", "| --- |" + " --- |" * (len(GROUPS) + 2)]
    for way in dict.fromkeys(r["way"] for r in runs):
        ok = [r for r in runs if r["way"] == way and r["status"] == "ok"]
        if not ok:
            lines.append(f"| {way} | error |" + " |" * (len(GROUPS) + 1))
            continue
        totals = [r["total_us_per_batch"] for r in ok]
        spread = f" ({min(totals):.0f}–{max(totals):.0f})" if len(ok) > 1 else ""
        cells = [f"{statistics.median(r['cpu_us_per_batch'][g] for r in ok):.0f}" for g in GROUPS]
        lines.append(f"| {way} | {statistics.median(r['delivered_per_s'] for r in ok):.0f} | "
                     f"{statistics.median(totals):.0f}{spread} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="io")
    parser.add_argument("--rate", type=float, default=1000.0, help="batches/s the loop asks for")
    parser.add_argument("--batches", type=int, default=3000, help="timed batches per way")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", default=None, help="also write the runs here")
    args = parser.parse_args(argv)
    res = run(args.workload, args.rate, args.batches, args.warmup, args.rounds, [w for w in args.ways.split(",") if w])
    print()
    print(res["markdown"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
