"""The classic generator and record-file cases, ready for tests and benchmarks.

- ``sleepy_image_mask(i)``: a generator that waits ``delay`` seconds (an object-store request, say) and
  yields one image/mask pair. One hundred of them through ``tf.data.Dataset.from_generator`` take
  ``100 * delay``; through ``kerasfeed.from_generators`` they overlap.
- ``write_jsonl_records(directory, counts)`` writes JSON-lines record files with a varying number of
  variable-length samples; ``read_jsonl_records(path)`` reads one back as ``(tokens, label)`` samples.
- ``busy_generator(i)``: pure-Python, CPU-bound items (threads cannot run it in parallel; worker
  processes can).

Everything here is module-level, so worker processes can import it.

Example:

```python
import functools
import kerasfeed
from kerasfeed.datasets.synthetic_streams import sleepy_image_mask, write_jsonl_records, read_jsonl_records

ds = kerasfeed.from_generators(functools.partial(sleepy_image_mask, delay=0.1), 100)
paths = write_jsonl_records("/tmp/records", counts=(3, 5, 7))
ds = kerasfeed.from_files(paths, read_jsonl_records, batch_size=4)
```
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Iterator, Sequence, Union

import numpy as np

FEATURES = 4  # columns of every token row in the JSON-lines records


def sleepy_image_mask(i: int, delay: float = 0.1, size: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields one ``(image, mask)`` pair after sleeping ``delay`` seconds: ``image`` is ``(size, size, 3)``
    float32 filled with ``i``; ``mask`` is ``(size, size)`` int32, 1 on the left half when ``i`` is odd."""
    time.sleep(delay)
    image = np.full((size, size, 3), i, np.float32)
    mask = np.zeros((size, size), np.int32)
    if i % 2:
        mask[:, : size // 2] = 1
    yield image, mask


def busy_generator(i: int, items: int = 4, work: int = 20_000) -> Iterator[tuple[np.ndarray, np.int64]]:
    """Yields ``items`` small arrays, each after ``work`` pure-Python loop steps."""
    for k in range(items):
        acc = 0
        for j in range(work):
            acc = (acc * 31 + j + i) % 1_000_003
        yield np.full(16, acc, np.float32), np.int64(i * items + k)


def write_jsonl_records(
    directory: Union[str, os.PathLike],
    counts: Sequence[int] = (3, 5, 7),
    seed: int = 0,
    max_len: int = 9,
) -> list[str]:
    """Writes one JSON-lines file per entry of ``counts``.

    File ``f`` holds ``counts[f]`` records ``{"id", "tokens", "label"}``: ``tokens`` is a ``(length, 4)``
    list of floats with ``length`` in ``1..max_len``, ``id`` is unique over all files (``f * 1000 + k``),
    and ``label`` is 1 when the tokens' mean is positive (learnable).

    Returns:
        The file paths, in order.
    """
    rng = np.random.default_rng(seed)
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, count in enumerate(counts):
        path = out / f"records_{f:03d}.jsonl"
        with open(path, "w") as fh:
            for k in range(count):
                length = int(rng.integers(1, max_len + 1))
                label = int(rng.integers(0, 2))
                tokens = rng.normal(0.8 if label else -0.8, 1.0, size=(length, FEATURES))
                fh.write(json.dumps({"id": f * 1000 + k, "tokens": tokens.round(4).tolist(), "label": label}) + "\n")
        paths.append(str(path))
    return paths


def read_jsonl_records(path: Union[str, os.PathLike]) -> Iterator[tuple[dict, np.ndarray]]:
    """Yields ``({"tokens": (length, 4) float32, "id": int64}, label int32)`` per line."""
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            tokens = np.asarray(rec["tokens"], np.float32).reshape(-1, FEATURES)
            yield {"tokens": tokens, "id": np.int64(rec["id"])}, np.int32(rec["label"])
