"""A stream whose producer gets stuck mid-stream (a helper of the tests).

argv[1] = the stream: "generators-threads", "generators-processes",
"files-threads", "files-processes" or "queue"; argv[2] = how the first
iterator goes while the producer is stuck:

- "delete-del": take 3 elements from ``iter(ds)``, then ``del`` it;
- "delete-break": the same with ``break`` out of a ``for`` loop;
- "fit": a 1-epoch ``model.fit`` with ``steps_per_epoch=3`` (the stream has
  more).

It prints how long the deletion took and the producer threads still alive
after it, then iterates the dataset again until it blocks on the stuck
producer (the test sends SIGINT then).

The producer makes 3 items, then waits forever (no ``timeout=``). Every line
printed is JSON; the worker pids are in it (processes).
"""

import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

import kerasfeed


def item(i):
    return np.full((2,), i, np.float32), np.float32(i)


def gen(shard):
    for i in range(3):
        yield item(i)
    threading.Event().wait()  # stuck forever
    yield item(3)


def read(path):
    for i in range(3):
        yield item(i)
    time.sleep(3600)  # stuck forever
    yield item(3)


def produce(put):
    for i in range(3):
        put(item(i))
    threading.Event().wait()


def say(**kw):
    print(json.dumps(kw), flush=True)


def producers_left(wait_s=3.0):
    """Producer threads of a pass still alive ``wait_s`` after the deletion
    (with worker processes they only wait for the worker, so they must end;
    a thread running the user's stuck generator itself cannot be stopped)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(("kerasfeed-generator", "kerasfeed-file"))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


KEEP = []  # module globals: alive until the interpreter finalizes


def build(kind):
    common = dict(output_signature=(tf_spec((2,)), tf_spec(())), prefetch=0)
    if kind == "queue":
        return kerasfeed.from_queue(produce, **common)
    api, executor = kind.split("-")
    if api == "generators":
        return kerasfeed.from_generators(gen, 1, executor=executor, workers=1, **common)
    folder = tempfile.mkdtemp(prefix="kerasfeed-stuck-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "a.txt")
    with open(path, "w") as f:
        f.write("x\n")
    return kerasfeed.from_files([path], read, executor=executor, workers=1, **common)


def tf_spec(shape):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.float32)


def first_iterator(ds, mode):
    """Deletes an iterator while the producer is stuck; returns (items, seconds)."""
    if mode == "delete-break":
        got = []
        for x, _ in ds:
            got.append(int(x[0]))
            if len(got) == 3:
                time.sleep(0.5)  # the producer is stuck now
                t0 = time.monotonic()
                break
        return got, time.monotonic() - t0
    if mode == "delete-del":
        it = iter(ds)
        got = [int(next(it)[0][0]) for _ in range(3)]
        time.sleep(0.5)
        t0 = time.monotonic()
        del it
        return got, time.monotonic() - t0
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    seen = []

    class Last(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)
            if batch == 2:
                self.t0 = time.monotonic()

    last = Last()
    model.fit(ds.batch(1), epochs=1, steps_per_epoch=3, verbose=0, callbacks=[last])
    return seen, time.monotonic() - last.t0


def main():
    kind, mode = sys.argv[1], sys.argv[2]
    ds = build(kind)
    KEEP.append(ds)
    stream = getattr(ds, "_kerasfeed_stream", None)
    pool = getattr(stream, "pool", None)
    pids = pool.pids if pool is not None else []
    got, del_s = first_iterator(ds, mode)
    say(got=got, del_s=round(del_s, 2), pids=pids, left=producers_left())
    for _ in ds:  # blocks on the stuck producer: the test sends SIGINT
        pass
    say(error="not interrupted")


main()
