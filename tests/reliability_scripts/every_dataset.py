"""Builds and iterates every kind of kerasfeed dataset (a helper of the tests).

argv[1] = "iterate": iterate each dataset fully, then list what TMPDIR holds.
argv[1] = "exit":    take 3 elements from a live iterator of each kind and
                     exit without closing anything.
"""

import json
import os
import sys
import tempfile
import time

import h5py
import numpy as np

import kerasfeed


class Slow:
    """Items of 10 ms (a sleep), variable length."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.01)
        return np.zeros((i % 3 + 1, 2), np.float32), np.int64(i)


def gen(k):
    for i in range(20):
        time.sleep(0.01)
        yield np.zeros((i % 2 + 1,), np.float32)


def read(path):
    with open(path) as f:
        for line in f:
            time.sleep(0.01)
            yield np.float32(line)


def produce(put):
    for _ in range(3):
        for i in range(30):
            time.sleep(0.01)
            put(np.full(2, i, np.float32))
        put(kerasfeed.END_OF_EPOCH)


def datasets(workdir):
    files = []
    for k in range(3):
        path = os.path.join(workdir, f"f{k}.txt")
        with open(path, "w") as f:
            f.write("\n".join(str(i) for i in range(20)))
        files.append(path)
    h5 = os.path.join(workdir, "d.h5")
    with h5py.File(h5, "w") as f:
        f["x"] = np.zeros((64, 3), np.float32)
        f["y"] = np.arange(64)
    yield "to_dataset threads", kerasfeed.to_dataset(Slow())
    yield "to_dataset batched", kerasfeed.to_dataset(Slow(), batch_size=4, shuffle=True, seed=0)
    yield "to_dataset ragged", kerasfeed.to_dataset(Slow(), batch_size=4, ragged=True)
    yield "to_dataset parallel map", kerasfeed.to_dataset(Slow(), num_parallel_calls=4)
    yield "to_dataset resumed", kerasfeed.to_dataset(Slow(), initial_state={"epoch": 1, "batches": 5})
    yield "to_dataset processes", kerasfeed.to_dataset(Slow(), executor="processes", workers=1)
    seq = kerasfeed.H5SliceSequence(h5, ("x", "y"), batch_size=8)
    yield "to_dataset hdf5 auto", kerasfeed.to_dataset(seq, executor="auto").unbatch().batch(5)
    yield "from_generators threads", kerasfeed.from_generators(gen, 4, batch_size=3)
    yield "from_generators processes", kerasfeed.from_generators(gen, 4, executor="processes", workers=1)
    yield "from_files", kerasfeed.from_files(files, read, shuffle_files=True, seed=0, shuffle_buffer=8)
    yield "from_queue", kerasfeed.from_queue(produce, maxsize=4, batch_size=2)
    export_dir = os.path.join(workdir, "export")
    kerasfeed.export(seq, export_dir, num_shards=2, executor="threads", progress=False)
    yield "load_export", kerasfeed.load_export(export_dir)


KEEP = []  # module globals: alive until the interpreter finalizes


def main():
    mode = sys.argv[1]
    workdir = tempfile.mkdtemp(dir=os.environ.get("KERASFEED_TEST_WORKDIR"))
    names = []
    for name, ds in datasets(workdir):
        names.append(name)
        it = iter(ds)
        if mode == "iterate":
            for _ in it:
                pass
        else:
            for _ in range(3):
                next(it)
            KEEP.append((ds, it))  # alive at exit, never closed
    tmp = tempfile.gettempdir()
    leftovers = sorted(n for _, _, fs in os.walk(tmp) for n in fs if n.startswith("__autograph_generated_file"))
    print(json.dumps({"datasets": names, "autograph_files": leftovers}), flush=True)


main()
