"""The four workloads of docs/field_notes.md (*Four workloads*) as ``kerasfeed.SceneSequence`` classes.

They live in an importable module (not in ``run.py``'s ``__main__``) so that
every peer can ship them to its worker processes: Keras' and PyTorch's pools
(forked, or pickled by reference) and kerasfeed's spawned workers (cloudpickle
by reference; ``run.py`` puts the repository root on ``PYTHONPATH``).

Each ``__getitem__(i)`` returns one whole batch ``(x, y)``:

- ``cpu``: ~1.7 ms of pure-Python arithmetic (holds the GIL), then a
  (32, 64, 64, 3) float32 batch.
- ``h5``: a contiguous slice of 8 scenes x 4096 points x 6 float32 (plus the 8
  labels) from a gzip-chunked HDF5 file with chunks of 8 scenes, opened lazily
  once per process.
- ``io``: ``time.sleep(0.005)`` (an object-store or network-filesystem
  latency) then tiny arrays.
- ``big``: a (32, 224, 224, 3) float32 batch (19 MB) that is cheap to make:
  transport-bound.

This module imports only numpy (h5py lazily), so a worker that unpickles a
workload does not pay for TensorFlow.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

from kerasfeed.sources.sequence import SceneSequence

# Iterations of the pure-Python loop of the cpu workload: ~1.7 ms on the
# 2-core reference machine (docs/field_notes.md, *Four workloads*). Fixed, so
# every way of feeding does the same work whatever the machine.
CPU_LOOP_ITERATIONS = 20_000
H5_SCENES_PER_BATCH = 8
H5_POINTS_PER_SCENE = 4096
IO_LATENCY_S = 0.005


def _python_work(n: int, seed: int) -> int:
    acc = seed
    for k in range(n):
        acc = (acc * 1103515245 + 12345 + k) & 0x7FFFFFFF
    return acc


class CpuBatches(SceneSequence):
    """``cpu``: pure-Python work (GIL-bound), then a (32, 64, 64, 3) batch."""

    def __init__(self, num_batches: int, iterations: int = CPU_LOOP_ITERATIONS):
        super().__init__()
        self.num = int(num_batches)
        self.iterations = int(iterations)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        acc = _python_work(self.iterations, int(i))
        x = np.full((32, 64, 64, 3), float(acc % 255), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


class H5Scenes(SceneSequence):
    """``h5``: batch ``i`` is scenes ``[8i, 8i + 8)`` of a gzip-chunked file.

    The file handle is opened on the first read in each process (and reopened
    after a fork: docs/field_notes.md, *h5py lock*: h5py handles must not cross one) and is
    never pickled.
    """

    def __init__(self, path: str, num_batches: Optional[int] = None,
                 scenes_per_batch: int = H5_SCENES_PER_BATCH):
        super().__init__()
        self.path = str(path)
        self.scenes_per_batch = int(scenes_per_batch)
        import h5py  # lazily: workers unpickle this class without reading yet

        with h5py.File(self.path, "r") as f:
            available = f["points"].shape[0] // self.scenes_per_batch
        self.num = available if num_batches is None else min(int(num_batches), available)
        self._handles: Optional[Tuple[int, Any]] = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num

    def _datasets(self):
        handles = self._handles
        if handles is None or handles[0] != os.getpid():
            with self._lock:
                handles = self._handles
                if handles is None or handles[0] != os.getpid():
                    import h5py

                    f = h5py.File(self.path, "r")
                    handles = (os.getpid(), f, f["points"], f["labels"])
                    self._handles = handles
        return handles[2], handles[3]

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        points, labels = self._datasets()
        start = int(i) * self.scenes_per_batch
        stop = start + self.scenes_per_batch
        return points[start:stop], labels[start:stop]

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class IoBatches(SceneSequence):
    """``io``: a 5 ms wait that releases the GIL, then tiny arrays."""

    def __init__(self, num_batches: int, latency_s: float = IO_LATENCY_S):
        super().__init__()
        self.num = int(num_batches)
        self.latency_s = float(latency_s)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        time.sleep(self.latency_s)
        x = np.full((32, 4), float(i), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


class BigBatches(SceneSequence):
    """``big``: a (32, 224, 224, 3) float32 batch (19 MB), cheap to make.

    One fill of fresh memory per batch (a memset-speed write), so the batch
    is real data while making it costs far less than moving it.
    """

    def __init__(self, num_batches: int):
        super().__init__()
        self.num = int(num_batches)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        x = np.full((32, 224, 224, 3), float(i % 251), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


# --- the classic case: many slow one-item generators ----------------------------

CLASSIC_SLEEP_S = 0.1
CLASSIC_IMAGE_SHAPE = (128, 128, 3)


def classic_generator(shard: int, sleep_s: float = CLASSIC_SLEEP_S) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """Waits ``sleep_s`` (a slow fetch), then yields one image/mask pair."""
    time.sleep(sleep_s)
    image = np.full(CLASSIC_IMAGE_SHAPE, float(shard % 255), dtype=np.float32)
    mask = np.full(CLASSIC_IMAGE_SHAPE[:2] + (1,), shard % 2, dtype=np.uint8)
    yield image, mask


# --- making the HDF5 file -------------------------------------------------------

def scene_file(cache_dir: os.PathLike, num_batches: int,
               points_per_scene: int = H5_POINTS_PER_SCENE,
               scenes_per_batch: int = H5_SCENES_PER_BATCH) -> pathlib.Path:
    """Returns a synthetic gzip-chunked scene file with ``num_batches`` batches.

    Made with ``kerasfeed.datasets.make_synthetic_scenes`` (chunks of 8
    scenes) and reused while its shape matches.
    """
    import h5py

    from kerasfeed.datasets import make_synthetic_scenes

    num_scenes = int(num_batches) * scenes_per_batch
    path = pathlib.Path(cache_dir) / f"scenes_{num_scenes}x{points_per_scene}.h5"
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                d = f["points"]
                if (d.shape == (num_scenes, points_per_scene, 6)
                        and d.chunks == (scenes_per_batch, points_per_scene, 6)
                        and d.compression == "gzip"):
                    return path
        except OSError:
            pass  # unreadable (e.g. an interrupted old run): rebuild it
    return make_synthetic_scenes(path, num_scenes=num_scenes, points_per_scene=points_per_scene,
                                 chunk_scenes=scenes_per_batch, compression="gzip", seed=0)


def make_workload(name: str, num_batches: int, cache_dir: os.PathLike) -> SceneSequence:
    """A fresh workload object (one per way of feeding, so no state is shared)."""
    if name == "cpu":
        return CpuBatches(num_batches)
    if name == "h5":
        return H5Scenes(scene_file(cache_dir, num_batches), num_batches)
    if name == "io":
        return IoBatches(num_batches)
    if name == "big":
        return BigBatches(num_batches)
    raise ValueError(f"Unknown workload {name!r}; expected one of {WORKLOADS}. Received: {name!r}")


WORKLOADS = ("cpu", "h5", "io", "big")
