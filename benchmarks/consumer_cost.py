"""The processes executor's consumer-side cost per item, in figures that do not depend on load.

What ``benchmarks/run.py`` reports as "consumer µs/item" is the pool's own figure: the CPU of the
thread that picks an item up (``load``, not counting its wait) plus the CPU of the reader threads,
per item. Wall-clock rates on a shared machine move with the load; these move much less:

- ``cpu``: that figure and its two parts, measured with ``time.thread_time`` over ``--items`` items
  per pass, ``--passes`` passes (median and range), plus the main process's CPU per item;
- ``--calls``: Python function calls per item on the pick-up path and in the reader threads
  (cProfile on each of those threads), which does not depend on load at all.

Run it once per tree to compare two versions (alternate the runs): ``PYTHONPATH=/path/to/other/tree
python benchmarks/consumer_cost.py`` measures the kerasfeed of that tree. The source is a ready-made
item (a (32, 64, 64, 3) float32 batch and its labels, like the ``cpu`` workload's) so the consumer,
not the workers, sets the pace.
Run: ``python -m benchmarks.consumer_cost [--items 400] [--passes 5] [--calls] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

import kerasfeed


class ReadyBatches(kerasfeed.SceneSequence):
    """A batch like the ``cpu`` workload's, made at once."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return np.full((32, 64, 64, 3), float(i % 255), np.float32), np.full((32,), i % 10, np.int64)


def _pool_core(ds: Any) -> Any:
    lookup = getattr(kerasfeed, "executor_of", None)  # older trees: the documented attribute
    pool = (lookup(ds) if lookup is not None else ds._kerasfeed_executor).pool
    return getattr(pool, "_dispatcher", None) or pool._core  # the name before the split


def _readers_cpu(core: Any) -> float:
    if hasattr(core, "lanes"):
        return sum(lane.process.reader_cpu_s for lane in core.lanes)
    return sum(w.reader_cpu_s for w in core.workers)


def _source(workload: str, items: int) -> Any:
    if workload == "cpu":  # the benchmark's: ~1.7 ms of Python per item in the workers
        from benchmarks.workloads import CpuBatches

        return CpuBatches(items)
    return ReadyBatches(items)


def _drain(ds: Any, workload: str) -> int:
    if workload == "cpu":  # as benchmarks/run.py iterates: batch by batch in Python
        n = 0
        for x, _ in ds:
            n += 1
            float(x.numpy()[0, 0, 0, 0])
        return n
    return int(ds.reduce(np.int64(0), lambda a, _: a + 1))


def measure(items: int, passes: int, workers: int, workload: str = "ready") -> dict:
    ds = kerasfeed.to_dataset(_source(workload, items), executor="processes", workers=workers)
    core = _pool_core(ds)
    _drain(ds, workload)  # warm-up: functions traced, workers started
    rows = []
    for _ in range(passes):
        c0, r0, n0, p0 = core.consumer_cpu_s, _readers_cpu(core), core.items, time.process_time()
        n = _drain(ds, workload)
        main = time.process_time() - p0
        done = core.items - n0
        assert n == items == done, (n, items, done)
        pickup, reader = (core.consumer_cpu_s - c0) / done * 1e6, (_readers_cpu(core) - r0) / done * 1e6
        rows.append({"consumer_us": pickup + reader, "pickup_us": pickup, "reader_us": reader,
                     "main_process_us": main / done * 1e6})
    del ds
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in rows[0]}


def count_calls(items: int, passes: int, workers: int) -> dict:
    """Python calls per item on the pick-up path and in the reader threads."""
    from kerasfeed.loading.pipeline import PassPipeline

    core_cls = type(_pool_core(kerasfeed.to_dataset(ReadyBatches(2), executor="processes", workers=1)))
    profiles: list = []
    local = threading.local()
    read_loop, load = core_cls._read_loop, PassPipeline.load

    def profiled_read_loop(self, lane):
        prof = cProfile.Profile()
        profiles.append(("reader", prof))
        prof.runcall(read_loop, self, lane)

    def profiled_load(self, i, epoch):
        prof = getattr(local, "prof", None)
        if prof is None:
            prof = local.prof = cProfile.Profile()
            profiles.append(("pickup", prof))
        prof.enable()
        try:
            return load(self, i, epoch)
        finally:
            prof.disable()

    core_cls._read_loop, PassPipeline.load = profiled_read_loop, profiled_load
    try:
        ds = kerasfeed.to_dataset(ReadyBatches(items), executor="processes", workers=workers)
        for _ in range(passes):
            ds.reduce(np.int64(0), lambda a, _: a + 1)
        core = _pool_core(ds)
        core.close()  # the reader threads end: their profiles are complete
        for lane_or_worker in getattr(core, "lanes", None) or core.workers:
            reader = getattr(getattr(lane_or_worker, "process", lane_or_worker), "reader", None)
            if reader is not None:
                reader.join(5)
        del ds, core
    finally:
        core_cls._read_loop, PassPipeline.load = read_loop, load
    total = items * passes
    out = {}
    for kind in ("pickup", "reader"):
        found = [p for k, p in profiles if k == kind]
        stats = pstats.Stats(found[0])
        for p in found[1:]:
            stats.add(p)
        out[f"{kind}_calls_per_item"] = stats.total_calls / total
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workload", choices=("ready", "cpu"), default="ready",
                        help="ready: items made at once (the consumer sets the pace); cpu: the benchmark's cpu "
                        "workload iterated in Python (the workers set the pace; run from the tree's root)")
    parser.add_argument("--calls", action="store_true", help="also count Python calls per item")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    res: dict = {"kerasfeed": kerasfeed.__file__, "workload": args.workload,
                 "cpu": measure(args.items, args.passes, args.workers, args.workload)}
    if args.calls:
        res["calls"] = count_calls(args.items, 2, args.workers)
    for name, r in res["cpu"].items():
        print(f"{name:16s} median {r['median']:7.1f} µs/item  [{r['min']:.1f} - {r['max']:.1f}]")
    for name, v in res.get("calls", {}).items():
        print(f"{name:24s} {v:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
