"""A synthetic HDF5 scene file: point clouds of simple shapes standing on a ground.

Each scene is one object (sphere, cube, cylinder, ...) with a random size, yaw, slight tilt and
position, standing on a patch of ground, plus Gaussian noise. The scene class is the object's shape, so
a small PointNet-style model (shared per-point Dense layers + a global max pool) learns it in a few
epochs; each point is also labelled ``ground`` or with the object's shape, for segmentation.

Reading it (the **h5** workload of docs/field_notes.md, *Four workloads*: 8 scenes x 4096 points x 6
float32 per batch, gzip chunks of 8 scenes):

```python
import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes

path = make_synthetic_scenes("/tmp/scenes.h5", num_scenes=512, points_per_scene=4096,
                             chunk_scenes=8)                     # ~2 s
seq = kerasfeed.H5SliceSequence(path, ("points", "labels"), batch_size=8)
x, y = seq[0]                                                   # (8, 4096, 6), (8,)
ds = kerasfeed.to_dataset(seq, executor="processes", workers=2)  # or "threads"
seq_mp = kerasfeed.H5SliceSequence(path, ("points", "labels"), batch_size=8,
                                   workers=2, use_multiprocessing=True)  # Keras' own
```

The raw sequential limit is ``h5py.File(path)["points"][i * 8:(i + 1) * 8]`` (plus ``"labels"``) in a
loop; ``H5SliceSequence.__getitem__`` adds a few microseconds to it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional, Union

import numpy as np

#: Shape names in class-id order; ``num_classes=k`` uses the first ``k``.
SHAPE_NAMES = ("sphere", "cube", "cylinder", "torus", "plane", "cone")
#: Names of the 6 per-point features in ``"points"``.
FEATURE_NAMES = ("x", "y", "z", "nx", "ny", "nz")
# Scenes are generated in blocks with their own seeded generator, so scene i does not depend on
# num_scenes: a 256-scene file is a prefix of a 512-scene file with the same seed and points_per_scene.
_BLOCK = 64
_GROUND_FRACTION = 0.25
_GROUND_HALF_SIZE = 2.0
_COMPRESSIONS = ("gzip", "lzf", None)


def make_synthetic_scenes(
    path: Union[str, os.PathLike],
    *,
    num_scenes: int = 512,
    points_per_scene: int = 1024,
    num_classes: int = 4,
    seed: int = 0,
    chunk_scenes: int = 8,
    compression: Optional[str] = "gzip",
    noise: float = 0.02,
) -> pathlib.Path:
    """Writes a synthetic point-cloud scene file in HDF5 and returns its path.

    The file holds:

    - ``"points"``: float32 ``(num_scenes, points_per_scene, 6)``: x, y, z in metres and the unit
      surface normal nx, ny, nz of each point.
    - ``"labels"``: int64 ``(num_scenes,)``: the scene class, the shape of its object, in
      ``[0, num_classes)`` (balanced within blocks of 64).
    - ``"point_labels"``: int32 ``(num_scenes, points_per_scene)``: 0 for ground points,
      ``1 + labels[i]`` for points on the object.

    Every dataset is chunked by ``chunk_scenes`` whole scenes along axis 0, compressed, and resizable
    along axis 0 (so rows can be appended later). File attributes: ``num_classes``, ``class_names``,
    ``num_point_classes``, ``point_class_names``, ``feature_names``, ``seed``. The file is written to a
    temporary name and renamed, so a reader never sees a half-written file; parent directories are
    created. The output is a pure function of the arguments (same seed, same bytes of data), and scene
    ``i`` does not depend on ``num_scenes``.

    Args:
        path: where to write the file (an existing file is replaced).
        num_scenes: number of scenes (rows), >= 1.
        points_per_scene: points per scene, >= 8; a quarter are ground.
        num_classes: number of object shapes, 2 to 6, taken in the order sphere, cube, cylinder, torus,
            plane, cone.
        seed: the random seed (a non-negative int).
        chunk_scenes: scenes per HDF5 chunk along axis 0, >= 1.
        compression: ``"gzip"`` (level 4), ``"lzf"`` or None.
        noise: standard deviation of the Gaussian position noise, in metres (>= 0; objects are 0.9 to
            1.6 m across).

    Returns:
        The path of the written file as a ``pathlib.Path``.

    Example:

    ```python
    from kerasfeed.datasets import make_synthetic_scenes

    path = make_synthetic_scenes("/tmp/scenes.h5", num_scenes=256)
    ```
    """
    path = _check_path(path)
    num_scenes = _check_int("num_scenes", num_scenes, 1)
    points_per_scene = _check_int("points_per_scene", points_per_scene, 8)
    num_classes = _check_int("num_classes", num_classes, 2, len(SHAPE_NAMES))
    seed = _check_int("seed", seed, 0)
    chunk_scenes = _check_int("chunk_scenes", chunk_scenes, 1)
    if compression not in _COMPRESSIONS:
        raise ValueError(f"`compression` must be one of {_COMPRESSIONS}. Received: compression={compression!r}")
    if (
        isinstance(noise, bool)
        or not isinstance(noise, (int, float, np.integer, np.floating))
        or not np.isfinite(noise)
        or noise < 0
    ):
        raise ValueError(f"`noise` must be a finite number >= 0. Received: noise={noise!r}")

    import h5py  # lazily: `import kerasfeed` must stay light

    class_names = list(SHAPE_NAMES[:num_classes])
    point_class_names = ["ground", *class_names]
    compression_opts = 4 if compression == "gzip" else None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            def create(name, shape, dtype):
                return f.create_dataset(name, shape=shape, maxshape=(None, *shape[1:]), dtype=dtype,
                                        chunks=(chunk_scenes, *shape[1:]), compression=compression,
                                        compression_opts=compression_opts)

            points = create("points", (num_scenes, points_per_scene, 6), np.float32)
            labels = create("labels", (num_scenes,), np.int64)
            point_labels = create("point_labels", (num_scenes, points_per_scene), np.int32)
            for start in range(0, num_scenes, _BLOCK):
                stop = min(start + _BLOCK, num_scenes)
                # Always a whole block (then cut), so that scene i is the same whatever num_scenes is.
                p, y, pl = _make_block(seed, start // _BLOCK, points_per_scene, num_classes, float(noise))
                points[start:stop] = p[: stop - start]
                labels[start:stop] = y[: stop - start]
                point_labels[start:stop] = pl[: stop - start]
            f.attrs["num_classes"] = num_classes
            f.attrs["class_names"] = class_names
            f.attrs["num_point_classes"] = len(point_class_names)
            f.attrs["point_class_names"] = point_class_names
            f.attrs["feature_names"] = list(FEATURE_NAMES)
            f.attrs["seed"] = seed
            f.attrs["generator"] = "kerasfeed.datasets.make_synthetic_scenes"
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _check_path(path) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or os.PathLike. Received: path={path!r}")
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"`path` must be a file path, not a directory. Received: path='{path}'")
    return path


def _check_int(name, value, low, high=None) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if ok and value >= low and (high is None or value <= high):
        return int(value)
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"`{name}` must be an int {bounds}. Received: {name}={value!r}")


def _make_block(seed, block, ppp, num_classes, noise):
    """The _BLOCK scenes of one generation block: (points, labels, point_labels)."""
    rng = np.random.default_rng([seed, block])
    n = _BLOCK
    # Balanced classes within the block, in a random order.
    labels = rng.permutation((np.arange(n) + block * _BLOCK) % num_classes).astype(np.int64)
    n_ground = max(1, int(ppp * _GROUND_FRACTION))
    n_obj = ppp - n_ground

    xyz = np.empty((n, n_obj, 3))
    nrm = np.empty((n, n_obj, 3))
    for c in range(num_classes):
        rows = np.flatnonzero(labels == c)
        if rows.size:
            p, q = _SHAPES[c](rng, rows.size * n_obj)
            xyz[rows] = p.reshape(rows.size, n_obj, 3)
            nrm[rows] = q.reshape(rows.size, n_obj, 3)

    # Pose: free yaw, a slight tilt, a size, standing on the ground near the centre.
    rot = _rotations(rng, n)
    xyz = np.einsum("sij,spj->spi", rot, xyz)
    nrm = np.einsum("sij,spj->spi", rot, nrm)
    scale = rng.uniform(0.45, 0.8, size=(n, 1, 1))
    xyz *= scale
    shift = np.concatenate([rng.uniform(-0.3, 0.3, size=(n, 1, 2)), np.zeros((n, 1, 1))], axis=2)
    shift[..., 2] = 0.02 - xyz[..., 2].min(axis=1, keepdims=False)[:, None]
    xyz += shift

    ground = np.empty((n, n_ground, 3))
    ground[..., :2] = rng.uniform(-_GROUND_HALF_SIZE, _GROUND_HALF_SIZE, size=(n, n_ground, 2))
    ground[..., 2] = 0.0
    ground_n = np.zeros((n, n_ground, 3))
    ground_n[..., 2] = 1.0

    pts = np.empty((n, ppp, 6), dtype=np.float32)
    pts[:, :n_obj, :3] = xyz
    pts[:, :n_obj, 3:] = nrm
    pts[:, n_obj:, :3] = ground
    pts[:, n_obj:, 3:] = ground_n
    pts[..., :3] += rng.normal(0.0, noise, size=(n, ppp, 3)) if noise else 0.0
    plab = np.zeros((n, ppp), dtype=np.int32)
    plab[:, :n_obj] = (labels + 1)[:, None]

    # Points of a real scan come in no particular order.
    order = np.argsort(rng.random((n, ppp)), axis=1)
    pts = np.take_along_axis(pts, order[..., None], axis=1)
    plab = np.take_along_axis(plab, order, axis=1)
    return pts, labels, plab


def _rotations(rng, n):
    yaw = rng.uniform(0, 2 * np.pi, n)
    tilt = rng.uniform(-0.25, 0.25, n)
    cy, sy, ct, st = np.cos(yaw), np.sin(yaw), np.cos(tilt), np.sin(tilt)
    rz = np.zeros((n, 3, 3))
    rz[:, 0, 0], rz[:, 0, 1], rz[:, 1, 0], rz[:, 1, 1], rz[:, 2, 2] = cy, -sy, sy, cy, 1
    rx = np.zeros((n, 3, 3))
    rx[:, 0, 0], rx[:, 1, 1], rx[:, 1, 2], rx[:, 2, 1], rx[:, 2, 2] = 1, ct, -st, st, ct
    return rz @ rx


# Each shape samples m surface points (roughly within the unit ball) and their normals.

def _sphere(rng, m):
    n = rng.normal(size=(m, 3))
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    return n, n.copy()


def _cube(rng, m):
    s = 1 / np.sqrt(3)  # half side: corners on the unit sphere
    p = rng.uniform(-s, s, size=(m, 3))
    axis = rng.integers(0, 3, m)
    sign = rng.choice([-1.0, 1.0], m)
    rows = np.arange(m)
    p[rows, axis] = sign * s
    n = np.zeros((m, 3))
    n[rows, axis] = sign
    return p, n


def _cylinder(rng, m):
    r, h = 0.6, 0.8  # radius, half height
    t = rng.uniform(0, 2 * np.pi, m)
    side = rng.random(m) < (2 * h) / (2 * h + r)  # by area
    p = np.empty((m, 3))
    n = np.zeros((m, 3))
    p[:, 0], p[:, 1], p[:, 2] = r * np.cos(t), r * np.sin(t), rng.uniform(-h, h, m)
    n[:, 0], n[:, 1] = np.cos(t), np.sin(t)
    cap = ~side
    rad = r * np.sqrt(rng.random(cap.sum()))
    top = np.where(rng.random(cap.sum()) < 0.5, h, -h)
    p[cap, 0], p[cap, 1], p[cap, 2] = rad * np.cos(t[cap]), rad * np.sin(t[cap]), top
    n[cap] = 0.0
    n[cap, 2] = np.sign(top)
    return p, n


def _torus(rng, m):
    big, small = 0.7, 0.28
    u = rng.uniform(0, 2 * np.pi, m)
    v = rng.uniform(0, 2 * np.pi, m)
    ring = big + small * np.cos(v)
    p = np.stack([ring * np.cos(u), ring * np.sin(u), small * np.sin(v)], axis=1)
    n = np.stack([np.cos(v) * np.cos(u), np.cos(v) * np.sin(u), np.sin(v)], axis=1)
    return p, n


def _plane(rng, m):
    # An upright board: a thin vertical sheet (a wall, a sign).
    p = np.stack([rng.uniform(-0.8, 0.8, m), np.zeros(m), rng.uniform(-0.6, 0.6, m)], axis=1)
    n = np.zeros((m, 3))
    n[:, 1] = rng.choice([-1.0, 1.0], m)  # both faces are seen
    return p, n


def _cone(rng, m):
    r, h = 0.7, 1.2
    t = rng.uniform(0, 2 * np.pi, m)
    slant = np.hypot(r, h)
    side = rng.random(m) < slant / (slant + r)  # by area
    # Uniform on the lateral surface: distance from apex ~ sqrt(U).
    d = np.sqrt(rng.random(m))
    rad = np.where(side, r * d, r * np.sqrt(rng.random(m)))
    z = np.where(side, h / 2 - h * d, -h / 2)
    p = np.stack([rad * np.cos(t), rad * np.sin(t), z], axis=1)
    n = np.stack([h * np.cos(t), h * np.sin(t), np.full(m, r)], axis=1) / slant
    n[~side] = (0.0, 0.0, -1.0)
    return p, n


_SHAPES = (_sphere, _cube, _cylinder, _torus, _plane, _cone)
