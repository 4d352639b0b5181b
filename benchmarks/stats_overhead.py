"""What the always-on input stats cost: an A/B of the consumer's CPU per item.

Two measurements:

1. **Recording cost** (deterministic): what one item adds, timed over many
   calls in a loop, in microseconds per item: the consumer's part (two clock
   reads around the pick-up and ``picked``) and the producer's part (one clock
   read and ``made``: the start of a make is a clock read the thread executor
   takes anyway, for its timeout).
2. **A/B through tf.data**: the same pipeline built with stats on and off
   (``kerasfeed.observe.stats.ENABLED``), drained the way ``model.fit`` pulls
   (``ds.reduce`` in C++: no Python per element besides the pick-up), in
   alternating pairs (on, off, off, on, ...). Per run: the main process's CPU
   time per item (``time.process_time``), split for the thread executor into
   its pool threads' CPU (Linux: ``/proc/self/task/<tid>/schedstat``, the
   threads' on-CPU nanoseconds) and the rest (the consumer: tf.data's threads
   and the pick-up), plus context switches per item (``getrusage``). CPU
   time, not wall time: other processes on the machine do not count, but a
   busy machine still moves it (caches, and how the GIL and tf.data's
   threads hand over). Reported: medians, the paired differences'
   median and spread (min..max over pairs); overhead = median paired
   difference / median off. The source returns a ready-made small array, so
   the consumer's own cost is as small as it gets and the stats' share as
   large as it gets. Only the threads executor's pick-up and a process
   executor's pick-up run in this process; both are measured.

Run: ``python -m benchmarks.stats_overhead [--items 3000] [--pairs 7]``;
``--quick`` for a smoke run. Prints a table and, with ``--json PATH``, writes
the figures (every run's, too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from kerasfeed.loading.groups import GroupLoader


class Ready:
    """A cheapest possible source: a preallocated small array per item."""

    def __init__(self, n: int):
        self.n = n
        self.x = np.ones((32, 4), np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.x


def recording_cost_us(calls: int = 200_000) -> dict:
    """Microseconds per item of what the collector adds, clock reads included:
    ``{"consumer", "producer", "total"}`` (this thread's CPU time, best of 5
    loops, the bare loop's cost subtracted)."""
    from kerasfeed.observe.stats import StatsCollector

    def consumer() -> float:
        c = StatsCollector("bench")
        c.pass_begin(0)
        clock = time.perf_counter
        t0 = time.thread_time()
        for _ in range(calls):
            a = clock()
            b = clock()
            c.picked(0, b - a, b)
        return (time.thread_time() - t0) / calls * 1e6

    def producer() -> float:
        c = StatsCollector("bench")
        clock = time.perf_counter
        start = clock()
        t0 = time.thread_time()
        for _ in range(calls):
            e = clock()
            c.made(e - start, None, e)
        return (time.thread_time() - t0) / calls * 1e6

    def loop() -> float:  # the bare loop, subtracted
        t0 = time.thread_time()
        for _ in range(calls):
            pass
        return (time.thread_time() - t0) / calls * 1e6

    base = min(loop() for _ in range(5))
    cons = max(0.0, min(consumer() for _ in range(5)) - base)
    prod = max(0.0, min(producer() for _ in range(5)) - base)
    return {"consumer": cons, "producer": prod, "total": cons + prod}


def _task_cpu_ns(tids: set) -> Optional[int]:
    """On-CPU nanoseconds of these threads of this process (Linux), else None."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return total


def _pool_thread_ids(ds: Any) -> set:
    """The native ids of this dataset's pool threads (thread executor; none for processes)."""
    return {t.native_id for t in getattr(ds._kerasfeed_executor, "_threads", [])}


def _context_switches() -> Optional[int]:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def _dataset(executor: str, items: int, enabled: bool, workers: int):
    """``to_dataset(Ready(items))`` built with stats switched on or off."""
    import kerasfeed
    from kerasfeed.observe import stats as stats_module

    kwargs = {"workers": workers} if executor == "processes" else {}
    saved, stats_module.ENABLED = stats_module.ENABLED, enabled
    try:
        return kerasfeed.to_dataset(Ready(items), executor=executor, **kwargs)
    finally:
        stats_module.ENABLED = saved


def _consumer_cpu_per_item(executor: str, items: int, enabled: bool, workers: int) -> dict:
    """One run: ``{"process", "pool", "consumer", "switches"}`` per item (µs;
    switches as a count); ``pool``/``consumer`` are None unless measurable."""
    ds = _dataset(executor, items, enabled, workers)
    ds.reduce(np.int64(0), lambda a, _: a + 1)  # warm-up pass (functions traced, workers, pool threads started)
    pool = _pool_thread_ids(ds)
    s0, p0 = _context_switches(), _task_cpu_ns(pool) if pool else None
    c0 = time.process_time()
    n = int(ds.reduce(np.int64(0), lambda a, _: a + 1))
    cpu = time.process_time() - c0
    p1, s1 = _task_cpu_ns(pool) if pool else None, _context_switches()
    assert n == items
    del ds
    out = {"process": cpu / items * 1e6, "pool": None, "consumer": None, "switches": None}
    if p0 is not None and p1 is not None:
        out["pool"] = (p1 - p0) / items / 1e3
        out["consumer"] = out["process"] - out["pool"]
    if s0 is not None and s1 is not None:
        out["switches"] = (s1 - s0) / items
    return out


def _python_side_cpu_per_item(executor: str, items: int, enabled: bool, workers: int) -> dict:
    """Like ``_consumer_cpu_per_item``, without tf.data: this thread calls the
    dataset's Python side (its group loader over ``PassPipeline.load``) the
    way the pick-up ``numpy_function`` does, item by item in pass order.
    ``consumer`` is this thread's CPU (``time.thread_time``): the pick-up
    alone, free of tf.data's own threads and their scheduling."""
    ds = _dataset(executor, items, enabled, workers)
    pipeline, groups = ds._kerasfeed_pipeline, ds._kerasfeed_groups

    def one_pass() -> int:
        if groups is not None:  # the group loader keeps the pass's position
            epoch = groups.begin()
            count = 0
            while True:
                out = groups.load(epoch)
                got = len(out[-1] if isinstance(groups, GroupLoader) else out[0])  # ragged: lengths last
                if not got:
                    return count
                count += got
        indices, epoch = pipeline.begin()
        for i in indices:
            pipeline.load(i, epoch)
        return len(indices)

    one_pass()  # warm-up pass
    pool = _pool_thread_ids(ds)
    s0, p0 = _context_switches(), _task_cpu_ns(pool) if pool else None
    c0, t0 = time.process_time(), time.thread_time()
    n = one_pass()
    mine, cpu = time.thread_time() - t0, time.process_time() - c0
    p1, s1 = _task_cpu_ns(pool) if pool else None, _context_switches()
    assert n == items
    del ds
    out = {"process": cpu / items * 1e6, "pool": None, "consumer": mine / items * 1e6, "switches": None}
    if p0 is not None and p1 is not None:
        out["pool"] = (p1 - p0) / items / 1e3
    if s0 is not None and s1 is not None:
        out["switches"] = (s1 - s0) / items
    return out


def _spread(values: Sequence[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(
    items: int,
    pairs: int,
    executors: Sequence[str],
    workers: int,
    calls: int = 200_000,
    mode: str = "tfdata",
) -> dict:
    """``mode``: ``"tfdata"`` (drained by ``ds.reduce``) or ``"python"`` (the
    Python side driven from one thread, see ``_python_side_cpu_per_item``)."""
    measure = {"tfdata": _consumer_cpu_per_item, "python": _python_side_cpu_per_item}[mode]
    rec = recording_cost_us(calls)
    out: dict = {"recording_us_per_item": rec["total"], "recording": rec, "items": items, "pairs": pairs,
                 "mode": mode, "executors": {}}
    for executor in executors:
        on, off = [], []
        for k in range(pairs):
            order = (True, False) if k % 2 == 0 else (False, True)
            for enabled in order:
                (on if enabled else off).append(measure(executor, items, enabled, workers))
        row: dict = {"runs": {"on": on, "off": off}}
        for part in ("process", "pool", "consumer", "switches"):
            if any(r[part] is None for r in on + off):
                continue
            diffs = [a[part] - b[part] for a, b in zip(on, off)]
            row[part] = {"on": _spread([r[part] for r in on]), "off": _spread([r[part] for r in off]),
                         "diff": _spread(diffs)}
        proc = row["process"]
        base = proc["off"]["median"]
        row.update({
            "on_us_per_item": proc["on"]["median"],
            "off_us_per_item": base,
            "paired_diff_us_median": proc["diff"]["median"],
            "overhead_pct": proc["diff"]["median"] / base * 100 if base else None,
            "recording_pct": rec["total"] / base * 100 if base else None,
        })
        out["executors"][executor] = row
    return out


def to_table(res: dict) -> str:
    rec = res["recording"]
    lines = [
        f"stats recording: {rec['total']:.2f} us per item (consumer {rec['consumer']:.2f}: two clock reads and "
        f"picked; producer {rec['producer']:.2f}: one clock read and made)",
        f"A/B ({res.get('mode', 'tfdata')}), {res['items']} items per pass, {res['pairs']} pairs, CPU per item: "
        "median on / median off / paired difference median [min..max]",
        "| executor | part | stats on | stats off | paired diff | overhead (A/B) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    consumer = "pick-up thread µs" if res.get("mode") == "python" else "consumer µs"
    names = {"process": "process CPU µs", "pool": "pool threads µs", "consumer": consumer,
             "switches": "context switches"}
    for name, r in res["executors"].items():
        base = r["process"]["off"]["median"]
        for part, label in names.items():
            if part not in r:
                continue
            f = r[part]
            d = f["diff"]
            share = f"{d['median'] / base * 100:+.1f} %" if part != "switches" and base else ""
            lines.append(
                f"| {name} | {label} | {f['on']['median']:.2f} | {f['off']['median']:.2f} | "
                f"{d['median']:+.2f} [{d['min']:+.2f}..{d['max']:+.2f}] | {share} |"
            )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executors", default="threads,processes")
    parser.add_argument(
        "--mode", default="tfdata,python",
        help="tfdata (drained by ds.reduce), python (the Python side driven from one thread), or both",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 items, 1 pair")
    parser.add_argument("--json", default=None, help="write the figures there")
    args = parser.parse_args(argv)
    items, pairs = (200, 1) if args.quick else (args.items, args.pairs)
    executors = [e for e in args.executors.split(",") if e]
    results = [run(items, pairs, executors, args.workers, mode=m) for m in args.mode.split(",") if m]
    print("\n\n".join(to_table(r) for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
