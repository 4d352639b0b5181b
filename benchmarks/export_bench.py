"""Export benchmark: writing the gzip HDF5 scene file to TFRecord shards, then training input from them.

Run on its own: ``python benchmarks/export_bench.py`` (``--quick`` for a tiny
run; ``--json PATH`` to keep the numbers). Two parts:

1. **Export throughput** (batches/s written, each batch = 8 scenes x 4096
   points x 6 float32 from ``H5SliceSequence`` over a gzip-chunked file):
   - ``serial``: the usual single loop, one ``tf.io.TFRecordWriter``,
     ``tf.train.Example`` built in the loop;
   - the process-pool round-robin recipe written correctly, two ways (a
     ``spawn`` ``multiprocessing.Pool`` whose workers open the file once
     each; writers never cross processes):
     ``pool, writers in main``: workers return serialized Examples in order
     (``imap``), written round-robin to one ``TFRecordWriter`` per shard in
     the main process; ``pool, shard per task``: each task writes one whole
     shard (items ``k, k + S, ...``) with its own writer to ``*.tmp`` and
     renames it when complete;
   - ``kerasfeed.export`` on worker processes and on threads.
   Start-up is inside the time (the pool's spawned workers import TensorFlow
   to build Examples; kerasfeed's workers import neither); this process's
   own imports are not. At a few hundred batches start-up dominates the
   parallel ways: ``--target-seconds 30`` sizes the file so the serial loop
   takes about that long (calibrated on a small file first).
2. **Training-input throughput** (batches/s into a compiled drain loop, the
   way ``model.fit`` pulls them; first pass untimed, best of ``--epochs``):
   ``load_export`` of the export vs ``to_dataset`` over the Python source on
   worker processes and on threads (the best of them is the reference).

Prints a table and one JSON line (``--json PATH`` also writes the JSON).
Numbers from a busy machine mean nothing; compare rows of one quiet run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SCENES_PER_BATCH = 8

# --- the pool recipe's worker side (module level: spawn workers import it) -----

_POOL_STATE: Dict[str, Any] = {}


def _pool_init(path: str) -> None:
    import h5py

    f = h5py.File(path, "r")
    _POOL_STATE.update(file=f, points=f["points"], labels=f["labels"])


def _example(points, labels) -> bytes:
    import tensorflow as tf

    feature = {
        "points": tf.train.Feature(bytes_list=tf.train.BytesList(value=[points.tobytes()])),
        "points_shape": tf.train.Feature(int64_list=tf.train.Int64List(value=list(points.shape))),
        "labels": tf.train.Feature(int64_list=tf.train.Int64List(value=labels.tolist())),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _pool_record(i: int) -> bytes:
    rows = slice(i * SCENES_PER_BATCH, (i + 1) * SCENES_PER_BATCH)
    return _example(_POOL_STATE["points"][rows], _POOL_STATE["labels"][rows])


def _pool_shard(args: tuple) -> int:
    k, shards, n, out, compression = args
    import tensorflow as tf

    final = os.path.join(out, f"shard-{k:05d}-of-{shards:05d}.tfrecord")
    with tf.io.TFRecordWriter(final + ".tmp", compression or "") as w:
        for i in range(k, n, shards):
            w.write(_pool_record(i))
    os.replace(final + ".tmp", final)  # a crash never leaves a shard that looks whole
    return k


# --- the ways of exporting ----------------------------------------------------


def export_serial(
    path: pathlib.Path, n: int, out: pathlib.Path, shards: int, workers: int, compression: Optional[str]
) -> None:
    import h5py
    import tensorflow as tf

    with h5py.File(path, "r") as f, tf.io.TFRecordWriter(str(out / "all.tfrecord"), compression or "") as w:
        for i in range(n):
            rows = slice(i * SCENES_PER_BATCH, (i + 1) * SCENES_PER_BATCH)
            w.write(_example(f["points"][rows], f["labels"][rows]))


def export_pool(
    path: pathlib.Path, n: int, out: pathlib.Path, shards: int, workers: int, compression: Optional[str]
) -> None:
    import tensorflow as tf

    writers = [tf.io.TFRecordWriter(str(out / f"shard-{k:05d}.tfrecord"), compression or "") for k in range(shards)]
    try:
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_pool_init, initargs=(str(path),)) as pool:
            for i, record in enumerate(pool.imap(_pool_record, range(n), chunksize=4)):
                writers[i % shards].write(record)
    finally:
        for w in writers:
            w.close()


def export_pool_shards(
    path: pathlib.Path, n: int, out: pathlib.Path, shards: int, workers: int, compression: Optional[str]
) -> None:
    tasks = [(k, shards, n, str(out), compression) for k in range(shards)]
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_pool_init, initargs=(str(path),)) as pool:
        for _ in pool.imap_unordered(_pool_shard, tasks):
            pass


def _sequence(path: pathlib.Path):
    import kerasfeed

    return kerasfeed.H5SliceSequence(str(path), ("points", "labels"), batch_size=SCENES_PER_BATCH)


def export_kerasfeed(executor: str) -> Callable:
    def run(
        path: pathlib.Path, n: int, out: pathlib.Path, shards: int, workers: int, compression: Optional[str]
    ) -> None:
        import kerasfeed

        kerasfeed.export(_sequence(path), out, num_shards=shards, executor=executor,
                         workers=workers if executor == "processes" else None, compression=compression,
                         progress=False)  # fmt: skip

    return run


KEPT = export_kerasfeed("processes")
EXPORT_WAYS = {
    "serial loop, one TFRecordWriter": export_serial,
    "multiprocessing.Pool (spawn), round-robin writers in the main process": export_pool,
    "multiprocessing.Pool (spawn), one task per shard writing it": export_pool_shards,
    "kerasfeed.export, processes": KEPT,
    "kerasfeed.export, threads": export_kerasfeed("threads"),
}


def _size(directory: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def time_exports(path: pathlib.Path, n: int, work: pathlib.Path, shards: int, workers: int,
                 compression: Optional[str] = None) -> List[Dict[str, Any]]:
    # This process's imports are not timed; worker start-up is (spawned pool workers
    # import TensorFlow to build Examples; kerasfeed's workers import neither).
    import h5py  # noqa: F401
    import tensorflow  # noqa: F401

    import kerasfeed.exporting.exporter  # noqa: F401

    rows = []
    for name, fn in EXPORT_WAYS.items():
        out = work / f"export-{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        start = time.perf_counter()
        fn(path, n, out, shards, workers, compression)
        seconds = time.perf_counter() - start
        rows.append({"way": name, "seconds": seconds, "batches_per_s": n / seconds, "mb_written": _size(out) / 2**20})
        print(f"  export  {name}: {n / seconds:,.1f} batches/s ({seconds:.2f} s)", flush=True)
        if fn is not KEPT:  # only the export the input part reads stays on disk
            shutil.rmtree(out, ignore_errors=True)
    return rows


def time_training_input(path: pathlib.Path, export_dir: pathlib.Path, n: int, workers: int,
                        epochs: int) -> List[Dict[str, Any]]:
    """The export read back (``load_export``) against ``to_dataset`` over the Python source, drained
    by the runner in graph mode (as ``fit`` pulls): first pass untimed, the best of ``epochs`` timed."""
    import kerasfeed
    from benchmarks import runner, ways

    ctx = ways.Context("graph", workers=workers)
    load = ways.Way("load-export", "kerasfeed.load_export (pure tf.data)",
                    lambda _seq, c: ways.tf_feed(kerasfeed.load_export(export_dir).prefetch(2), c))
    rows = []
    for way, label in ((load, load.label),
                       (ways.REGISTRY["kerasfeed-processes"],
                        f"kerasfeed.to_dataset(H5SliceSequence), processes (workers={workers})"),
                       (ways.REGISTRY["kerasfeed-threads"], "kerasfeed.to_dataset(H5SliceSequence), threads")):
        r = runner.measure(way, lambda: _sequence(path), ctx, min_timed_s=float("inf"), max_timed_epochs=epochs,
                           progress=lambda line: None)
        if r["status"] != "ok":
            raise RuntimeError(f"{label}: {r['note']}")
        rows.append({"way": label, "batches_per_s": r["batches_per_s"], "epoch_s": r["timed_epoch_s"],
                     "first_pass_s": r["build_s"] + r["epoch1_s"]})
        print(f"  input   {label}: {r['batches_per_s']:,.1f} batches/s", flush=True)
    best_source = max(r["batches_per_s"] for r in rows[1:])
    for r in rows:
        r["x_best_source"] = r["batches_per_s"] / best_source
    return rows


def to_markdown(res: Dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"### Export benchmark ({res['date']})",
        "",
        f"{cfg['batches']} batches of {SCENES_PER_BATCH} scenes x {cfg['points']} points x 6 float32 from a "
        "gzip-chunked "
        f"HDF5 file; {cfg['shards']} shards, {cfg['workers']} workers, compression {cfg['compression']}, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| export way | batches/s | x serial | seconds | MB written |",
        "| --- | --- | --- | --- | --- |",
    ]
    serial = res["export"][0]["batches_per_s"]
    for r in res["export"]:
        lines.append(f"| {r['way']} | {r['batches_per_s']:,.1f} | {r['batches_per_s'] / serial:.2f}x | "
                     f"{r['seconds']:.2f} | {r['mb_written']:.1f} |")
    lines += [
        "",
        "| training input | batches/s | x best Python source | timed pass s | first pass s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in res["input"]:
        lines.append(f"| {r['way']} | {r['batches_per_s']:,.1f} | {r['x_best_source']:.2f}x | {r['epoch_s']:.3f} | "
                     f"{r['first_pass_s']:.2f} |")
    return "\n".join(lines)


def _batch_bytes(points: int) -> int:
    return SCENES_PER_BATCH * points * 6 * 4


def calibrate(work: pathlib.Path, points: int, seconds: float, compression: Optional[str]) -> int:
    """Batches for which the serial loop takes about ``seconds`` (timed on a small file)."""
    from kerasfeed.datasets import make_synthetic_scenes

    sample = 64
    path = make_synthetic_scenes(work / "calibrate.h5", num_scenes=sample * SCENES_PER_BATCH, points_per_scene=points,
                                 chunk_scenes=SCENES_PER_BATCH, compression="gzip")  # fmt: skip
    out = work / "calibrate"
    out.mkdir(parents=True, exist_ok=True)
    export_serial(path, sample, out, 1, 1, compression)  # warm-up: imports, first file opens
    start = time.perf_counter()
    export_serial(path, sample, out, 1, 1, compression)
    rate = sample / (time.perf_counter() - start)
    shutil.rmtree(out, ignore_errors=True)
    os.remove(path)
    batches = max(16, int(rate * seconds))
    print(f"calibration: serial loop ~{rate:,.0f} batches/s -> {batches} batches for ~{seconds:g} s", flush=True)
    return batches


def check_disk(work: pathlib.Path, batches: int, points: int) -> None:
    # The source file, the kept export and one more export at a time, each about the raw size.
    need = int(3.1 * batches * _batch_bytes(points))
    free = shutil.disk_usage(work).free
    if need > free:
        raise SystemExit(
            f"export_bench: {batches} batches need about {need / 2**30:.1f} GiB in {work} (the scene file and two "
            f"exports), {free / 2**30:.1f} GiB are free; pass fewer --batches or another --workdir. "
            f"Received: batches={batches}"
        )
    print(f"disk: about {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free in {work}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=400, help="batches (of 8 scenes) in the file (~300 MB per copy)")
    parser.add_argument("--target-seconds", type=float,
                        help="size the file so the serial loop takes about this long (overrides --batches; "
                             "20-40 s lets the parallel ways get past start-up)")  # fmt: skip
    parser.add_argument("--points", type=int, default=4096, help="points per scene")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed passes of the input part (best kept)")
    parser.add_argument("--compression", choices=["GZIP", "ZLIB"], help="TFRecord compression, for every way")
    parser.add_argument("--quick", action="store_true", help="tiny settings (a smoke run)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    parser.add_argument("--workdir", type=pathlib.Path, help="where the files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.points, args.shards, args.epochs = 12, 256, 4, 1

    from kerasfeed.datasets import make_synthetic_scenes

    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="kerasfeed-export-bench-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        if args.target_seconds:
            args.batches = calibrate(work, args.points, args.target_seconds, args.compression)
        check_disk(work, args.batches, args.points)
        start = time.perf_counter()
        path = make_synthetic_scenes(work / "scenes.h5", num_scenes=args.batches * SCENES_PER_BATCH,
                                     points_per_scene=args.points, chunk_scenes=SCENES_PER_BATCH,
                                     compression="gzip")  # fmt: skip
        print(f"export benchmark: {args.batches} batches ({args.batches * _batch_bytes(args.points) / 2**20:,.0f} MB), "
              f"{args.shards} shards, {args.workers} workers; scene file made in {time.perf_counter() - start:.0f} s",
              flush=True)  # fmt: skip
        exports = time_exports(path, args.batches, work, args.shards, args.workers, args.compression)
        kf_dir = work / f"export-{list(EXPORT_WAYS.values()).index(KEPT)}"  # the kerasfeed.export (processes) one
        inputs = time_training_input(path, kf_dir, args.batches, args.workers, args.epochs)
        res = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {"batches": args.batches, "points": args.points, "shards": args.shards, "workers": args.workers,
                       "compression": args.compression, "mb_per_copy": args.batches * _batch_bytes(args.points) / 2**20,
                       "target_seconds": args.target_seconds, "cpus": os.cpu_count()},
            "export": exports,
            "input": inputs,
        }
        print()
        print(to_markdown(res))
        print(json.dumps(res))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
