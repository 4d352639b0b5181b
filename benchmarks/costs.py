"""What the input path costs the training loop, in figures that move far less with machine load than rates.

Three measures, each a subcommand (``python benchmarks/costs.py SUBCOMMAND --help``):

- ``paced``: each way of the registry consumed by a plain Python loop at a fixed ``--rate``
  (``next(it)``, then a sleep to the next tick), in its own child process, after ``--warmup``
  batches; the CPU of every thread of that process (``/proc/self/task/*/schedstat``) and of its
  worker processes, per batch, by group: the pacing loop (``main``), kerasfeed's pool threads,
  tf.data's threads, other Python threads (Grain's), worker processes. Under ``fit`` on a small
  machine that CPU competes with the train step.
- ``consumer``: the processes executor's consumer side per item (the pick-up, not counting its
  wait, plus the reader threads; ``time.thread_time``), median and range over ``--passes``, and with
  ``--calls`` the Python calls per item on each (cProfile), which do not depend on load at all.
- ``place``: ``jax.device_put`` of one ``decode`` batch from a heap array and from a lent
  shared-memory view, wall and CPU per call (issue 24: is placing lent memory dearer?).
- ``state-sync``: what carrying the source's state to the worker processes costs per pass (the
  consumer's check, the send when it changed, whole passes), for a small source and one holding a
  large array (writeable, read-only, changed in place every pass).

``PYTHONPATH=/other/tree python benchmarks/costs.py ...`` measures another tree's kerasfeed
(alternate the runs to compare two versions).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pathlib
import pstats
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import machine, runner, ways, workloads  # noqa: E402

PACED_WAYS = ("memory", "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto", "grain-threads")
GROUPS = ("main", "kerasfeed threads", "tf.data threads", "other threads", "worker processes")


# --- paced: CPU per batch at a fixed pace, by thread group -------------------------------------------


def _thread_group(name: Optional[str]) -> str:
    return ("main" if name == "MainThread" else "tf.data threads" if name is None  # not started by Python
            else "kerasfeed threads" if name.startswith("kerasfeed") else "other threads")


def _thread_cpu_us() -> Dict[str, float]:
    """CPU so far (µs) of this process's threads, summed by group."""
    return collections.Counter(machine.thread_cpu_us(_thread_group))


def _workers_cpu_us() -> float:
    return sum(machine.workers_cpu(machine.descendants()).values()) * 1e6


def paced_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Consumes ``spec["way"]`` (what ``model.fit`` on TensorFlow would get) at a fixed pace; CPU by group."""
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


def paced(workload: str = "io", rate: float = 1000.0, batches: int = 3000, warmup: int = 300, rounds: int = 1,
          names: Sequence[str] = PACED_WAYS, cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """Runs every way ``rounds`` times (round after round); returns the runs and a markdown table."""
    workloads.check_names([workload])
    if not rate > 0 or int(batches) < 1 or int(warmup) < 0 or int(rounds) < 1:
        raise ValueError("`rate` must be > 0, `batches` and `rounds` at least 1, `warmup` at least 0. "
                         f"Received: rate={rate}, batches={batches}, warmup={warmup}, rounds={rounds}")
    for name in names:
        if name not in PACED_WAYS:
            raise ValueError(f"Unknown way {name!r}; expected some of {PACED_WAYS}. Received: {name!r}")
    cache = cache_dir or str(runner.DEFAULT_OUTPUT_DIR / "cache")
    pathlib.Path(cache).mkdir(parents=True, exist_ok=True)
    workloads.prepare(workload, batches + warmup, cache)
    runs: List[Dict[str, Any]] = []
    for round_ in range(int(rounds)):
        for name in names:
            spec = {"call": "benchmarks.costs:paced_child", "way": name, "workload": workload, "rate": rate,
                    "batches": batches, "warmup": warmup, "cache_dir": cache}
            (r,) = runner.isolated([spec], timeout_s=600, progress=lambda line: None)
            runs.append({**r, "round": round_})
            print(f"  {name:20s} " + (f"{r['delivered_per_s']:7.0f}/s  {r['total_us_per_batch']:6.0f} µs CPU per batch"
                                      if r["status"] == "ok" else r["note"]), flush=True)
    lines = [f"CPU µs per batch at {rate:.0f} batches/s (`{workload}`; median over rounds, total's range)", "",
             "| way | delivered/s | total | " + " | ".join(GROUPS) + " |", "| --- |" + " --- |" * (len(GROUPS) + 2)]
    for name in dict.fromkeys(r["way"] for r in runs):
        ok = [r for r in runs if r["way"] == name and r["status"] == "ok"]
        if not ok:
            lines.append(f"| {name} | error |" + " |" * (len(GROUPS) + 1))
            continue
        totals = [r["total_us_per_batch"] for r in ok]
        spread = f" ({min(totals):.0f}–{max(totals):.0f})" if len(ok) > 1 else ""
        cells = [f"{statistics.median(r['cpu_us_per_batch'][g] for r in ok):.0f}" for g in GROUPS]
        lines.append(f"| {name} | {statistics.median(r['delivered_per_s'] for r in ok):.0f} | "
                     f"{statistics.median(totals):.0f}{spread} | " + " | ".join(cells) + " |")
    return {"workload": workload, "rate": rate, "batches": batches, "rounds": rounds, "runs": runs,
            "markdown": "\n".join(lines)}


# --- consumer: the processes executor's consumer side per item -----------------------------------------


class ReadyBatches(workloads.SceneSequence):
    """A batch like the ``cpu`` workload's, made at once: the consumer, not the workers, sets the pace."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return np.full((32, 64, 64, 3), float(i % 255), np.float32), np.full((32,), i % 10, np.int64)


def _dispatcher(ds: Any) -> Any:
    import kerasfeed

    ex = kerasfeed.executor_of(ds)
    if hasattr(ex, "_dispatcher"):
        return ex._dispatcher
    return getattr(ex.pool, "_dispatcher", None) or ex.pool._core  # older trees: behind a WorkerPool


def _source(workload: str, items: int) -> Any:
    return workloads.CpuBatches(items) if workload == "cpu" else ReadyBatches(items)


def _drain(ds: Any, workload: str) -> int:
    if workload == "cpu":  # as benchmarks/run.py's first epoch iterates: batch by batch in Python
        return sum(1 for x, _ in ds if float(x.numpy()[0, 0, 0, 0]) >= 0)
    return int(ds.reduce(np.int64(0), lambda a, _: a + 1))


def consumer(items: int, passes: int, workers: int, workload: str = "ready") -> Dict[str, Any]:
    """Consumer CPU µs per item (pick-up + readers) and the main process's, median/min/max over passes."""
    import kerasfeed

    ds = kerasfeed.to_dataset(_source(workload, items), executor="processes", workers=workers)
    d = _dispatcher(ds)
    readers = lambda: sum(lane.process.reader_cpu_s for lane in d.lanes)  # noqa: E731
    _drain(ds, workload)  # warm-up: functions traced, workers started
    rows = []
    for _ in range(passes):
        c0, r0, n0, p0 = d.consumer_cpu_s, readers(), d.items, time.process_time()
        n = _drain(ds, workload)
        main, done = time.process_time() - p0, d.items - n0
        if not n == items == done:
            raise RuntimeError(f"a pass delivered {n} items ({done} counted), expected {items}")
        pickup, reader = (d.consumer_cpu_s - c0) / done * 1e6, (readers() - r0) / done * 1e6
        rows.append({"consumer_us": pickup + reader, "pickup_us": pickup, "reader_us": reader,
                     "main_process_us": main / done * 1e6})
    kerasfeed.executor_of(ds).close()
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in rows[0]}


def count_calls(items: int, passes: int, workers: int) -> Dict[str, float]:
    """Python calls per item on the pick-up path (``PassPipeline.load``) and in the reader threads."""
    import kerasfeed
    from kerasfeed.execution.processes import dispatcher as dispatcher_module
    from kerasfeed.loading.pipeline import PassPipeline

    profiles: list = []
    local = threading.local()
    read_loop, load = dispatcher_module.read_loop, PassPipeline.load

    def profiled_read_loop(d, lane):
        prof = cProfile.Profile()
        profiles.append(("reader", prof))
        prof.runcall(read_loop, d, lane)

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

    dispatcher_module.read_loop, PassPipeline.load = profiled_read_loop, profiled_load
    try:
        ds = kerasfeed.to_dataset(ReadyBatches(items), executor="processes", workers=workers)
        for _ in range(passes):
            ds.reduce(np.int64(0), lambda a, _: a + 1)
        d = _dispatcher(ds)
        kerasfeed.executor_of(ds).close()  # the reader threads end: their profiles are complete
        for lane in d.lanes:
            if lane.process.reader is not None:
                lane.process.reader.join(5)
    finally:
        dispatcher_module.read_loop, PassPipeline.load = read_loop, load
    out = {}
    for kind in ("pickup", "reader"):
        stats = pstats.Stats(*[p for k, p in profiles if k == kind])
        out[f"{kind}_calls_per_item"] = stats.total_calls / (items * passes)
    return out


# --- state-sync: carrying the source's state to the workers, per pass --------------------------------


class Small(workloads.SceneSequence):
    """16 batches; re-shuffles its own index list (in place) at the end of every pass when ``shuffle``."""

    def __init__(self, shuffle: bool = True, batches: int = 16):
        super().__init__()
        self.shuffle, self.indices, self.rng = shuffle, np.arange(batches * 4), np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.indices) // 4

    def __getitem__(self, i: int) -> np.ndarray:
        return self.indices[4 * i:4 * i + 4].astype(np.float32)

    def on_epoch_end(self) -> None:
        if self.shuffle:
            self.rng.shuffle(self.indices)


class Holding(Small):
    """``Small`` plus a large array: unchanged (writeable or read-only), or changed in place every pass."""

    def __init__(self, mb: int, read_only: bool = False, touch: bool = False):
        super().__init__(shuffle=False)
        self.table = np.zeros(mb * 2**20 // 8)
        self.table.flags.writeable = not read_only
        self.touch = touch

    def on_epoch_end(self) -> None:
        if self.touch:
            self.table[0] += 1


def state_sync(mb: int = 100, passes: int = 5, workers: int = 2, with_passes: bool = True) -> str:
    """A markdown table: the check, the send and whole passes through ``to_dataset(executor="processes")``."""
    import kerasfeed
    from kerasfeed.execution.state_sync import StateTracker

    ms = lambda xs: f"{statistics.median(xs) * 1e3:9.2f}"  # noqa: E731
    cases = [("small, unchanged", lambda: Small(shuffle=False)), ("small, re-shuffled every pass", Small),
             (f"{mb} MB array, unchanged (writeable)", lambda: Holding(mb)),
             (f"{mb} MB array, unchanged (read-only)", lambda: Holding(mb, read_only=True)),
             (f"{mb} MB array, changed in place every pass", lambda: Holding(mb, touch=True))]
    lines = [f"State sync cost per pass (median of {passes} passes, ms; {workers} workers)", "",
             "| source | check ms | send ms | bytes sent per change | pass ms |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, make in cases:
        source, checks, sends = make(), [], []
        tracker = StateTracker(source)
        for _ in range(passes):
            source.on_epoch_end()
            t0 = time.perf_counter()
            tracker.fingerprints()
            t1 = time.perf_counter()
            payload, _ = tracker.check()
            t2 = time.perf_counter()
            checks.append(t1 - t0)
            sends.append(max(0.0, (t2 - t1) - (t1 - t0)) if payload else 0.0)
        sent = tracker.sent_bytes // max(tracker.syncs, 1) if max(sends) else 0
        times = []
        if with_passes:
            ds = kerasfeed.to_dataset(make(), executor="processes", workers=workers)
            for _ in range(passes + 1):  # the first, with start-up, is left out
                t0 = time.perf_counter()
                for _ in ds:
                    pass
                times.append(time.perf_counter() - t0)
            kerasfeed.executor_of(ds).close()
        lines.append(f"| {name} | {ms(checks)} | {ms(sends)} | {sent:,} | {ms(times[1:]) if times else ''} |")
    return "\n".join(lines)


# --- place: jax.device_put of one batch from the heap and from shared memory --------------------------


def place(repeats: int, shape: Sequence[int] = (64, 96, 96, 3)) -> Dict[str, Dict[str, float]]:
    """µs per ``jax.device_put(...).block_until_ready()`` of one uint8 batch (``decode``'s by default), wall
    and this thread's CPU, median over ``repeats``: from a heap array, and from a view of a shared-memory
    segment lent as the processes executor lends a worker's item (issue 24: is placing lent memory dearer?)."""
    import jax

    from kerasfeed.execution.processes import shm

    heap = np.random.default_rng(0).integers(0, 255, size=tuple(shape), dtype=np.uint8)
    spec, arrays, nbytes = shm.encode(heap)
    segment, fd = shm.new_segment(nbytes, "costs-place")
    os.close(fd)
    shm.write(segment, arrays)
    lent = shm.lend(spec, segment, nbytes, lambda: None)
    if not np.array_equal(lent, heap):
        raise RuntimeError("the shared-memory view does not hold the batch written into it")
    out = {}
    for name, a in (("heap", heap), ("shared memory (lent)", lent)):
        for _ in range(5):
            jax.device_put(a).block_until_ready()
        wall, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            jax.device_put(a).block_until_ready()
            wall.append((time.perf_counter() - t0) * 1e6)
            cpu.append((time.thread_time() - c0) * 1e6)
        out[name] = {"wall_us": statistics.median(wall), "cpu_us": statistics.median(cpu),
                     "wall_us_min": min(wall), "wall_us_max": max(wall)}
    out["device"] = {"name": str(jax.devices()[0]), "bytes": int(heap.nbytes)}
    del lent
    segment.close()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("paced", help="CPU per batch at a fixed pace, by thread group")
    p.add_argument("--workload", default="io")
    p.add_argument("--rate", type=float, default=1000.0, help="batches/s the loop asks for")
    p.add_argument("--batches", type=int, default=3000, help="timed batches per way")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ways", default=",".join(PACED_WAYS))
    c = sub.add_parser("consumer", help="the processes executor's consumer CPU per item")
    c.add_argument("--items", type=int, default=400)
    c.add_argument("--passes", type=int, default=5)
    c.add_argument("--workers", type=int, default=2)
    c.add_argument("--workload", choices=("ready", "cpu"), default="ready",
                   help="ready: items made at once (the consumer sets the pace); cpu: the cpu workload "
                        "iterated in Python (the workers set the pace)")
    c.add_argument("--calls", action="store_true", help="also count Python calls per item")
    s = sub.add_parser("state-sync", help="carrying the source's state to the workers, per pass")
    s.add_argument("--mb", type=int, default=100, help="size of the large array in MB")
    s.add_argument("--passes", type=int, default=5)
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--no-passes", action="store_true", help="only the consumer-side check, no worker processes")
    pl = sub.add_parser("place", help="jax.device_put of one batch from the heap and from shared memory")
    pl.add_argument("--repeats", type=int, default=200)
    for each in (p, c, pl):
        each.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    res: Any
    if args.what == "paced":
        res = paced(args.workload, args.rate, args.batches, args.warmup, args.rounds, runner.split(args.ways))
        print("\n" + res["markdown"])
    elif args.what == "consumer":
        res = {"workload": args.workload, "cpu": consumer(args.items, args.passes, args.workers, args.workload)}
        if args.calls:
            res["calls"] = count_calls(args.items, 2, args.workers)
        for name, r in res["cpu"].items():
            print(f"{name:16s} median {r['median']:7.1f} µs/item  [{r['min']:.1f} - {r['max']:.1f}]")
        for name, v in res.get("calls", {}).items():
            print(f"{name:24s} {v:.1f}")
    elif args.what == "place":
        res = place(args.repeats)
        for name, r in res.items():
            shown = (f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
            print(f"{name:22s} " + ", ".join(shown))
    else:
        print(state_sync(args.mb, args.passes, args.workers, not args.no_passes))
    if getattr(args, "json", None):
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
