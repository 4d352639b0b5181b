"""Class balancing over sharded TFRecords: tf.data's two ways against a kerasfeed BalancedOrder.

The case: 100+ TFRecord shards of ``tf.train.Example`` records (a float
feature vector and an int64 label) with a 1:50 class imbalance, to be read as
batches with both classes equally frequent. Three ways, each run in its own
subprocess (so peak RSS is its own):

- ``rejection_resample``: every shard read (interleaved), every record parsed,
  then ``Dataset.rejection_resample`` (target 50/50, the true initial
  distribution given) keeps about one in 25 majority records.
- ``sample_from_datasets``: one reader per class (each reads every shard,
  parses every record and keeps its class, repeated), mixed 50/50 by
  ``Dataset.sample_from_datasets``.
- ``kerasfeed``: a ``BalancedOrder`` over the records' labels picks the items
  of every pass before anything is read; the source reads exactly those
  records (by file and byte offset, ``os.pread``, on kerasfeed's threads) and
  returns their serialized bytes; batches are parsed with the same
  ``tf.io.parse_example`` feature spec. The offsets and labels are side
  files written with the shards (the labels as the writer knew them, the
  offsets by scanning record headers once, timed and printed separately);
  record CRCs are not checked, TFRecordDataset checks them.

Measured per way: time from building the pipeline to its first batch, records
read (parsed) per record delivered, peak RSS of the process, batches/s after
the first batch, and the rare class's share of delivered records.

Run ``python benchmarks/balanced.py`` (defaults: 128 shards of 2,000 records
of 256 floats, batches of 256, 200 timed batches), ``--tiny`` for a seconds-long
check. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

METHODS = ("rejection_resample", "sample_from_datasets", "kerasfeed")
RARE_EVERY = 51  # record k is of the rare class when k % 51 == 0: 1:50


def write_shards(workdir: pathlib.Path, shards: int, per_shard: int, dim: int) -> dict:
    """Writes the TFRecord shards, the labels and the (file, offset, length) index."""
    import tensorflow as tf

    workdir.mkdir(parents=True, exist_ok=True)
    meta_path = workdir / "meta.json"
    meta = {"shards": shards, "per_shard": per_shard, "dim": dim}
    if meta_path.exists() and json.loads(meta_path.read_text()).get("config") == meta:  # written already
        return json.loads(meta_path.read_text())
    rng = np.random.default_rng(0)
    files, labels = [], []
    for s in range(shards):
        path = workdir / f"part-{s:05d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as w:
            for k in range(per_shard):
                label = int((s * per_shard + k) % RARE_EVERY == 0)
                x = rng.normal(loc=label, size=dim).astype(np.float32)
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }))
                w.write(ex.SerializeToString())
                labels.append(label)
        files.append(str(path))
    np.save(workdir / "labels.npy", np.asarray(labels, dtype=np.int8))
    start = time.perf_counter()
    index = scan_offsets(files)
    scan_s = time.perf_counter() - start
    np.save(workdir / "index.npy", index)
    out = {"config": meta, "files": files, "index_scan_s": scan_s, "records": len(labels)}
    meta_path.write_text(json.dumps(out))
    return out


def scan_offsets(files: list) -> np.ndarray:
    """(file, offset of the payload, length) of every record, from the framing headers only."""
    rows = []
    for f, path in enumerate(files):
        with open(path, "rb") as fh:
            pos = 0
            while True:
                head = fh.read(12)  # uint64 length, uint32 crc of the length
                if len(head) < 12:
                    break
                (length,) = struct.unpack("<Q", head[:8])
                rows.append((f, pos + 12, length))
                pos += 12 + length + 4  # payload, uint32 crc of the payload
                fh.seek(pos)
    return np.asarray(rows, dtype=np.int64)


class RecordSource:
    """Item i: the serialized bytes of record i (pread by file and offset)."""

    def __init__(self, files: list, index: np.ndarray):
        self.files, self.index = files, index
        self.reads = 0
        self._fds: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        f, offset, length = (int(v) for v in self.index[i])
        fd = self._fds.get(f)
        if fd is None:
            with self._lock:
                fd = self._fds.setdefault(f, os.open(self.files[f], os.O_RDONLY))
        self.reads += 1  # approximate under threads; exact enough for a ratio
        item = np.empty((), dtype=object)  # not np.bytes_: numpy drops trailing NUL bytes of "S" arrays
        item[()] = os.pread(fd, length, offset)
        return item


def _features(tf, dim):
    return {"x": tf.io.FixedLenFeature([dim], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}


def build(method: str, meta: dict, args, counter):
    import tensorflow as tf

    files, dim, bs = meta["files"], meta["config"]["dim"], args.batch_size
    spec = _features(tf, dim)

    def parse_one(record):
        counter.assign_add(1)
        ex = tf.io.parse_single_example(record, spec)
        return ex["x"], ex["label"]

    def reader(seed):
        ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
        return ds.interleave(tf.data.TFRecordDataset, cycle_length=16, num_parallel_calls=tf.data.AUTOTUNE).repeat()

    if method == "rejection_resample":
        ds = reader(0).map(parse_one, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.rejection_resample(lambda x, y: tf.cast(y, tf.int32), target_dist=[0.5, 0.5],
                                   initial_dist=[1 - 1 / RARE_EVERY, 1 / RARE_EVERY], seed=0)
        ds = ds.map(lambda _, xy: xy).batch(bs)
    elif method == "sample_from_datasets":
        per_class = [reader(c).map(parse_one, num_parallel_calls=tf.data.AUTOTUNE).filter(lambda x, y, c=c: y == c)
                     for c in (0, 1)]
        ds = tf.data.Dataset.sample_from_datasets(per_class, weights=[0.5, 0.5], seed=0).batch(bs)
    else:
        import kerasfeed

        labels = np.load(pathlib.Path(args.workdir) / "labels.npy")
        index = np.load(pathlib.Path(args.workdir) / "index.npy")
        source = RecordSource(files, index)
        order = kerasfeed.BalancedOrder(labels, num_samples=(args.batches + 1) * bs, seed=0)

        def parse_batch(records):
            ex = tf.io.parse_example(records, spec)
            return ex["x"], ex["label"]

        ds = kerasfeed.to_dataset(source, batch_size=bs, order=order).map(parse_batch)
        ds._bench_source = source
    return ds.prefetch(2)


def run_one(method: str, args) -> dict:
    import tensorflow as tf

    meta = json.loads((pathlib.Path(args.workdir) / "meta.json").read_text())
    counter = tf.Variable(0, dtype=tf.int64)
    start = time.perf_counter()
    ds = build(method, meta, args, counter)
    it = iter(ds)
    _, y = next(it)
    first = time.perf_counter() - start
    rare = int(np.sum(y.numpy()))
    t = time.perf_counter()
    for _ in range(args.batches):
        _, y = next(it)
        rare += int(np.sum(y.numpy()))
    rate = args.batches / (time.perf_counter() - t)
    delivered = (args.batches + 1) * args.batch_size
    source = getattr(ds, "_bench_source", None) or _find_source(ds)
    reads = source.reads if source is not None else int(counter.numpy())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"method": method, "first_batch_s": first, "reads_per_item": reads / delivered,
            "peak_rss_mb": rss, "batches_per_s": rate, "rare_share": rare / delivered}


def _find_source(ds):
    from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged

    pipeline = find_tagged(ds, PIPELINE_ATTR)
    return getattr(pipeline, "_source", None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=128)
    p.add_argument("--records-per-shard", type=int, default=2000)
    p.add_argument("--dim", type=int, default=256, help="floats per record")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=200, help="timed batches after the first")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workdir", default=None, help="where the shards go (reused when the settings match)")
    p.add_argument("--tiny", action="store_true", help="4 shards of 200 records, 16 floats, 3 batches of 32")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one method, JSON out
    args = p.parse_args(argv)
    if args.tiny:
        args.shards, args.records_per_shard, args.dim, args.batch_size, args.batches = 4, 200, 16, 32, 3
    if args.workdir is None:
        name = f"kerasfeed-balanced-{args.shards}x{args.records_per_shard}x{args.dim}"
        args.workdir = os.path.join(tempfile.gettempdir(), name)
    if args.run:
        # The shards are written by the first method's process (reused after):
        # this parent process never imports TensorFlow.
        write_shards(pathlib.Path(args.workdir), args.shards, args.records_per_shard, args.dim)
        print(json.dumps(run_one(args.run, args)))
        return 0
    rows = []
    for method in args.methods.split(","):
        if method not in METHODS:
            p.error(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        cmd = [sys.executable, __file__, "--run", method, "--workdir", args.workdir,
               "--batch-size", str(args.batch_size), "--batches", str(args.batches), "--shards", str(args.shards),
               "--records-per-shard", str(args.records_per_shard), "--dim", str(args.dim)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(f"{method} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    meta = json.loads((pathlib.Path(args.workdir) / "meta.json").read_text())
    print(f"{args.shards} TFRecord shards, {meta['records']} records (1:{RARE_EVERY - 1}), {args.dim} floats each; "
          f"batches of {args.batch_size}; {args.batches} timed batches. kerasfeed's offset index: "
          f"{meta['index_scan_s']:.2f} s to scan once (not included below).\n")
    print("| method | first batch s | records read per record delivered | peak RSS MB | batches/s | rare share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['first_batch_s']:.2f} | {r['reads_per_item']:.2f} | {r['peak_rss_mb']:.0f} | "
              f"{r['batches_per_s']:.1f} | {r['rare_share']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
