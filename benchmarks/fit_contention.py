"""What slows ``model.fit`` on ``to_loader`` when the batches are ready: variants, one child process each.

Issue 24's open question. On the GPU machine (2026-11-23) ``fit`` under JAX
on ``decode`` ran at ~0.62-0.72 of the in-memory rate with 15 workers while
the step found a placed batch ready 97 % of the time: the step is slowed,
not starved. This entry times ``fit`` (epochs after the first, median) on
one workload under named variants that each remove one suspect, and records
per step the main process's CPU, each of its threads' CPU (kerasfeed's
reader threads, the device-prefetch thread, the training thread, the rest:
the framework's), the step's waits (``stats(loader)["device"]``) and the
prefetch thread's placement time (``place_ms``).

Variants (``--variants``, comma-separated):

- ``memory``: numpy arrays handed to ``fit`` (the limit);
  ``memory+burn``: the same beside ``--burners`` niced pure-Python loops
  (CPU contention alone); ``memory+work``: beside ``--burners`` niced
  processes making the workload's batches (the workers' CPU and memory
  traffic without kerasfeed's hand-over).
- ``kf``: ``to_loader(executor=ProcessExecutor(workers=W))`` as users run
  it; ``kf-prefetch0``: ``device_prefetch=0`` (Keras places each batch);
  ``kf-copy``: batches copied out of shared memory; ``kf-inflight4``: 4
  items ahead per worker; ``kf-reserve2``: workers kept off the first two
  cores (``worker_init`` sets their affinity); ``kf-switch``:
  ``sys.setswitchinterval(0.001)`` in the training process (GIL hand-offs).
- ``kf-premade``: ``kf`` on a source whose items are made once per worker
  and then only returned: the hand-over (shared memory, reader threads,
  pick-up, placement) without the workers' load; with ``memory+work`` it
  splits the gap in two. ``kf-premade-threads``: the same source on the
  threads executor: kerasfeed's loader and placement without worker
  processes, shared memory or reader threads (heap arrays, as in memory).

    KERAS_BACKEND=jax python benchmarks/fit_contention.py --output-dir /tmp/fc --workload decode \\
        --variants memory,kf,kf-prefetch0,memory+work --workers 15

Writes ``fit_contention.json`` and ``fit_contention.md`` and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402

VARIANTS = ("memory", "memory+burn", "memory+work", "kf", "kf-prefetch0", "kf-copy", "kf-inflight4",
            "kf-reserve2", "kf-switch", "kf-premade", "kf-premade-threads", "kf-nice0", "memory+work-nice0")
_MARK = "FIT_CONTENTION "


def _thread_group(name: Optional[str]) -> str:
    """kerasfeed's threads by role, the training thread, and the rest (the framework's) as one."""
    if name is not None and name.startswith("kerasfeed-worker-"):
        return "kerasfeed readers"
    if name is not None and (name == "MainThread" or name.startswith("kerasfeed")):
        return name
    return "framework and other"


def _reserved_cpus_init(reserve: int) -> Optional[Any]:
    """A ``worker_init`` keeping workers off the first ``reserve`` CPUs (None if that leaves none)."""
    cpus = sorted(os.sched_getaffinity(0))
    keep = cpus[reserve:]
    return functools.partial(os.sched_setaffinity, 0, keep) if keep else None


class Premade:
    """The items of ``workload``, made on first use in each process, then returned as they are.

    Module-level (workers import it by name); pickles as its arguments.
    """

    def __init__(self, workload: str, batches: int, cache_dir: str):
        self.args = (workload, batches, cache_dir)
        self._items: Optional[list] = None

    def __len__(self) -> int:
        return self.args[1]

    def __getitem__(self, i: int) -> Any:
        if self._items is None:
            from benchmarks import workloads

            seq = workloads.make_workload(*self.args)
            self._items = [seq[k] for k in range(len(seq))]
        return self._items[i]

    def __getstate__(self) -> dict:
        return {"args": self.args, "_items": None}


def _feed(variant: str, seq: Any, workers: int) -> tuple:
    """(what fit takes, its keyword arguments, the loader or None)."""
    import kerasfeed
    from benchmarks import ways

    if variant.startswith("memory"):  # the benchmarks' in-memory way: the batches concatenated, fit slices them
        feed = ways.REGISTRY["memory"].make(seq, ways.Context(mode="fit", backend=os.environ["KERAS_BACKEND"]))
        return feed.x, feed.fit_kwargs, None
    if variant == "kf-premade-threads":
        loader = kerasfeed.to_loader(seq, executor="threads")  # returning a made item needs no parallelism
        return loader, {}, loader
    init = _reserved_cpus_init(2) if variant == "kf-reserve2" else None
    ex = kerasfeed.ProcessExecutor(seq, workers=workers, worker_init=init,
                                   in_flight_per_worker=4 if variant == "kf-inflight4" else 2,
                                   worker_nice=0 if variant == "kf-nice0" else None)
    loader = kerasfeed.to_loader(seq, executor=ex, copy=variant == "kf-copy",
                                 device_prefetch=0 if variant == "kf-prefetch0" else None)
    return loader, {}, loader


def child(config: Dict[str, Any]) -> Dict[str, Any]:
    """Runs one variant's ``fit`` in this process; returns its row."""
    if config["variant"] == "kf-switch":
        sys.setswitchinterval(0.001)
    import keras
    import numpy as np

    import kerasfeed
    from benchmarks import runner, workloads

    n = config["batches"]
    made_once = config["variant"].startswith("kf-premade")
    seq = (Premade if made_once else workloads.make_workload)(config["workload"], n, config["cache_dir"])
    x0, _ = seq[0]
    net = runner.build_model(config["model"], np.asarray(x0), 10)
    feed, kwargs, loader = _feed(config["variant"], seq, config["workers"])
    marks: List[tuple] = []

    class Marks(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            marks.append((time.perf_counter(), time.process_time(), machine.thread_cpu_us(_thread_group)))

        def on_train_end(self, logs=None):
            marks.append((time.perf_counter(), time.process_time(), machine.thread_cpu_us(_thread_group)))

    try:
        net.fit(feed, **kwargs, epochs=config["epochs"], verbose=0, callbacks=[Marks()], shuffle=False)
        rates = [n / (b[0] - a[0]) for a, b in zip(marks[1:-1], marks[2:])]
        (_, c0, th0), (_, c1, th1) = marks[1], marks[-1]
        steps = n * (len(marks) - 2)
        row = {"steps_per_s": statistics.median(rates), "epoch_rates": [round(r, 1) for r in rates],
               "main_cpu_us": (c1 - c0) / steps * 1e6,
               # Threads that ended within the timed epochs (a pass's prefetch thread) count only in main_cpu_us.
               "threads_us": {k: round((v - th0.get(k, 0.0)) / steps) for k, v in th1.items()}}
        if loader is not None:
            s = kerasfeed.stats(loader)
            dev = s.get("device") or {}
            row["device"] = {"prefetch": dev.get("prefetch"), "ready_fraction": dev.get("ready_fraction"),
                             "wait_p95_ms": (dev.get("wait_ms") or {}).get("p95"),
                             "place_mean_ms": (dev.get("place_ms") or {}).get("mean")}
            row["pipeline_wait_p95_ms"] = (s.get("wait_ms") or {}).get("p95")
        return row
    finally:
        if loader is not None:
            loader.close()
            loader.executor.close()


def _burners(variant: str, count: int, config: Dict[str, Any], env: Dict[str, str]) -> List[subprocess.Popen]:
    if variant not in ("memory+burn", "memory+work", "memory+work-nice0"):
        return []
    code = ("while True: pass" if variant == "memory+burn" else
            "from benchmarks.workloads import make_workload\n"
            f"s = make_workload({config['workload']!r}, {config['batches']}, {config['cache_dir']!r})\n"
            "while True: [s[i] for i in range(len(s))]")
    nice = [] if variant.endswith("-nice0") else ["nice", "-n", "10"]
    return [subprocess.Popen([*nice, sys.executable, "-c", code], env=env) for _ in range(count)]


def run(variants: Sequence[str], *, workload: str, workers: int, batches: int, epochs: int, burners: int,
        cache_dir: str, model: str = "conv", progress: Any = print) -> List[Dict[str, Any]]:
    """Each variant in its own child (a fresh framework); rows in ``variants``' order."""
    from benchmarks import workloads

    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"Unknown variant {v!r}; expected some of {VARIANTS}. Received: {v!r}")
    workloads.check_names([workload])
    pathlib.Path(cache_dir).mkdir(parents=True, exist_ok=True)
    workloads.prepare(workload, batches, cache_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)])}
    rows = []
    for variant in variants:
        config = {"variant": variant, "workload": workload, "workers": workers, "batches": batches,
                  "epochs": epochs, "cache_dir": cache_dir, "model": model}
        side = _burners(variant, burners, config, env)
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], env=env,
                                  capture_output=True, text=True, timeout=300)
        finally:
            for p in side:
                p.kill()
                p.wait()
        found = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
        row = json.loads(found[-1][len(_MARK):]) if found else {"error": proc.stderr.strip()[-500:]}
        rows.append({**config, **row})
        progress(f"  {variant:14s} " + (f"{row['steps_per_s']:7.1f} steps/s  main CPU {row['main_cpu_us']:.0f} µs/step"
                                        if "steps_per_s" in row else row["error"][-200:]))
    return rows


def to_markdown(rows: List[Dict[str, Any]], header: str) -> str:
    memory = next((r["steps_per_s"] for r in rows if r["variant"] == "memory" and "steps_per_s" in r), None)
    out = [header, "", "| variant | steps/s (× memory) | main CPU µs/step | training thread µs | readers µs | "
           "step ready | place ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "steps_per_s" not in r:
            out.append(f"| {r['variant']} | error: {r['error'][-120:]} | | | | | |")
            continue
        ratio = f" ({r['steps_per_s'] / memory:.2f}×)" if memory else ""
        dev, th = r.get("device") or {}, r["threads_us"]
        ready = dev.get("ready_fraction")
        place = dev.get("place_mean_ms")
        out.append(f"| {r['variant']} | {r['steps_per_s']:.0f}{ratio} | {r['main_cpu_us']:.0f} | "
                   f"{th.get('MainThread', 0)} | {th.get('kerasfeed readers', 0)} | "
                   f"{'–' if ready is None else f'{ready:.2f}'} | {'–' if place is None else f'{place:.2f}'} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        print(_MARK + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--workload", default="decode")
    p.add_argument("--variants", default="memory,kf,kf-prefetch0,memory+work")
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--epochs", type=int, default=8, help="the first is never timed")
    p.add_argument("--burners", type=int, default=9, help="side processes of memory+burn / memory+work")
    p.add_argument("--model", default="conv", help="conv, or conv-small for a CPU smoke run")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error(f"--epochs must be at least 2 (the first is never timed). Received: {args.epochs}")
    from benchmarks.machine import machine_info
    from benchmarks.report import machine_line

    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        rows = run([v for v in args.variants.split(",") if v], workload=args.workload, workers=args.workers,
                   batches=args.batches, epochs=args.epochs, burners=args.burners, model=args.model,
                   cache_dir=args.cache_dir or str(out / "cache"))
    except ValueError as e:
        p.error(str(e))
    header = (f"### `fit` contention on `{args.workload}`, KERAS_BACKEND={os.environ.get('KERAS_BACKEND')} "
              f"({date}; {args.workers} workers, {args.batches} batches × {args.epochs} epochs, median of the "
              f"timed epochs)\n\n{machine_line({**machine, 'loadavg_end': [round(x, 2) for x in os.getloadavg()]})}")
    md = to_markdown(rows, header)
    (out / "fit_contention.json").write_text(json.dumps({"date": date, "rows": rows}, indent=1))
    (out / "fit_contention.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
