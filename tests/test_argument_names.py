"""Bad arguments that gave a bare Python error (or were taken silently) name the argument and what was received."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

import kerasfeed


class Small(kerasfeed.SceneSequence):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.full((2,), i, np.float32)


def _path_message(owner: str, name: str, value) -> str:
    return re.escape(
        f"{owner}: `{name}` must be a non-empty path (a str or os.PathLike). "
        f"Received: {name}={value!r} of type {type(value).__name__}"
    )


@pytest.mark.parametrize("bad", [None, 5, b"logs", ""])
def test_worker_run_dir_refuses_a_non_path_naming_log_dir(bad):
    with pytest.raises(TypeError, match=f"^{_path_message('worker_run_dir', 'log_dir', bad)}$"):
        kerasfeed.worker_run_dir(bad)
    assert kerasfeed.worker_run_dir(pathlib.Path("logs")).endswith("worker_0")


@pytest.mark.parametrize("bad", [None, 3.5, b"out"])
def test_export_refuses_a_non_path_directory(bad):
    with pytest.raises(TypeError, match=f"^{_path_message('export', 'directory', bad)}$"):
        kerasfeed.export(Small(), bad, num_shards=1, executor="threads", progress=False)


@pytest.mark.parametrize("bad", [None, 7])
@pytest.mark.parametrize("name", ["load_export", "verify_export", "ExportSource"])
def test_load_and_verify_export_refuse_a_non_path_directory(name, bad):
    with pytest.raises(TypeError, match=f"^{_path_message(name, 'directory', bad)}$"):
        getattr(kerasfeed, name)(bad)


def test_load_export_still_takes_a_pathlib_directory(tmp_path):
    kerasfeed.export(Small(), tmp_path / "e", num_shards=2, executor="threads", progress=False)
    assert kerasfeed.verify_export(tmp_path / "e")["items"] == 4
    assert [float(x[0]) for x in kerasfeed.load_export(tmp_path / "e")] == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [None, "mirrored", object()])
def test_distribute_refuses_what_is_not_a_strategy_naming_strategy(bad):
    with pytest.raises(TypeError) as e:
        kerasfeed.distribute(bad, Small())
    assert str(e.value).startswith("kerasfeed.distribute: `strategy` must be a tf.distribute.Strategy")
    assert str(e.value).endswith(f"Received: strategy={bad!r} of type {type(bad).__name__}")


def test_distribute_still_takes_the_default_strategy():
    dist = kerasfeed.distribute(tf.distribute.get_strategy(), Small())
    assert sorted(float(x[0]) for x in dist) == [0, 1, 2, 3]


def test_set_epoch_takes_non_negative_ints_numpy_ones_included():
    seq = Small()
    for epoch in (3, np.int64(4), np.uint8(5), np.int32(0)):
        seq.set_epoch(epoch)
        assert seq.epoch == int(epoch) and type(seq.epoch) is int
    for bad, error in ((1.5, ValueError), (-1, ValueError), ("a", ValueError), (True, ValueError), (None, ValueError)):
        with pytest.raises(error) as e:
            seq.set_epoch(bad)
        assert str(e.value) == (f"SceneSequence.set_epoch: `epoch` must be a non-negative int. Received: epoch={bad!r}")
        assert seq.epoch == 0  # the last good value stays


def test_scene_point_sampler_center_must_be_a_bool():
    with pytest.raises(
        TypeError, match=re.escape("ScenePointSampler: `center` must be True or False. Received: center='no'")
    ):
        kerasfeed.ScenePointSampler(8, center="no")
    assert kerasfeed.ScenePointSampler(8, center=np.bool_(False)).center is False


def test_scene_point_sampler_rng_must_be_a_numpy_generator():
    points = np.random.default_rng(0).random((1, 16, 3)).astype(np.float32)
    labels = np.zeros((1, 16), np.int32)
    sampler = kerasfeed.ScenePointSampler(4, block_size=10.0)
    for bad in (None, 0, np.random.RandomState(0)):
        with pytest.raises(TypeError) as e:
            sampler((points, labels), rng=bad)
        assert str(e.value).startswith("ScenePointSampler: `rng` must be a numpy Generator")
        assert str(e.value).endswith(f"Received: rng={bad!r} of type {type(bad).__name__}")
    x, y = sampler((points, labels), rng=np.random.default_rng(1))
    assert x.shape == (1, 4, 3) and y.shape == (1, 4)


def test_the_long_run_options_have_one_name_and_default_on_every_front_end():
    # retries / max_skipped / worker_max_items / worker_max_rss (issue 40): declared once (LoadOptions),
    # keyword-only on to_dataset, to_loader and export, with the fail-fast defaults.
    import dataclasses
    import inspect

    from kerasfeed.loading.options import LoadOptions

    defaults = {"retries": 0, "max_skipped": 0, "worker_max_items": None, "worker_max_rss": None}
    fields = {f.name: f.default for f in dataclasses.fields(LoadOptions)}
    assert {k: fields[k] for k in defaults} == defaults
    for front_end in (kerasfeed.to_dataset, kerasfeed.to_loader, kerasfeed.export):
        params = inspect.signature(front_end).parameters
        for name, default in defaults.items():
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (front_end.__name__, name)
            assert params[name].default == default, (front_end.__name__, name)
    # to_loader now takes timeout= too, as to_dataset does (a hung read under a long fit).
    assert inspect.signature(kerasfeed.to_loader).parameters["timeout"].default is None
