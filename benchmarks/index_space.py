"""Index spaces of 10^6 to 10^9 items: first batch, RSS, and the cost per index of a seeded order.

```bash
.venv/bin/python benchmarks/index_space.py           # 10^6, 10^8, 10^9 items (quiet machine: minutes)
.venv/bin/python benchmarks/index_space.py --tiny    # 10^4 and 10^5 items: a seconds-long check
.venv/bin/python benchmarks/index_space.py --sizes 1e6,1e7 --json out.json
```

**First batch** (one subprocess per method and size, so RSS is its own): from nothing to the first
batch of 256 indices of a shuffled pass, and the peak RSS growth on the way (sampled every 5 ms):

- ``kerasfeed-shuffled``: ``kerasfeed.to_loader(source, batch_size=256, shuffle=True, seed=0)`` on
  threads over a source whose item ``i`` is ``i`` (the order is computed per position);
- ``kerasfeed-balanced``: the same with ``order=kerasfeed.BalancedOrder(labels, seed=0)``, labels
  int8 at 1:49 (made before the measure: the labels array itself is not counted);
- ``grain-index_shuffle``: ``grain.MapDataset.range(n).shuffle(seed=0).batch(256)[0]`` (Grain's
  ``index_shuffle``, O(1) memory);
- ``numpy-permutation``: ``np.random.default_rng(0).permutation(n)[:256]`` (a materialized pass, as
  kerasfeed 0.1 drew it: 8 bytes per item).

"bins hit" is how many of 16 equal bins of ``[0, n)`` the first batch falls in (a uniform shuffle: 16).

**Cost per index** (in this process, n = the largest size): the hot path of every executor
(``PassPlan.next_index`` over a lazy pass view: computed a window of 4096 positions at a time), the
order alone (``IndexOrder.at`` on windows of 4096), ``BalancedOrder.at`` and ``WeightedOrder.at``
(10^7 labels/weights), Grain's ``index_shuffle`` (one Python call per index), and the same plan over
a materialized pass (a list of 10^6 indices, as kerasfeed 0.1 planned every pass).

Depends on numpy, psutil, kerasfeed and (optionally) grain only: no benchmark harness.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.machine import PeakRss  # noqa: E402

BATCH = 256
METHODS = ("kerasfeed-shuffled", "kerasfeed-balanced", "grain-index_shuffle", "numpy-permutation")
MB = 2**20


class Identity:
    """Item ``i`` is ``i``: a source of any length that costs nothing."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.int64(i)


def _labels(n):
    labels = np.zeros(n, dtype=np.int8)
    labels[::50] = 1  # 1:49
    return labels


def _first_batch(method, n):
    """What one method does up to its first batch (run inside the measure)."""
    if method == "kerasfeed-shuffled":
        import kerasfeed

        loader = kerasfeed.to_loader(Identity(n), batch_size=BATCH, shuffle=True, seed=0, executor="threads")
        batch = next(iter(loader))
        loader.close()
        return batch
    if method == "kerasfeed-balanced":
        import kerasfeed

        order = kerasfeed.BalancedOrder(STATE["labels"], seed=0)
        loader = kerasfeed.to_loader(Identity(n), batch_size=BATCH, order=order, executor="threads")
        batch = next(iter(loader))
        loader.close()
        return batch
    if method == "grain-index_shuffle":
        import grain

        return np.asarray(grain.MapDataset.range(n).shuffle(seed=0).batch(BATCH)[0])
    if method == "numpy-permutation":
        return np.random.default_rng(0).permutation(n)[:BATCH]
    raise ValueError(f"Unknown method {method!r}. Received: method={method!r}")


STATE: dict = {}


def measure_one(method, n):
    """One method at one size, in this (fresh) process: a JSON-able dict."""
    if method == "kerasfeed-balanced":
        STATE["labels"] = _labels(n)
    if method.startswith("kerasfeed"):  # imports and first-use costs out of the measure
        import kerasfeed

        warm = kerasfeed.to_loader(Identity(4), batch_size=2, shuffle=True, seed=0, executor="threads")
        next(iter(warm))
        warm.close()
    elif method.startswith("grain"):
        import grain  # noqa: F401
    with PeakRss() as rss:
        t0 = time.perf_counter()
        batch = np.asarray(_first_batch(method, n)).reshape(-1)
        seconds = time.perf_counter() - t0
    bins = int(np.count_nonzero(np.histogram(batch, np.linspace(0, n, 17))[0]))
    return dict(method=method, items=n, first_batch_s=seconds, peak_rss_growth_mb=rss.growth / MB, bins_hit=bins,
                distinct=int(len(np.unique(batch))))


def _run_one(method, n, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, str(n)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(method=method, items=n, error=f"timed out after {timeout} s")
    if out.returncode != 0:
        return dict(method=method, items=n, error=out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ns_per_index(fn, count, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / count * 1e9


def per_index_costs(n):
    """ns per index of the hot paths (see the module docs)."""
    import kerasfeed
    from kerasfeed.execution.plan import PassPlan
    from kerasfeed.sampling.views import pass_view

    out = {}
    order = kerasfeed.IndexOrder(n, shuffle=True, seed=0)
    windows = [np.arange(s, s + 4096) for s in range(0, 64 * 4096, 4096)]
    out["IndexOrder.at (window of 4096)"] = _ns_per_index(lambda: [order.at(0, w % n) for w in windows], 64 * 4096)

    steps = min(32 * 4096, n)

    def plan_path(view_of):
        plan = PassPlan(0, view_of(), window=1 << 30)
        for _ in range(steps):
            plan.next_index()

    out["PassPlan.next_index, shuffled view"] = _ns_per_index(lambda: plan_path(lambda: pass_view(order, 0)), steps)
    small = min(n, 10**6)
    listed = np.random.default_rng(0).permutation(small).tolist()  # kerasfeed 0.1: a list per pass
    out[f"PassPlan.next_index, a materialized pass ({small} items)"] = _ns_per_index(
        lambda: plan_path(lambda: listed[:steps]), steps
    )
    m = min(n, 10**7)
    balanced = kerasfeed.BalancedOrder(_labels(m), seed=0)
    out[f"BalancedOrder.at ({m} labels)"] = _ns_per_index(lambda: [balanced.at(0, w % m) for w in windows], 64 * 4096)
    weighted = kerasfeed.WeightedOrder(np.random.default_rng(0).random(m), seed=0)
    out[f"WeightedOrder.at ({m} weights)"] = _ns_per_index(lambda: [weighted.at(0, w % m) for w in windows], 64 * 4096)
    try:
        from grain.experimental import index_shuffle
    except ImportError:  # pragma: no cover - grain not installed
        out["grain index_shuffle (a call per index)"] = None
    else:
        k = min(20_000, n)
        out["grain index_shuffle (a call per index)"] = _ns_per_index(
            lambda: [index_shuffle(i, max_index=n - 1, seed=0, rounds=4) for i in range(k)], k
        )
    return out


def to_markdown(results):
    lines = ["| method | items | first batch s | peak RSS growth MB | bins hit (of 16) | distinct |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results["first_batch"]:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['items']:.0e} | {r['error']} | | | |")
            continue
        lines.append(f"| {r['method']} | {r['items']:.0e} | {r['first_batch_s']:.3f} | {r['peak_rss_growth_mb']:.1f} | "
                     f"{r['bins_hit']} | {r['distinct']} |")
    lines += ["", "| hot path | ns per index |", "| --- | --- |"]
    for name, ns in results["per_index_ns"].items():
        lines.append(f"| {name} | {'n/a' if ns is None else f'{ns:.0f}'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e8,1e9", help="item counts, comma-separated")
    parser.add_argument("--tiny", action="store_true", help="10^4 and 10^5 items: a smoke run")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]))))
        return None
    sizes = [10**4, 10**5] if args.tiny else [int(float(s)) for s in args.sizes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not sizes or min(sizes) < 1:
        parser.error(f"--methods must be among {list(METHODS)} and --sizes positive. Received: {unknown or sizes}")
    results = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d"),
        "first_batch": [_run_one(m, n, args.timeout) for n in sizes for m in methods],
        "per_index_ns": per_index_costs(max(sizes)),
    }
    print(to_markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
