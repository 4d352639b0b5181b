"""Transforms for sequences that take ``transform=`` (e.g. ``H5SliceSequence``): ``ScenePointSampler``."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from kerasfeed import _validation as _v


class ScenePointSampler:
    """A ``transform`` that samples ``num_points`` points per block of each scene.

    PointNet's recipe for large scenes: cut each scene into square blocks
    on the ground (x, y) plane and train on a fixed number of points per
    block. Use it as ``H5SliceSequence(..., keys=("points", "point_labels"),
    transform=ScenePointSampler(...))``: each batch of scenes becomes
    ``(x, y)`` with ``x`` of shape ``(blocks, num_points, channels)`` and
    ``y`` the per-point labels ``(blocks, num_points)``. The sampling uses
    the sequence's generator, so it is a pure function of ``(seed, epoch,
    index)``: reproducible, and different every epoch.

    Blocks lie on a grid of ``block_size`` metres starting at each scene's
    minimum x and y, with origins every ``stride`` metres (``stride <
    block_size`` overlaps them). Blocks with fewer than ``min_block_points``
    points are skipped. A block with at least ``num_points`` points is
    sampled without replacement, a smaller one with replacement.

    Args:
        num_points: points sampled per block.
        block_size: block side in the units of x, y.
        stride: distance between block origins; defaults to ``block_size``.
        blocks_per_scene: if set, sample exactly this many blocks per scene
            (without replacement when there are enough), so every batch has
            ``scenes * blocks_per_scene`` blocks, a fixed shape that
            ``tf.data`` and XLA prefer; None keeps every block (the number
            varies by scene).
        min_block_points: minimum points for a block to count.
        center: subtract each block's centre from x and y (channels 0 and 1)
            so the model sees positions relative to the block.

    Example:

    ```python
    seq = kerasfeed.H5SliceSequence(
        "scenes.h5", ("points", "point_labels"), batch_size=2, seed=0,
        transform=kerasfeed.ScenePointSampler(num_points=256, block_size=1.0,
                                              blocks_per_scene=8))
    x, y = seq[0]  # (16, 256, 6) float32, (16, 256) int32
    ```
    """

    def __init__(self, num_points: int, *, block_size: float = 1.0, stride: Optional[float] = None,
                 blocks_per_scene: Optional[int] = None, min_block_points: int = 1, center: bool = True):
        cls = type(self).__name__
        self.num_points = _v.positive_int("num_points", num_points, owner=cls)
        self.block_size = _v.positive_float("block_size", block_size, owner=cls)
        self.stride = self.block_size if stride is None else _v.positive_float("stride", stride, owner=cls)
        self.blocks_per_scene = _v.positive_int("blocks_per_scene", blocks_per_scene, allow_none=True, owner=cls)
        self.min_block_points = _v.positive_int("min_block_points", min_block_points, owner=cls)
        self.center = _v.flag("center", center, owner=cls)

    def blocks(self, xy: np.ndarray) -> list:
        """The blocks of one scene.

        Args:
            xy: ``(P, 2)`` x and y of the scene's points.

        Returns:
            A list of ``(point_indices, (centre_x, centre_y))``, one per block
            with at least ``min_block_points`` points.
        """
        xy = np.asarray(xy, np.float64)  # bounds in float32 left gaps between blocks far from 0
        lo, hi = xy.min(axis=0), xy.max(axis=0)
        # Each point's range of blocks per axis, then its (x block, y block) pairs grouped: O(P log P)
        # whatever the grid (a mask per grid cell took minutes for mm coordinates in 1 m blocks).
        axes = [self._axis_blocks(xy[:, axis], lo[axis], float(hi[axis] - lo[axis])) for axis in (0, 1)]
        (x0, x1, count_x), (y0, y1, count_y) = axes
        nx, ny = np.maximum(x1 - x0 + 1, 0), np.maximum(y1 - y0 + 1, 0)
        per = nx * ny  # blocks of each point (more than 1 where blocks overlap, 0 in gaps between them)
        point = np.repeat(np.arange(len(xy)), per)
        if not len(point):  # every point in a gap between blocks (stride > block_size)
            return []
        j = np.arange(len(point)) - np.repeat(np.cumsum(per) - per, per)  # a point's pair number
        kx, ky = x0[point] + j // ny[point], y0[point] + j % ny[point]
        # By x block then y block, as the grid was walked, and points ascending in a block.
        n = len(xy)
        if count_x * count_y * n < 2**63:  # one int64 key per pair: a plain sort, ~4x faster than lexsort
            key = (kx * count_y + ky) * n + point
            key.sort()
            cell, point = np.divmod(key, n)
            starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
            kx, ky = np.divmod(cell[starts], count_y)
        else:
            order = np.lexsort((point, ky, kx))
            point, kx, ky = point[order], kx[order], ky[order]
            starts = np.flatnonzero(np.r_[True, (kx[1:] != kx[:-1]) | (ky[1:] != ky[:-1])])
            kx, ky = kx[starts], ky[starts]
        ends = np.r_[starts[1:], len(point)]
        keep = ends - starts >= self.min_block_points
        starts, ends = starts[keep], ends[keep]
        half = self.block_size / 2
        cxs = lo[0] + kx[keep].astype(np.float64) * self.stride + half  # block origin + half, as before
        cys = lo[1] + ky[keep].astype(np.float64) * self.stride + half
        return [(point[a:b], (cx, cy)) for a, b, cx, cy in zip(starts.tolist(), ends.tolist(), cxs, cys)]

    def _axis_blocks(self, v: np.ndarray, lo: float, extent: float) -> tuple:
        """The first and last block along one axis of each of the values ``v`` (first > last: none), and
        the number of blocks along it.

        Block ``k`` spans ``[lo + k * stride, end(k))``, the last one also its end; the bounds are
        computed as by a walk over the blocks, so that points on a bound fall in the same block(s)."""
        size, stride = self.block_size, self.stride
        count = 1 if extent <= size else math.ceil((extent - size) / stride) + 1

        def start(k):
            return lo + k.astype(np.float64) * stride

        def end(k):
            nxt = lo + (k + 1).astype(np.float64) * stride
            if stride == size:  # tiling blocks share the next one's very bound (start + block_size
                return nxt  # could round past it and take a point twice)
            if stride < size:  # blocks that touch share their bound: no point between
                return np.maximum(start(k) + size, nxt)
            return start(k) + size

        # Both bounds are non-decreasing in k: the blocks of a value are a range, found by search.
        last = _first_above(start, v, (v - lo) / stride + 1, count) - 1
        first = _first_above(end, v, (v - lo - size) / stride + 1, count)
        first[v == end(np.array([count - 1]))[0]] = count - 1  # the last block is closed
        return first, last, count

    def __call__(self, batch: Any, rng: np.random.Generator):
        """Samples ``batch`` (``(points, point_labels)``) with ``rng``, the
        ``np.random.Generator`` the sequence passes for this batch."""
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                "ScenePointSampler: `rng` must be a numpy Generator (np.random.default_rng(seed)); the sequence "
                f"passes its own. Received: rng={rng!r} of type {type(rng).__name__}"
            )
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                "ScenePointSampler expects batches (points, point_labels), e.g. from "
                f"keys=('points', 'point_labels'). Received: a batch of type {type(batch).__name__}"
            )
        points, labels = (np.asarray(a) for a in batch)
        if points.ndim != 3 or points.shape[-1] < 2 or labels.shape != points.shape[:2]:
            raise ValueError(
                "ScenePointSampler expects points (scenes, points, channels>=2) and point_labels "
                f"(scenes, points). Received: points.shape={points.shape}, point_labels.shape={labels.shape}"
            )
        _check_scenes(points)
        if not points.shape[0]:  # no scenes: no blocks
            none = (0, self.num_points)
            return np.zeros((*none, points.shape[2]), np.float32), np.zeros(none, labels.dtype)
        xs, ys = [], []
        for s in range(points.shape[0]):
            blocks = self.blocks(points[s, :, :2])
            if not blocks:
                raise ValueError(
                    f"ScenePointSampler: scene {s} of the batch has no block with at least "
                    f"min_block_points={self.min_block_points} points. Received: {points.shape[1]} points"
                )
            if self.blocks_per_scene is not None:
                pick = rng.choice(len(blocks), self.blocks_per_scene, replace=len(blocks) < self.blocks_per_scene)
                blocks = [blocks[k] for k in pick]
            for idx, (cx, cy) in blocks:
                take = idx[rng.choice(idx.size, self.num_points, replace=idx.size < self.num_points)]
                x = points[s, take]
                # float64 (or int) coordinates are centred before the cast: far from 0 (UTM, 5e6 m) float32
                # steps are 0.5 m, and a 1 m block came out as 3 distinct y values.
                x = x.astype(np.float32 if x.dtype.itemsize <= 4 and x.dtype.kind == "f" else np.float64, copy=True)
                if self.center:
                    x[:, 0] -= cx
                    x[:, 1] -= cy
                xs.append(x.astype(np.float32, copy=False))
                ys.append(labels[s, take])
        return np.stack(xs), np.stack(ys)

    def __repr__(self) -> str:
        return (f"ScenePointSampler(num_points={self.num_points}, block_size={self.block_size}, "
                f"stride={self.stride}, blocks_per_scene={self.blocks_per_scene})")


def _first_above(bound: Any, v: np.ndarray, guess: np.ndarray, count: int) -> np.ndarray:
    """Per value of ``v``, the least k in ``[0, count]`` with ``bound(k) > v`` (``bound`` of int64 k,
    non-decreasing), from the estimates ``guess`` by steps of one (floor division gets within a step or
    two; ``bound`` itself decides, rounding included)."""
    k = np.clip(np.floor(guess), 0, count).astype(np.int64)
    while True:
        down = (k > 0) & (bound(k - 1) > v)
        up = (k < count) & (bound(k) <= v)  # never with down: bound(k - 1) <= bound(k)
        if not (down.any() or up.any()):
            return k
        k += up.astype(np.int64) - down


def _check_scenes(points: np.ndarray) -> None:
    """Scenes whose blocks can be cut: at least one point, finite x and y."""
    if points.shape[0] and not points.shape[1]:
        raise ValueError(f"ScenePointSampler: the scenes have no points. Received: points.shape={points.shape}")
    bad = np.count_nonzero(~np.isfinite(points[..., :2]), axis=(1, 2))
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"ScenePointSampler: scene {s} of the batch has {int(bad[s])} x/y values that are NaN or infinite; "
            f"blocks need finite positions. Received: points.shape={points.shape}"
        )


__all__ = ["ScenePointSampler"]
