"""``model.fit`` epochs of several ways alternating in one process: same-run ratios on a noisy machine.

``python benchmarks/fit_ab.py --workload h5 --ways memory,kerasfeed-cached --rounds 10``

``fit.py`` runs each configuration in its own child process, one after another; on a machine whose
speed drifts between minutes (a shared VM: the same configuration varied by +-20 % from one run to the
next on 2026-11-27), a ratio of two such runs carries that drift. Here every way is built once in one
process (its own fresh source and model), warmed up (``--warmup`` epochs: the first fills a cache), and
then the ways run one epoch each, in turn, ``--rounds`` times. Each round's ratio is against the first
way's epoch of the same round, so a slow minute slows both. Printed: per way the median batches/s and
main-process CPU per batch, and per round the ratios (median, range). The price is that the ways share
the process: TensorFlow's thread pools, and a way's idle worker processes while another way runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import runner, ways, workloads  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402


def _epoch_clock() -> Any:
    import keras

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = (time.perf_counter(), time.process_time())
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches = batch + 1

        def on_epoch_end(self, epoch, logs=None):
            self.took = (time.perf_counter() - self.start[0], time.process_time() - self.start[1])

    return Clock()


def run_ab(workload: str, way_names: Sequence[str], *, batches: Optional[int] = None, rounds: int = 10, warmup: int = 2,
           workers: int = 2, cache_dir: pathlib.Path = runner.DEFAULT_OUTPUT_DIR / "cache") -> Dict[str, Any]:
    """Builds every way of ``way_names`` on ``workload`` in this process and alternates their epochs
    (``batches`` an epoch; None: the workload's full size).

    Returns:
        ``{"machine", "workload", "ways", "rounds": [{way: {"batches_per_s", "main_cpu_us"}}],
        "ratios": {way: [per round, against the first way]}, "summary": {way: {...}}}``.

    Raises:
        ValueError: an unknown way or workload, fewer than two ways, or a way that cannot feed ``fit``.
    """
    if len(way_names) < 2:
        raise ValueError(f"--ways needs two ways or more, the first the reference. Received: {list(way_names)}")
    workloads.check_names([workload])
    batches = batches or workloads.REGISTRY[workload].full
    unknown = [w for w in way_names if w not in ways.REGISTRY]
    if unknown:
        raise ValueError(f"unknown ways {unknown}; expected among {sorted(ways.REGISTRY)}. Received: {list(way_names)}")
    ctx = ways.Context("fit", "tensorflow", workers)
    for name in way_names:
        why = ways.REGISTRY[name].missing(ctx)
        if why is not None:
            raise ValueError(f"way {name!r} cannot run here: {why}. Received: --ways {','.join(way_names)}")
    workloads.prepare(workload, batches, cache_dir)
    feeds, models = {}, {}
    try:
        for name in way_names:
            seq = workloads.make_workload(workload, batches, cache_dir)
            x0, y0 = (np.asarray(a) for a in seq[0])
            feeds[name] = ways.REGISTRY[name].make(seq, ctx)
            models[name] = runner.build_model("tiny", x0, int(max(10, np.max(y0) + 1)))
        for name in way_names:  # warm-up: tracing, a cache's first pass
            feed = feeds[name]
            models[name].fit(feed.x, **feed.fit_kwargs, epochs=warmup, verbose=0, shuffle=False)
        per_round: List[Dict[str, Dict[str, float]]] = []
        for r in range(rounds):
            row = {}
            for name in way_names:
                clock, feed = _epoch_clock(), feeds[name]
                # Keras' epoch numbers go on from call to call: a kerasfeed pipeline's pass follows them (a
                # pass 0 again would drop the next pass its workers made ahead).
                models[name].fit(feed.x, **feed.fit_kwargs, initial_epoch=warmup + r, epochs=warmup + r + 1,
                                 verbose=0, shuffle=False, callbacks=[clock])
                if clock.batches != batches:
                    raise RuntimeError(f"way {name!r} ran {clock.batches} batches in an epoch, expected {batches}")
                wall, cpu = clock.took
                row[name] = {"batches_per_s": batches / wall, "main_cpu_us": cpu / batches * 1e6}
            per_round.append(row)
    finally:
        for feed in feeds.values():
            feed.close()
    ref = way_names[0]
    ratios = {name: [r[name]["batches_per_s"] / r[ref]["batches_per_s"] for r in per_round] for name in way_names}
    summary = {name: {"batches_per_s": statistics.median(r[name]["batches_per_s"] for r in per_round),
                      "main_cpu_us": statistics.median(r[name]["main_cpu_us"] for r in per_round),
                      "ratio": statistics.median(ratios[name]), "ratio_range": [min(ratios[name]), max(ratios[name])]}
               for name in way_names}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"machine": machine_info(), "date": now, "workload": workload, "batches": batches,
            "ways": list(way_names), "rounds": per_round, "ratios": ratios, "summary": summary}


def render(result: Dict[str, Any]) -> str:
    ref = result["ways"][0]
    lines = [f"`fit_ab.py`, {result['workload']} ({result['batches']} batches an epoch), {len(result['rounds'])} "
             f"alternating rounds, {result['date']}; ratios against `{ref}` in the same round:", "",
             "| way | batches/s (median) | main CPU us/batch | ratio (median; range) |", "| --- | --- | --- | --- |"]
    for name in result["ways"]:
        s = result["summary"][name]
        lo, hi = s["ratio_range"]
        lines.append(f"| {name} | {s['batches_per_s']:,.0f} | {s['main_cpu_us']:,.0f} | "
                     f"{s['ratio']:.2f} ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="h5", help=f"one of {','.join(workloads.REGISTRY)}")
    p.add_argument("--ways", default="memory,kerasfeed-cached",
                   help="comma-separated way names (benchmarks/ways.py); the first is the reference")
    p.add_argument("--batches", type=int, default=None, help="batches per epoch (default: the workload's full size)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        p.error(f"--rounds and --warmup must be at least 1. Received: --rounds {args.rounds} --warmup {args.warmup}")
    try:
        result = run_ab(args.workload, [w for w in args.ways.split(",") if w], batches=args.batches,
                        rounds=args.rounds, warmup=args.warmup, workers=args.workers)
    except ValueError as e:  # a bad name: said as argparse says it (rc 2), not a traceback
        p.error(str(e))
    print(render(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
