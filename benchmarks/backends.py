"""Batches/s under the JAX, PyTorch and TensorFlow backends, drained the way their ``fit`` drains them.

Every way of feeding is handed to Keras' own data-adapter machinery, as
``model.fit`` does (``ways.Context(mode="adapter")``): a ``kerasfeed.to_loader``
loader (itself a data adapter), a ``keras.utils.PyDataset`` (Keras' threads or
processes), a Grain dataset (JAX) and a PyTorch ``DataLoader`` (PyTorch). Each
epoch calls the adapter's ``on_epoch_begin``, drains ``get_jax_iterator()``
(each leaf put on the device as the jitted step would), ``get_torch_dataloader()``
(torch tensors) or ``get_tf_dataset()`` (a compiled loop; for a loader that is
``to_dataset`` with the same arguments), then ``on_epoch_end``. The TensorFlow
rows are the reference the other backends are compared with, in the same run.

Usage (each backend runs in its own child process: ``KERAS_BACKEND`` is fixed when Keras is imported)::

    python benchmarks/backends.py                       # every backend, full size
    python benchmarks/backends.py --batches 8 --min-time 0 --workloads cpu,io   # a smoke run
    python benchmarks/backends.py --json out.json       # also write the rows

Rates are batches / best timed epoch (epoch 2 on, up to ``--max-epochs``, while
the timed total is under ``--min-time`` s); × is the ratio to a serial loop
drained the same way in the same process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report, runner, ways, workloads  # noqa: E402

BACKENDS = ("jax", "torch", "tensorflow")
COMMON_WAYS = ("serial", "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto", "keras-threads",
               "keras-processes")
BACKEND_WAYS = {"jax": COMMON_WAYS + ("grain-threads", "grain-mp"), "torch": COMMON_WAYS + ("torch",),
                "tensorflow": COMMON_WAYS}


def run_backends(backends: Sequence[str], names: Sequence[str], batches: Optional[int], workers: int,
                 min_time: float, max_epochs: int, only: Optional[List[str]]) -> List[Dict[str, Any]]:
    """Every backend's ways on every workload, one child process per backend."""
    cache = pathlib.Path(tempfile.gettempdir()) / "kerasfeed-bench"
    cache.mkdir(exist_ok=True)
    rows: List[Dict[str, Any]] = []
    for backend in backends:
        configs = []
        for name in names:
            n = batches or workloads.REGISTRY[name].full
            workloads.prepare(name, n, cache)
            for way in ways.select(list(BACKEND_WAYS[backend]), only, always=("serial",)):
                configs.append({"way": way.name, "workload": name, "batches": n, "cache_dir": str(cache),
                                "mode": "adapter", "backend": backend, "workers": workers,
                                "min_timed_s": min_time, "max_timed_epochs": max(1, max_epochs - 1)})
        print(f"KERAS_BACKEND={backend}", file=sys.stderr, flush=True)
        rows += runner.isolated(configs, {"KERAS_BACKEND": backend},
                                progress=lambda line: print(line, file=sys.stderr, flush=True))
    runner.add_ratios(rows, lambda r: r["way"] == "serial", "x_serial")
    return rows


def to_markdown(rows: List[Dict[str, Any]]) -> str:
    lines: List[str] = []
    for backend in BACKENDS:
        mine = [r for r in rows if r.get("backend") == backend]
        if mine:
            names = list(dict.fromkeys(r["workload"] for r in mine))
            lines += [f"#### KERAS_BACKEND={backend}: batches/s (× the serial loop)", ""]
            lines += report.table(mine, names, "x_serial", "way of feeding", row_of=lambda r: r["way"])
            lines += report.notes(mine) + [""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=BACKENDS, help="run this backend only (default: each, in its own process)")
    p.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    p.add_argument("--ways", default="", help="comma-separated subset of ways (serial always runs)")
    p.add_argument("--batches", type=int, help="batches per epoch for every workload (default: per workload)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--min-time", type=float, default=4.0, help="seconds of timed epochs per way, at least one epoch")
    p.add_argument("--max-epochs", type=int, default=10)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    names = runner.split(args.workloads)
    try:
        workloads.check_names(names)
        ways.select([], runner.split(args.ways) or None)
    except ValueError as e:
        p.error(str(e))
    rows = run_backends([args.backend] if args.backend else BACKENDS, names, args.batches, args.workers,
                        args.min_time, args.max_epochs, runner.split(args.ways) or None)
    print(to_markdown(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
