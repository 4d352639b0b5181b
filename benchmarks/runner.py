"""The one runner: a way of feeding on a workload, built, timed and closed the same way by every benchmark.

How a configuration (one way x one workload x one ``Context``) is measured:

1. A fresh source is made and the way's feed is built on it (``build``).
2. Epoch 1 runs untimed: it holds the one-off start-up (workers starting,
   files opening, signatures probed, functions traced). ``first batch s`` is
   the wall time from the start of ``build`` to the first batch of epoch 1.
3. Epoch 2 is timed; short ones are followed by more timed epochs (up to
   ``max_timed_epochs`` while the timed total is under ``min_timed_s``), the
   best is kept, so per-epoch costs (a pool rebuilt every epoch) stay in.
   Under ``model.fit`` every epoch after the first is timed (``epochs``),
   between Keras' ``on_epoch_begin`` calls.
4. Each batch is consumed as the context says (``ways.Context``): read
   through a zero-copy view (a Python loop), pulled by a compiled
   ``tf.function`` (graph), put on the device (Keras' JAX adapter), or trained on.
5. The feed is closed and the runner waits until every process it started is
   gone (killing stragglers by pid after 10 s, and saying so).

``isolated`` runs configurations in a child process (one per backend, or one
per configuration), so one's threads, workers and framework state never slow
the next. Ratios are always taken within one run (and one round).
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks import machine, ways, workloads  # noqa: E402
from benchmarks.ways import Context, Way  # noqa: E402

DEFAULT_OUTPUT_DIR = ROOT / "benchmarks" / "results"
_MARK = "BENCH-ROW "
Progress = Callable[[str], None]


# --- consuming a pass ----------------------------------------------------------------------------


def _adapter_functions(feed: ways.Feed, ctx: Context) -> Tuple[Callable, Callable, Optional[Callable]]:
    """A pass as Keras' ``fit`` pulls it on ``ctx.backend``: ``get_data_adapter(x)``, its epoch
    hooks and its backend iterator; the serial loop (no ``x``) is converted the same way."""
    adapter = None
    if feed.x is not None:
        from keras.src.trainers.data_adapters import get_data_adapter

        adapter = get_data_adapter(feed.x, **feed.fit_kwargs)
    consume: Callable[[Any], float] = ways.touch
    if ctx.backend == "jax":
        import jax

        def consume(batch: Any) -> float:
            jax.block_until_ready([jax.device_put(a) for a in jax.tree_util.tree_leaves(batch)])
            return 0.0
    elif ctx.backend == "torch":
        import torch

        def consume(batch: Any) -> float:
            if not all(isinstance(t, torch.Tensor) for t in ways.flatten(batch)):
                raise TypeError(f"the torch adapter yielded {type(batch).__name__}, not torch tensors")
            return 0.0
    if adapter is None:
        if ctx.backend == "torch":
            return (lambda: (tuple(torch.from_numpy(np.asarray(a)) for a in ways.flatten(b)) for b in feed.epoch()),
                    consume, None)
        return feed.epoch, consume, None
    source = {"jax": adapter.get_jax_iterator, "torch": adapter.get_torch_dataloader,
              "tensorflow": adapter.get_tf_dataset}[ctx.backend]

    def iterate() -> Any:
        adapter.on_epoch_begin()
        try:
            yield from source()
        finally:
            adapter.on_epoch_end()

    compiled = None
    if ctx.backend == "tensorflow":  # traced here, untimed: fit's train function pulls in the graph
        drain = ways.graph_drainer(adapter.get_tf_dataset())

        def compiled() -> Tuple[int, float]:
            adapter.on_epoch_begin()
            try:
                return drain()
            finally:
                adapter.on_epoch_end()
    return iterate, consume, compiled


def pass_functions(feed: ways.Feed, ctx: Context) -> Tuple[Callable, Callable, Callable[[], Tuple[int, float]]]:
    """``(iterate, consume, timed)``: ``iterate()`` yields one pass's batches (epoch 1), ``consume``
    is what the loop does with each, ``timed()`` consumes a whole pass and returns ``(batches, total)``."""
    if ctx.mode == "adapter":
        iterate, consume, compiled = _adapter_functions(feed, ctx)
    else:
        iterate, consume, compiled = feed.epoch, ways.touch, feed.drain

    def timed() -> Tuple[int, float]:
        if compiled is not None:
            return compiled()
        count, total = 0, 0.0
        for count, batch in enumerate(iterate(), 1):
            total += consume(batch)
        return count, total

    return iterate, consume, timed


# --- one configuration ----------------------------------------------------------------------------


def _row(way: Way, ctx: Context, **extra: Any) -> Dict[str, Any]:
    return {"way": way.name, "label": way.title(ctx), "measures": way.measures, "mode": ctx.mode,
            "backend": ctx.backend, "num_workers": ctx.workers, **extra}


def _finish(row: Dict[str, Any], before: set, feed: Any, seq: Any) -> None:
    """Closes the feed and the source, then waits for every process the configuration started."""
    try:
        if feed is not None:
            feed.close()
    except Exception as e:  # noqa: BLE001 - reported in the row
        row.setdefault("close_error", f"{type(e).__name__}: {e}")
    closer = getattr(seq, "close", None)
    if callable(closer):
        try:
            closer()
        except Exception:  # noqa: BLE001 - the feed's error is already in the row
            pass
    gc.collect()
    killed = machine.wait_for_exit(before)
    if killed:
        row["killed_after_close"] = killed
    row["main_rss_mb_after"] = psutil.Process().memory_info().rss / 2**20


def _report(row: Dict[str, Any], way: Way, progress: Progress, label: str) -> None:
    name = label + row["way"] + (f"@{row['num_workers']}" if "{workers}" in way.label else "")
    if row["status"] == "ok":
        ws = row.get("workers") or []
        first = "batch" if "first_batch_s" in row else "epoch"
        progress(f"  {name:28s} {row['batches_per_s']:9.1f} batches/s  first {first} {row[f'first_{first}_s']:.2f}s"
                 f"  main CPU {row['main_cpu_us_per_batch']:.0f} µs/batch"
                 + (f"  {len(ws)} workers, {mean([w['rss_mb'] for w in ws]):.0f} MB RSS each" if ws else ""))
    else:
        progress(f"  {name:28s} {row['note']}")


def _unavailable(row: Dict[str, Any], way: Way, ctx: Context, progress: Progress, label: str) -> bool:
    """Whether ``way`` cannot run here; if so ``row`` says why (and is reported)."""
    missing = way.missing(ctx)
    if missing:
        row.update(status="skipped" if missing.startswith("skipped") else "n/a", note=missing)
        _report(row, way, progress, label)
    return bool(missing)


def measure(way: Way, make_seq: Callable[[], Any], ctx: Context, *, min_timed_s: float = 4.0,
            max_timed_epochs: int = 10, progress: Progress = print, label: str = "") -> Dict[str, Any]:
    """Builds ``way`` on a fresh source, runs its epochs in ``ctx.mode``, closes it. Never raises."""
    row = _row(way, ctx)
    if _unavailable(row, way, ctx, progress, label):
        return row
    before = {p.pid for p in machine.descendants()}
    memory: Dict[int, Dict[str, float]] = {}
    feed = seq = None
    try:
        seq = make_seq()
        n = len(seq)
        t0 = time.perf_counter()
        feed = way.make(seq, ctx)
        iterate, consume, timed_pass = pass_functions(feed, ctx)
        build_s = time.perf_counter() - t0
        first_batch_s, count, checksum = None, 0, 0.0
        for count, batch in enumerate(iterate(), 1):
            checksum += consume(batch)
            if count == 1:
                first_batch_s = time.perf_counter() - t0
            if count in (1, n // 2):  # pools rebuilt per epoch are gone by its end
                machine.sample_workers(before, memory)
        epoch1_s = time.perf_counter() - t0 - build_s
        if count != n:
            raise RuntimeError(f"epoch 1 delivered {count} batches, expected {n}")
        timed: List[Dict[str, Any]] = []
        while len(timed) < max_timed_epochs:
            procs = machine.new_workers(before)
            wcpu0 = machine.workers_cpu(procs)
            c0, t = time.process_time(), time.perf_counter()
            count, touched = timed_pass()
            wall, main_cpu = time.perf_counter() - t, time.process_time() - c0
            wcpu1 = machine.workers_cpu(procs)
            checksum += touched
            if count != n:
                raise RuntimeError(f"epoch {len(timed) + 2} delivered {count} batches, expected {n}")
            persistent = bool(wcpu0) and all(pid in wcpu1 for pid in wcpu0)
            timed.append({"wall_s": wall, "main_cpu_s": main_cpu,
                          "worker_cpu_s": sum(wcpu1[p] - wcpu0[p] for p in wcpu0) if persistent else None})
            if sum(e["wall_s"] for e in timed) >= min_timed_s:
                break
        machine.sample_workers(before, memory)
        info = feed.info()
        row.update(_summary(n, timed), status="ok", build_s=build_s, epoch1_s=epoch1_s, first_batch_s=first_batch_s,
                   one_off_s=max(0.0, build_s + epoch1_s - min(e["wall_s"] for e in timed)),
                   workers=[{"pid": pid, **m} for pid, m in sorted(memory.items())],
                   executor=info or None, checksum=checksum)
        _note_pick(row, way, info)
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others
        row.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        _finish(row, before, feed, seq)
        feed = seq = None
    _report(row, way, progress, label)
    return row


def _note_pick(row: Dict[str, Any], way: Way, info: Dict[str, Any]) -> None:
    """``auto``'s rows say which executor it picked, and why."""
    if way.name == "kerasfeed-auto" and info.get("name"):
        row["picked"], row["note"] = info["name"], info.get("reason") or f"picked {info['name']}"


def _summary(n: int, timed: List[Dict[str, Any]]) -> Dict[str, Any]:
    best = min(timed, key=lambda e: e["wall_s"])
    return {"batches": n, "batches_per_s": n / best["wall_s"], "timed_epoch_s": best["wall_s"],
            "timed_epochs_s": [e["wall_s"] for e in timed],
            "epoch_rates_median": n / statistics.median(e["wall_s"] for e in timed),
            "main_cpu_us_per_batch": best["main_cpu_s"] / n * 1e6,
            "worker_cpu_us_per_batch": None if best.get("worker_cpu_s") is None else best["worker_cpu_s"] / n * 1e6}


def mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


# --- model.fit ----------------------------------------------------------------------------------


def build_model(kind: str, x: np.ndarray, num_classes: int, steps_per_execution: int = 1) -> Any:
    """``tiny``: the mean over the inner axes, one Dense (the input path sets the rate);
    ``conv``: 3 conv layers (32/64/128 filters, 3x3, stride 2), pooling, one Dense (images);
    ``conv-small``: the same with 4/8/16 filters (a CPU smoke run)."""
    import keras

    inputs = keras.Input(x.shape[1:], dtype=str(x.dtype))
    if kind == "tiny":
        h = inputs
        if x.ndim > 2:
            axes = tuple(range(1, x.ndim - 1))
            h = keras.layers.Lambda(lambda t: keras.ops.mean(t, axis=axes))(h)
    elif kind in ("conv", "conv-small"):
        if x.ndim != 4:
            raise ValueError(f"the conv model needs image batches (4 dimensions). Received: shape {x.shape}")
        h = keras.layers.Rescaling(1 / 255)(inputs)
        for filters in (32, 64, 128) if kind == "conv" else (4, 8, 16):
            h = keras.layers.Conv2D(filters, 3, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
    else:
        raise ValueError(f"Unknown model {kind!r}; expected 'tiny', 'conv' or 'conv-small'. Received: {kind!r}")
    model = keras.Model(inputs, keras.layers.Dense(num_classes)(h))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


_MODELS: Dict[tuple, Any] = {}


def _clock(num_batches: int, before: set, memory: Dict[int, Dict[str, float]]) -> Any:
    """A Keras callback recording each epoch's start (wall, main CPU, workers' CPU) and its batches."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.marks: List[Tuple[float, float, float]] = []
            self.batches: List[int] = []

        def _mark(self):
            cpu = sum(machine.workers_cpu(machine.new_workers(before)).values())
            self.marks.append((time.perf_counter(), time.process_time(), cpu))

        def on_epoch_begin(self, epoch, logs=None):
            self._mark()
            self.batches.append(0)

        def on_train_batch_end(self, batch, logs=None):
            # Keras passes the last step of each execution, uncapped when steps_per_execution
            # does not divide the epoch.
            self.batches[-1] = min(batch + 1, num_batches)
            if len(self.batches) == 1 and batch in (0, num_batches // 2):
                machine.sample_workers(before, memory)

        def on_train_end(self, logs=None):
            self._mark()

    return Clock()


def measure_fit(way: Way, make_seq: Callable[[], Any], ctx: Context, *, epochs: int = 4, model: str = "tiny",
                steps_per_execution: int = 1, progress: Progress = print, label: str = "") -> Dict[str, Any]:
    """``model.fit(..., epochs=epochs)`` on ``way``'s feed; epoch 1 untimed, the others timed. Never raises."""
    row = _row(way, ctx, model=model)
    if _unavailable(row, way, ctx, progress, label):
        return row
    before = {p.pid for p in machine.descendants()}
    memory: Dict[int, Dict[str, float]] = {}
    feed = seq = None
    try:
        seq = make_seq()
        n = len(seq)
        x0, y0 = seq[0]
        x0, classes = np.asarray(x0), int(max(10, np.max(np.asarray(y0)) + 1))
        key = (model, x0.shape, str(x0.dtype), classes, steps_per_execution)
        if key not in _MODELS:  # one model per shape in a process: its train step compiles once
            _MODELS[key] = build_model(model, x0, classes, steps_per_execution)
        net = _MODELS[key]
        t0 = time.perf_counter()
        feed = way.make(seq, ctx)
        clock = _clock(n, before, memory)
        net.fit(feed.x, **feed.fit_kwargs, epochs=epochs, verbose=0, callbacks=[clock], shuffle=False)
        for e, count in enumerate(clock.batches):
            if count != n:
                raise RuntimeError(f"epoch {e + 1} ran {count} batches, expected {n}")
        m = clock.marks
        timed = [{"wall_s": b[0] - a[0], "main_cpu_s": b[1] - a[1], "worker_cpu_s": b[2] - a[2]}
                 for a, b in zip(m[1:-1], m[2:])]
        info = feed.info()
        row.update(_summary(n, timed), status="ok", first_epoch_s=m[1][0] - t0,
                   workers=[{"pid": pid, **v} for pid, v in sorted(memory.items())], executor=info or None)
        _note_pick(row, way, info)
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others
        row.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        _finish(row, before, feed, seq)
        feed = seq = None
    _report(row, way, progress, label)
    return row


# --- configurations by name, in this process or a child ---------------------------------------------


def run_config(config: Dict[str, Any], progress: Progress = print) -> Dict[str, Any]:
    """Runs one configuration given by names (JSON-able): ``way``, ``workload``, ``batches``,
    ``cache_dir``, the ``Context`` fields, and ``epochs``/``model``/``steps_per_execution``
    (mode ``fit``) or ``min_timed_s``/``max_timed_epochs``; ``round`` is kept in the row.
    ``call: "module:function"`` runs that function on the config instead (a benchmark's own measure);
    past ``deadline`` (``time.time()``) the configuration is skipped."""
    if config.get("deadline") and time.time() > config["deadline"]:  # a run's time budget is spent
        return {**config, "status": "skipped", "note": "skipped: past the run's time budget"}
    if "call" in config:
        module, _, function = config["call"].partition(":")
        return getattr(importlib.import_module(module), function)(config)
    ctx = Context(config.get("mode", "graph"), config.get("backend", "tensorflow"), int(config.get("workers", 2)),
                  config.get("auto_workers"))
    way = ways.REGISTRY[config["way"]]

    def make_seq() -> Any:
        return workloads.make_workload(config["workload"], config["batches"], config["cache_dir"])

    if ctx.mode == "fit":
        row = measure_fit(way, make_seq, ctx, epochs=int(config.get("epochs", 4)), model=config.get("model", "tiny"),
                          steps_per_execution=int(config.get("steps_per_execution", 1)), progress=progress)
    else:
        row = measure(way, make_seq, ctx, min_timed_s=float(config.get("min_timed_s", 4.0)),
                      max_timed_epochs=int(config.get("max_timed_epochs", 10)), progress=progress)
    row.update(workload=config["workload"], round=config.get("round", 0))
    return row


def isolated(configs: List[Dict[str, Any]], env: Optional[Dict[str, str]] = None, timeout_s: float = 900,
             progress: Progress = print) -> List[Dict[str, Any]]:
    """Runs ``configs`` one after another in one child process (``env`` added to its environment);
    a configuration the child never reported (a crash, the timeout) comes back as an error row."""
    full_env = {**os.environ, **(env or {})}
    # The caller's PYTHONPATH first (``PYTHONPATH=/other/tree`` measures that tree's kerasfeed), then
    # this repository, so worker processes can import the workload classes by module name.
    full_env["PYTHONPATH"] = os.pathsep.join([p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p]
                                             + [str(ROOT)])
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(configs)]
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:  # progress lines as they come, rows marked
                if line.startswith(_MARK):
                    rows.append(json.loads(line[len(_MARK):]))
                elif line.strip():
                    progress(line.rstrip())
            proc.wait()
        finally:
            timed_out = not timer.is_alive() and proc.returncode != 0
            timer.cancel()
        err.seek(0)
        tail = " | ".join(err.read().strip().splitlines()[-3:])[:300]
    why = f"timed out after {timeout_s:.0f} s" if timed_out else f"child exited {proc.returncode}"
    for config in configs[len(rows):]:
        rows.append({**config, "status": "error", "note": f"error: {why}: {tail}"})
    return rows


def _child(configs: List[Dict[str, Any]]) -> None:
    for config in configs:
        row = run_config(config, progress=lambda line: print(line, flush=True))
        print(_MARK + json.dumps(row, default=str), flush=True)


# --- results -----------------------------------------------------------------------------------------


def add_ratios(rows: List[Dict[str, Any]], reference: Callable[[Dict[str, Any]], bool], key: str = "ratio",
               by: Iterable[str] = ("mode", "backend", "workload", "round")) -> None:
    """``row[key]`` = its rate / the best reference rate of its group (same mode, backend, workload, round)."""
    by = tuple(by)
    best: Dict[tuple, float] = {}
    for r in rows:
        if r.get("status") == "ok" and reference(r):
            group = tuple(r.get(k) for k in by)
            best[group] = max(best.get(group, 0.0), r["batches_per_s"])
    for r in rows:
        ref = best.get(tuple(r.get(k) for k in by))
        if r.get("status") == "ok" and ref:
            r[key] = r["batches_per_s"] / ref


def save_results(out_dir: Any, stem: str, results: Dict[str, Any]) -> pathlib.Path:
    """Writes ``<out_dir>/<stem>.json`` and its ``"markdown"`` entry to ``<out_dir>/<stem>.md``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    (out / f"{stem}.md").write_text(results["markdown"])
    return path


def split(text: Optional[str]) -> Optional[List[str]]:
    """``"a,b"`` -> ``["a", "b"]``; None stays None."""
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
    else:
        sys.exit("runner.py is run by the benchmarks (benchmarks/run.py, fit.py, backends.py, gpu.py).")
