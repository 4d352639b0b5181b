"""Batches/s under the JAX, PyTorch and TensorFlow backends, drained the way their ``fit`` drains them.

Every way of feeding is handed to Keras' own data-adapter machinery, which is
what ``model.fit`` does with it: a ``kerasfeed.to_loader`` loader (itself a
data adapter), a ``keras.utils.PyDataset`` (``PyDatasetAdapter``: Keras'
threads or processes), a Grain dataset (``GrainDatasetAdapter``, JAX) and a
PyTorch ``DataLoader`` (``TorchDataLoaderAdapter``, PyTorch). Each epoch then
calls the adapter's ``on_epoch_begin``, drains ``get_jax_iterator()`` (JAX:
numpy batches, each leaf put on the device as the jitted step would) or
``get_torch_dataloader()`` (PyTorch: torch tensors) or ``get_tf_dataset()``
(TensorFlow: a compiled loop pulls every batch, ``peers.graph_drainer``; for
a loader this is ``to_dataset`` with the same arguments) and calls
``on_epoch_end``. The TensorFlow rows are the reference the other backends
are compared with, in the same run. The workloads are the four of ``benchmarks/workloads.py``.

Usage (each backend runs in its own process: ``KERAS_BACKEND`` is fixed when
Keras is imported)::

    python benchmarks/backends.py                       # both backends, full size
    python benchmarks/backends.py --batches 8 --min-time 0 --workloads cpu,io   # a smoke run
    python benchmarks/backends.py --json out.json       # also write the rows

Rates are batches / best timed epoch (epoch 2 on, up to ``--max-epochs``,
while the timed total is under ``--min-time`` s); × is the ratio to a serial
loop drained the same way in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import workloads  # noqa: E402

BACKENDS = ("jax", "torch", "tensorflow")
DEFAULT_BATCHES = {"cpu": 300, "h5": 200, "io": 1000, "big": 150}


# --- ways of feeding: each returns a Keras data adapter ---------------------------------


class _SerialAdapter:
    """``seq[i]`` in a plain loop, as numpy: the reference every rate is divided by."""

    def __init__(self, seq):
        self.seq = seq

    def on_epoch_begin(self):
        pass

    def on_epoch_end(self):
        pass

    def get_jax_iterator(self):
        return (self.seq[i] for i in range(len(self.seq)))

    def get_torch_dataloader(self):
        import torch

        from kerasfeed.loader.convert import map_arrays

        return (map_arrays(torch.from_numpy, b) for b in self.get_jax_iterator())

    def close(self):
        pass


def _kerasfeed(executor: str, workers: int) -> Callable[[Any], Any]:
    def make(seq):
        import kerasfeed

        return kerasfeed.to_loader(seq, executor=executor, workers=workers if executor == "processes" else None)

    return make


def _keras(workers: int, processes: bool) -> Callable[[Any], Any]:
    def make(seq):
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        seq.workers, seq.use_multiprocessing, seq.max_queue_size = workers, processes, 10
        return PyDatasetAdapter(seq)

    return make


def _grain(threads: Optional[int], processes: Optional[int]) -> Callable[[Any], Any]:
    def make(seq):
        import grain
        from keras.src.trainers.data_adapters.grain_dataset_adapter import GrainDatasetAdapter

        ds = grain.MapDataset.source(seq).to_iter_dataset(grain.ReadOptions(num_threads=threads or 1))
        if processes:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's worker processes read absl flags
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=processes))
        return GrainDatasetAdapter(ds)

    return make


def _torch(workers: int) -> Callable[[Any], Any]:
    def make(seq):
        from keras.src.trainers.data_adapters.torch_data_loader_adapter import TorchDataLoaderAdapter
        from torch.utils.data import DataLoader

        return TorchDataLoaderAdapter(DataLoader(seq, batch_size=None, num_workers=workers, persistent_workers=True))

    return make


def ways(backend: str, workers: int) -> Dict[str, Callable[[Any], Any]]:
    out = {
        "serial": _SerialAdapter,
        "kerasfeed-threads": _kerasfeed("threads", workers),
        "kerasfeed-processes": _kerasfeed("processes", workers),
        "kerasfeed-auto": _kerasfeed("auto", workers),
        "keras-threads": _keras(8, False),
        "keras-processes": _keras(workers, True),
    }
    if backend == "jax":
        out["grain-threads"] = _grain(16, None)
        out["grain-processes"] = _grain(None, workers)
    elif backend == "torch":
        out["torch-dataloader"] = _torch(workers)
    return out


# --- draining ---------------------------------------------------------------------------


def _drainer(backend: str) -> Callable[[Any], int]:
    """One epoch as the backend's fit pulls it; returns the number of batches."""
    if backend == "jax":
        import jax

        def drain(adapter):
            n = 0
            adapter.on_epoch_begin()
            for batch in adapter.get_jax_iterator():
                leaves = jax.tree_util.tree_leaves(batch)
                jax.block_until_ready([jax.device_put(a) for a in leaves])
                n += 1
            adapter.on_epoch_end()
            return n
    elif backend == "tensorflow":
        from benchmarks import peers

        def drain(adapter):
            adapter.on_epoch_begin()
            if isinstance(adapter, _SerialAdapter):
                n = sum(1 for _ in adapter.get_jax_iterator())
            else:
                run = getattr(adapter, "_bench_drain", None)
                if run is None:  # traced once per adapter, in the untimed first epoch
                    run = adapter._bench_drain = peers.graph_drainer(adapter.get_tf_dataset())
                n, _ = run()
            adapter.on_epoch_end()
            return n
    else:
        import torch

        def drain(adapter):
            n = 0
            adapter.on_epoch_begin()
            for batch in adapter.get_torch_dataloader():
                leaves = batch.values() if isinstance(batch, dict) else batch
                for t in leaves if isinstance(leaves, (tuple, list)) else [leaves]:
                    assert isinstance(t, torch.Tensor), type(t)
                n += 1
            adapter.on_epoch_end()
            return n

    return drain


def _measure(make, seq, drain, way, min_time, max_epochs):
    """Builds the way, drains an untimed first epoch, then times epochs; returns
    ``(batches/s of the best timed epoch, first epoch s, timed epochs)``."""
    t0 = time.perf_counter()
    adapter = make(seq)
    try:
        first = drain(adapter)
        startup = time.perf_counter() - t0
        timed, best, epochs = 0.0, None, 0
        while epochs < max(1, max_epochs - 1) and (epochs == 0 or timed < min_time):
            t = time.perf_counter()
            n = drain(adapter)
            dt = time.perf_counter() - t
            assert n == first == len(seq), f"{way}: {n} batches, expected {len(seq)}"
            timed += dt
            best = dt if best is None else min(best, dt)
            epochs += 1
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()
        loader = getattr(adapter, "_dataloader", None)
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    return len(seq) / best, startup, epochs


def run_backend(backend: str, names: Sequence[str], batches: Dict[str, int], workers: int, min_time: float,
                max_epochs: int, only: Optional[Sequence[str]]) -> List[Dict[str, Any]]:
    import keras

    assert keras.backend.backend() == backend, f"KERAS_BACKEND must be {backend}. Received: {keras.backend.backend()}"
    drain = _drainer(backend)
    rows = []
    cache = pathlib.Path(tempfile.gettempdir()) / "kerasfeed-bench"
    cache.mkdir(exist_ok=True)
    for name in names:
        serial_rate = None
        for way, make in ways(backend, workers).items():
            if only and way not in only and way != "serial":
                continue
            seq = workloads.make_workload(name, batches[name], cache)
            try:
                rate, startup, epochs = _measure(make, seq, drain, way, min_time, max_epochs)
            except Exception as e:  # noqa: BLE001 - one way failing (a missing package) must not end the run
                print(f"  {backend:5s} {name:4s} {way:20s} failed: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
                rows.append({"backend": backend, "workload": name, "way": way, "batches_per_s": None,
                             "x_serial": None, "error": f"{type(e).__name__}: {e}"})
                continue
            if way == "serial":
                serial_rate = rate
            rows.append({"backend": backend, "workload": name, "way": way, "batches_per_s": rate,
                         "x_serial": rate / serial_rate if serial_rate else None,
                         "first_epoch_s": startup, "timed_epochs": epochs})
            print(f"  {backend:5s} {name:4s} {way:20s} {rate:9.1f} batches/s", file=sys.stderr, flush=True)
    return rows


def to_markdown(rows: List[Dict[str, Any]]) -> str:
    lines = []
    for backend in BACKENDS:
        mine = [r for r in rows if r["backend"] == backend]
        if not mine:
            continue
        names = list(dict.fromkeys(r["workload"] for r in mine))
        lines += [f"#### KERAS_BACKEND={backend}: batches/s (× the serial loop)", "",
                  "| way of feeding | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for way in dict.fromkeys(r["way"] for r in mine):
            cells = []
            for name in names:
                r = next((r for r in mine if r["workload"] == name and r["way"] == way), None)
                if r is None or r["batches_per_s"] is None:
                    cells.append("–" if r is None else "failed")
                else:
                    ratio = "" if r["x_serial"] is None else f" ({r['x_serial']:.2f}×)"
                    cells.append(f"{r['batches_per_s']:,.0f}{ratio}")
            lines.append(f"| {way} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _without_json(args: list) -> list:
    """The command line minus ``--json PATH`` / ``--json=PATH`` (each backend's child writes its own)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=BACKENDS,
                   help="run one backend in this process (default: each in a subprocess)")
    p.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    p.add_argument("--ways", default="", help="comma-separated subset of ways (serial always runs)")
    p.add_argument("--batches", type=int, help="batches per epoch for every workload (default: per workload)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--min-time", type=float, default=4.0, help="seconds of timed epochs per way, at least one epoch")
    p.add_argument("--max-epochs", type=int, default=10)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    for n in names:
        if n not in workloads.WORKLOADS:
            p.error(f"unknown workload {n!r}; expected some of {workloads.WORKLOADS}. Received: {args.workloads}")
    batches = {n: args.batches or DEFAULT_BATCHES[n] for n in names}
    only = [w for w in args.ways.split(",") if w] or None
    if args.backend:
        rows = run_backend(args.backend, names, batches, args.workers, args.min_time, args.max_epochs, only)
    else:
        rows = []
        for backend in BACKENDS:
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "rows.json"
                cmd = [sys.executable, __file__, "--backend", backend, "--json", str(out)] + _without_json(
                    list(argv if argv is not None else sys.argv[1:])
                )
                env = {**os.environ, "KERAS_BACKEND": backend,
                       "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
                subprocess.run(cmd, check=True, env=env)
                rows += json.loads(out.read_text())
        print(to_markdown(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    elif args.backend:
        print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
