"""kerasfeed.datasets.make_synthetic_scenes: file layout, labels, determinism and bad arguments."""

import h5py
import numpy as np
import pytest

from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.datasets.synthetic import SHAPE_NAMES


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs), {k: (f[k].chunks, f[k].compression) for k in f}


def test_layout_dtypes_chunks_and_attrs(tmp_path):
    path = make_synthetic_scenes(tmp_path / "sub" / "s.h5", num_scenes=40, points_per_scene=128,
                                 num_classes=5, chunk_scenes=4)
    assert path == tmp_path / "sub" / "s.h5" and path.is_file()
    data, attrs, layout = _read(path)
    assert data["points"].shape == (40, 128, 6) and data["points"].dtype == np.float32
    assert data["labels"].shape == (40,) and data["labels"].dtype == np.int64
    assert data["point_labels"].shape == (40, 128) and data["point_labels"].dtype == np.int32
    assert layout["points"] == ((4, 128, 6), "gzip")
    assert layout["labels"] == ((4,), "gzip")
    assert layout["point_labels"] == ((4, 128), "gzip")
    assert attrs["num_classes"] == 5
    assert list(attrs["class_names"]) == list(SHAPE_NAMES[:5])
    assert list(attrs["point_class_names"]) == ["ground", *SHAPE_NAMES[:5]]
    assert attrs["num_point_classes"] == 6
    # Every class present, point labels are ground (0) or the scene's object (1 + class).
    assert set(data["labels"]) == set(range(5))
    for i in range(40):
        assert set(np.unique(data["point_labels"][i])) == {0, 1 + data["labels"][i]}
    # Normals are unit vectors; ground points lie near z = 0 with upward normals.
    np.testing.assert_allclose(np.linalg.norm(data["points"][..., 3:], axis=-1), 1.0, atol=1e-5)
    ground = data["point_labels"] == 0
    assert np.abs(data["points"][..., 2][ground]).max() < 0.2
    np.testing.assert_allclose(data["points"][..., 5][ground], 1.0)
    assert not any(p.name.endswith(".tmp") for p in path.parent.iterdir())  # no temp file left


def test_deterministic_per_seed_and_prefix_stable(tmp_path):
    a = _read(make_synthetic_scenes(tmp_path / "a.h5", num_scenes=70, points_per_scene=32, seed=3))[0]
    b = _read(make_synthetic_scenes(tmp_path / "b.h5", num_scenes=70, points_per_scene=32, seed=3))[0]
    c = _read(make_synthetic_scenes(tmp_path / "c.h5", num_scenes=70, points_per_scene=32, seed=4))[0]
    d = _read(make_synthetic_scenes(tmp_path / "d.h5", num_scenes=100, points_per_scene=32, seed=3,
                                    compression=None, chunk_scenes=16))[0]
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], d[k][:70])  # a prefix of a longer file
    assert not np.array_equal(a["points"], c["points"])


def test_lzf_and_uncompressed(tmp_path):
    for comp in ("lzf", None):
        path = make_synthetic_scenes(tmp_path / f"{comp}.h5", num_scenes=9, points_per_scene=16,
                                     compression=comp, chunk_scenes=4)
        with h5py.File(path) as f:
            assert f["points"].compression == comp
            assert f["points"].shape == (9, 16, 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_scenes=0), "`num_scenes` must be an int >= 1. Received: num_scenes=0"),
        (dict(num_scenes=2.5), "Received: num_scenes=2.5"),
        (dict(points_per_scene=4), "`points_per_scene` must be an int >= 8. Received: points_per_scene=4"),
        (dict(num_classes=1), "`num_classes` must be an int in [2, 6]. Received: num_classes=1"),
        (dict(num_classes=7), "Received: num_classes=7"),
        (dict(seed=-1), "`seed` must be an int >= 0. Received: seed=-1"),
        (dict(chunk_scenes=0), "`chunk_scenes` must be an int >= 1. Received: chunk_scenes=0"),
        (dict(compression="zstd"), "Received: compression='zstd'"),
        (dict(noise=-0.1), "`noise` must be a finite number >= 0. Received: noise=-0.1"),
        (dict(noise=float("nan")), "Received: noise=nan"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        make_synthetic_scenes(tmp_path / "x.h5", **kwargs)
    assert message in str(info.value)
    assert not (tmp_path / "x.h5").exists()


def test_directory_path_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a directory. Received: path="):
        make_synthetic_scenes(tmp_path)
    with pytest.raises(TypeError, match="Received: path=5"):
        make_synthetic_scenes(5)


def test_classes_learnable_by_small_pointnet(tmp_path):
    import keras
    path = make_synthetic_scenes(tmp_path / "learn.h5", num_scenes=512, points_per_scene=512)
    data = _read(path)[0]
    x, y = data["points"], data["labels"]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((512, 6)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.GlobalMaxPooling1D(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(4, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x[:256], y[:256], batch_size=16, epochs=5, verbose=0)
    _, accuracy = model.evaluate(x[256:], y[256:], verbose=0)
    assert accuracy > 0.5, accuracy  # chance is 0.25
