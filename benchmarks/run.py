"""kerasfeed benchmark: every way of feeding the four workloads (docs/field_notes.md, *Four workloads*), drained.

Run ``make bench`` (or ``python benchmarks/run.py``); ``--quick`` for a small
run. Each pipeline is drained the way ``model.fit`` pulls it, with no model
(``ways.Context(mode="graph")``: tf.data ways in a compiled loop, the others
in a Python loop). It prints markdown tables of batches/s and the ratio to a
plain serial loop, with the machine and the date, and writes
``benchmarks/results/latest.json`` and ``latest.md``. See
``benchmarks/README.md`` for what each row measures. The ways are
``benchmarks/ways.py``'s, timed by ``benchmarks/runner.py``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Union

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import runner, ways, workloads  # noqa: E402
from benchmarks.machine import descendants, machine_info, wait_for_exit  # noqa: E402
from benchmarks.report import README_END, README_START, save_chart, to_markdown, update_readme  # noqa: E402

__all__ = ["run_benchmark", "to_markdown", "update_readme", "README_START", "README_END", "main"]

SECTIONS = ("main", "h5file", "classic")
DRAIN_WAYS = ("serial", "tf-from-generator", "tf-map", "keras-threads", "keras-processes", "torch",
              "kerasfeed-threads", "kerasfeed-processes", "kerasfeed-auto")
H5FILE_WAYS = ("serial", "kerasfeed-processes", "kerasfeed-threads", "keras-threads", "keras-processes", "raw-h5py")
CLASSIC_GENERATORS = 100


def h5file_section(n: int, cache_dir: pathlib.Path, only: Optional[Sequence[str]], ctx: ways.Context,
                   timing: Dict[str, Any], progress: runner.Progress) -> Dict[str, Any]:
    """The gzip-chunked scene file through ``kerasfeed.H5SliceSequence``: kerasfeed vs Keras vs
    the serial loop vs raw h5py reads of the same rows (the limit of one process)."""
    import kerasfeed

    path = workloads.scene_file(cache_dir, n)
    source = "kerasfeed.H5SliceSequence(path, ('points', 'labels'), 8)"
    progress(f"[h5file] {source}, {n} batches of 8 scenes x 4096 points x 6 float32 (gzip, chunks of 8 scenes)")
    rows = []
    for way in ways.select(list(H5FILE_WAYS), only and list(only) + ["raw-h5py"], always=("serial",)):
        if way.name == "raw-h5py":  # it reads the file itself: the workload's class says where and what
            def make_seq() -> Any:
                return workloads.make_workload("h5", n, cache_dir)
        else:
            def make_seq() -> Any:
                return kerasfeed.H5SliceSequence(str(path), ("points", "labels"), workloads.H5_SCENES_PER_BATCH)
        rows.append(runner.measure(way, make_seq, ctx, progress=progress, label="[h5file] ", **timing))
    runner.add_ratios(rows, lambda r: r["way"] == "serial", "x_serial")
    kp = next((r for r in rows if r["way"] == "kerasfeed-processes" and "x_serial" in r), None)
    target = None if kp is None else {"x_serial": kp["x_serial"], "target": 1.5, "met": kp["x_serial"] >= 1.5}
    return {"source": source, "path_name": path.name, "batches": n, "rows": rows, "target": target}


def classic_section(quick: bool, progress: runner.Progress) -> Dict[str, Any]:
    """100 generators that each sleep 0.1 s then yield one image/mask pair: one ``from_generator``
    over them chained (measured on 10, scaled: it is linear) against ``kerasfeed.from_generators``."""
    import tensorflow as tf

    import kerasfeed

    total, measured = CLASSIC_GENERATORS, 5 if quick else 10
    spec = (tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE, tf.float32),
            tf.TensorSpec(workloads.CLASSIC_IMAGE_SHAPE[:2] + (1,), tf.uint8))
    out: Dict[str, Any] = {"generators": total, "sleep_s": workloads.CLASSIC_SLEEP_S}

    def run_pass(ds: Any) -> tuple:
        t, count = time.perf_counter(), 0
        for count, item in enumerate(ds, 1):
            ways.touch(item)
        return time.perf_counter() - t, count

    chained = tf.data.Dataset.from_generator(
        lambda: itertools.chain.from_iterable(workloads.classic_generator(k) for k in range(measured)),
        output_signature=spec)
    wall, count = run_pass(chained)
    out["from_generator"] = {
        "measured_generators": measured, "measured_s": wall, "items": count, "extrapolated_s": wall * total / measured,
        "note": f"measured on {measured} generators and scaled by {total}/{measured} (it is linear: one at a time)"}
    before = {p.pid for p in descendants()}
    ds = None
    try:
        t = time.perf_counter()
        ds = kerasfeed.from_generators(workloads.classic_generator, total, executor="threads", output_signature=spec)
        build_s, passes = time.perf_counter() - t, []
        for _ in range(2):
            wall, count = run_pass(ds)
            if count != total:
                raise RuntimeError(f"a pass delivered {count} items, expected {total}")
            passes.append(wall)
        out["kerasfeed"] = {"passes_s": passes, "best_s": min(passes), "items": total, "build_s": build_s,
                            "call": "kerasfeed.from_generators(classic_generator, 100, executor='threads', "
                                    "output_signature=...)"}
        out["speedup"] = out["from_generator"]["extrapolated_s"] / min(passes)
        out.update(target={"speedup": out["speedup"], "target": 20.0, "met": out["speedup"] >= 20.0}, status="ok")
        progress(f"[classic] from_generator chained: {out['from_generator']['extrapolated_s']:.2f} s for {total} "
                 f"(measured {measured}); kerasfeed: {min(passes):.3f} s; {out['speedup']:.1f}x faster")
    except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
        out.update(status="error", note=f"error: {type(e).__name__}: {str(e)[:300]}")
        progress(f"[classic] {out['note']}")
    finally:
        ds = None  # its stream threads end with it
        gc.collect()
        wait_for_exit(before)
    return out


def run_benchmark(*, quick: bool = False, workloads_: Sequence[str] = workloads.WORKLOADS,
                  only: Optional[Sequence[str]] = None, batches: Optional[Union[int, Dict[str, int]]] = None,
                  process_workers: int = 2, sections: Sequence[str] = SECTIONS, rounds: int = 1,
                  output_dir: Optional[os.PathLike] = runner.DEFAULT_OUTPUT_DIR,
                  progress: runner.Progress = print) -> Dict[str, Any]:
    """Runs the drain benchmark and returns the results (also written to ``output_dir``).

    Args:
        quick: small sizes (a minute or so) instead of the full run.
        workloads_: which workloads (``cpu``, ``h5``, ``io``, ``big``, or the image ones).
        only: way names to run (the serial loop always runs: it is the
            reference; a way outside the default rows, such as ``tf-map-pool64``,
            runs when named); ``classic`` selects the slow generators; None runs every way.
        batches: batches per epoch: an int for every workload, or a dict such
            as ``{"io": 60}`` overriding some of the sizes.
        process_workers: worker processes for kerasfeed processes, PyTorch and Keras processes.
        sections: among ``main`` (the table), ``h5file`` (the gzip-chunked
            scene file rows) and ``classic`` (100 slow generators).
        rounds: every configuration runs once per round, each ratio against
            the serial loop of its own round; the tables show medians and ranges.
        output_dir: where ``latest.json`` / ``latest.md`` go (and the cached
            HDF5 files, under ``cache/``); None writes nothing.
        progress: called with one line per configuration.

    Returns:
        A JSON-able dict: ``machine``, ``date``, ``settings``, ``workloads``,
        ``ways``, ``rows``, ``latency_line``, ``h5file``, ``classic``, ``markdown``.
    """
    workloads.check_names(workloads_)
    for s in sections:
        if s not in SECTIONS:
            raise ValueError(f"Unknown section {s!r}; expected some of {SECTIONS}. Received: {s!r}")
    named = [n for n in only or () if n != "classic"]
    chosen = ways.select(list(DRAIN_WAYS) + [n for n in named if n not in DRAIN_WAYS], named or None,
                         always=("serial",))
    if int(rounds) < 1:
        raise ValueError(f"`rounds` must be at least 1. Received: rounds={rounds}")
    sizes = {w: getattr(workloads.REGISTRY[w], "quick" if quick else "full") for w in workloads.REGISTRY}
    if isinstance(batches, dict):
        sizes.update({k: int(v) for k, v in batches.items()})
    elif batches is not None:
        sizes = {k: int(batches) for k in sizes}
    if any(sizes[w] < 2 for w in workloads_):
        raise ValueError(f"Every workload needs at least 2 batches per epoch. Received: batches={batches!r}")
    # Full runs time up to 4 s per configuration: the 2-core machine has slow phases lasting seconds
    # (every process ~30% slower); a shorter window can sit entirely in one, for one way and not its peers.
    timing = {"min_timed_s": 0.3 if quick else 4.0, "max_timed_epochs": 2 if quick else 10}
    ctx = ways.Context("graph", workers=int(process_workers))
    os.environ["PYTHONPATH"] = os.pathsep.join(  # worker processes import the workloads by module name
        dict.fromkeys([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    tmp = tempfile.TemporaryDirectory(prefix="kerasfeed-bench-") if output_dir is None else None
    cache_dir = pathlib.Path(tmp.name if tmp else pathlib.Path(output_dir) / "cache")
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine = machine_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    progress(f"kerasfeed benchmark, {date}, {'quick' if quick else 'full'} run on {machine['cpu']} "
             f"({machine['cores_usable']} cores), load {machine['loadavg_start']}")
    rows: List[Dict[str, Any]] = []
    h5file = classic = None
    try:
        if "main" in sections:
            for wl in workloads_:
                workloads.prepare(wl, sizes[wl], cache_dir)  # made once, outside any timing
                progress(f"[{wl}] {sizes[wl]} batches per epoch")
                for round_, way in itertools.product(range(int(rounds)), chosen):
                    row = runner.measure(way, lambda wl=wl: workloads.make_workload(wl, sizes[wl], cache_dir), ctx,
                                         progress=progress, **timing)
                    rows.append({**row, "workload": wl, "round": round_})
            runner.add_ratios(rows, lambda r: r["way"] == "serial", "x_serial")
        if "h5file" in sections:
            h5file = h5file_section(sizes["h5"], cache_dir, named or None, ctx, timing, progress)
        if "classic" in sections and (not only or "classic" in only):
            classic = classic_section(quick, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res = {"date": date, "machine": machine, "workloads": list(workloads_), "rows": rows,
           "settings": {"quick": quick, "batches": {w: sizes[w] for w in workloads_}, "workloads": list(workloads_),
                        "only": list(only) if only else None, "process_workers": process_workers,
                        "sections": list(sections), "rounds": int(rounds), **timing},
           "ways": [{"name": w.name, "label": w.title(ctx), "measures": w.measures} for w in chosen],
           "latency_line": _latency_line(rows), "h5file": h5file, "classic": classic,
           "elapsed_s": time.perf_counter() - started}
    res["markdown"] = to_markdown(res)
    if output_dir is not None:
        runner.save_results(output_dir, "latest", res)
    return res


def _latency_line(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    kt = [r for r in rows if r["workload"] == "io" and r["way"] == "kerasfeed-threads" and "x_serial" in r]
    if not kt:
        return None
    x = statistics.median(r["x_serial"] for r in kt)
    return {"x_serial": x, "batches_per_s": statistics.median(r["batches_per_s"] for r in kt),
            "target": 20.0, "met": x >= 20.0}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                        help=f"comma-separated, among {','.join(workloads.REGISTRY)}")
    parser.add_argument("--only", default=None, help="comma-separated way names, e.g. kerasfeed-threads,keras-threads "
                        "(serial always runs); 'classic' selects the 100 slow generators")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch for every workload")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes for kerasfeed processes, PyTorch and Keras processes (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="run every configuration this many times; "
                        "median and range of the ratios, each against its own round's serial loop")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated among main,h5file,classic")
    parser.add_argument("--output-dir", default=str(runner.DEFAULT_OUTPUT_DIR))
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="do not run: re-render the markdown of a saved results JSON")
    parser.add_argument("--update-readme", metavar="PATH", action="append", default=[],
                        help=f"replace the {README_START} ... {README_END} block of PATH with the "
                             "results (repeatable), e.g. benchmarks/README.md")
    parser.add_argument("--chart", metavar="PNG", default=None, help="also draw the main table as a PNG chart")
    args = parser.parse_args(argv)
    if args.render:
        res = json.loads(pathlib.Path(args.render).read_text())
        res["markdown"] = to_markdown(res)
    else:
        try:
            res = run_benchmark(quick=args.quick, workloads_=runner.split(args.workloads),
                                only=runner.split(args.only), batches=args.batches, process_workers=args.workers,
                                sections=runner.split(args.sections), rounds=args.rounds, output_dir=args.output_dir)
        except ValueError as e:
            parser.error(str(e))
        print(f"Wrote {pathlib.Path(args.output_dir) / 'latest.json'} and latest.md")
    print()
    print(res["markdown"])
    if args.chart and res.get("rows"):
        save_chart(res, args.chart)
        print(f"Drew {args.chart}")
    for path in args.update_readme:
        update_readme(path, res["markdown"])
        print(f"Updated the results block of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
