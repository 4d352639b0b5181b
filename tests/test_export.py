"""kerasfeed.export / load_export / verify_export / ExportSource: what goes in comes out."""

import json
import logging
import os
import pathlib
import pickle
import re

import numpy as np
import pytest
import tensorflow as tf
from _export_sources import Mixed, Passes, Work

import kerasfeed
from kerasfeed._leaves import as_array
from kerasfeed.exporting import encoding
from kerasfeed.exporting.spec import ExportSpec


def _items(ds):
    return list(ds.as_numpy_iterator())


def _assert_same(a, b):
    tf.nest.assert_same_structure(a, b)
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _op_types(ds):
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    ops = {n.op for n in graph.node}
    for f in graph.library.function:
        ops |= {n.op for n in f.node_def}
    return ops


@pytest.mark.parametrize("executor,compression", [("threads", None), ("processes", "GZIP")])
def test_load_export_equals_to_dataset_item_for_item(tmp_path, executor, compression):
    src = Mixed()
    workers = 2 if executor == "processes" else None
    manifest = kerasfeed.export(src, tmp_path / "out", num_shards=4, executor=executor, workers=workers,
                                compression=compression, progress=False)  # fmt: skip
    assert manifest["complete"] and [s["count"] for s in manifest["shards"]] == [4, 3, 3, 3]
    ds = kerasfeed.load_export(tmp_path / "out")
    # One stands in for the other: the same spec, leading dimension open as to_dataset leaves it.
    assert ds.element_spec == kerasfeed.to_dataset(src).element_spec
    assert ds.element_spec[1][0] == tf.TensorSpec([None, 3], tf.float32)
    assert ds.element_spec[0]["numbers"]["uint64"] == tf.TensorSpec([None, 2], tf.uint64)
    ref = kerasfeed.to_dataset(src, output_signature=ds.element_spec)
    assert ds.cardinality().numpy() == 13
    got, want = _items(ds), _items(ref)
    assert len(got) == len(want) == 13
    for a, b in zip(got, want):
        _assert_same(a, b)
    ops = _op_types(ds)
    assert "TFRecordDataset" in ops and "ParseExampleV2" in ops
    assert not {"PyFunc", "EagerPyFunc", "PyFuncStateless"} & ops


def test_records_are_plain_tf_train_examples(tmp_path):
    kerasfeed.export(Mixed(3), tmp_path, num_shards=1, executor="threads", progress=False)
    records = list(tf.data.TFRecordDataset(str(tmp_path / "shard-00000-of-00001.tfrecord")).as_numpy_iterator())
    assert len(records) == 3
    example = tf.train.Example.FromString(records[2])
    feature = example.features.feature
    assert list(feature["y/1"].bytes_list.value) == [b"item 2"]
    assert list(feature["x/numbers/int16:shape"].int64_list.value) == [2, 3]
    assert np.frombuffer(feature["x/numbers/float32"].bytes_list.value[0], "<f4").tolist() == Mixed()[2][0]["numbers"]["float32"].ravel().tolist()
    # TensorFlow's own serialization of the same message parses back to the same item.
    spec = ExportSpec.from_json(json.loads((tmp_path / "manifest.json").read_text())["element_spec"])
    _assert_same(encoding.decode(spec, example.SerializeToString()), encoding.decode(spec, records[2]))


def test_manifest_records_spec_counts_sizes_and_checksums(tmp_path):
    kerasfeed.export(Mixed(7), tmp_path, num_shards=3, executor="threads", progress=False)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert (m["num_items"], m["num_shards"], m["file_format"], m["kerasfeed_version"]) == (7, 3, "tfrecord", kerasfeed.__version__)
    fields = {f["name"]: f for f in m["element_spec"]["fields"]}
    assert fields["y[0]"]["shape"] == [None, 3] and fields["x['numbers']['uint32']"]["dtype"] == "uint32"
    for k, shard in enumerate(m["shards"]):
        path = tmp_path / shard["file"]
        assert shard["count"] == len(range(k, 7, 3)) and path.stat().st_size == shard["bytes"]
        assert shard["crc32c"] == f"{encoding.crc32c(path.read_bytes()):08x}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"] + [s["file"] for s in m["shards"]]
    assert kerasfeed.verify_export(tmp_path) == {"items": 7, "shards": 3, "bytes": sum(s["bytes"] for s in m["shards"])}


def test_sharded_and_shuffled_reads(tmp_path):
    class Ids(kerasfeed.SceneSequence):
        def __len__(self):
            return 21

        def __getitem__(self, i):
            return np.int64(i)

    kerasfeed.export(Ids(), tmp_path, num_shards=6, executor="threads", progress=False)
    for w in range(3):  # 6 files over 3 pipelines: exactly to_dataset's shards
        ctx = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=w)
        ds = kerasfeed.load_export(tmp_path, input_context=ctx)
        assert ds.cardinality().numpy() == 7 and ds.element_spec == tf.TensorSpec([], tf.int64)
        assert _items(ds) == _items(kerasfeed.to_dataset(Ids(), input_context=ctx))
    # Files {0,4}/{1,5}/{2}/{3} hold 7/7/4/3 items: equal steps would leave 9 of 21 unread, in silence.
    lost = r"shares would be \[7, 7, 4, 3\] items.* 9 of the 21 items would never be read\. Export with a number of "
    lost += r"shards divisible by 4 \(e\.g\. num_shards=8\), or read with a `num_shards` that divides 6 \(1, 2, 3, 6\)"
    with pytest.raises(ValueError, match=lost + r"\. Received: num_shards=4$"):
        kerasfeed.load_export(tmp_path, num_shards=4, shard_index=1)
    ctx = tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=0)
    with pytest.raises(ValueError, match=r"Received: input_context.num_input_pipelines=4$"):
        kerasfeed.load_export(tmp_path, input_context=ctx)
    halves = [_items(kerasfeed.load_export(tmp_path, num_shards=2, shard_index=w)) for w in range(2)]
    assert [len(h) for h in halves] == [10, 10] and sorted(sum(halves, [])) == list(range(20))
    ds = kerasfeed.load_export(tmp_path, shuffle_files=True, seed=3)
    first, second = _items(ds), _items(ds)
    assert sorted(first) == sorted(second) == list(range(21)) and first != second
    with pytest.raises(ValueError, match="the export has 6 files, fewer than the input pipelines.*Received: num_shards=7$"):
        kerasfeed.load_export(tmp_path, num_shards=7)


def test_fit_from_an_export(tmp_path):
    import keras

    class Xy(kerasfeed.SceneSequence):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            x = np.random.default_rng(i).standard_normal(4).astype("float32")
            return x, np.float32(x.sum())

    kerasfeed.export(Xy(), tmp_path, num_shards=2, executor="threads", progress=False)
    assert kerasfeed.load_export(tmp_path).element_spec == kerasfeed.to_dataset(Xy()).element_spec
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = model.fit(kerasfeed.load_export(tmp_path).batch(8), epochs=2, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()


def test_arrayrecord_export_as_a_random_access_source(tmp_path):
    src = Mixed(9)
    kerasfeed.export(src, tmp_path, num_shards=2, executor="threads", format="arrayrecord", compression="ZSTD", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir())[-1] == "shard-00001-of-00002.arrayrecord"
    back = kerasfeed.ExportSource(tmp_path, verify="checksum")
    assert len(back) == 9
    _assert_same(back[7], tf.nest.map_structure(as_array, src[7]))  # text as object arrays of bytes
    _assert_same(back[-1], tf.nest.map_structure(as_array, src[8]))
    back = pickle.loads(pickle.dumps(back))  # no open reader travels
    ds = kerasfeed.to_dataset(back, executor="processes", workers=2, shuffle=True, seed=1)
    ref = kerasfeed.to_dataset(src, shuffle=True, seed=1)
    for a, b in zip(_items(ds), _items(ref)):
        _assert_same(a, b)
    mixed = kerasfeed.mix([back, kerasfeed.ExportSource(tmp_path)], [2, 1])  # any indexable-source tool takes it
    assert len(_items(kerasfeed.to_dataset(mixed))) == len(mixed) > 0
    with pytest.raises(IndexError, match="holds 9 items. Received: index=9"):
        back[9]
    _assert_same(back[np.int32(4)], back[4])
    for odd in (1.0, "3", True, slice(0, 2)):  # no silent int(): as the HDF5 sequences
        with pytest.raises(TypeError, match=rf"ExportSource indices must be integers\. Received: index={re.escape(repr(odd))}$"):
            back[odd]
    with pytest.raises(kerasfeed.ExportError, match="load_export reads TFRecord exports.*ExportSource"):
        kerasfeed.load_export(tmp_path)


def test_export_runs_without_tensorflow(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests'); import kerasfeed; from _export_sources import Slow; "
        f"kerasfeed.export(Slow(8), {str(tmp_path)!r}, num_shards=2, executor='processes', workers=2, progress=False); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'google.protobuf')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(pathlib.Path(__file__).parent.parent))
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]
    assert kerasfeed.verify_export(tmp_path)["items"] == 8


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_export_probes_and_writes_pass_0_and_gives_the_epoch_back(tmp_path, executor):
    """A source left at pass 1 (by a fit or a to_dataset pass): the spec is probed from pass 0's items,
    which are the ones written, and the caller's source is at pass 1 again afterwards."""
    src = Passes(9)
    src.set_epoch(1)  # pass 1's items 0, 1, 2, 8 all hold 5 floats; pass 0's item 8 holds 3
    workers = 2 if executor == "processes" else None
    kerasfeed.export(src, tmp_path, num_shards=3, executor=executor, workers=workers, progress=False)
    assert src.epoch == 1
    items = _items(kerasfeed.load_export(tmp_path))
    assert [int(e) for e, _ in items] == [0] * 9 and [len(x) for _, x in items] == [5] * 8 + [3]
    assert kerasfeed.load_export(tmp_path).element_spec[1] == tf.TensorSpec([None], tf.float32)
    src.set_epoch(2)  # resume compares pass 0's spec too, whatever pass the source is at
    kerasfeed.export(src, tmp_path, num_shards=3, executor="threads", progress=False, resume=True)
    assert src.epoch == 2
    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 0, field y: expected shape \(2,\), received shape \(5,\)\. \(the spec given as"):
        kerasfeed.export(src, tmp_path / "narrow", num_shards=3, executor="threads", progress=False,
                         output_signature=(tf.TensorSpec([], tf.int64), tf.TensorSpec([2], tf.float32)))  # fmt: skip
    assert src.epoch == 2  # after a failure too


@pytest.mark.parametrize(
    "work, lock, chosen, why",
    [
        ("wait", False, "threads", "mostly waits"),
        ("spin", False, "processes", "GIL-bound"),
        ("spin", True, "threads", "falls back to threads: .*lock"),
    ],
)
def test_export_auto_executor_chooses_like_to_dataset(tmp_path, caplog, work, lock, chosen, why):
    """executor="auto" probes the source (not the shard tasks), logs its choice and exports every item."""
    with caplog.at_level(logging.INFO, logger="kerasfeed"):
        kerasfeed.export(Work(16, work, lock), tmp_path, num_shards=4, executor="auto", workers=2, progress=False)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert re.search(why, logged) and "export(executor='auto') for Work: auto chose" in logged, logged
    items = list(kerasfeed.load_export(tmp_path).as_numpy_iterator())
    assert [int(i) for i, _ in items] == list(range(16))
    in_here = {int(pid) for _, pid in items} == {os.getpid()}
    assert in_here == (chosen == "threads"), (chosen, {int(pid) for _, pid in items})
    with pytest.raises(ValueError, match=r"`executor` must be one of \('threads', 'processes', 'auto'\). Received: executor='fork'"):
        kerasfeed.export(Work(4, "wait"), tmp_path / "x", num_shards=2, executor="fork")
    with pytest.raises(ValueError, match=r"must be one of \(None, 'GZIP', 'ZLIB'\). Received: compression='zip'$"):
        kerasfeed.export(Work(4, "wait"), tmp_path / "x", num_shards=2, compression="zip")  # as given, not 'ZIP'


class _OneTuple(kerasfeed.SceneSequence):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return (np.array([i], "int64"),)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_1_tuple_item_stays_one_in_to_dataset_and_load_export(tmp_path, executor):
    # to_dataset's unbatched path gave the bare tensor (its rows split by from_tensor_slices), while its
    # batched path, tf.data's from_generator and load_export keep the 1-tuple.
    kerasfeed.export(_OneTuple(), tmp_path, num_shards=2, executor="threads", progress=False)
    ds = kerasfeed.to_dataset(_OneTuple(), executor=executor)
    spec = (tf.TensorSpec((None,), tf.int64),)
    assert ds.element_spec == spec == kerasfeed.load_export(tmp_path).element_spec
    got = list(ds.as_numpy_iterator())
    assert [type(x) for x in got] == [tuple] * 5
    _assert_same(got, list(kerasfeed.load_export(tmp_path).as_numpy_iterator()))
