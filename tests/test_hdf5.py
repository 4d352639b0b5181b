"""HDF5 sources: H5SliceSequence, H5WindowSequence, ScenePointSampler."""

import gc
import itertools
import math
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.hdf5.handles import REGISTRY

PPS = 32  # points per scene: small files, fast tests


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two scene files (20 + 13 rows, chunks of 4) and their contents read with numpy."""
    d = tmp_path_factory.mktemp("h5")
    a = make_synthetic_scenes(d / "a.h5", num_scenes=20, points_per_scene=PPS, chunk_scenes=4, seed=1)
    b = make_synthetic_scenes(d / "b.h5", num_scenes=13, points_per_scene=PPS, chunk_scenes=4, seed=2)
    data = {}
    for key in ("points", "labels", "point_labels"):
        with h5py.File(a) as fa, h5py.File(b) as fb:
            data[key] = np.concatenate([fa[key][()], fb[key][()]])
    return a, b, data


def _all_rows(seq):
    return np.concatenate([seq.batch_rows(i) for i in range(len(seq))])


# ---- slices ------------------------------------------------------------------


def test_slices_match_numpy_and_straddle_files(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8)
    assert len(seq) == 5 and seq.num_rows == 33 and seq.file_lengths == (20, 13)
    for i in range(len(seq)):
        x, y = seq[i]
        rows = slice(8 * i, min(8 * i + 8, 33))
        np.testing.assert_array_equal(x, data["points"][rows])
        np.testing.assert_array_equal(y, data["labels"][rows])
        assert x.dtype == np.float32 and y.dtype == np.int64
    x, _ = seq[2]  # rows 16..23: 4 from a.h5, 4 from b.h5
    with h5py.File(a) as fa, h5py.File(b) as fb:
        np.testing.assert_array_equal(x[:4], fa["points"][16:20])
        np.testing.assert_array_equal(x[4:], fb["points"][0:4])
    assert seq[4][0].shape == (1, PPS, 6)  # the short last batch
    np.testing.assert_array_equal(seq[-1][0], seq[4][0])
    with pytest.raises(IndexError, match=r"batch index 5 is out of range for 5 batches"):
        seq[5]
    with pytest.raises(TypeError, match=r"indices must be integers. Received: index=1.5"):
        seq[1.5]


def test_drop_remainder_and_open_kwargs(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=8, drop_remainder=True,
                                    open_kwargs={"rdcc_nbytes": 4 << 20})
    assert len(seq) == 4
    assert all(seq[i].shape == (8,) for i in range(4))
    np.testing.assert_array_equal(np.concatenate([seq[i] for i in range(4)]), data["labels"][:32])


def test_dict_nested_and_single_keys(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], {"pts": "points", "seg": "point_labels"}, batch_size=5)
    item = seq[4]
    assert isinstance(item, dict) and list(item) == ["pts", "seg"]
    np.testing.assert_array_equal(item["pts"], data["points"][20:25])
    np.testing.assert_array_equal(item["seg"], data["point_labels"][20:25])

    nested = kerasfeed.H5SliceSequence(a, ({"points": "points"}, ["labels"]), batch_size=3)
    x, (y,) = nested[1]
    np.testing.assert_array_equal(x["points"], data["points"][3:6])
    np.testing.assert_array_equal(y, data["labels"][3:6])

    single = kerasfeed.H5SliceSequence(a, "labels", batch_size=6)
    assert isinstance(single[0], np.ndarray)
    np.testing.assert_array_equal(single[3], data["labels"][18:20])


def test_batch_shuffle_deterministic_per_epoch(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=4, shuffle=True, seed=7)
    epoch0 = [seq.batch_rows(i)[0] // 4 for i in range(len(seq))]
    assert sorted(epoch0) == list(range(9))  # a permutation of the batches
    assert epoch0 != list(range(9))
    items0 = [seq[i] for i in range(len(seq))]
    for i, item in enumerate(items0):  # contiguous rows of a shuffled batch order
        np.testing.assert_array_equal(item, data["labels"][seq.batch_rows(i)])
    again = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=4, shuffle=True, seed=7)
    assert [again.batch_rows(i)[0] // 4 for i in range(9)] == epoch0
    seq.set_epoch(1)
    epoch1 = [seq.batch_rows(i)[0] // 4 for i in range(9)]
    assert sorted(epoch1) == list(range(9)) and epoch1 != epoch0
    seq.on_epoch_begin()
    seq.on_epoch_end()  # a pass ends: the epoch advances, as under Keras
    assert seq.epoch == 2
    other_seed = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=4, shuffle=True, seed=8)
    assert [other_seed.batch_rows(i)[0] // 4 for i in range(9)] != epoch0
    plain = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=4)
    plain.set_epoch(3)
    np.testing.assert_array_equal(_all_rows(plain), np.arange(33))


def test_sample_shuffle_within_windows_of_chunks(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=4, shuffle=True,
                                    seed=3, shuffle_window_chunks=2)
    assert seq.window_rows == 8  # 2 chunks of 4 rows
    assert len(seq) == 9
    for epoch in (0, 1):
        seq.set_epoch(epoch)
        rows = _all_rows(seq)
        np.testing.assert_array_equal(np.sort(rows), np.arange(33))  # each row once per epoch
        for i in range(len(seq)):
            r = seq.batch_rows(i)
            assert len(set(r // 8)) == 1  # a batch draws from one window
            x, y = seq[i]
            np.testing.assert_array_equal(x, data["points"][r])
            np.testing.assert_array_equal(y, data["labels"][r])
        assert seq.batch_rows(8).tolist() == [32]  # the partial window stays last
        if epoch == 0:
            rows0 = rows
    assert not np.array_equal(rows0, rows)  # a new sample order every epoch
    assert not np.array_equal(np.sort(rows0[:4]), rows0[:4])  # samples, not only batches, mix
    seq.set_epoch(0)
    again = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=4, shuffle=True,
                                      seed=3, shuffle_window_chunks=2)
    np.testing.assert_array_equal(_all_rows(again), rows0)
    # Without shuffle the windows come in file order, samples still shuffled inside.
    ordered = kerasfeed.H5SliceSequence([a, b], "labels", batch_size=4, seed=3, shuffle_window_chunks=2)
    windows = [int(ordered.batch_rows(i)[0] // 8) for i in range(len(ordered))]
    assert windows == sorted(windows)


def _noisy(batch, rng):
    x, y = batch
    return x + rng.normal(size=x.shape).astype(x.dtype), y


def test_transform_rng_seeded_per_epoch_and_index(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8, seed=11, transform=_noisy)
    x0, y0 = seq[0]
    np.testing.assert_array_equal(y0, data["labels"][:8])
    assert not np.allclose(x0, data["points"][:8])
    np.testing.assert_array_equal(seq[0][0], x0)  # same (seed, epoch, index): same draw
    assert not np.allclose(seq[1][0] - data["points"][8:16], x0 - data["points"][:8])
    copy = pickle.loads(pickle.dumps(seq))
    np.testing.assert_array_equal(copy[0][0], x0)  # same in another process's copy
    seq.set_epoch(1)
    assert not np.allclose(seq[0][0], x0)  # a new draw every epoch
    seq.set_epoch(0)
    np.testing.assert_array_equal(seq[0][0], x0)
    with pytest.raises(TypeError, match=r"`transform` must be a callable .* Received: transform=3"):
        kerasfeed.H5SliceSequence(a, "labels", 4, transform=3)


# ---- windows -------------------------------------------------------------------


def test_shuffle_windows_take_their_chunks_from_a_file_with_rows(files, tmp_path):
    # An empty resizable placeholder first (h5py chunks it 64 rows a guess) made the windows 16 chunks.
    a, b, _ = files
    empty = tmp_path / "empty.h5"
    with h5py.File(a) as full, h5py.File(empty, "w") as f:
        for key in ("points", "labels"):
            rows = full[key].shape[1:]
            f.create_dataset(key, shape=(0, *rows), maxshape=(None, *rows), dtype=full[key].dtype)
    seq = kerasfeed.H5SliceSequence([empty, a, b], ("points", "labels"), batch_size=4, shuffle=True, seed=3,
                                    shuffle_window_chunks=2)
    assert seq.window_rows == 8  # 2 of a.h5's chunks of 4 rows


def test_time_windows(tmp_path):
    t1 = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
    t2 = 1000 + np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    paths = []
    for name, sig in (("r1.h5", t1), ("r2.h5", t2)):
        with h5py.File(tmp_path / name, "w") as f:
            f.create_dataset("signal", data=sig, chunks=(5, 2), compression="gzip")
            f.create_dataset("step", data=np.arange(len(sig)))
        paths.append(tmp_path / name)
    seq = kerasfeed.H5WindowSequence(paths, ("signal", "step"), batch_size=4, window=6, stride=4)
    # r1: starts 0,4,..,24 (7 windows); r2: starts 0,4 (2 windows); none crosses files
    assert seq.num_windows == 9 and len(seq) == 3
    expected = [t1[s : s + 6] for s in range(0, 25, 4)] + [t2[s : s + 6] for s in (0, 4)]
    got = np.concatenate([seq[i][0] for i in range(3)])
    np.testing.assert_array_equal(got, np.stack(expected))
    x, steps = seq[1]  # windows 4..7 straddle r1 -> r2
    assert x.shape == (4, 6, 2) and steps.shape == (4, 6)
    assert seq.window_starts(1) == [(0, 16), (0, 20), (0, 24), (1, 0)]
    np.testing.assert_array_equal(steps[-1], np.arange(6))

    last = kerasfeed.H5WindowSequence(paths, ("signal", "step"), batch_size=4, window=6, stride=4,
                                      transform=lambda b, rng: (b[0], b[1][:, -1]))
    x, y = last[0]
    np.testing.assert_array_equal(y, [5, 9, 13, 17])  # a target per window

    shuffled = kerasfeed.H5WindowSequence(paths, "signal", batch_size=2, window=6, stride=4,
                                          shuffle=True, seed=0)
    starts = [tuple(shuffled.window_starts(i)) for i in range(len(shuffled))]
    assert sorted(sum(starts, ())) == sorted(sum((tuple(seq.window_starts(i)) for i in range(3)), ()))
    shuffled.set_epoch(1)
    assert [tuple(shuffled.window_starts(i)) for i in range(len(shuffled))] != starts
    for i in range(len(shuffled)):
        for w, (f, s) in zip(shuffled[i], shuffled.window_starts(i)):
            np.testing.assert_array_equal(w, (t1, t2)[f][s : s + 6])

    with pytest.raises(ValueError, match=r"no batches: the files have \(30, 12\) rows, giving 0 windows of window=40"):
        kerasfeed.H5WindowSequence(paths, "signal", batch_size=2, window=40)
    with pytest.raises(ValueError, match=r"`stride` must be a positive int. Received: stride=0"):
        kerasfeed.H5WindowSequence(paths, "signal", batch_size=2, window=4, stride=0)


def test_windows_far_apart_read_their_rows_not_the_rows_between(tmp_path, monkeypatch):
    """A batch of consecutive windows was one slice from its first window to its last: stride 1e5 and
    window 4 read 22,000 times the rows it kept."""
    data = np.arange(200_000, dtype="f4")
    with h5py.File(tmp_path / "long.h5", "w") as f:
        f.create_dataset("x", data=data, chunks=(10_000,))
    read = []
    real = kerasfeed.H5WindowSequence._read_rows
    monkeypatch.setattr(kerasfeed.H5WindowSequence, "_read_rows",
                        lambda self, f, key, a, b: read.append(b - a) or real(self, f, key, a, b))
    for stride, most in ((20_000, 8 * 4), (3, 7 * 3 + 4)):  # apart: a run each; overlapping or close: one slice
        seq = kerasfeed.H5WindowSequence(tmp_path / "long.h5", "x", 8, window=4, stride=stride)
        read.clear()
        batch = seq[0]
        assert np.array_equal(batch, np.stack([data[s:s + 4] for _, s in seq.window_starts(0)]))
        assert sum(read) == most, (stride, read)


def test_windows_of_a_compound_with_a_string_field(tmp_path):
    """h5py tags the string field's dtype with metadata, which numpy's strided windows cannot rebuild."""
    dt = np.dtype([("a", "<i4"), ("c", "S3")])
    rows = np.array([(i, b"x%d" % i) for i in range(9)], dtype=dt)
    with h5py.File(tmp_path / "rec.h5", "w") as f:
        f["rec"] = rows
    seq = kerasfeed.H5WindowSequence(tmp_path / "rec.h5", "rec", batch_size=2, window=3, stride=2)
    got = np.concatenate([seq[i] for i in range(len(seq))])
    np.testing.assert_array_equal(got, np.stack([rows[s : s + 3] for s in (0, 2, 4, 6)]))


# ---- scene sampling ------------------------------------------------------------


def test_scene_point_sampler(files):
    a, b, data = files
    sampler = kerasfeed.ScenePointSampler(num_points=16, block_size=1.0, center=False)
    seq = kerasfeed.H5SliceSequence(a, ("points", "point_labels"), batch_size=2, seed=5, transform=sampler)
    x, y = seq[3]
    assert x.ndim == 3 and x.shape[1:] == (16, 6) and y.shape == x.shape[:2]
    assert x.shape[0] >= 2  # at least one block per scene
    scenes = data["points"][6:8].reshape(-1, 6)
    labels = data["point_labels"][6:8].reshape(-1)
    for block, block_labels in zip(x, y):
        for p, lab in zip(block, block_labels):  # every sample is a real point with its label
            match = np.flatnonzero((scenes == p).all(axis=1))
            assert match.size and lab in labels[match]
        assert np.ptp(block[:, 0]) <= 1.0 + 1e-6 and np.ptp(block[:, 1]) <= 1.0 + 1e-6
    # The blocks of a scene partition its points when stride == block_size.
    idx = np.concatenate([i for i, _ in sampler.blocks(data["points"][6, :, :2])])
    np.testing.assert_array_equal(np.sort(idx), np.arange(PPS))
    # Seeded per (epoch, index).
    np.testing.assert_array_equal(seq[3][0], x)
    seq.set_epoch(1)
    assert not np.array_equal(seq[3][0], x)

    fixed = kerasfeed.H5SliceSequence(
        a, ("points", "point_labels"), batch_size=2, seed=5,
        transform=kerasfeed.ScenePointSampler(num_points=64, block_size=2.0, blocks_per_scene=3))
    shapes = {tuple(fixed[i][0].shape) for i in range(len(fixed))}
    assert shapes == {(6, 64, 6)}  # fixed shapes whatever the scene
    xc, _ = fixed[0]
    assert np.abs(xc[..., :2]).max() <= 1.0 + 1e-5  # centred in 2 m blocks

    with pytest.raises(ValueError, match=r"expects batches \(points, point_labels\)"):
        kerasfeed.H5SliceSequence(a, "points", batch_size=2, transform=sampler)[0]
    with pytest.raises(ValueError, match=r"`block_size` must be a positive number. Received: block_size=0"):
        kerasfeed.ScenePointSampler(8, block_size=0)
    with pytest.raises(ValueError, match=r"`num_points` must be a positive int. Received: num_points=-1"):
        kerasfeed.ScenePointSampler(-1)


def test_scene_point_sampler_far_from_the_origin_empty_and_non_finite_scenes():
    # float32 scenes ~1000 m from the origin: block bounds computed in float32 left points between two blocks
    # (51 of 100,000 here were never sampled).
    rng = np.random.default_rng(0)
    xy = (1000 + rng.random((100_000, 2))).astype(np.float32)
    for stride in (None, 0.03):
        sampler = kerasfeed.ScenePointSampler(4, block_size=0.1, stride=stride)
        covered = np.zeros(len(xy), bool)
        for idx, _ in sampler.blocks(xy):
            covered[idx] = True
        assert covered.all(), f"stride={stride}: {np.count_nonzero(~covered)} points in no block"
    tiles = np.concatenate([i for i, _ in kerasfeed.ScenePointSampler(4, block_size=0.1).blocks(xy)])
    assert len(tiles) == len(xy)  # stride == block_size: each point in exactly one block
    # ... also one on a bound: 1.2 + 0.1 rounds past 13 * 0.1, and x=1.3 fell in blocks 12 and 13
    on_bounds = np.array([[0.0, 0.0], [1.3, 0.0], [1.5, 0.0], [1.8, 0.0], [2.5, 0.0], [3.0, 0.0]])
    tiles = np.concatenate([i for i, _ in kerasfeed.ScenePointSampler(1, block_size=0.1).blocks(on_bounds)])
    assert sorted(tiles.tolist()) == list(range(len(on_bounds)))
    sampler, r = kerasfeed.ScenePointSampler(8), np.random.default_rng(0)
    x, y = sampler((np.zeros((0, 5, 3), np.float32), np.zeros((0, 5), np.int32)), r)
    assert x.shape == (0, 8, 3) and y.shape == (0, 8) and y.dtype == np.int32
    with pytest.raises(ValueError, match=r"the scenes have no points. Received: points.shape=\(2, 0, 3\)"):
        sampler((np.zeros((2, 0, 3)), np.zeros((2, 0))), r)
    points = np.zeros((3, 4, 3))
    points[1, 2, 1] = np.nan
    points[1, 3, 0] = np.inf
    with pytest.raises(ValueError, match=r"scene 1 of the batch has 2 x/y values that are NaN or infinite"):
        sampler((points, np.zeros((3, 4))), r)


def _reference_blocks(xy, size, stride, min_points):
    """ScenePointSampler.blocks the plain way: a mask per block along each axis, every grid cell."""
    xy = np.asarray(xy, np.float64)
    lo, hi = xy.min(axis=0), xy.max(axis=0)
    per_axis = []
    for axis in (0, 1):
        extent, v = float(hi[axis] - lo[axis]), xy[:, axis]
        count = 1 if extent <= size else math.ceil((extent - size) / stride) + 1
        blocks = []
        for k in range(count):
            start = lo[axis] + k * stride
            end = lo[axis] + (k + 1) * stride if stride == size else start + size
            if stride < size:
                end = max(end, lo[axis] + (k + 1) * stride)
            inside = (v >= start) & ((v <= end) if k == count - 1 else (v < end))
            blocks.append((inside, start + size / 2))
        per_axis.append(blocks)
    out = []
    for mx, cx in per_axis[0]:
        for my, cy in per_axis[1]:
            idx = np.flatnonzero(mx & my)
            if idx.size >= min_points:
                out.append((idx, (cx, cy)))
    return out


def test_scene_blocks_match_a_walk_over_every_grid_cell():
    rng = np.random.default_rng(0)
    scenes = [
        rng.random((300, 2)) * 3,
        (1000 + rng.random((300, 2))).astype(np.float32),  # far from the origin, float32
        np.round(rng.random((200, 2)) * 30) / 10,  # on a 0.1 grid: many points on bounds
        rng.integers(0, 6, (100, 2)).astype(np.float64),  # on the bounds of 1.0 blocks, the last one too
        np.c_[rng.random(50) * 4, np.full(50, 2.0)],  # no extent in y
        np.array([[0.0, 0.0], [1.3, 0.0], [1.5, 0.0], [1.8, 0.0], [2.5, 0.0], [3.0, 0.0]]),
        np.array([[5.0, 5.0]]),
    ]
    # Tiling, overlapping, and with gaps between blocks (stride > block_size).
    grids = [(0.1, 0.1), (0.1, 0.03), (0.1, 0.25), (0.3, 0.2), (1.0, 1.0), (1.0, 0.5), (1.0, 1.5), (0.7, 0.7)]
    for xy, (size, stride), min_points in itertools.product(scenes, grids, (1, 3)):
        got = kerasfeed.ScenePointSampler(4, block_size=size, stride=stride, min_block_points=min_points).blocks(xy)
        want = _reference_blocks(xy, size, stride, min_points)
        assert len(got) == len(want), (size, stride, min_points)
        for (idx, centre), (ref_idx, ref_centre) in zip(got, want):
            assert idx.dtype == ref_idx.dtype and np.array_equal(idx, ref_idx) and centre == ref_centre


@pytest.mark.timeout(60)
def test_scene_blocks_of_a_grid_of_millions_of_cells():
    # Before: a mask over all points per grid cell (64 million here) took minutes per scene, e.g. for
    # coordinates in mm with the default block_size=1.0.
    rng = np.random.default_rng(0)
    xy = rng.integers(0, 8000, (4096, 2)) + 0.5
    xy[0], xy[1] = 0.5, 7999.5  # 7999 blocks a side; the last one closed, so 7999.5 is in block 7998
    blocks = kerasfeed.ScenePointSampler(16).blocks(xy)
    cells = np.minimum(xy - 0.5, 7998).astype(np.int64)
    expected = np.unique(cells, axis=0)  # by x block, then y block
    assert len(blocks) == len(expected)
    np.testing.assert_array_equal([centre for _, centre in blocks], expected + 1.0)  # lo + k + 0.5
    for idx, cell in zip((idx for idx, _ in blocks), expected):
        assert (cells[idx] == cell).all()
    np.testing.assert_array_equal(np.sort(np.concatenate([idx for idx, _ in blocks])), np.arange(len(xy)))
    points = np.concatenate([xy, rng.random((len(xy), 4))], axis=1)[None].astype(np.float32)
    x, y = kerasfeed.ScenePointSampler(16, blocks_per_scene=8)((points, np.zeros((1, len(xy)))), rng)
    assert x.shape == (8, 16, 6) and y.shape == (8, 16)


# ---- handles, pickling, processes ----------------------------------------------


def test_import_is_light_and_h5py_lazy():
    code = (
        "import sys, kerasfeed; kerasfeed.H5SliceSequence; kerasfeed.ScenePointSampler; "
        "import kerasfeed.datasets; "
        "print(sorted(m for m in ('h5py', 'keras', 'tensorflow') if m in sys.modules))"
    )
    env = dict(os.environ, KERASFEED_LIGHT_WORKER="1")  # as in a kerasfeed worker process
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_pickles_before_and_after_reads(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8, shuffle=True, seed=2)
    fresh = pickle.loads(pickle.dumps(seq))  # before any read
    np.testing.assert_array_equal(fresh[1][0], seq[1][0])
    seq.set_epoch(4)
    blob = cloudpickle.dumps(seq)  # after reads: handles are open here
    assert b"h5py" not in blob
    copy = pickle.loads(blob)
    assert copy.epoch == 4
    for i in range(len(seq)):
        np.testing.assert_array_equal(copy[i][0], seq[i][0])
    seq.close()
    copy.close()


def _read_in_child(seq, queue):
    queue.put((os.getpid(), seq[1][0]))


def test_forked_child_opens_its_own_handles(files):
    a, b, data = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8)
    seq[0]  # the parent opens the files before forking
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_read_in_child, args=(seq, queue))
    proc.start()
    pid, x = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0 and pid != os.getpid()
    np.testing.assert_array_equal(x, data["points"][8:16])
    np.testing.assert_array_equal(seq[2][0], data["points"][16:24])  # parent's handles still fine
    seq.close()


def test_close_context_manager_and_gc_release_files(files):
    a, b, _ = files
    base = REGISTRY.open_count()
    with kerasfeed.H5SliceSequence([a, b], "labels", batch_size=8) as seq:
        assert REGISTRY.open_count() == base  # construction closed its files again
        seq[2]  # straddles: opens both files
        assert REGISTRY.open_count() == base + 2
    assert REGISTRY.open_count() == base
    seq[0]  # a later read reopens
    assert REGISTRY.open_count() == base + 1
    seq.close()
    seq.close()  # idempotent
    assert REGISTRY.open_count() == base

    # Two sequences over one file share its handle; it closes with the last.
    s1 = kerasfeed.H5SliceSequence(a, "labels", batch_size=4)
    s2 = kerasfeed.H5SliceSequence(a, "points", batch_size=4)
    s1[0], s2[0]
    assert REGISTRY.open_count() == base + 1
    ids = [i for i in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE) if i.name and os.path.samefile(i.name, a)]
    assert ids
    s1.close()
    assert REGISTRY.open_count() == base + 1
    np.testing.assert_array_equal(s2[1].shape, (4, PPS, 6))
    del s2
    gc.collect()
    assert REGISTRY.open_count() == base
    assert not any(i.valid for i in ids)


# ---- bad input -------------------------------------------------------------------


def test_missing_file_and_directory(files, tmp_path):
    a, _, _ = files
    missing = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError, match=rf"HDF5 file not found. Received: path='{missing}'"):
        kerasfeed.H5SliceSequence([a, missing], "labels", 4)
    with pytest.raises(IsADirectoryError, match=rf"got a directory. Received: path='{tmp_path}'"):
        kerasfeed.H5SliceSequence(tmp_path, "labels", 4)


def test_a_file_that_cannot_be_read_is_a_permission_error_not_a_missing_signature(files, monkeypatch):
    # h5py raises PermissionError for a file without read permission (root reads any file: h5py's own
    # error stands in), and h5py.is_hdf5 cannot read it either: it was "not an HDF5 file (no HDF5 signature)".
    import h5py

    a, _, _ = files

    def refused(path, *args, **kwargs):
        raise PermissionError(13, f"Unable to synchronously open file (unable to open file: name = '{path}', "
                                  "errno = 13, error message = 'Permission denied')")

    monkeypatch.setattr(h5py, "File", refused)
    monkeypatch.setattr(h5py, "is_hdf5", lambda path: refused(path))
    with pytest.raises(PermissionError, match=rf"H5SliceSequence: file '{a}' cannot be read \(permission denied\)"):
        kerasfeed.H5SliceSequence(a, "labels", 4)


def test_links_without_targets_and_virtual_datasets_without_sources_are_named(tmp_path):
    """A dangling link was "no dataset key" beside a list that lacked it; a virtual dataset whose source
    file is gone read HDF5's fill value (zeros) for its rows, silently."""
    path = tmp_path / "links.h5"
    with h5py.File(path, "w") as f:
        f["y"] = np.arange(6)
        f["x"] = h5py.ExternalLink("missing_source.h5", "/data")
        f["s"] = h5py.SoftLink("/nowhere")
    with pytest.raises(ValueError, match=r"has a link whose target is missing \(an external link to "
                                         r"'missing_source.h5':/data\) at key 'x'"):
        kerasfeed.H5SliceSequence(path, "x", 2)
    with pytest.raises(ValueError, match=r"a soft link to /nowhere\) at key 's'"):
        kerasfeed.H5SliceSequence(path, "s", 2)
    source = tmp_path / "source.h5"
    with h5py.File(source, "w") as f:
        f["data"] = np.arange(6, dtype="float32")
    layout = h5py.VirtualLayout(shape=(6,), dtype="float32")
    layout[:] = h5py.VirtualSource("source.h5", "data", shape=(6,))  # beside the virtual file
    virtual = tmp_path / "virtual.h5"
    with h5py.File(virtual, "w", libver="latest") as f:
        f.create_virtual_dataset("x", layout, fillvalue=-1)
    assert kerasfeed.H5SliceSequence(virtual, "x", 3)[1].tolist() == [3.0, 4.0, 5.0]
    source.unlink()
    with pytest.raises(ValueError, match=r"dataset 'x' in file '.*virtual.h5' is virtual and its source file "
                                         r"'source.h5' is not there"):
        kerasfeed.H5SliceSequence(virtual, "x", 3)
    # The source file there, its dataset not (a typo): fill values too, read without a word.
    with h5py.File(source, "w") as f:
        f["data"] = np.arange(3, dtype="float32")
    half = h5py.VirtualLayout(shape=(6,), dtype="float32")
    half[0:3] = h5py.VirtualSource("source.h5", "data", shape=(3,))
    half[3:6] = h5py.VirtualSource("source.h5", "typo", shape=(3,))
    with h5py.File(virtual, "w", libver="latest") as f:
        f.create_virtual_dataset("x", half, fillvalue=-1)
    with pytest.raises(ValueError, match=r"is virtual and its source dataset 'typo' in file 'source.h5' is not there"):
        kerasfeed.H5SliceSequence(virtual, "x", 3)


def test_enums_coded_differently_in_two_files_and_a_path_that_is_a_pipe_are_refused(tmp_path):
    """numpy's dtype equality leaves h5py's enum metadata out: "dog" coded 1 in one file and 0 in the other
    was mixed silently. A named pipe blocked h5py's open for ever."""
    codes = ({"cat": 0, "dog": 1}, {"dog": 0, "cat": 1})
    for k, mapping in enumerate(codes):
        with h5py.File(tmp_path / f"e{k}.h5", "w") as f:
            f.create_dataset("label", data=np.zeros(2, "i1"), dtype=h5py.enum_dtype(mapping, basetype="i1"))
    with pytest.raises(ValueError, match=r"dataset 'label' differs between files: .*e0.h5' has rows of shape \(\) and "
                                         r"dtype int8 and enum \{'cat': 0, 'dog': 1\}, but .*e1.h5' has .* and enum "
                                         r"\{'cat': 1, 'dog': 0\}"):
        kerasfeed.H5SliceSequence([tmp_path / "e0.h5", tmp_path / "e1.h5"], "label", 4)
    assert kerasfeed.H5SliceSequence([tmp_path / "e0.h5"] * 2, "label", 4)[0].tolist() == [0, 0, 0, 0]
    os.mkfifo(tmp_path / "pipe.h5")
    with pytest.raises(OSError, match=r"expected an HDF5 file but got a path that is not a regular file \(a pipe, "
                                      r"device\). Received: path='.*pipe.h5'"):
        kerasfeed.H5SliceSequence(tmp_path / "pipe.h5", "x", 2)


def test_many_files_stay_within_the_descriptor_limit_and_running_out_is_named_as_such(tmp_path):
    """Each file read stayed open until close(): a sequence of one file per scene failed past RLIMIT_NOFILE
    (1024 on many machines), in every worker. It now keeps max_open_files open (a quarter of the limit by
    default) and closes the least recently read one. Past the limit itself the open failed, and so did
    h5py.is_hdf5, so the error said "is not an HDF5 file (no HDF5 signature)"."""
    for j in range(60):
        with h5py.File(tmp_path / f"m{j}.h5", "w") as f:
            f["x"] = np.full(1, j, "i4")
    code = (
        "import resource, sys, kerasfeed\n"
        "from kerasfeed.hdf5.handles import REGISTRY\n"
        "paths = [f'{sys.argv[1]}/m{j}.h5' for j in range(60)]\n"
        "seq = kerasfeed.H5SliceSequence(paths, 'x', 1)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "print('read', [int(seq[i][0]) for i in range(60)] == list(range(60)), REGISTRY.open_count())\n"
        "seq.close()\n"
        "seq = kerasfeed.H5SliceSequence(paths, 'x', 1, max_open_files=100)\n"
        "try:\n    [seq[i] for i in range(60)]\nexcept OSError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, KERAS_BACKEND="numpy"))
    assert "read True 16\n" in out.stdout, out.stdout + out.stderr[-2000:]  # 16: max(16, 40 // 4)
    assert "no file descriptor left (RLIMIT_NOFILE 40; a sequence keeps up to max_open_files= files open" in (
        out.stdout), out.stdout + out.stderr[-2000:]
    assert "Pass a smaller max_open_files=" in out.stdout and "no HDF5 signature" not in out.stdout


def test_files_closed_past_max_open_files_reopen_with_the_same_rows_and_never_under_a_read(tmp_path):
    """Eight threads read 30 files at random through a sequence that may keep 3 open: a file closed while
    another thread read it would raise or read garbage."""
    paths = []
    for j in range(30):
        paths.append(str(tmp_path / f"m{j}.h5"))
        with h5py.File(paths[-1], "w") as f:
            f["x"] = np.full((4, 64), j, "i4")
    seq = kerasfeed.H5SliceSequence(paths, "x", 2, max_open_files=3)
    wrong, failed = [], []

    def read(k):
        rng = np.random.default_rng(k)
        for i in rng.integers(0, len(seq), 200):
            try:
                if not (seq[int(i)] == i // 2).all():
                    wrong.append(int(i))
            except Exception as e:  # noqa: BLE001 - counted and shown
                failed.append(repr(e))

    threads = [threading.Thread(target=read, args=(k,)) for k in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not wrong and not failed[:3] and seq._h5.open_files() <= 3
    with kerasfeed.H5RowSequence(paths, "x", 4, order=kerasfeed.IndexOrder(120, shuffle=True, seed=0),
                                 max_open_files=2) as rows:
        got = np.concatenate([rows[i] for i in range(len(rows))])
        assert sorted(got[:, 0].tolist()) == sorted(np.repeat(np.arange(30), 4).tolist())
        assert rows._h5.open_files() <= 2
    # A file closed past the bound and replaced since reads as a replaced file: refused, never the new rows.
    [seq[i] for i in (20, 40, 58)]  # three other files: file 0 is closed now
    with h5py.File(tmp_path / "new.h5", "w") as f:
        f["x"] = np.full((4, 64), 99, "i4")
    os.replace(tmp_path / "new.h5", paths[0])
    with pytest.raises(kerasfeed.FileChangedError, match="was replaced after the sequence was built"):
        seq[0]
    with pytest.raises(ValueError, match="max_open_files"):
        kerasfeed.H5SliceSequence(paths, "x", 2, max_open_files=0)


def test_a_null_dataspace_key_is_named_as_such_and_a_long_key_list_stays_short_in_repr(tmp_path):
    path = tmp_path / "many.h5"
    with h5py.File(path, "w") as f:
        for k in range(300):
            f[f"k{k:03d}"] = np.arange(4)
        f["null"] = h5py.Empty("f4")
    with pytest.raises(ValueError, match=r"dataset 'null' .* is an empty \(null dataspace\) dataset"):  # "a scalar"
        kerasfeed.H5SliceSequence(path, "null", 2)
    text = repr(kerasfeed.H5SliceSequence(path, [f"k{k:03d}" for k in range(300)], 2))
    assert len(text) < 300 + len(str(path)) and text.endswith("..., batch_size=2, batches=2>"), text  # 2,100 before


def test_non_hdf5_and_corrupt_files(files, tmp_path):
    a, _, _ = files
    text = tmp_path / "notes.h5"
    text.write_text("just some text, not HDF5\n" * 100)
    with pytest.raises(OSError, match=rf"file '{text}' is not an HDF5 file \(no HDF5 signature\)"):
        kerasfeed.H5SliceSequence(text, "labels", 4)

    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(a.read_bytes()[:2000])
    with pytest.raises(OSError, match=rf"file '{truncated}' could not be opened as HDF5 \(corrupt or truncated"):
        kerasfeed.H5SliceSequence(truncated, "labels", 4)

    # Garbage inside one compressed chunk: construction succeeds (shapes are
    # fine), the read of that chunk fails, naming the rows, key and file.
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(a.read_bytes())
    with h5py.File(damaged) as f:
        info = f["points"].id.get_chunk_info(3)  # rows 12..15
    raw = bytearray(damaged.read_bytes())
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    damaged.write_bytes(bytes(raw))
    seq = kerasfeed.H5SliceSequence(damaged, ("points", "labels"), 4)
    seq[2]  # an intact chunk
    with pytest.raises(OSError, match=rf"reading rows 12:16 of dataset 'points' in file '{damaged}' failed"):
        seq[3]
    # Through tf.data, while iterating (the signature probe reads 0, 1, 2 and
    # the last batch): the batch index, the file and the key reach the caller.
    ds = kerasfeed.to_dataset(seq)
    with pytest.raises(tf.errors.OpError, match=rf"H5SliceSequence\[3\] raised OSError: H5SliceSequence: reading rows 12:16 of dataset 'points' in file '{damaged}'"):
        for _ in ds:
            pass
    seq.close()


def test_file_removed_after_construction(files, tmp_path):
    a, _, _ = files
    copy = tmp_path / "copy.h5"
    copy.write_bytes(a.read_bytes())
    seq = kerasfeed.H5SliceSequence(copy, "labels", 4)
    copy.unlink()
    with pytest.raises(FileNotFoundError, match=rf"HDF5 file not found. Received: path='{copy}' \(it had 20 rows "
                                                 r"when the sequence was built: removed since\)"):
        seq[0]


def _replace(path, values):
    """Writes ``x`` to a temporary file renamed over ``path`` (as make_synthetic_scenes does): a new inode."""
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        f["x"] = values
    os.replace(tmp, path)


def test_a_file_replaced_by_rename_is_a_new_file(tmp_path):
    path = tmp_path / "r.h5"
    _replace(path, np.zeros(10, np.int64))
    base = REGISTRY.open_count()
    old = kerasfeed.H5SliceSequence(path, "x", 5)
    unread = kerasfeed.H5SliceSequence(path, "x", 5)
    old[0]  # holds the first file open
    _replace(path, np.arange(100, 120))
    # A new sequence reads the new file, not the handle open under its path.
    new = kerasfeed.H5SliceSequence(path, "x", 5)
    assert new.num_rows == 20
    np.testing.assert_array_equal(new[3], np.arange(115, 120))
    assert REGISTRY.open_count() == base + 2
    # Sequences built before keep reading the file they inspected while this
    # process has it open...
    np.testing.assert_array_equal(unread[1], np.zeros(5))
    assert REGISTRY.open_count() == base + 2
    # ...and refuse to reopen the path (after close, or in a worker) onto another file.
    old.close()
    unread.close()
    worker_copy = pickle.loads(pickle.dumps(old))
    for seq in (old, worker_copy):
        with pytest.raises(kerasfeed.FileChangedError, match=rf"file '{path}' was replaced after the sequence was built: .*\(10 rows\)"):
            seq[0]
    new.close()
    assert REGISTRY.open_count() == base


def test_a_dataset_shortened_in_place_raises_naming_the_rows(tmp_path):
    path = tmp_path / "short.h5"
    with h5py.File(path, "w") as f:
        for key in ("x", "y"):
            f.create_dataset(key, data=np.arange(10), maxshape=(None,))
    seqs = [
        kerasfeed.H5SliceSequence(path, ("x", "y"), 4),
        kerasfeed.H5WindowSequence(path, ("x", "y"), 4, window=3),
        kerasfeed.H5RowSequence(path, ("x", "y"), 4, order=kerasfeed.IndexOrder(10)),
    ]
    time.sleep(0.05)  # past the file system's timestamp tick: the write below is seen as one
    with h5py.File(path, "a") as f:  # same file, fewer rows (h5py would clip reads in silence)
        f["x"].resize((6,))
        f["y"].resize((6,))
    asked = ["rows 8:10", "rows 4:10", r"2 rows \(8..9\)"]
    for seq, rows in zip(seqs, asked):
        with pytest.raises(OSError, match=rf"dataset 'x' in file '{path}' has 6 rows now, 10 when the sequence was built, so {rows} cannot be read: the file changed since"):
            seq[-1]
        # Rows the file still has: refused too, the file having been written since (not only shortened).
        with pytest.raises(kerasfeed.FileChangedError, match=rf"file '{path}' was written in place after the sequence was built"):
            seq[0]
        seq.close()


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_file_overwritten_in_place_is_refused_not_read_as_zeros(tmp_path, executor):
    """Before: ``shutil.copyfile`` (or ``cp``, ``rsync --inplace``) over a file open for reading kept its inode,
    so no check saw it, and the workers' handles read zeros and the other file's bytes: 17,500 of 20,000
    labels wrong, no error."""
    path, other = tmp_path / "cp.h5", tmp_path / "other.h5"
    for name, base in ((path, 0), (other, 10**6)):  # the same layout and size: only the values differ
        with h5py.File(name, "w") as f:
            f.create_dataset("x", data=np.arange(base, base + 4000, dtype=np.float32).reshape(1000, 4), chunks=(50, 4))
            f.create_dataset("y", data=np.arange(base, base + 1000), chunks=(50,))
    assert path.stat().st_size == other.stat().st_size
    seqs = [kerasfeed.H5SliceSequence(path, ("x", "y"), 50),
            kerasfeed.H5RowSequence(path, ("x", "y"), 50, order=kerasfeed.IndexOrder(1000))]
    for seq in seqs:
        seq.close()
    with kerasfeed.to_loader(seqs[0], executor=executor, **({"workers": 2} if executor == "processes" else {})) as ld:
        time.sleep(0.05)  # past the file system's timestamp tick
        shutil.copyfile(other, path)  # same inode, other bytes; the probe left the file open where it reads
        with pytest.raises(kerasfeed.ItemError) as info:
            list(ld)
    assert info.value.exc_type == "FileChangedError", info.value
    assert f"file '{path}' was written in place after the sequence was built" in str(info.value)
    for seq in (*seqs, pickle.loads(pickle.dumps(seqs[1]))):  # a worker's copy too
        with pytest.raises(kerasfeed.FileChangedError, match=r"mtime_ns \d+ -> \d+\), so (rows \d+:\d+|50 rows) "):
            seq[3]
        seq.close()


def test_missing_key_group_and_length_mismatch(files, tmp_path):
    a, b, _ = files
    with pytest.raises(ValueError) as info:
        kerasfeed.H5SliceSequence([a, b], ("points", "colours"), 4)
    msg = str(info.value)
    assert f"file '{a}' has no dataset key 'colours'" in msg
    assert "'labels'" in msg and "'points'" in msg  # lists what the file has
    assert "Received: keys=('points', 'colours')" in msg

    odd = tmp_path / "odd.h5"
    with h5py.File(odd, "w") as f:
        f.create_dataset("x", data=np.zeros((10, 3), np.float32))
        f.create_dataset("y", data=np.zeros((9,), np.int64))
        f.create_group("grp")
        f.create_dataset("scalar", data=3.0)
    with pytest.raises(ValueError, match=rf"datasets in file '{odd}' have different lengths .* Received: 'x': 10, 'y': 9"):
        kerasfeed.H5SliceSequence(odd, ("x", "y"), 4)
    with pytest.raises(ValueError, match=rf"file '{odd}' has a group, not a dataset, at key 'grp'"):
        kerasfeed.H5SliceSequence(odd, "grp", 4)
    with pytest.raises(ValueError, match=rf"dataset 'scalar' in file '{odd}' is a scalar"):
        kerasfeed.H5SliceSequence(odd, "scalar", 4)

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=np.zeros((10, 4), np.float32))
    with pytest.raises(ValueError, match=rf"dataset 'x' differs between files: '{odd}' has rows of shape \(3,\) .* but '{other}' has rows of shape \(4,\)"):
        kerasfeed.H5SliceSequence([odd, other], "x", 4)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((), dict(keys=[], batch_size=4), ValueError, "`keys` has an empty sequence at keys. Received: keys=[]"),
        ((), dict(keys=5, batch_size=4), TypeError, "found int at keys. Received: keys=5"),
        ((), dict(keys=("points", 3), batch_size=4), TypeError, "found int at keys[1]"),
        ((), dict(keys="labels", batch_size=0), ValueError, "`batch_size` must be a positive int. Received: batch_size=0"),
        ((), dict(keys="labels", batch_size=4, shuffle="yes"), TypeError, "Received: shuffle='yes'"),
        ((), dict(keys="labels", batch_size=4, seed=-2), ValueError, "Received: seed=-2"),
        ((), dict(keys="labels", batch_size=4, shuffle_window_chunks=0), ValueError, "Received: shuffle_window_chunks=0"),
        ((), dict(keys="labels", batch_size=4, open_kwargs={"mode": "a"}), ValueError, "may not set 'mode'"),
        ((), dict(keys="labels", batch_size=64, drop_remainder=True), ValueError, "no batches: the files hold 20 rows in total, fewer than batch_size=64"),
    ],
)
def test_bad_arguments(files, args, kwargs, error, message):
    a, _, _ = files
    with pytest.raises(error) as info:
        kerasfeed.H5SliceSequence(a, *args, **kwargs)
    assert message in str(info.value)


def test_bad_paths_argument():
    with pytest.raises(ValueError, match=r"`paths` must be a path or a non-empty sequence of paths. Received: paths=\[\]"):
        kerasfeed.H5SliceSequence([], "x", 4)
    with pytest.raises(TypeError, match=r"every path must be a str or os.PathLike. Received: 3 in paths"):
        kerasfeed.H5SliceSequence(["a.h5", 3], "x", 4)


# ---- SWMR ------------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys, h5py, numpy as np
    f = h5py.File(sys.argv[1], "w", libver="latest")
    d = f.create_dataset("x", shape=(0, 3), maxshape=(None, 3), chunks=(4, 3), dtype="f4")
    f.swmr_mode = True
    def append(n):
        old = d.shape[0]
        d.resize(old + n, axis=0)
        d[old:] = np.arange(old * 3, (old + n) * 3, dtype="f4").reshape(n, 3)
        d.flush()
    append(10); print("ready", flush=True)
    sys.stdin.readline(); append(10); print("ready", flush=True)
    sys.stdin.readline(); f.close()
    """
)


def test_swmr_keys_a_writer_appends_one_after_the_other_take_the_rows_all_have(tmp_path):
    """A writer appending to 'x' then 'y' is seen between the two (x one row ahead): building a sequence
    then was refused ("different lengths") in about 1 of 20 builds. Under swmr the rows every key has are
    the snapshot."""
    path = tmp_path / "between.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("x", data=np.arange(10, dtype="f4"), maxshape=(None,), chunks=(4,))
        f.create_dataset("y", data=np.arange(9), maxshape=(None,), chunks=(4,))
    seq = kerasfeed.H5SliceSequence(path, ("x", "y"), 3, swmr=True)
    assert seq.file_lengths == (9,) and [y.tolist() for _, y in (seq[i] for i in range(3))] == [[0, 1, 2], [3, 4, 5],
                                                                                                 [6, 7, 8]]
    with pytest.raises(ValueError, match=r"different lengths along axis 0.*Received: 'x': 10, 'y': 9"):
        kerasfeed.H5SliceSequence(path, ("x", "y"), 3)


def test_swmr_reads_while_a_writer_appends(tmp_path):
    path = tmp_path / "live.h5"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        # Without SWMR, HDF5 refuses to open a file held open for writing.
        with pytest.raises(OSError, match=rf"file '{path}' could not be opened as HDF5 .*already open for write"):
            kerasfeed.H5SliceSequence(path, "x", 4)
        old = kerasfeed.H5SliceSequence(path, "x", 4, swmr=True)
        assert len(old) == 3
        np.testing.assert_array_equal(old[0], np.arange(12, dtype="f4").reshape(4, 3))
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "ready"
        # The old sequence keeps its snapshot; a new one sees the new rows.
        assert len(old) == 3
        np.testing.assert_array_equal(old[2], np.arange(24, 30, dtype="f4").reshape(2, 3))
        new = kerasfeed.H5SliceSequence(path, "x", 4, swmr=True)
        assert len(new) == 5
        expected = np.arange(60, dtype="f4").reshape(20, 3)
        np.testing.assert_array_equal(np.concatenate([new[i] for i in range(5)]), expected)
        old.close()
        new.close()
    finally:
        writer.stdin.write("\n")
        writer.stdin.flush()
        writer.wait(30)


# ---- Keras and tf.data -------------------------------------------------------------


def _pointnet(num_classes=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((PPS, 6)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.GlobalMaxPooling1D(),
        keras.layers.Dense(num_classes, activation="softmax"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("use_multiprocessing", [False, True])
def test_model_fit_with_keras_workers(files, use_multiprocessing):
    a, b, _ = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8, shuffle=True, seed=0,
                                    workers=2, use_multiprocessing=use_multiprocessing)
    seq[0]  # handles open in the parent before Keras forks its workers
    history = _pointnet().fit(seq, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    # on_epoch_end advanced it (Keras also calls it once in fit's initial reset()).
    assert seq.epoch >= 1
    seq.close()


def _assert_pass_equals(got, reference, epoch):
    """``got`` (a pass's (x, y) batches) equals ``reference``'s batches at ``epoch``."""
    reference.set_epoch(epoch)
    assert len(got) == len(reference)
    for i, (x, y) in enumerate(got):
        ex, ey = reference[i]
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


@pytest.mark.parametrize("window", [None, 2])
def test_to_dataset_threads_matches_getitem_per_epoch(files, window):
    a, b, _ = files
    kwargs = dict(batch_size=8, shuffle=True, seed=4, transform=_noisy, shuffle_window_chunks=window)
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), **kwargs)
    ds = kerasfeed.to_dataset(seq)
    passes = [[(x.numpy(), y.numpy()) for x, y in ds] for _ in range(2)]
    reference = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), **kwargs)
    for epoch, got in enumerate(passes):
        _assert_pass_equals(got, reference, epoch)
    assert not np.array_equal(passes[0][0][1], passes[1][0][1]) or not np.array_equal(
        passes[0][1][1], passes[1][1][1])
    history = _pointnet().fit(kerasfeed.to_dataset(seq), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    seq.close()
    reference.close()


def test_to_dataset_processes(files):
    a, b, _ = files
    seq = kerasfeed.H5SliceSequence([a, b], ("points", "labels"), batch_size=8, shuffle=True, seed=4,
                                    transform=_noisy)
    seq[0]  # open in the consumer first: workers must open their own handles
    ds = kerasfeed.to_dataset(seq, executor="processes", workers=2)
    try:
        assert ds._kerasfeed_executor.name == "processes"
        reference = pickle.loads(pickle.dumps(seq))
        for epoch in range(2):
            _assert_pass_equals([(x.numpy(), y.numpy()) for x, y in ds], reference, epoch)
    finally:
        ds._kerasfeed_executor.close()
        seq.close()


def test_big_endian_datasets_keep_their_dtype_and_feed_every_front_end_natively(tmp_path):
    """A big-endian dataset's batches are in its dtype whether their rows come from one run of one file or
    several (numpy's concatenation returned native rows, so a batch's byte order depended on where it fell);
    the front ends hand them over in native byte order, which TensorFlow, JAX and torch take (to_dataset
    refused the very dtype its probe had read, and `.torch()`/`.jax()` failed)."""
    import jax
    import torch

    paths, xs, ys = [], [], []
    for j, n in enumerate((7, 6)):
        x = (np.arange(n * 2) + 100 * j).reshape(n, 2).astype(">f4")  # arithmetic would give native arrays
        y = (np.arange(n) + 10 * j).astype(">i8")
        path = tmp_path / f"be{j}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=x, chunks=(3, 2), compression="gzip")
            f.create_dataset("y", data=y, chunks=(4,))
        paths.append(str(path))
        xs.append(x)
        ys.append(y)
    x_all, y_all = np.concatenate(xs), np.concatenate(ys)
    order = kerasfeed.IndexOrder(13, shuffle=True, seed=3)
    readers = [kerasfeed.H5SliceSequence(paths, ("x", "y"), 5),  # batch 1 straddles the two files
               kerasfeed.H5RowSequence(paths, ("x", "y"), 4, order=order)]  # shuffled rows: several runs
    for seq in readers:
        rows = [seq.batch_rows(i) for i in range(len(seq))]
        for i, picked in enumerate(rows):
            x, y = seq[i]
            assert (x.dtype.str, y.dtype.str) == (">f4", ">i8"), (type(seq).__name__, i)
            assert np.array_equal(x, x_all[picked]) and np.array_equal(y, y_all[picked])
        for executor, kw in (("threads", {}), ("processes", {"workers": 2})):
            loader = kerasfeed.to_loader(seq, executor=executor, **kw)
            try:
                batches = list(loader)
                assert [b[0].dtype.str for b in batches] == ["<f4"] * len(rows)
                for (x, y), picked in zip(batches, rows):
                    assert np.array_equal(x, x_all[picked]) and np.array_equal(y, y_all[picked])
                assert all(t[0].dtype == torch.float32 for t in loader.torch())
                assert all(a[0].dtype == jax.numpy.float32 for a in loader.jax())
            finally:
                loader.close()
        got = [(x.numpy(), y.numpy()) for x, y in kerasfeed.to_dataset(seq)]
        assert len(got) == len(rows)
        for (x, y), picked in zip(got, rows):
            assert x.dtype == np.float32 and np.array_equal(x, x_all[picked]) and np.array_equal(y, y_all[picked])


def test_point_sampler_centres_float64_coordinates_far_from_the_origin_before_the_cast():
    """UTM-like coordinates (5e6 m) were cast to float32 first, whose steps there are 0.5 m: a 1 m block's
    centred y came out as 3 distinct values, off by up to 0.25 m and outside the block."""
    pts = np.random.default_rng(2).uniform(0, 1, (1, 200, 3)) + np.array([500_000.0, 5_000_000.0, 0.0])
    sampler = kerasfeed.ScenePointSampler(num_points=200, block_size=1.0, blocks_per_scene=1)
    x, _ = sampler((pts, np.zeros((1, 200), "int32")), np.random.default_rng(0))
    (_, (cx, cy)), = sampler.blocks(pts[0, :, :2])
    assert x.dtype == np.float32 and len(np.unique(x[0, :, 1])) > 150
    np.testing.assert_allclose(np.sort(x[0, :, 1]), np.sort(pts[0, :, 1] - cy).astype(np.float32), atol=1e-6)
    assert np.abs(x[0, :, :2]).max() <= 0.5 + 1e-6


def test_close_while_threads_read_lets_the_files_go_after_those_reads(tmp_path):
    # close() released every file at once, under the reads in flight: "Unable to synchronously get dataspace
    # (identifier is not of specified type)" in hundreds of passes (helper, 2 of 2).
    from kerasfeed.hdf5.handles import REGISTRY

    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((64, 16), "f4")
        f["y"] = np.arange(64)
    before = set(REGISTRY._entries)  # other tests' sequences may hold files here, and be collected meanwhile
    seq = kerasfeed.H5SliceSequence(path, ("x", "y"), batch_size=2)
    stop = threading.Event()

    def closer():
        while not stop.is_set():
            seq.close()
            time.sleep(0.0005)

    thread = threading.Thread(target=closer)
    thread.start()
    passes = 0
    try:
        with kerasfeed.to_loader(seq, executor="threads") as loader:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                ys = [y for _, y in loader]
                np.testing.assert_array_equal(np.concatenate(ys), np.arange(64))
                passes += 1
    finally:
        stop.set()
        thread.join()
    seq.close()
    assert passes > 5 and set(REGISTRY._entries) <= before  # the file let go once its reads ended


def test_a_sequence_collected_while_a_file_opens_does_not_wait_for_itself(tmp_path):
    # Opening a file allocates; a garbage collection then may run a dropped sequence's __del__ on the same thread,
    # whose close() released its files through the registry's lock that thread held: a test hung 300 s there.
    from kerasfeed.hdf5.handles import REGISTRY

    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    for path in (first, second):
        with h5py.File(path, "w") as f:
            f["x"] = np.zeros((8, 2), "f4")
    seq = kerasfeed.H5SliceSequence(first, "x", batch_size=2)
    seq[0]  # holds the file in this process
    seq.itself = seq  # a cycle: only the collector frees it
    del seq
    done = threading.Event()
    ident = ("test", str(second))

    def open_second():
        REGISTRY.acquire(ident, lambda: (gc.collect(), h5py.File(second, "r"))[1])
        done.set()

    threading.Thread(target=open_second, daemon=True).start()
    assert done.wait(30), "the thread opening a file waited for itself"
    REGISTRY.release(ident)
