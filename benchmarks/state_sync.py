"""What carrying the source's state to worker processes costs per pass.

At every pass boundary, ``executor="processes"`` checks whether the epoch
hooks (or anything else in the consumer) changed the source since the
workers' copy was made, and sends what changed (see
``kerasfeed/execution/state_sync.py``). This script measures, per pass:

- ``check``: the consumer's fingerprint of the source (paid every pass);
- ``send``: pickling and sending what changed (paid only when it changed);
- ``pass``: a whole pass through ``to_dataset(executor="processes")``, with
  the source unchanged and with the change made in ``on_epoch_end``.

for a small source (an index list re-shuffled in ``on_epoch_end``) and for
sources holding a 100 MB array: writeable, read-only, and changed in place.

Run ``python benchmarks/state_sync.py`` (``--mb 8 --passes 3`` for a quick
run). Run it on a quiet machine: it prints milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kerasfeed
from kerasfeed.execution.state_sync import StateTracker


class Small(kerasfeed.SceneSequence):
    """16 batches; re-shuffles its own index list (in place) when ``shuffle``."""

    def __init__(self, shuffle: bool = True, batches: int = 16):
        super().__init__()
        self.shuffle = shuffle
        self.indices = np.arange(batches * 4)
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return len(self.indices) // 4

    def __getitem__(self, i):
        return self.indices[4 * i : 4 * i + 4].astype(np.float32)

    def on_epoch_end(self):
        if self.shuffle:
            self.rng.shuffle(self.indices)


class Holding(Small):
    """``Small`` plus a large array: unchanged (writeable or read-only), or
    changed in place in ``on_epoch_end`` (``touch``)."""

    def __init__(self, mb: int, read_only: bool = False, touch: bool = False):
        super().__init__(shuffle=False)
        self.table = np.zeros(mb * 2**20 // 8)
        self.table.flags.writeable = not read_only
        self.touch = touch

    def on_epoch_end(self):
        if self.touch:
            self.table[0] += 1


def _ms(samples: list) -> str:
    return f"{statistics.median(samples) * 1e3:9.2f}"


def measure_tracker(source, passes: int) -> tuple[list, list, int]:
    """Times ``StateTracker.check`` over ``passes`` passes, running the hooks
    between them: (check seconds, of which pickling what changed, bytes sent)."""
    tracker = StateTracker(source)
    checks, sends = [], []
    for _ in range(passes):
        source.on_epoch_end()
        t0 = time.perf_counter()
        fps = tracker.fingerprints()
        t1 = time.perf_counter()
        payload, _ = tracker.check()
        t2 = time.perf_counter()
        checks.append(t1 - t0)
        sends.append(max(0.0, (t2 - t1) - (t1 - t0)) if payload else 0.0)
        del fps
    return checks, sends, tracker.sent_bytes // max(tracker.syncs, 1)


def measure_passes(source, passes: int, workers: int) -> list:
    """Wall time of whole passes through ``to_dataset(executor="processes")``
    (the first, with start-up, left out)."""
    ds = kerasfeed.to_dataset(source, executor="processes", workers=workers)
    times = []
    for _ in range(passes + 1):
        t0 = time.perf_counter()
        for _ in ds:
            pass
        times.append(time.perf_counter() - t0)
    kerasfeed.executor_of(ds).close()
    return times[1:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="size of the large array in MB")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-passes", action="store_true", help="only the consumer-side check, no worker processes")
    args = parser.parse_args(argv)
    cases = [
        ("small, unchanged", lambda: Small(shuffle=False)),
        ("small, re-shuffled every pass", lambda: Small(shuffle=True)),
        (f"{args.mb} MB array, unchanged (writeable)", lambda: Holding(args.mb)),
        (f"{args.mb} MB array, unchanged (read-only)", lambda: Holding(args.mb, read_only=True)),
        (f"{args.mb} MB array, changed in place every pass", lambda: Holding(args.mb, touch=True)),
    ]
    print(f"# state sync cost per pass (median of {args.passes} passes, ms; {args.workers} workers)\n")
    print("| source | check ms | send ms | bytes sent per change | pass ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, make in cases:
        checks, sends, sent = measure_tracker(make(), args.passes)
        passes = "" if args.no_passes else _ms(measure_passes(make(), args.passes, args.workers))
        print(f"| {name} | {_ms(checks)} | {_ms(sends)} | {sent if max(sends) else 0:,} | {passes} |")


if __name__ == "__main__":
    main()
