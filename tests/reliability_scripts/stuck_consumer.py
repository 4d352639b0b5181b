"""A consumer whose next item never comes (a helper of the tests).

argv[1] = "threads" | "processes"; argv[2] = the mode:

- "delete-break" / "delete-del": leave a ``for`` loop with ``break`` after
  3 elements / ``del`` a live iterator after 3 elements, while a load waits
  for a stuck item; print how long that took; end with the dataset alive.
- "sigint-next": take 3 elements, print a line, then wait in ``next(it)``
  for a stuck item (the test sends SIGINT then).
- "sigint-take": print a line, then iterate ``ds.take(3)``, whose end waits
  inside TensorFlow for the stuck item (the test sends SIGINT then).
- "sigint-fit": print a line, then ``model.fit`` on (x, y) batches, whose
  step waits inside TensorFlow for the stuck item (the test sends SIGINT then).

Every line printed is JSON; the worker pids are in it (processes).
"""

import json
import sys
import time

import numpy as np

import kerasfeed


class Stuck:
    """Items 3.. never come (a 10-minute sleep); the last one is quick (probed)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if 3 <= i < 39:
            time.sleep(600)
        return np.full((2,), i, np.float32)


def say(**kw):
    print(json.dumps(kw), flush=True)


KEEP = []  # module globals: alive until the interpreter finalizes


def main():
    executor, mode = sys.argv[1], sys.argv[2]
    kwargs = {"workers": 1} if executor == "processes" else {}
    # Small items: grouped (up to 64 per call), as by default; a group never waits for a later item.
    ds = kerasfeed.to_dataset(Stuck(), executor=executor, **kwargs)
    assert ds._kerasfeed_group_items > 1
    KEEP.append(ds)
    ex = kerasfeed.executor_of(ds)
    pids = ex.pids if executor == "processes" else []
    if mode == "delete-break":
        got = []
        for x in ds:  # the loop's iterator is deleted when the loop is left
            got.append(int(x[0]))
            if len(got) == 3:
                time.sleep(0.5)  # the load of item 3 is waiting now
                t0 = time.monotonic()
                break
        say(got=got, del_s=round(time.monotonic() - t0, 2), pids=pids)
        return  # the script ends with the dataset alive
    if mode == "delete-del":
        it = iter(ds)
        got = [int(next(it)[0]) for _ in range(3)]
        time.sleep(0.5)  # the load of item 3 is waiting now
        t0 = time.monotonic()
        del it
        say(got=got, del_s=round(time.monotonic() - t0, 2), pids=pids)
        return
    if mode == "sigint-fit":
        import keras

        pairs = ds.map(lambda x: (x[None], x[None, :1]))  # item i: a batch of one (x, y)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        say(pids=pids)
        model.fit(pairs, epochs=2, verbose=0)  # never returns: the test sends SIGINT
        got = []
    elif mode == "sigint-take":
        # take(3) destroys its input inside TensorFlow after the 3rd element:
        # the 4th next() joins the prefetch thread that waits for item 3.
        say(pids=pids)
        it = iter(ds.take(3))
        got = [int(next(it)[0]) for _ in range(3)]
        time.sleep(1.0)  # the prefetch thread waits for item 3 by now, even on a loaded machine
        for _ in it:  # the end of take(3): never returns, the test sends SIGINT
            pass
    else:
        it = iter(ds)
        got = [int(next(it)[0]) for _ in range(3)]
        say(pids=pids)
        next(it)  # never returns: the test sends SIGINT
    say(error="not interrupted", got=got)


main()
