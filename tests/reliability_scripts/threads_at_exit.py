"""kerasfeed's daemon threads at interpreter exit (a helper of the tests).

argv[1] = "to_loader" (TensorFlow never imported, with KERAS_BACKEND=numpy) | "to_dataset"; then one or more of
"moment" (some items sleep 1 s) and "forever" (they never return): it reads the first 2 batches of a pass, those
items in progress on pool threads; "device" (``to_loader`` only): the same through ``loader.jax()`` with a device
prefetch of 2, its thread waiting for room; "generators", "queue" (``to_dataset`` only): a ``from_generators``
(2 shards) or ``from_queue`` stream whose producers are 2 s into making their 4th item. It ends with every
iterator alive.

An ``atexit`` hook registered before kerasfeed is imported runs after kerasfeed's own hooks; it prints one JSON
line: per source, the threads that called it (device: the prefetch thread) and are still alive then, and how
long the exit took until then. weakref's exit hook (finalizers, which only ask threads to stop) is registered
before it, so it runs after the report: it often runs last, and a thread it stops runs on into finalization.
"""

import atexit
import json
import sys
import threading
import time
import weakref

ENDED = [0.0]
CALLERS = {}  # source name -> the threads that called it


def _report():
    left = {name: sorted(t.name for t in threads if t.is_alive()) for name, threads in CALLERS.items()}
    exit_s = time.monotonic() - ENDED[0]
    callers = {name: len(threads) for name, threads in CALLERS.items()}
    print(json.dumps({"left": left, "callers": callers, "exit_s": round(exit_s, 2), "tf": "tensorflow" in sys.modules}),
          flush=True)


weakref.finalize(_report, int)  # registers weakref's exit hook now: it runs after the report
atexit.register(_report)  # before kerasfeed's hooks: it runs after them

import logging  # noqa: E402

import numpy as np  # noqa: E402

import kerasfeed  # noqa: E402

logging.getLogger("kerasfeed").setLevel(logging.DEBUG)
logging.getLogger("kerasfeed").addHandler(logging.StreamHandler(sys.stderr))
never = threading.Event()


class Blocks:
    def __init__(self, how):
        self.how = how
        CALLERS[how] = set()

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if self.how == "device":  # quick; its callers are not the thread looked at
            return np.full(2, i, np.float32)
        if threading.current_thread() is not threading.main_thread():
            CALLERS[self.how].add(threading.current_thread())
        if 8 <= i < 31 and i % 2:  # the last one is probed: quick
            if self.how == "forever":
                never.wait()
            else:
                time.sleep(1.0)
        return np.full(2, i, np.float32)


def stream(how):
    CALLERS[how].add(threading.current_thread())
    for i in range(32):
        if i == 3:
            time.sleep(2.0)
        yield np.full(2, i, np.float32)


def open_iterator(how):
    if how == "device":
        return iter(kerasfeed.to_loader(Blocks(how), batch_size=4, executor="threads", device_prefetch=2).jax())
    if how in ("generators", "queue"):
        import tensorflow as tf

        CALLERS[how] = set()
        spec = tf.TensorSpec((2,), tf.float32)
        if how == "generators":
            return iter(kerasfeed.from_generators(lambda k: stream(how), 2, output_signature=spec))
        return iter(kerasfeed.from_queue(lambda put: [put(x) for x in stream(how)], output_signature=spec))
    return iter(getattr(kerasfeed, sys.argv[1])(Blocks(how), batch_size=4, executor="threads"))


iterators = []
for how in sys.argv[2:]:
    it = open_iterator(how)
    first = [np.asarray(next(it)).ravel()[0].item() for _ in range(2)]
    if how == "device":
        CALLERS[how] = {t for t in threading.enumerate() if t.name == "kerasfeed-device-prefetch"}
        time.sleep(0.5)  # it places the next 2 batches and waits for room (not in a load the exit would fail)
    iterators.append(it)
    print(json.dumps({how: first}), flush=True)
ENDED[0] = time.monotonic()
