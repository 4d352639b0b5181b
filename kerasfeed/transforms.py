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
        masks = []
        for axis in (0, 1):
            extent = float(hi[axis] - lo[axis])
            count = 1 if extent <= self.block_size else math.ceil((extent - self.block_size) / self.stride) + 1
            v = xy[:, axis]
            axis_masks = []
            for k in range(count):
                a = lo[axis] + k * self.stride
                end = a + self.block_size
                if self.stride == self.block_size:  # tiling blocks share the next one's very bound: a + block_size
                    end = lo[axis] + (k + 1) * self.stride  # could round past it and take a point twice
                elif self.stride < self.block_size:  # blocks that touch share their bound: no point between
                    end = max(end, lo[axis] + (k + 1) * self.stride)
                # Half-open blocks; the last one also takes the scene's edge.
                upper = v <= end if k == count - 1 else v < end
                axis_masks.append(((v >= a) & upper, a + self.block_size / 2))
            masks.append(axis_masks)
        out = []
        for mx, cx in masks[0]:
            for my, cy in masks[1]:
                idx = np.flatnonzero(mx & my)
                if idx.size >= self.min_block_points:
                    out.append((idx, (cx, cy)))
        return out

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
                x = points[s, take].astype(np.float32, copy=True)
                if self.center:
                    x[:, 0] -= cx
                    x[:, 1] -= cy
                xs.append(x)
                ys.append(labels[s, take])
        return np.stack(xs), np.stack(ys)

    def __repr__(self) -> str:
        return (f"ScenePointSampler(num_points={self.num_points}, block_size={self.block_size}, "
                f"stride={self.stride}, blocks_per_scene={self.blocks_per_scene})")


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
