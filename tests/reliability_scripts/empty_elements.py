"""Items and stream elements that hold no values, through every grouped split (NOTE [ Unbatching empty elements ]).

Run as a script (a regression crashes the interpreter): prints one JSON line of the shapes each case yielded.
"""

import json
import sys

import numpy as np

import kerasfeed


class Rows:
    """Items that are batches of rows; ``empty`` ones have none."""

    def __init__(self, n, empty, width=3):
        self.n, self.empty, self.width = n, set(empty), width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((0 if i in self.empty else 4, self.width), i, np.float32)


class NoPoints:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"points": np.zeros((0, 3), np.float32), "id": np.int64(i)}


def rows_stream(k):
    for i in range(3):
        yield np.full((0 if i == 1 else 2, 3), k, np.float32)


def shapes(ds):
    return [[list(t.shape) for t in (b.values() if isinstance(b, dict) else [b])] for b in ds]


def main():
    executor = sys.argv[1]
    kw = {"workers": 2} if executor == "processes" else {}
    out = {
        # batches with a varying leading dimension, one of them empty (probed items are not)
        "batches": shapes(kerasfeed.to_dataset(Rows(12, {5}), executor=executor, **kw)),
        # every item holds no values: a zero inner dimension
        "zero_width": shapes(kerasfeed.to_dataset(Rows(6, (), width=0), executor=executor, **kw)),
        # samples without points, batched, with an id beside them
        "no_points": shapes(kerasfeed.to_dataset(NoPoints(), batch_size=2, executor=executor, **kw)),
        # a stream whose generators yield an empty batch
        "stream": shapes(kerasfeed.from_generators(rows_stream, 2, executor=executor, **kw)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
