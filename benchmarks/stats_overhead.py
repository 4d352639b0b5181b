"""What the always-on input stats cost: an A/B of the consumer's CPU per item.

Two measurements:

1. **Recording cost** (deterministic): the collector calls one item costs
   (``picked`` + ``made``, plus the two clock reads around each), timed over
   many calls in a loop, in microseconds per item.
2. **A/B through tf.data**: the same pipeline built with stats on and off
   (``kerasfeed.observe.stats.ENABLED``), drained the way ``model.fit`` pulls
   (``ds.reduce`` in C++: no Python per element besides the pick-up), in
   alternating pairs (on, off, off, on, ...). The figure is the main
   process's CPU time per item (``time.process_time``), median over pairs;
   overhead = (on - off) / off. The source returns a ready-made small array,
   so the consumer's own cost is as small as it gets and the stats' share as
   large as it gets. Only the threads executor's pick-up and a process
   executor's pick-up run in this process; both are measured.

Run: ``python -m benchmarks.stats_overhead [--items 3000] [--pairs 7]``;
``--quick`` for a smoke run. Prints a table and, with ``--json PATH``, writes
the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np


class Ready:
    """A cheapest possible source: a preallocated small array per item."""

    def __init__(self, n: int):
        self.n = n
        self.x = np.ones((32, 4), np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.x


def recording_cost_us(calls: int = 200_000) -> float:
    """Microseconds per item of what the collector adds (clock reads included)."""
    from kerasfeed.observe.stats import StatsCollector

    c = StatsCollector("bench")
    c.pass_begin(0)
    clock = time.perf_counter
    t0 = clock()
    for _ in range(calls):
        a = clock()
        b = clock()
        c.picked(0, b - a, b)
        e = clock()
        c.made(e - b, None, e)
    return (clock() - t0) / calls * 1e6


def _consumer_cpu_per_item(executor: str, items: int, enabled: bool, workers: int) -> float:
    import kerasfeed
    from kerasfeed.observe import stats as stats_module

    kwargs = {"workers": workers} if executor == "processes" else {}
    saved, stats_module.ENABLED = stats_module.ENABLED, enabled
    try:
        ds = kerasfeed.to_dataset(Ready(items), executor=executor, **kwargs)
    finally:
        stats_module.ENABLED = saved
    ds.reduce(np.int64(0), lambda a, _: a + 1)  # warm-up pass (functions traced, workers started)
    c0 = time.process_time()
    n = int(ds.reduce(np.int64(0), lambda a, _: a + 1))
    cpu = time.process_time() - c0
    assert n == items
    del ds
    return cpu / items * 1e6


def run(items: int, pairs: int, executors: Sequence[str], workers: int, calls: int = 200_000) -> dict:
    out: dict = {"recording_us_per_item": recording_cost_us(calls), "items": items, "pairs": pairs, "executors": {}}
    for executor in executors:
        on, off = [], []
        for k in range(pairs):
            order = (True, False) if k % 2 == 0 else (False, True)
            for enabled in order:
                (on if enabled else off).append(_consumer_cpu_per_item(executor, items, enabled, workers))
        diffs = [a - b for a, b in zip(on, off)]
        base = statistics.median(off)
        out["executors"][executor] = {
            "on_us_per_item": statistics.median(on),
            "off_us_per_item": base,
            "paired_diff_us_median": statistics.median(diffs),
            "overhead_pct": statistics.median(diffs) / base * 100 if base else None,
            "recording_pct": out["recording_us_per_item"] / base * 100 if base else None,
        }
    return out


def to_table(res: dict) -> str:
    lines = [
        f"stats recording: {res['recording_us_per_item']:.2f} us per item (collector calls and clock reads)",
        f"A/B, {res['items']} items per pass, {res['pairs']} pairs, main-process CPU per item (median):",
        "| executor | stats on µs/item | stats off µs/item | paired diff µs | overhead (A/B) | recording / off |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res["executors"].items():
        lines.append(
            f"| {name} | {r['on_us_per_item']:.1f} | {r['off_us_per_item']:.1f} | {r['paired_diff_us_median']:+.1f} | "
            f"{r['overhead_pct']:+.1f} % | {r['recording_pct']:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executors", default="threads,processes")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 items, 1 pair")
    parser.add_argument("--json", default=None, help="write the figures there")
    args = parser.parse_args(argv)
    items, pairs = (200, 1) if args.quick else (args.items, args.pairs)
    res = run(items, pairs, [e for e in args.executors.split(",") if e], args.workers)
    print(to_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
