"""The item cache's own benchmark: what ``fit.py`` cannot show (``model.fit`` rates are in ``fit.py``).

``python benchmarks/cache.py [--rounds R] [--workloads cpu,h5,h5aug] [--batches N] [--output-dir DIR]``

- **pass 0**: the first pass drained through ``to_loader`` (worker processes),
  with and without ``cache="memory"``, each configuration in a fresh child
  process, alternating which runs first: the ratio cached / uncached of the
  pass's seconds (the cache's cost while it fills), then the later passes'
  seconds with the cache.
- **kept**: a script run twice over one kept directory, in two fresh processes:
  the second run's first epoch against the first run's cached epochs (a
  kept cache serves the next run from its first epoch).
- **memory**: one store per host: a source of 2 MB items with an ``augment``
  (so every worker reads every stored item) on 2 worker processes; the
  store's pages as each process maps them (``/proc/<pid>/smaps``: RSS, and
  PSS, which splits a shared page among its mappers), against the bytes
  stored; and a kept directory's disk use against its files' apparent size.

Prints markdown tables with the machine and the date; writes
``DIR/cache_latest.json`` and ``.md``.
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
import tempfile
import time
from typing import Any, Dict, List

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import workloads  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402

CHILD = "--child"


def _child(workload: str, batches: int, cache: str, passes: int, data: str, workers: int) -> Dict[str, Any]:
    """In a fresh process: seconds of each pass of a to_loader drain (the loader made before timing)."""
    import kerasfeed

    seq = workloads.make_workload(workload, batches, data)
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=0, executor="processes", workers=workers,
                                 cache=None if cache == "none" else cache)
    times = []
    with loader:
        for _ in range(passes):
            t0 = time.perf_counter()
            for batch in loader:
                pass
            times.append(time.perf_counter() - t0)
        stats = kerasfeed.stats(loader)
    return {"times": times, "misses": stats.get("cache_misses"), "hits": stats.get("cache_hits")}


class _Blocks:
    """``load(i)``: a 2 MB float32 block (stored); ``augment``: + 1 (reads every stored page)."""

    def __init__(self, n: int = 64):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def load(self, i: int) -> Any:
        import numpy as np

        return np.full((512, 1024), i, np.float32)

    def augment(self, x: Any) -> Any:
        return x + 1.0

    def __getitem__(self, i: int) -> Any:
        return self.augment(self.load(i))


def _store_pages(pid: int) -> Dict[str, int]:
    """KB of the item store's mappings in process ``pid`` (memfd or a kept directory's data.bin)."""
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = "kerasfeed-cache-data" in line or line.rstrip().endswith("data.bin")
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif inside and line.startswith("Pss:"):
                pss += int(line.split()[1])
    return {"rss_kb": rss, "pss_kb": pss}


def _memory_child(cache: str, n: int) -> Dict[str, Any]:
    import psutil

    import kerasfeed

    with kerasfeed.to_loader(_Blocks(n), executor="processes", workers=2, cache=cache, shuffle=True, seed=0) as ld:
        for _ in range(2):
            for _batch in ld:
                pass
        stats = kerasfeed.stats(ld)
        procs = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
        pages = {str(p): _store_pages(p) for p in procs}
    out = {"stored_bytes": stats["cache_bytes"], "pages": pages}
    if cache != "memory":
        data = os.path.join(cache, "data.bin")
        out["disk_bytes"] = os.stat(data).st_blocks * 512
        out["apparent_bytes"] = os.path.getsize(data)
    return out


def _run_child(*args: str) -> Dict[str, Any]:
    # Children drain to_loader, which needs no TensorFlow: Keras' numpy backend (unless one is set)
    # spares each of them TensorFlow's import (~5 s, before timing).
    env = {"KERAS_BACKEND": "numpy", **os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, CHILD, *args], capture_output=True, text=True, env=env,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_range(values: List[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def run(workloads_: List[str], batches: int, rounds: int, passes: int, workers: int, data: str,
        blocks: int = 64) -> Dict[str, Any]:
    for name in workloads_:
        workloads.prepare(name, batches, data)
    rows: Dict[str, Any] = {}
    for name in workloads_:
        first, later, ratios = [], [], []
        for r in range(rounds):
            order = ("none", "memory") if r % 2 == 0 else ("memory", "none")
            got = {c: _run_child(name, str(batches), c, str(passes), data, str(workers)) for c in order}
            # Per item made: the probed items were stored before pass 0 (it makes fewer than uncached).
            cached = got["memory"]["times"][0] / max(got["memory"]["misses"], 1)
            ratios.append(cached / (got["none"]["times"][0] / batches))
            first.append(got["none"]["times"][0])
            later.append(statistics.median(got["memory"]["times"][1:]))
        rows[name] = {"pass0_ratio_per_item_made": ratios, "uncached_pass0_s": first, "cached_later_s": later}
    kept = {}
    for name in workloads_:
        runs = []
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as d:
                cache = os.path.join(d, "items")
                one = _run_child(name, str(batches), cache, str(passes), data, str(workers))
                two = _run_child(name, str(batches), cache, "1", data, str(workers))
            runs.append({"first_run": one["times"], "second_run_first_epoch": two["times"][0],
                         "second_run_made": two["misses"]})
        kept[name] = runs
    memory = {"memory": _run_child("memory", "memory", str(blocks))}
    with tempfile.TemporaryDirectory() as d:
        memory["directory"] = _run_child("memory", os.path.join(d, "items"), str(blocks))
    return {"rows": rows, "kept": kept, "memory": memory}


def markdown(result: Dict[str, Any], info: Dict[str, Any]) -> str:
    summary = (f"{info['cpu']} ({info['cores_usable']} cores), {info['ram_gb']} GB; Python {info['python']}, "
               f"numpy {info.get('numpy')}, h5py {info.get('h5py')}; load at start {info.get('loadavg_start')}")
    lines = [f"Machine: {summary}; {result['date']}.", "",
             "| workload | pass 0, s per item made: cached / uncached (median [range]) | uncached pass 0 s | "
             "cached later pass s |",
             "| --- | --- | --- | --- |"]
    for name, r in result["rows"].items():
        cells = [_median_range(r[k]) for k in ("pass0_ratio_per_item_made", "uncached_pass0_s", "cached_later_s")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| workload | first run: pass 0 s, later passes s | second run: first epoch s (items made) |",
              "| --- | --- | --- |"]
    for name, runs in result["kept"].items():
        for k in runs:
            later = statistics.median(k["first_run"][1:]) if len(k["first_run"]) > 1 else float("nan")
            lines.append(f"| {name} | {k['first_run'][0]:.3f}, {later:.3f} | "
                         f"{k['second_run_first_epoch']:.3f} ({k['second_run_made']}) |")
    lines += ["", "| store | stored MB | processes mapping its pages | their PSS summed, MB (one copy: = stored) | "
              "disk MB (apparent size) |", "| --- | --- | --- | --- | --- |"]
    for kind, m in result["memory"].items():
        mapping = sum(1 for v in m["pages"].values() if v["rss_kb"])
        pss = sum(v["pss_kb"] for v in m["pages"].values()) / 1024
        disk = "" if "disk_bytes" not in m else f"{m['disk_bytes'] / 2**20:.0f} ({m['apparent_bytes'] / 2**30:.0f} GB)"
        stored = m["stored_bytes"] / 2**20
        lines.append(f"| {kind} | {stored:.0f} | {mapping} of {len(m['pages'])} | {pss:.0f} | {disk} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD and sys.argv[2] == "memory":
        print(json.dumps(_memory_child(sys.argv[3], int(sys.argv[4]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        name, batches, cache, passes, data, workers = sys.argv[2:8]
        print(json.dumps(_child(name, int(batches), cache, int(passes), data, int(workers))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="cpu,h5,h5aug")
    p.add_argument("--batches", type=int, default=120)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test): 12 batches, 1 round, 2 passes")
    args = p.parse_args()
    if args.quick:
        args.batches, args.rounds, args.passes = 12, 1, 2
    names = args.workloads.split(",")
    workloads.check_names(names)
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = str(out / "cache")
    info = machine_info()
    result = run(names, args.batches, args.rounds, args.passes, args.workers, data, 8 if args.quick else 64)
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["machine"] = info
    text = markdown(result, info)
    (out / "cache_latest.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "cache_latest.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
