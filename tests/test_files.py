"""kerasfeed.from_files: per-file readers, flattened, shuffled and batched."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from _util import fit_step_counter

import kerasfeed
from kerasfeed.datasets.synthetic_streams import read_jsonl_records, write_jsonl_records


@pytest.fixture
def records(tmp_path):
    """The classic case: three JSON-lines files with 3, 5 and 7 variable-length samples."""
    paths = write_jsonl_records(tmp_path, counts=(3, 5, 7), seed=0)
    truth = {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                rec = json.loads(line)
                truth[rec["id"]] = (np.asarray(rec["tokens"], np.float32), rec["label"])
    assert len(truth) == 15 and len({t.shape[0] for t, _ in truth.values()}) > 1
    return paths, truth


def test_every_sample_once_with_its_own_shape(records):
    paths, truth = records
    ds = kerasfeed.from_files(paths, read_jsonl_records)
    x_spec, y_spec = ds.element_spec
    assert x_spec["tokens"].shape.as_list() == [None, 4] and y_spec.dtype == tf.int32
    seen = []
    for x, y in ds:
        i = int(x["id"])
        tokens, label = truth[i]
        np.testing.assert_array_equal(x["tokens"].numpy(), tokens)  # true length, no padding
        assert int(y) == label
        seen.append(i)
    assert sorted(seen) == sorted(truth)  # each sample exactly once
    # deterministic interleave over the 3 files (cycle_length = 3, one sample each)
    expected = [0, 1000, 2000, 1, 1001, 2001, 2, 1002, 2002, 1003, 2003, 1004, 2004, 2005, 2006]
    assert seen == expected


def test_padded_and_ragged_batches(records):
    paths, truth = records
    padded = list(kerasfeed.from_files(paths, read_jsonl_records, batch_size=4))
    assert [int(y.shape[0]) for _, y in padded] == [4, 4, 4, 3]
    ids = []
    for x, _ in padded:
        batch = x["tokens"].numpy()
        for row, i in zip(batch, x["id"].numpy()):
            tokens = truth[int(i)][0]
            assert batch.shape[1] >= tokens.shape[0]
            np.testing.assert_array_equal(row[: tokens.shape[0]], tokens)
            assert not row[tokens.shape[0]:].any()  # zero padding
            ids.append(int(i))
    assert sorted(ids) == sorted(truth)
    ragged = list(kerasfeed.from_files(paths, read_jsonl_records, batch_size=4, ragged=True, drop_remainder=True))
    assert len(ragged) == 3
    x = ragged[0][0]
    assert isinstance(x["tokens"], tf.RaggedTensor)
    for row, i in zip(x["tokens"], x["id"].numpy()):
        np.testing.assert_array_equal(row.numpy(), truth[int(i)][0])


def test_trainable_through_model_fit(records):
    paths, truth = records
    ds = kerasfeed.from_files(paths, read_jsonl_records, batch_size=4, shuffle_buffer=16, seed=0)
    ds = ds.map(lambda x, y: (x["tokens"], y))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 4))
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Masking()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(keras.optimizers.Adam(0.1), "binary_crossentropy", metrics=[keras.metrics.BinaryAccuracy()])
    before = [w.copy() for w in model.get_weights()]
    counter, steps = fit_step_counter()
    hist = model.fit(ds, epochs=5, verbose=0, callbacks=[counter])
    assert steps == [4] * 5  # 15 samples -> 4 padded batches, every epoch
    assert all(np.isfinite(hist.history["loss"]))
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))


def _order(ds):
    return [int(x["id"]) for x, _ in ds]


def test_shuffle_files_is_seeded_per_pass(records):
    paths, truth = records

    def make():
        return kerasfeed.from_files(paths, read_jsonl_records, shuffle_files=True, seed=3, cycle_length=1)

    a, b = make(), make()
    passes_a = [_order(a) for _ in range(4)]
    passes_b = [_order(b) for _ in range(4)]
    assert passes_a == passes_b  # same seed, same sequence of per-pass orders
    for order in passes_a:
        assert sorted(order) == sorted(truth)
        files = [i // 1000 for i in order]
        assert files == sorted(files, key=files.index)  # cycle_length=1: whole files in a row
    assert len({tuple(o) for o in passes_a}) > 1  # the file order changes between passes
    assert _order(kerasfeed.from_files(paths, read_jsonl_records, cycle_length=1)) == sorted(truth)


def test_shuffle_buffer_is_seeded_and_new_every_pass(records):
    paths, truth = records

    def make():
        return kerasfeed.from_files(paths, read_jsonl_records, shuffle_buffer=15, seed=7)

    a, b = make(), make()
    passes_a = [_order(a) for _ in range(3)]
    assert passes_a == [_order(b) for _ in range(3)]
    assert all(sorted(o) == sorted(truth) for o in passes_a)
    assert passes_a[0] != passes_a[1]


def test_read_fn_may_return_a_list_and_files_may_be_empty(tmp_path):
    paths = []
    for f, n in enumerate([2, 0, 3]):
        path = tmp_path / f"part{f}.npy"
        np.save(path, np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 100 * f)
        paths.append(path)  # os.PathLike is fine

    def read_rows(path):
        return list(np.load(path))  # a list of (3,) samples

    ds = kerasfeed.from_files(paths, read_rows, batch_size=2)
    rows = np.concatenate([b.numpy() for b in ds])
    assert ds.element_spec.dtype == tf.float64
    assert sorted(rows[:, 0].tolist()) == [0.0, 3.0, 200.0, 203.0, 206.0]


def test_read_fn_error_names_the_file_and_samples_before(records, tmp_path):
    paths, _ = records
    with open(paths[1], "a") as fh:
        fh.write('{"id": 1005, "tokens": [[1, 2, 3, 4]], "label": \n')  # a truncated record
    ds = kerasfeed.from_files(paths, read_jsonl_records, output_signature=(
        {"tokens": tf.TensorSpec([None, 4], tf.float32), "id": tf.TensorSpec([], tf.int64)},
        tf.TensorSpec([], tf.int32),
    ))
    got = []
    with pytest.raises(tf.errors.OpError) as info:
        for x, _ in ds:
            got.append(int(x["id"]))
    msg = str(info.value)
    assert f"kerasfeed: read_jsonl_records('{paths[1]}') (file 1 of 3) raised JSONDecodeError after 5 items" in msg
    assert "Original traceback" in msg and "json.loads(line)" in msg
    # every sample before the failure point was delivered
    assert {0, 1, 2, 1000, 1001, 1002, 1003, 1004} <= set(got)


def test_missing_file_while_probing(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(kerasfeed.StreamError, match=r"read_jsonl_records\('.*nope.jsonl'\) \(file 0 of 1\) raised FileNotFoundError after 0 items"):
        kerasfeed.from_files([missing], read_jsonl_records)


def test_sample_that_breaks_the_signature_names_the_file(tmp_path):
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps({"x": [0.0] * (5 if k == 3 else 4)}) + "\n" for k in range(5)))

    def read(p):
        with open(p) as fh:
            for line in fh:
                yield np.asarray(json.loads(line)["x"], np.float32)

    with pytest.raises(tf.errors.OpError, match=r"Item 3 of read\('.*wide.jsonl'\) \(file 0 of 1\), field item: expected shape \(4,\), received shape \(5,\)"):
        list(kerasfeed.from_files([path], read, probe=2))


def test_processes_executor_reads_the_same_samples(records):
    paths, truth = records
    ds = kerasfeed.from_files(paths, read_jsonl_records, executor="processes", workers=2, cycle_length=2)
    try:
        procs = _order(ds)
        assert sorted(procs) == sorted(truth)
        assert procs == _order(kerasfeed.from_files(paths, read_jsonl_records, cycle_length=2, workers=2))
    finally:
        ds._kerasfeed_stream.close()


def test_bad_arguments(records):
    paths, _ = records
    bad = [
        (dict(paths=[]), ValueError, "Received: paths=[]"),
        (dict(paths="a.jsonl"), TypeError, "Received: paths='a.jsonl'"),
        (dict(paths=[paths[0], 3]), TypeError, "Received: paths[1]=3"),
        (dict(read_fn="json"), TypeError, "Received: read_fn='json'"),
        (dict(shuffle_files=1), TypeError, "Received: shuffle_files=1"),
        (dict(seed="x"), TypeError, "Received: seed='x'"),
        (dict(shuffle_buffer=-2), ValueError, "Received: shuffle_buffer=-2"),
        (dict(executor="cluster"), ValueError, "Received: executor='cluster'"),
        (dict(drop_remainder=True), ValueError, "needs `batch_size`"),
        (dict(ragged=True), ValueError, "Received: ragged=True, batch_size=None"),
        (dict(padding_values=-1), ValueError, "Received: padding_values=-1, batch_size=None"),
    ]
    for kwargs, exc, text in bad:
        args = {"paths": paths, "read_fn": read_jsonl_records}
        args.update(kwargs)
        with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
            kerasfeed.from_files(args.pop("paths"), args.pop("read_fn"), **args)
    assert os.path.exists(paths[0])
