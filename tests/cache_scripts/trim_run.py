"""One run over a kept directory cache of large items: ``python trim_run.py CACHE_DIR LOG [MAX_BYTES]``.

The source has 64 items of 2 MB whose values say their index, and appends a line to LOG per item it makes
(``pid index``, as ``kept_run.py``).
The run drains 2 passes through to_loader (threads) with ``Cache(CACHE_DIR, max_bytes=MAX_BYTES)`` and prints
one JSON line: every item's first value per pass, and the store's figures. The kill-during-trim test SIGKILLs
a run with a smaller MAX_BYTES than the directory holds while it copies the records it keeps.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import kerasfeed

ITEMS, ITEM_FLOATS = 64, 512 * 1024


class Numbered(kerasfeed.SceneSequence):
    def __init__(self, log):
        super().__init__()
        self._log = log  # private: not part of the kept cache's key

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        with open(self._log, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
        return np.full(ITEM_FLOATS, float(i), np.float32)


def main(directory: str, log: str, max_bytes=None) -> None:
    cache = kerasfeed.Cache(directory, max_bytes=None if max_bytes is None else int(max_bytes))
    with kerasfeed.to_loader(Numbered(log), executor="threads", cache=cache) as loader:
        passes = [[float(np.asarray(x)[0]) if np.all(np.asarray(x) == np.asarray(x)[0]) else -1.0 for x in loader]
                  for _ in range(2)]
        stats = kerasfeed.stats(loader)
    print(json.dumps({"passes": passes, "cache_items": stats["cache_items"], "cache_hits": stats["cache_hits"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
