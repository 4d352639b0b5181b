"""kerasfeed's tf.data functions are instantiated single-device (NOTE [ kerasfeed's functions are
instantiated single-device ], kerasfeed/tfdata/functions.py), and a TensorFlow without tf.data's private
classes gets the same elements through the public transformations."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.tfdata import functions


class Small(kerasfeed.SceneSequence):
    """Small items (grouped by default); ``max_skipped`` marks them."""

    def __len__(self):
        return 60

    def __getitem__(self, i):
        return np.full((4, 3), i, np.float32), np.full((4,), i, np.int64)


CONFIGS = {
    "grouped": dict(executor="threads"),
    "one by one": dict(executor="threads", group_items=1),
    "skips": dict(executor="threads", group_items=1, max_skipped=2),
    "cached, read in the graph": dict(executor="threads", group_items=1, cache="memory"),
    "windows": dict(executor="threads", group_items=1, num_parallel_calls=2),
}


def _library(ds) -> dict:
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    return {f.signature.name: f for f in graph.library.function}


def _drain(ds, passes: int = 3) -> list:
    return [[tuple(t.numpy() for t in element) for element in ds] for _ in range(passes)]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_function_of_a_pipeline_is_single_device(name):
    ds = kerasfeed.to_dataset(Small(), **CONFIGS[name])
    try:
        library = _library(ds)
        ours = [n for n in library if n.startswith("__inference_kerasfeed_")]
        assert ours, sorted(library)
        public = [n for n in library if n.startswith("__inference_Dataset_")]  # tf.data's public transformations
        assert public == [], public
        for n in ours:
            assert library[n].attr["experimental_ints_on_device"].b is True, n
        for one_pass in _drain(ds):
            assert sorted(int(y[0]) for _, y in one_pass) == list(range(60))
            assert all(np.array_equal(x, np.full((4, 3), y[0], np.float32)) for x, y in one_pass)
    finally:
        kerasfeed.executor_of(ds).close()


@pytest.mark.parametrize("name", CONFIGS)
def test_without_private_classes_the_same_elements(name, monkeypatch, caplog):
    made = kerasfeed.to_dataset(Small(), **CONFIGS[name])
    try:
        single = _drain(made)
    finally:
        kerasfeed.executor_of(made).close()
    monkeypatch.setattr(functions, "_Unary", None)
    monkeypatch.setattr(functions, "_fell_back", [])
    with caplog.at_level(logging.INFO, logger="kerasfeed"):
        ds = kerasfeed.to_dataset(Small(), **CONFIGS[name])
    try:
        library = _library(ds)
        assert not any(f.attr["experimental_ints_on_device"].b for f in library.values())
        public = _drain(ds)
    finally:
        kerasfeed.executor_of(ds).close()
    said = [r.getMessage() for r in caplog.records if "multi-device" in r.getMessage()]
    assert len(said) == 1 and "private dataset classes are missing" in said[0], said
    assert len(public) == len(single)
    for a, b in zip(public, single):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert all(np.array_equal(u, v) for u, v in zip(x, y))


def test_an_op_this_tensorflow_lacks_falls_back_naming_why(monkeypatch, caplog):
    monkeypatch.setattr(functions, "_OPS", {**functions._OPS, "map": ("no_such_dataset_op", "f")})
    monkeypatch.setattr(functions, "_fell_back", [])
    with caplog.at_level(logging.INFO, logger="kerasfeed"):
        ds = kerasfeed.to_dataset(Small(), executor="threads", group_items=1)
    try:
        library = _library(ds)
        assert any(n.startswith("__inference_Dataset_map") for n in library), sorted(library)
        assert any(n.startswith("__inference_kerasfeed_flat_map") for n in library), sorted(library)  # still its own
        one_pass = _drain(ds, passes=1)[0]
    finally:
        kerasfeed.executor_of(ds).close()
    assert [int(y[0]) for _, y in one_pass] == list(range(60))
    said = [r.getMessage() for r in caplog.records if "multi-device" in r.getMessage()]
    assert len(said) == 1 and "AttributeError" in said[0] and "no_such_dataset_op" in said[0], said


class Int32Labels(Small):
    def __getitem__(self, i):
        return np.full((4, 3), i, np.float32), np.full((4,), i, np.int32)


@pytest.mark.parametrize("name", CONFIGS)
def test_int32_tensors_keep_a_function_multi_device_and_the_pipeline_runs(name):
    """A stateless function returning (float32, int32), marked single-device, failed tf.data's rewrite at
    ``iter()`` ("Expected only one fetch node"); kerasfeed leaves functions with int32 tensors unmarked."""
    ds = kerasfeed.to_dataset(Int32Labels(), **CONFIGS[name])
    try:
        library = _library(ds)
        for n, f in library.items():
            if n.startswith("__inference_kerasfeed_"):
                int32 = any(a.type == tf.int32.as_datatype_enum
                            for a in list(f.signature.input_arg) + list(f.signature.output_arg))
                assert f.attr["experimental_ints_on_device"].b is not int32, n
        # downstream: a user's stateless parallel map and a prefetch, over a few passes
        user = ds.map(lambda x, y: (x * 2, y + 1), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
        for _ in range(2):
            got = [(x.numpy(), y.numpy()) for x, y in user]
            assert sorted(int(y[0]) for _, y in got) == list(range(1, 61))
            assert all(np.array_equal(x, np.full((4, 3), 2 * (y[0] - 1), np.float32)) for x, y in got)
    finally:
        kerasfeed.executor_of(ds).close()


def test_a_stateless_int32_map_runs_and_keeps_its_transformation():
    base = tf.data.Dataset.range(40).map(lambda i: (tf.cast(i, tf.float32), tf.cast(i, tf.int32)))
    floats = tf.data.Dataset.range(40).map(lambda i: tf.cast(i, tf.float32))
    for made, single in ((functions.inline_map(base, lambda x, y: (x * 2, y + 1)), False),  # returns int32
                         (functions.parallel_map(base, lambda x, y: (x * 2, y + 1), tf.data.AUTOTUNE), False),
                         (functions.inline_map(base, lambda x, y: x * 2), False),  # takes int32
                         (functions.inline_map(floats, lambda x: (x * 2, tf.cast(x, tf.int64))), True)):
        assert type(made).__name__ == "_Transformation" and made.kind in ("map", "parallel_map")
        got = list(made.prefetch(2).as_numpy_iterator())
        assert len(got) == 40 and float(np.ravel(got[-1])[0]) == 78.0
        assert made.single_device is single
