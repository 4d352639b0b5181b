"""The registry of workloads: what ``source[i]`` costs, as ``kerasfeed.SceneSequence`` classes.

The four of docs/field_notes.md (*Four workloads*), measured on the 2-core
machine, and the two image workloads of the GPU machine (issue 24). Each
``__getitem__(i)`` returns one whole batch ``(x, y)``:

- ``cpu``: ~1.7 ms of pure-Python arithmetic (holds the GIL), then a
  (32, 64, 64, 3) float32 batch.
- ``h5``: a contiguous slice of 8 scenes x 4096 points x 6 float32 (plus the 8
  labels) from a gzip-chunked HDF5 file with chunks of 8 scenes.
- ``io``: ``time.sleep(0.005)`` (an object-store latency) then tiny arrays.
- ``big``: a (32, 224, 224, 3) float32 batch (19 MB), cheap to make:
  transport-bound.
- ``decode``: 64 uint8 images 96x96x3 (1.77 MB): ~6 ms of GIL-held Python
  (the per-sample decoding stand-in), then numpy makes 64 raw 112x112x3
  images and takes a random 96x96 crop of each, flipped at random.
- ``h5img``: a contiguous 64-image slice (96x96x3 uint8, and 64 labels) of a
  gzip-chunked HDF5 file (chunks of 16 images).

They live in an importable module so that every peer can ship them to its
worker processes (Keras' and PyTorch's pools, kerasfeed's spawned workers).
This module imports only numpy (h5py lazily) and kerasfeed's ``SceneSequence``:
no TensorFlow. A new workload is one ``Workload`` entry in ``REGISTRY``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from kerasfeed.sources.sequence import SceneSequence

# Iterations of the pure-Python loop: 20,000 take ~1.7 ms on the 2-core
# reference machine (docs/field_notes.md, *Four workloads*). Fixed, so every
# way of feeding does the same work whatever the machine.
CPU_LOOP_ITERATIONS = 20_000
DECODE_LOOP_ITERATIONS = 70_000  # ~6 ms there: the GIL-held part of `decode`
H5_SCENES_PER_BATCH = 8
H5_POINTS_PER_SCENE = 4096
IO_LATENCY_S = 0.005
IMAGES_PER_BATCH = 64
IMAGE_SIDE, RAW_SIDE = 96, 112
IMAGE_CHUNK = 16  # images per gzip chunk of the h5img file


def _python_work(n: int, seed: int) -> int:
    acc = seed
    for k in range(n):
        acc = (acc * 1103515245 + 12345 + k) & 0x7FFFFFFF
    return acc


class _Batches(SceneSequence):
    """``num_batches`` synthetic batches; subclasses make batch ``i``."""

    def __init__(self, num_batches: int):
        super().__init__()
        self.num = int(num_batches)

    def __len__(self) -> int:
        return self.num


class CpuBatches(_Batches):
    """``cpu``: pure-Python work (GIL-bound), then a (32, 64, 64, 3) batch."""

    def __init__(self, num_batches: int, iterations: int = CPU_LOOP_ITERATIONS):
        super().__init__(num_batches)
        self.iterations = int(iterations)

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        acc = _python_work(self.iterations, int(i))
        x = np.full((32, 64, 64, 3), float(acc % 255), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


class IoBatches(_Batches):
    """``io``: a 5 ms wait that releases the GIL, then tiny arrays."""

    def __init__(self, num_batches: int, latency_s: float = IO_LATENCY_S):
        super().__init__(num_batches)
        self.latency_s = float(latency_s)

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        time.sleep(self.latency_s)
        x = np.full((32, 4), float(i), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


class BigBatches(_Batches):
    """``big``: a (32, 224, 224, 3) float32 batch (19 MB): one memset-speed fill."""

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        x = np.full((32, 224, 224, 3), float(i % 251), dtype=np.float32)
        y = np.full((32,), i % 10, dtype=np.int64)
        return x, y


class DecodeBatches(_Batches):
    """``decode``: ~6 ms of GIL-held Python, then 64 random crops and flips (uint8 96x96x3)."""

    def __init__(self, num_batches: int, iterations: int = DECODE_LOOP_ITERATIONS):
        super().__init__(num_batches)
        self.iterations = int(iterations)

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        acc = _python_work(self.iterations, int(i))
        rng = np.random.default_rng(int(i))
        raw = rng.integers(0, 256, (IMAGES_PER_BATCH, RAW_SIDE, RAW_SIDE, 3), dtype=np.uint8)
        tops, lefts = rng.integers(0, RAW_SIDE - IMAGE_SIDE + 1, (2, IMAGES_PER_BATCH))
        flips = rng.random(IMAGES_PER_BATCH) < 0.5
        x = np.empty((IMAGES_PER_BATCH, IMAGE_SIDE, IMAGE_SIDE, 3), np.uint8)
        for k in range(IMAGES_PER_BATCH):
            crop = raw[k, tops[k]:tops[k] + IMAGE_SIDE, lefts[k]:lefts[k] + IMAGE_SIDE]
            x[k] = crop[:, ::-1] if flips[k] else crop
        y = (np.arange(IMAGES_PER_BATCH, dtype=np.int64) + acc) % 10
        return x, y


class H5Slices(SceneSequence):
    """Batch ``i`` is rows ``[per_batch * i, per_batch * (i + 1))`` of each dataset of one HDF5 file.

    ``h5``: ``("points", "labels")``, 8 scenes per batch; ``h5img``:
    ``("images", "labels")``, 64 images per batch. The file is opened on the
    first read in each process (and reopened after a fork: h5py handles must
    not cross one, docs/field_notes.md, *h5py lock*) and never pickled.
    """

    def __init__(self, path: os.PathLike, names: Sequence[str], per_batch: int,
                 num_batches: Optional[int] = None):
        super().__init__()
        import h5py  # lazily: workers unpickle this class without reading yet

        self.path, self.names, self.per_batch = str(path), tuple(names), int(per_batch)
        with h5py.File(self.path, "r") as f:
            available = f[self.names[0]].shape[0] // self.per_batch
        self.num = available if num_batches is None else min(int(num_batches), available)
        self._handles: Optional[Tuple[Any, ...]] = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num

    def _datasets(self) -> Tuple[Any, ...]:
        handles = self._handles
        if handles is None or handles[0] != os.getpid():
            with self._lock:
                handles = self._handles
                if handles is None or handles[0] != os.getpid():
                    import h5py

                    f = h5py.File(self.path, "r")
                    handles = (os.getpid(), f, *(f[name] for name in self.names))
                    self._handles = handles
        return handles[2:]

    def __getitem__(self, i: int) -> Tuple[np.ndarray, ...]:
        start = int(i) * self.per_batch
        return tuple(d[start:start + self.per_batch] for d in self._datasets())

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = state["_lock"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class H5AugSlices(H5Slices):
    """``h5`` split for the item cache: ``load`` reads the gzip slice (stored with cache=); ``augment``, every
    pass, mirrors each scene's x axis with probability 1/2 and shifts each scene by a small random offset
    (a flip and noise: 0.22-0.25 ms a batch over distinct batches on the 2-core Intel VM, 2026-11-26; 0.47 ms
    as first written, see ``augment``; per-point noise on 98K coordinates would cost ~0.7 ms, more than the
    whole in-memory step). It draws from
    ``kerasfeed.item_rng()`` in kerasfeed, else from a generator seeded by the batch's first label, so every
    way of feeding does the same work."""

    def load(self, i: int) -> Tuple[np.ndarray, ...]:
        return H5Slices.__getitem__(self, i)

    def augment(self, item: Tuple[np.ndarray, ...]) -> Tuple[np.ndarray, ...]:
        points, labels = item
        try:
            import kerasfeed

            rng = kerasfeed.item_rng()
        except RuntimeError:  # another way of feeding: no kerasfeed item here
            rng = np.random.default_rng(int(labels[0]))
        out = points.copy()
        out[rng.random(len(out)) < 0.5, :, 0] *= -1
        # The per-scene offset of x, y, z (0 for the other channels), repeated over the points and added in one
        # contiguous pass: the same numbers as `out[..., :3] += offset` (0.0 added elsewhere), whose inner loop
        # of 3 strided floats per point cost 0.42 ms a batch against 0.05 ms (2026-11-25, the 2-core machine).
        offset = np.zeros((len(out), 1, out.shape[-1]), np.float32)
        offset[..., :3] = rng.normal(0.0, 0.01, (len(out), 1, 3)).astype(np.float32)
        out += np.repeat(offset, out.shape[1], axis=1)
        return out, labels

    def __getitem__(self, i: int) -> Tuple[np.ndarray, ...]:
        return self.augment(self.load(i))


# --- the HDF5 files (made once per size, outside any timing, and reused) -------------


def _matches(path: pathlib.Path, name: str, shape: tuple, chunks: tuple) -> bool:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            d = f[name]
            return d.shape == shape and d.chunks == chunks and d.compression == "gzip"
    except (OSError, KeyError):
        return False  # missing or unreadable (an interrupted old run): rebuild it


def scene_file(cache_dir: os.PathLike, num_batches: int, points_per_scene: int = H5_POINTS_PER_SCENE,
               scenes_per_batch: int = H5_SCENES_PER_BATCH) -> pathlib.Path:
    """The gzip-chunked scene file of ``h5`` (``kerasfeed.datasets.make_synthetic_scenes``)."""
    from kerasfeed.datasets import make_synthetic_scenes

    num_scenes = int(num_batches) * scenes_per_batch
    path = pathlib.Path(cache_dir) / f"scenes_{num_scenes}x{points_per_scene}.h5"
    if _matches(path, "points", (num_scenes, points_per_scene, 6), (scenes_per_batch, points_per_scene, 6)):
        return path
    return make_synthetic_scenes(path, num_scenes=num_scenes, points_per_scene=points_per_scene,
                                 chunk_scenes=scenes_per_batch, compression="gzip", seed=0)


def image_file(cache_dir: os.PathLike, num_batches: int) -> pathlib.Path:
    """The gzip-chunked image file of ``h5img``: smooth images with noise (they compress ~3x)."""
    import h5py

    n = int(num_batches) * IMAGES_PER_BATCH
    shape, chunks = (n, IMAGE_SIDE, IMAGE_SIDE, 3), (IMAGE_CHUNK, IMAGE_SIDE, IMAGE_SIDE, 3)
    path = pathlib.Path(cache_dir) / f"images_{n}x{IMAGE_SIDE}.h5"
    if _matches(path, "images", shape, chunks):
        return path
    rng = np.random.default_rng(0)
    ramp = np.add.outer(np.arange(IMAGE_SIDE), np.arange(IMAGE_SIDE))[None, :, :, None]
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        images = f.create_dataset("images", shape, np.uint8, chunks=chunks, compression="gzip")
        f.create_dataset("labels", data=np.arange(n, dtype=np.int64) % 10)
        for start in range(0, n, IMAGES_PER_BATCH):
            k = min(IMAGES_PER_BATCH, n - start)
            base = rng.integers(0, 128, (k, 1, 1, 3))
            noise = rng.integers(0, 4, (k, IMAGE_SIDE, IMAGE_SIDE, 3))
            images[start:start + k] = ((base + ramp + noise) % 256).astype(np.uint8)
    os.replace(tmp, path)
    return path


# --- the registry ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload: ``make(num_batches, cache_dir)`` returns a fresh source.

    Attributes:
        name: its id (``--workloads``).
        make: builds a fresh source (one per configuration, so no state is shared).
        full: batches per epoch of a full run on the 2-core machine.
        quick: batches per epoch of a ``--quick`` run.
        prepare: makes its file, once, outside any timing (None: nothing to make).
        what: one line for the tables.
    """

    name: str
    make: Callable[[int, pathlib.Path], SceneSequence]
    full: int
    quick: int
    prepare: Optional[Callable[[pathlib.Path, int], Any]] = None
    what: str = ""


REGISTRY: Dict[str, Workload] = {w.name: w for w in (
    Workload("cpu", lambda n, _c: CpuBatches(n), 300, 40, what="1.7 ms of GIL-held Python, (32, 64, 64, 3) float32"),
    Workload("h5", lambda n, c: H5Slices(scene_file(c, n), ("points", "labels"), H5_SCENES_PER_BATCH, n),
             200, 24, scene_file, "8 scenes x 4096 x 6 float32 from a gzip-chunked HDF5 file"),
    Workload("h5aug", lambda n, c: H5AugSlices(scene_file(c, n), ("points", "labels"), H5_SCENES_PER_BATCH, n),
             200, 24, scene_file, "h5 split as load (the slice) + augment (a flip and noise on the coordinates)"),
    Workload("io", lambda n, _c: IoBatches(n), 1000, 120, what="5 ms wait, tiny arrays"),
    Workload("big", lambda n, _c: BigBatches(n), 150, 16, what="(32, 224, 224, 3) float32, 19 MB"),
    Workload("decode", lambda n, _c: DecodeBatches(n), 200, 8,
             what="6 ms of GIL-held Python + numpy crop/flip, 64 x 96x96x3 uint8"),
    Workload("h5img", lambda n, c: H5Slices(image_file(c, n), ("images", "labels"), IMAGES_PER_BATCH, n),
             200, 8, image_file, "64 x 96x96x3 uint8 from a gzip-chunked HDF5 file"),
)}
WORKLOADS = ("cpu", "h5", "io", "big")  # the 2-core benchmarks' four (docs/field_notes.md)
IMAGE_WORKLOADS = ("decode", "h5img")  # the GPU machine's (issue 24)


def check_names(names: Sequence[str], known: Sequence[str] = tuple(REGISTRY)) -> None:
    """Raises ``ValueError`` naming the first unknown workload."""
    for name in names:
        if name not in known:
            raise ValueError(f"Unknown workload {name!r}; expected some of {tuple(known)}. Received: {name!r}")


def make_workload(name: str, num_batches: int, cache_dir: os.PathLike) -> SceneSequence:
    """A fresh workload object (one per way of feeding, so no state is shared)."""
    check_names([name])
    return REGISTRY[name].make(int(num_batches), pathlib.Path(cache_dir))


def prepare(name: str, num_batches: int, cache_dir: os.PathLike) -> None:
    """Makes the workload's file (if any) before anything is timed."""
    if REGISTRY[name].prepare is not None:
        REGISTRY[name].prepare(pathlib.Path(cache_dir), int(num_batches))


# --- the classic case: many slow one-item generators ------------------------------------

CLASSIC_SLEEP_S = 0.1
CLASSIC_IMAGE_SHAPE = (128, 128, 3)


def classic_generator(shard: int, sleep_s: float = CLASSIC_SLEEP_S) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """Waits ``sleep_s`` (a slow fetch), then yields one image/mask pair."""
    time.sleep(sleep_s)
    image = np.full(CLASSIC_IMAGE_SHAPE, float(shard % 255), dtype=np.float32)
    mask = np.full(CLASSIC_IMAGE_SHAPE[:2] + (1,), shard % 2, dtype=np.uint8)
    yield image, mask
