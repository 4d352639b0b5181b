"""``model.fit`` over ``to_dataset(executor="processes")``, to be stopped by Ctrl-C (a helper of the tests).

Trains a small model for many short epochs (24 items of ~3 ms each, so the
driver's SIGINT lands at start-up, probing, worker start, mid-epoch or at an
epoch boundary, depending on when it comes). Prints one JSON line once the
workers are known (``{"parent": pid, "workers": [pids]}``) and one
(``{"training": true}``) once the first batch is trained. SIGUSR1 dumps every
thread's Python stack to stderr (what a hung run was doing).

Run by ``benchmarks/ctrl_c.py`` (which sends the SIGINT to the process group).
With argv[1] == "gc-callback" the script interrupts itself instead: after the
first batch, a SIGINT handled inside a ``gc.callbacks`` function, where Python
drops the KeyboardInterrupt ("Exception ignored in ...", as in JAX's callback).
"""

import faulthandler
import gc
import json
import os
import signal
import sys
import time

faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash shows every thread's stack
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

import numpy as np  # noqa: E402

import kerasfeed  # noqa: E402


class Items:
    """24 batches of (8, 4) float32, each after ~3 ms (a sleep and a little Python)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.002)
        acc = 0
        for k in range(2000):
            acc += k * k
        return np.full((8, 4), i % 7, np.float32), np.full((8, 1), i % 2, np.float32)


def sigint_inside(phase, info):
    """A gc callback that gets a Ctrl-C (once): its KeyboardInterrupt is raised right here."""
    if phase == "start" and sigint_inside in gc.callbacks:
        gc.callbacks.remove(sigint_inside)
        signal.raise_signal(signal.SIGINT)


def say(**kw):
    print(json.dumps(kw), flush=True)


def main():
    ds = kerasfeed.to_dataset(Items(), executor="processes", workers=2, shuffle=True, seed=0)
    say(parent=os.getpid(), workers=kerasfeed.executor_of(ds).pids)
    import keras

    class FirstBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not getattr(self, "said", False):
                self.said = True
                say(training=True)
                if sys.argv[1:] == ["gc-callback"]:
                    gc.callbacks.append(sigint_inside)
                    gc.collect()

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(ds, epochs=100_000, verbose=0, callbacks=[FirstBatch()])  # Keras warns: shuffle=True is ignored
    say(error="fit returned without an interrupt")


main()
