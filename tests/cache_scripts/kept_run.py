"""One run over a kept directory cache: ``python kept_run.py H5 CACHE_DIR LOG [--passes P] [--slow S]``.

The source reads an HDF5 file (kerasfeed.H5SliceSequence) and appends one line
to LOG per item it makes (O_APPEND: atomic per line, from any process). The
run drains P shuffled passes through to_loader on worker processes and prints
one JSON line: a digest of every batch of every pass, and the store's figures.
``--slow S`` sleeps S seconds per item made (the kill test's window); ``--max-bytes B`` sets the cache's
budget (``kerasfeed.Cache(CACHE_DIR, max_bytes=B)``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np

import kerasfeed


class Logged(kerasfeed.H5SliceSequence):
    cache_ignores = ("log",)  # the file it appends to: not what its items are made from (docs/cache.md)

    def __init__(self, path, log, slow):
        super().__init__(path, ("points", "labels"), 4)
        self.log, self._slow = log, slow  # _slow is private: not part of a kept cache key

    def __getitem__(self, i):
        if self._slow:
            time.sleep(self._slow)
        item = super().__getitem__(i)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return item


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("h5")
    ap.add_argument("cache")
    ap.add_argument("log")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--executor", default="processes")
    ap.add_argument("--max-bytes", type=int, default=None)
    args = ap.parse_args()
    cache = args.cache if args.max_bytes is None else kerasfeed.Cache(args.cache, max_bytes=args.max_bytes)
    kw = {"workers": 2} if args.executor == "processes" else {}
    digest = hashlib.sha256()
    with kerasfeed.to_loader(Logged(args.h5, args.log, args.slow), shuffle=True, seed=11, executor=args.executor,
                             cache=cache, **kw) as loader:
        for _ in range(args.passes):
            for x, y in loader:
                digest.update(np.ascontiguousarray(x).tobytes())
                digest.update(np.ascontiguousarray(y).tobytes())
        stats = kerasfeed.stats(loader)
    print(json.dumps({"digest": digest.hexdigest(), "cache_items": stats["cache_items"],
                      "cache_hits": stats["cache_hits"], "cache_misses": stats["cache_misses"]}), flush=True)


if __name__ == "__main__":
    main()
