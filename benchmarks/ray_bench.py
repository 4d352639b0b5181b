"""executor="ray" against worker processes on one machine: per-item overhead and large-item throughput.

Each executor is made once (its start-up is timed), warmed up with one pass, then
``--repeats`` passes are timed; the table shows the median and the range over them.
Loads go through the executor seam as the pass pipeline drives it (``plan`` once
per pass, then ``load`` item after item in the pass's order), so what is measured is
the executor: what an item costs to request, make, move and pick up.

- ``tiny``: an 8-float item made at once (``np.full``): the per-item overhead.
  "consumer CPU" is this process's CPU time per item, every thread counted
  (Ray's core-worker threads, the processes executor's reader threads).
- ``large``: a ``--large-mb`` MB float32 array (made once per worker, returned
  every time): each executor copies it once into shared memory (the worker
  processes' slot; Ray's object store), and the consumer maps it without a copy.

Ray here is the one ``executor="ray"`` starts itself on 127.0.0.1 (all actors on
this one node), so the figures are Ray's per-item cost, not a cluster's network.

    .venv/bin/python benchmarks/ray_bench.py                # about a minute on 2 cores
    .venv/bin/python benchmarks/ray_bench.py --repeats 7 --tiny-items 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info, version


class Tiny:
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(8, i, np.float32)


class Large:
    def __init__(self, n: int, nbytes: int):
        self.n = n
        self.nbytes = nbytes
        self._buf = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self._buf is None:
            self._buf = np.ones(self.nbytes // 4, np.float32)
        return self._buf

    def __getstate__(self):
        return {"n": self.n, "nbytes": self.nbytes, "_buf": None}


def one_pass(ex, epoch: int, n: int) -> dict:
    order = np.random.default_rng(epoch).permutation(n)
    c0, t0 = time.process_time(), time.perf_counter()
    ex.plan(epoch, order)
    nbytes = 0
    for i in order.tolist():
        item = ex.load(i, epoch)
        nbytes += item.nbytes
        float(item[-1])  # touch it
        del item
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"items_s": n / wall, "cpu_us": cpu / n * 1e6, "mb_s": nbytes / 2**20 / wall}


def measure(kind: str, source, workers: int, repeats: int) -> dict:
    from kerasfeed.execution.processes.executor import ProcessExecutor
    from kerasfeed.execution.ray.executor import RayExecutor

    t0 = time.perf_counter()
    ex = RayExecutor(source, workers=workers) if kind == "ray" else ProcessExecutor(source, workers=workers)
    if kind == "processes":
        ex.wait_ready()
    start_s = time.perf_counter() - t0
    try:
        one_pass(ex, 0, len(source))  # warm-up
        runs = [one_pass(ex, epoch, len(source)) for epoch in range(1, repeats + 1)]
    finally:
        ex.close()
    out = {"start_s": start_s}
    for key in ("items_s", "cpu_us", "mb_s"):
        values = [r[key] for r in runs]
        out[key] = (statistics.median(values), min(values), max(values))
    return out


def _cell(v: tuple, digits: int = 0) -> str:
    med, lo, hi = v
    return f"{med:,.{digits}f} [{lo:,.{digits}f}-{hi:,.{digits}f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tiny-items", type=int, default=1000)
    p.add_argument("--large-items", type=int, default=60)
    p.add_argument("--large-mb", type=float, default=4.0)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    info = machine_info()
    large_bytes = int(args.large_mb * 2**20)
    rows = []
    for workload, source in (("tiny", Tiny(args.tiny_items)), ("large", Large(args.large_items, large_bytes))):
        for kind in ("processes", "ray"):
            rows.append((workload, kind, measure(kind, source, args.workers, args.repeats)))
            print(f"  done: {workload} / {kind}", file=sys.stderr)
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {info['cpu']}, {info['cores_usable']} cores, "
          f"{info['ram_gb']} GB; Python {info['python']}, Ray {version('ray')}, numpy {info['numpy']}; "
          f"load average {info['loadavg_start'][0]} at the start, {load_end[0]} at the end; {args.workers} workers, "
          f"median [min-max] of {args.repeats} passes (tiny: {args.tiny_items} items of 32 B; large: "
          f"{args.large_items} items of {args.large_mb:g} MB)\n")
    print("| workload | executor | start-up s | items/s | consumer CPU µs/item | MB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workload, kind, r in rows:
        mb = _cell(r["mb_s"]) if workload == "large" else "-"
        print(f"| {workload} | {kind} | {r['start_s']:.2f} | {_cell(r['items_s'])} | {_cell(r['cpu_us'])} | {mb} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
