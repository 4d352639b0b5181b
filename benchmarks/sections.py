"""The benchmark's sections (the main table, the scene file, the slow generators) and ``run_benchmark``."""

from __future__ import annotations

import datetime
import gc
import os
import pathlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from benchmarks import peers, workloads
from benchmarks.harness import (
    CLASSIC_GENERATORS,
    DEFAULT_OUTPUT_DIR,
    FULL_BATCHES,
    QUICK_BATCHES,
    ROOT,
    SECTIONS,
    add_ratios,
    descendants,
    machine_info,
    run_config,
    save_results,
    select_ways,
    wait_for_exit,
)
from benchmarks.report import to_markdown


class _RawH5(peers.Feed):
    """The limit of the h5 rows: h5py slice reads in a plain loop, file already open."""

    def __init__(self, path: str, num_batches: int, scenes: int = workloads.H5_SCENES_PER_BATCH):
        import h5py

        self.file = h5py.File(path, "r")
        self.points, self.labels = self.file["points"], self.file["labels"]
        self.n, self.scenes = num_batches, scenes

    def epoch(self):
        for i in range(self.n):
            a = i * self.scenes
            yield self.points[a:a + self.scenes], self.labels[a:a + self.scenes]

    def close(self):
        self.file.close()


def _h5slice_available() -> bool:
    try:
        import kerasfeed

        return getattr(kerasfeed, "H5SliceSequence", None) is not None
    except (ImportError, AttributeError):
        return False


def h5file_section(path: pathlib.Path, n: int, main_rows: List[Dict[str, Any]],
                   only: Optional[Sequence[str]], process_workers: int, timing: Dict[str, Any],
                   progress: Callable[[str], None]) -> Dict[str, Any]:
    """Gzip-chunked scene file: kerasfeed vs Keras vs serial vs raw h5py reads of the same rows."""
    names = ("serial", "kerasfeed-processes", "kerasfeed-threads",
             "keras-threads", "keras-processes")
    chosen = [w for w in peers.ways(process_workers) if w.name in names]
    chosen.sort(key=lambda w: names.index(w.name))
    raw = peers.Way("raw-h5py", "raw sequential h5py read (the limit)",
                    lambda _seq: _RawH5(str(path), n),
                    measures="h5py.File opened once; points[a:b], labels[a:b] in a loop, no class")
    if only:
        chosen = [w for w in chosen if w.name in only or w.name == "serial"]
    if _h5slice_available():
        import kerasfeed

        def make_seq():
            return kerasfeed.H5SliceSequence(str(path), ("points", "labels"),
                                             workloads.H5_SCENES_PER_BATCH)
        source = "kerasfeed.H5SliceSequence(path, ('points', 'labels'), 8)"
        reuse = {}
    else:
        def make_seq():
            return workloads.H5Scenes(str(path), n)
        source = "benchmarks.workloads.H5Scenes (kerasfeed.H5SliceSequence not available)"
        # Same class, same file as the main table's h5 column: reuse those rows.
        reuse = {r["way"]: r for r in main_rows if r.get("workload") == "h5"}
    progress(f"[h5file] {source}, {n} batches of 8 scenes x 4096 points x 6 float32 (gzip, chunks of 8 scenes)")
    rows = []
    for way in chosen + [raw]:
        if way.name in reuse:
            row = dict(reuse[way.name])
            row["note"] = (row.get("note", "") + " (from the main table's h5 column)").strip()
            progress(f"  [h5file] {way.name:22s} reused from the main table")
        else:
            row = run_config(way, make_seq, progress=progress, label="[h5file] ", **timing)
        rows.append(row)
    add_ratios(rows)
    kp = next((r for r in rows if r["way"] == "kerasfeed-processes" and r["status"] == "ok"), None)
    target = None
    if kp is not None and "x_serial" in kp:
        target = {"x_serial": kp["x_serial"], "target": 1.5, "met": kp["x_serial"] >= 1.5}
    return {"source": source, "path_name": path.name, "batches": n, "rows": rows, "target": target}


def classic_section(quick: bool, progress: Callable[[str], None]) -> Dict[str, Any]:
    """100 slow generators: 100 generators that each sleep 0.1 s then yield one image/mask pair."""
    try:
        import kerasfeed

        from_generators = getattr(kerasfeed, "from_generators")
    except (ImportError, AttributeError):
        progress("[classic] n/a (not available: kerasfeed.from_generators does not exist yet)")
        return {"status": "n/a", "note": "n/a (not available: kerasfeed.from_generators does not exist yet)"}
    import itertools

    import tensorflow as tf

    total = CLASSIC_GENERATORS
    measured = 5 if quick else 10  # the chained baseline is ~0.1 s per generator
    spec = (tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE, tf.float32),
            tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE[:2] + (1,), tf.uint8))
    out: Dict[str, Any] = {"generators": total, "sleep_s": workloads.CLASSIC_SLEEP_S}

    def run_pass(ds) -> tuple:
        t = time.perf_counter()
        count = 0
        for count, item in enumerate(ds, 1):
            peers.touch(item)
        return time.perf_counter() - t, count

    # Baseline: one from_generator over the generators chained one after another.
    ds = tf.data.Dataset.from_generator(
        lambda: itertools.chain.from_iterable(workloads.classic_generator(k) for k in range(measured)),
        output_signature=spec)
    wall, count = run_pass(ds)
    out["from_generator"] = {
        "measured_generators": measured, "measured_s": wall, "items": count,
        "extrapolated_s": wall * total / measured,
        "note": f"measured on {measured} generators and scaled by {total}/{measured} (it is linear: one at a time)",
    }
    before = {p.pid for p in descendants()}
    kf_ds = None
    try:
        t = time.perf_counter()
        try:  # the same signature the baseline gets, so neither probes
            kf_ds = from_generators(workloads.classic_generator, total, executor="threads",
                                    output_signature=spec)
        except TypeError:
            kf_ds = from_generators(workloads.classic_generator, total)
        build_s = time.perf_counter() - t
        passes = []
        for _ in range(2):
            wall, count = run_pass(kf_ds)
            if count != total:
                raise RuntimeError(f"a pass delivered {count} items, expected {total}")
            passes.append(wall)
        out["kerasfeed"] = {"passes_s": passes, "best_s": min(passes), "items": total, "build_s": build_s,
                            "call": "kerasfeed.from_generators(classic_generator, 100, executor='threads', "
                                    "output_signature=...)"}
        out["speedup"] = out["from_generator"]["extrapolated_s"] / min(passes)
        out["target"] = {"speedup": out["speedup"], "target": 20.0, "met": out["speedup"] >= 20.0}
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
        out.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
    finally:
        ex = getattr(kf_ds, "_kerasfeed_executor", None)
        if ex is not None and hasattr(ex, "close"):
            ex.close()
        ds = kf_ds = None
        gc.collect()
        wait_for_exit(before)
    if out["status"] == "ok":
        progress(f"[classic] from_generator chained: {out['from_generator']['extrapolated_s']:.2f} s for {total} "
                 f"(measured {measured}); kerasfeed: {out['kerasfeed']['best_s']:.3f} s; "
                 f"{out['speedup']:.1f}x faster")
    else:
        progress(f"[classic] {out['note']}")
    return out


# --- the whole run ----------------------------------------------------------------------


def run_benchmark(*, quick: bool = False, workloads_: Sequence[str] = workloads.WORKLOADS,
                  only: Optional[Sequence[str]] = None,
                  batches: Optional[Union[int, Dict[str, int]]] = None,
                  process_workers: int = 2, sections: Sequence[str] = SECTIONS,
                  output_dir: Optional[os.PathLike] = DEFAULT_OUTPUT_DIR,
                  progress: Callable[[str], None] = print) -> Dict[str, Any]:
    """Runs the benchmark and returns the results (also written to ``output_dir``).

    Args:
        quick: small sizes (a minute or so) instead of the full run.
        workloads_: which of ``cpu``, ``h5``, ``io``, ``big`` to run.
        only: way names to run (the serial loop always runs: it is the
            reference); None runs every way.
        batches: batches per epoch: an int for every workload, or a dict
            such as ``{"io": 60}`` overriding some of the sizes.
        process_workers: worker processes for kerasfeed processes and PyTorch.
        sections: among ``main`` (the table), ``h5file`` (the gzip-chunked scene file
            rows) and ``classic`` (100 slow generators).
        output_dir: where ``latest.json`` / ``latest.md`` go (and the cached
            HDF5 file, under ``cache/``); None writes nothing (the HDF5 file
            then goes to a temporary directory).
        progress: called with one line per configuration.

    Returns:
        A JSON-able dict: ``machine``, ``date``, ``settings``, ``rows``,
        ``latency_line``, ``h5file``, ``classic`` and ``markdown``.
    """
    import tempfile

    for w in workloads_:
        if w not in workloads.WORKLOADS:
            raise ValueError(f"Unknown workload {w!r}; expected some of {workloads.WORKLOADS}. Received: {w!r}")
    for s in sections:
        if s not in SECTIONS:
            raise ValueError(f"Unknown section {s!r}; expected some of {SECTIONS}. Received: {s!r}")
    known = {w.name for w in peers.ways(process_workers) + peers.extra_ways()} | {"raw-h5py"}
    for name in only or ():
        if name not in known:
            raise ValueError(f"Unknown way {name!r}; expected some of {sorted(known)}. Received: {name!r}")

    # Worker processes (spawned by kerasfeed, PyTorch or Keras) import the
    # workload classes by module name: make the repository importable there.
    pythonpath = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in pythonpath.split(os.pathsep):
        os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")

    tmp = None
    if output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kerasfeed-bench-")
        cache_dir = pathlib.Path(tmp.name)
    else:
        cache_dir = pathlib.Path(output_dir) / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    sizes = dict(QUICK_BATCHES if quick else FULL_BATCHES)
    if isinstance(batches, dict):
        sizes.update({k: int(v) for k, v in batches.items()})
    elif batches is not None:
        sizes = {k: int(batches) for k in sizes}
    if any(v < 2 for v in sizes.values()):
        raise ValueError(f"Every workload needs at least 2 batches per epoch. Received: batches={batches!r}")
    # Full runs time up to 4 s per configuration: this machine has slow
    # phases lasting seconds (every process ~30% slower), and a window that
    # short can sit entirely in one; the best epoch of a longer one rarely does.
    timing = {"min_timed_s": 0.3 if quick else 4.0, "max_timed_epochs": 2 if quick else 10}
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed benchmark, {date}, {'quick' if quick else 'full'} run on "
             f"{machine['cpu']} ({machine['cores_usable']} cores), load {machine['loadavg_start']}")
    all_ways = select_ways(peers.ways(process_workers), only)
    all_ways += [w for w in peers.extra_ways() if only and w.name in only]

    rows: List[Dict[str, Any]] = []
    try:
        if "main" in sections:
            for wl in workloads_:
                n = sizes[wl]
                if wl == "h5":
                    workloads.scene_file(cache_dir, n)  # made once, outside any timing
                progress(f"[{wl}] {n} batches per epoch")
                wl_rows = []
                for way in all_ways:
                    row = run_config(way, lambda wl=wl, n=n: workloads.make_workload(wl, n, cache_dir),
                                     progress=progress, **timing)
                    row["workload"] = wl
                    wl_rows.append(row)
                add_ratios(wl_rows)
                rows += wl_rows

        latency = _latency_line(rows)
        h5file = None
        if "h5file" in sections:
            n = sizes["h5"]
            h5file = h5file_section(workloads.scene_file(cache_dir, n), n, rows, only,
                                    process_workers, timing, progress)
        classic = None
        if "classic" in sections and (not only or "classic" in only):
            classic = classic_section(quick, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()

    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results = {
        "date": date,
        "machine": machine,
        "settings": {"quick": quick, "batches": {w: sizes[w] for w in workloads_},
                     "workloads": list(workloads_), "only": list(only) if only else None,
                     "process_workers": process_workers, "sections": list(sections), **timing},
        "workloads": list(workloads_),
        "ways": [{"name": w.name, "label": w.label, "measures": w.measures} for w in all_ways],
        "rows": rows,
        "latency_line": latency,
        "h5file": h5file,
        "classic": classic,
        "elapsed_s": time.perf_counter() - started,
    }
    results["markdown"] = to_markdown(results)
    if output_dir is not None:
        save_results(output_dir, "latest", results)
    return results


def _latency_line(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    kt = next((r for r in rows if r.get("workload") == "io" and r["way"] == "kerasfeed-threads"), None)
    if kt is None or kt["status"] != "ok" or "x_serial" not in kt:
        return None
    return {"x_serial": kt["x_serial"], "batches_per_s": kt["batches_per_s"],
            "target": 20.0, "met": kt["x_serial"] >= 20.0}


# --- markdown ----------------------------------------------------------------------------
