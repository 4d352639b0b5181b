"""The GPU-machine benchmark (issue 24): drain scaling over worker counts, and ``model.fit`` under
JAX and PyTorch against the in-memory rate and the peers, on ``decode``, ``h5img`` and ``big``.

No TensorFlow anywhere: kerasfeed feeds through ``to_loader``; the GPU machine
has JAX, PyTorch, numpy, h5py, cloudpickle and psutil, and Keras and Grain come
as wheels (``benchmarks/README.md`` has the one-line recipe). Two sections, each
configuration timed by ``benchmarks/runner.py`` on ``benchmarks/ways.py``'s ways:

- ``drain``: a plain ``for batch in ...`` loop over numpy batches (``Context(mode="loop")``):
  kerasfeed processes at every ``--workers`` count (1/4/8/15 on 16 cores),
  kerasfeed threads and auto, and at the largest count the PyTorch ``DataLoader``,
  Keras ``PyDataset`` (processes, through its adapter) and Grain (``mp_prefetch``;
  threads). Ratio: × the serial loop.
- ``fit``: ``model.fit`` of a small conv net (3 conv layers, 32/64/128 filters;
  ``--quick``: 4/8/16; the batch as the workload makes it: 64 images for
  ``decode``/``h5img``) under each ``--backends`` entry, each backend and
  workload in its own child process;
  epoch 1 untimed, the best later epoch kept: the in-memory rate (numpy arrays
  handed to ``fit``), kerasfeed processes at the largest count and 8, ``auto``,
  the peers, and kerasfeed with ``device_prefetch=0`` (the default places 2
  batches on the accelerator ahead of the step). Ratio: to the in-memory rate.

Configurations not started within ``--budget-s`` seconds (500) are skipped and
say so, so the whole run fits one 10-minute command on the GPU machine.

A way whose package is missing is reported as ``skipped: <package> not installed``.

    python benchmarks/gpu.py --output-dir /tmp/gpu            # the full run, ~5 min on 16 cores
    python benchmarks/gpu.py --quick --workers 1,2 --output-dir /tmp/gpu-smoke   # a CPU smoke run

It writes ``gpu.json`` and ``gpu.md`` to ``--output-dir`` and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BACKENDS = ("jax", "torch")
# Keras' backend must exist before anything imports Keras (kerasfeed.SceneSequence does): no TensorFlow here.
os.environ.setdefault("KERAS_BACKEND", next((b for b in BACKENDS if importlib.util.find_spec(b)), "jax"))

from benchmarks import report, runner, ways, workloads  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402

WORKLOADS = ("decode", "h5img", "big")
SECTIONS = ("drain", "fit")
FULL_BATCHES = {"decode": 150, "h5img": 200, "big": 100}
PEERS = ("torch", "keras-processes", "grain-mp")  # at the largest worker count
DRAIN_WAYS = ("serial", "kerasfeed-processes", "kerasfeed-threads", "kerasfeed-auto") + PEERS + ("grain-threads",)
# kerasfeed-cached: the item cache's goal (JAX fit on decode from epoch 2 at >= 0.9 of memory; README, 2026-11-26).
FIT_WAYS = ("memory", "kerasfeed-processes", "kerasfeed-auto", "kerasfeed-cached") + PEERS + ("kerasfeed-no-prefetch",)
BUDGET_S = 500  # one device command may run 10 minutes: configurations past this are skipped, and say so


def _configs(mode: str, way: str, workload: str, n: int, counts: Sequence[int], base: Dict[str, Any]) -> List[Dict]:
    """One configuration per worker count for kerasfeed processes, the largest count for the rest.
    ``fit`` runs kerasfeed processes at 8 (if among the counts) and the largest count only."""
    if mode == "fit":
        counts = [w for w in counts if w == 8 or w == counts[-1]]
    counts = counts if way == "kerasfeed-processes" else counts[-1:]
    return [{**base, "mode": mode, "way": way, "workload": workload, "batches": n, "workers": w} for w in counts]


def run_gpu_benchmark(*, output_dir: os.PathLike, cache_dir: Optional[os.PathLike] = None, quick: bool = False,
                      workloads_: Sequence[str] = WORKLOADS,
                      workers: Sequence[int] = (1, 4, 8, 15), backends: Sequence[str] = BACKENDS,
                      sections: Sequence[str] = SECTIONS, only: Optional[Sequence[str]] = None,
                      batches: Optional[int] = None, epochs: Optional[int] = None, rounds: int = 1,
                      auto_workers: Optional[int] = None, budget_s: float = BUDGET_S,
                      progress: runner.Progress = print) -> Dict[str, Any]:
    """Runs the sections and returns the results (written to ``output_dir`` as ``gpu.json``/``gpu.md``).

    Args:
        output_dir: where ``gpu.json`` and ``gpu.md`` go.
        cache_dir: where the ``h5img`` file is made once and reused (default ``<output_dir>/cache``).
        quick: a smoke run: 4 batches per epoch, the shortest timing.
        workloads_: among ``decode``, ``h5img``, ``big`` (any registered workload).
        workers: worker counts of the scaling rows, ascending; the peers use the largest.
        backends: Keras backends of the fit section (``jax``, ``torch``).
        sections: among ``drain`` and ``fit``.
        only: way names (the references, ``serial`` and ``memory``, always run).
        batches: batches per epoch for every workload.
        epochs: fit epochs per configuration, the first untimed (default 3; 2 with ``quick``).
        rounds: every configuration once per round; ratios within a round; medians and ranges.
        auto_workers: ``workers`` given to ``executor="auto"`` (None: kerasfeed's default).
        budget_s: configurations not started within this many seconds are skipped (and say so).
        progress: called with one line per configuration.
    """
    workloads.check_names(workloads_)
    for name, given, known in (("section", sections, SECTIONS), ("backend", backends, BACKENDS)):
        for x in given:
            if x not in known:
                raise ValueError(f"Unknown {name} {x!r}; expected some of {known}. Received: {x!r}")
    counts = sorted({int(w) for w in workers})
    if not counts or counts[0] < 1 or int(rounds) < 1:
        raise ValueError(f"`workers` must be positive counts and `rounds` at least 1. "
                         f"Received: workers={list(workers)}, rounds={rounds}")
    epochs = int(epochs or (2 if quick else 3))
    if epochs < 2:
        raise ValueError(f"`epochs` must be at least 2 (the first is never timed). Received: epochs={epochs}")
    sizes = {w: int(batches or (4 if quick else FULL_BATCHES.get(w, workloads.REGISTRY[w].full))) for w in workloads_}
    cache = pathlib.Path(cache_dir or pathlib.Path(output_dir) / "cache")
    cache.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed GPU-machine benchmark, {date}, {'quick' if quick else 'full'} run on {machine['cpu']} "
             f"({machine['cores_usable']} cores), workers {counts}, load {machine['loadavg_start']}")
    started, rows = time.perf_counter(), []
    base = {"cache_dir": str(cache), "auto_workers": auto_workers, "epochs": epochs,
            "model": "conv-small" if quick else "conv", "backend": None,
            "min_timed_s": 0.0 if quick else 1.0, "max_timed_epochs": 1 if quick else 10,
            "deadline": time.time() + budget_s}
    timeout = lambda: max(60.0, base["deadline"] - time.time() + 90)  # noqa: E731 - the config under way ends
    for wl in workloads_:
        workloads.prepare(wl, sizes[wl], cache)  # made once, outside any timing
    for round_ in range(int(rounds)):
        if "drain" in sections:
            for wl in workloads_:
                progress(f"[drain] {wl}: {sizes[wl]} batches per epoch")
                configs = [c for way in ways.select(list(DRAIN_WAYS), only, always=("serial",))
                           for c in _configs("loop", way.name, wl, sizes[wl], counts, {**base, "round": round_})]
                rows += runner.isolated(configs, timeout_s=timeout(), progress=progress)
        for backend in backends if "fit" in sections else ():
            for wl in workloads_:
                progress(f"[fit] KERAS_BACKEND={backend} {wl}: {sizes[wl]} batches per epoch, {epochs} epochs")
                configs = [c for way in ways.select(list(FIT_WAYS), only, always=("memory",))
                           for c in _configs("fit", way.name, wl, sizes[wl], counts,
                                             {**base, "backend": backend, "round": round_})]
                if importlib.util.find_spec(backend) is None:
                    rows += [{**c, "status": "skipped", "note": f"skipped: {backend} not installed"} for c in configs]
                    continue
                rows += runner.isolated(configs, {"KERAS_BACKEND": backend}, timeout_s=timeout(), progress=progress)
    for r in rows:
        r["label"] = ways.REGISTRY[r["way"]].title(ways.Context("loop"), r.get("num_workers", r.get("workers")))
    runner.add_ratios([r for r in rows if r.get("mode") == "loop"], lambda r: r["way"] == "serial", "x_serial")
    runner.add_ratios([r for r in rows if r.get("mode") == "fit"], lambda r: r["way"] == "memory")
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res = {"machine": machine, "date": date, "kind": "gpu", "rows": rows, "elapsed_s": time.perf_counter() - started,
           "settings": {"quick": quick, "batches": sizes, "workers": counts, "backends": list(backends),
                        "sections": list(sections), "epochs": epochs, "rounds": int(rounds),
                        "auto_workers": auto_workers, "workloads": list(workloads_), **base}}
    res["markdown"] = to_markdown(res)
    res["summary"] = summary(res)
    runner.save_results(output_dir, "gpu", res)
    return res


def _key(r: Dict[str, Any]) -> str:
    workers = r.get("num_workers", r.get("workers"))
    return f"{r['way']}@{workers}" if "{workers}" in ways.REGISTRY[r["way"]].label else r["way"]


def to_markdown(res: Dict[str, Any]) -> str:
    s, rows = res["settings"], res["rows"]
    out = [f"### GPU-machine benchmark ({'quick' if s['quick'] else 'full'} run, {res['date']})", "",
           report.machine_line(res["machine"]), "",
           f"Batches per epoch: {s['batches']}; worker counts {s['workers']} (peers at {s['workers'][-1]}); "
           f"fit: a 3-conv-layer net ({s['model']}), {s['epochs']} epochs, the first untimed (best later epoch shown)."
           + (f" {s['rounds']} rounds: median (median ratio; range)." if s["rounds"] > 1 else ""), ""]
    drain = [r for r in rows if r.get("mode") == "loop"]
    if drain:
        out += ["#### Plain iteration (numpy batches): batches/s (× the serial loop)", ""]
        out += report.table(drain, s["workloads"], "x_serial", row_of=_key) + report.notes(drain) + [""]
    for backend in s["backends"]:
        fit = [r for r in rows if r.get("mode") == "fit" and r.get("backend") == backend]
        if fit:
            out += [f"#### `model.fit` under KERAS_BACKEND={backend}: steps/s (ratio to the in-memory rate)", ""]
            out += report.table(fit, s["workloads"], row_of=_key) + report.notes(fit) + [""]
    picks = sorted({f"- {r['workload']} ({r['mode']}): {r.get('picked')}: {r.get('note', '')}" for r in rows
                    if r["way"] == "kerasfeed-auto" and r.get("status") == "ok"})
    if picks:
        out += ["What `auto` picked, and why:", ""] + picks + [""]
    return "\n".join(out + [f"Whole run: {res['elapsed_s']:.0f} s."]) + "\n"


def summary(res: Dict[str, Any]) -> str:
    """The short table: kerasfeed's best against the best peer, per section and workload."""
    s, rows = res["settings"], [r for r in res["rows"] if r.get("status") == "ok"]
    lines = ["| section | " + " | ".join(s["workloads"]) + " |", "| --- |" + " --- |" * len(s["workloads"])]
    views = [("drain", "loop", None, "batches_per_s", "{:,.0f}")] + [
        (f"fit {b}", "fit", b, "ratio", "{:.2f}") for b in s["backends"]]
    for title, mode, backend, key, form in views:
        for side, pick in (("kerasfeed", lambda w: w.startswith("kerasfeed")), ("best peer", lambda w: w in PEERS)):
            cells = []
            for wl in s["workloads"]:
                mine = [r for r in rows if r["mode"] == mode and r.get("backend") == backend and r["workload"] == wl
                        and pick(r["way"]) and key in r]
                best = max(mine, key=lambda r: r[key], default=None)
                cells.append("–" if best is None else f"{form.format(best[key])} ({_key(best)})")
            lines.append(f"| {title}: {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True, help="where gpu.json and gpu.md go")
    p.add_argument("--cache-dir", default=None, help="where the HDF5 file is made (default: OUTPUT_DIR/cache)")
    p.add_argument("--quick", action="store_true", help="a smoke run (4 batches per epoch; fine on a CPU)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--workers", default=None, help="worker counts, e.g. 1,4,8,15 (default: those below the "
                   "core count, up to 15)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--only", default=None, help="comma-separated way names (serial and memory always run)")
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--auto-workers", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"skip configurations not started within this many seconds (default {BUDGET_S})")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = [int(w) for w in runner.split(args.workers)] if args.workers else (
        [w for w in (1, 4, 8, 15) if w < cores] or [1])
    try:
        ways.select([], runner.split(args.only))
        res = run_gpu_benchmark(output_dir=args.output_dir, cache_dir=args.cache_dir, quick=args.quick,
                                workloads_=runner.split(args.workloads),
                                workers=counts, backends=runner.split(args.backends),
                                sections=runner.split(args.sections), only=runner.split(args.only),
                                batches=args.batches, epochs=args.epochs, rounds=args.rounds,
                                auto_workers=args.auto_workers, budget_s=args.budget_s)
    except ValueError as e:
        p.error(str(e))
    print()
    print(res["markdown"])
    print(f"Wrote {pathlib.Path(args.output_dir) / 'gpu.json'} and gpu.md\n")
    print(res["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
