"""SceneSequence and to_dataset with the threads executor: values, order, shuffling, epochs, errors."""

import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed


class Ramp(kerasfeed.SceneSequence):
    """Batch i: x filled with i (plus column offsets), y = i % 2."""

    def __init__(self, n=6, batch=4, last=None, **kwargs):
        super().__init__(**kwargs)
        self.n, self.batch, self.last = n, batch, last
        self.events = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        b = self.last if (self.last and i == self.n - 1) else self.batch
        x = np.full((b, 3), i, np.float32) + np.arange(3, dtype=np.float32)
        y = np.full((b, 1), i % 2, np.float32)
        return x, y

    def on_epoch_begin(self):
        self.events.append("begin")

    def on_epoch_end(self):
        super().on_epoch_end()
        self.events.append("end")


def _tiny_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_values_and_order_match_getitem():
    seq = Ramp(n=5, last=2)
    ds = kerasfeed.to_dataset(seq)
    assert ds.element_spec[0].shape.as_list() == [None, 3]  # last batch is short
    assert int(ds.cardinality()) == 5
    # On a dataset nothing else holds (it held the dataset weakly: freed between the lookup and the call).
    assert int(kerasfeed.to_dataset(Ramp(n=5, last=2)).cardinality()) == 5 == len(kerasfeed.to_dataset(seq))
    method = kerasfeed.to_dataset(seq, batch_size=2).cardinality
    assert int(method()) == 3
    got = [(x.numpy(), y.numpy()) for x, y in ds]
    assert len(got) == 5
    for i, (x, y) in enumerate(got):
        ex, ey = seq[i]
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_fit_seq_and_fit_dataset_train_identically():
    seq = Ramp(n=6)
    m1 = _tiny_model()
    m1.fit(seq, epochs=2, shuffle=False, verbose=0)
    m2 = _tiny_model()
    m2.fit(kerasfeed.to_dataset(seq), epochs=2, verbose=0)
    for a, b in zip(m1.get_weights(), m2.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # and the models did train (weights moved from the shared start)
    m0 = _tiny_model()
    assert any(not np.allclose(a, b) for a, b in zip(m0.get_weights(), m1.get_weights()))


def test_fit_seq_keras_workers_threads_and_processes():
    for kwargs in ({"workers": 2}, {"workers": 2, "use_multiprocessing": True}):
        seq = Ramp(n=4, **kwargs)
        hist = _tiny_model().fit(seq, epochs=1, verbose=0)
        assert np.isfinite(hist.history["loss"][0])


def test_epoch_hooks_fire_once_per_pass():
    seq = Ramp(n=3)
    ds = kerasfeed.to_dataset(seq)
    for _ in range(3):
        assert len(list(ds)) == 3
    assert seq.events == ["begin", "end"] * 3
    assert seq.epoch == 3
    seq2 = Ramp(n=3)
    _tiny_model().fit(kerasfeed.to_dataset(seq2), epochs=2, verbose=0)
    assert seq2.events == ["begin", "end"] * 2


def test_seeded_shuffle_reproducible_and_new_per_epoch():
    class Idx:
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return np.int64(i)

    def orders(seed, passes=3):
        ds = kerasfeed.to_dataset(Idx(), shuffle=True, seed=seed)
        return [[int(v) for v in ds] for _ in range(passes)]

    a, b = orders(7), orders(7)
    assert a == b  # same seed, same sequence of epoch orders
    for order in a:
        assert sorted(order) == list(range(50))  # a permutation
    assert a[0] != a[1] and a[1] != a[2]  # drawn anew every pass
    assert a[0] != list(range(50))
    assert orders(8)[0] != a[0]


def test_samples_batched_with_drop_remainder():
    class Samples:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"a": np.array([i, -i], np.int32)}, np.float64(i)

    ds = kerasfeed.to_dataset(Samples(), batch_size=4)
    batches = list(ds)
    assert [int(b[1].shape[0]) for b in batches] == [4, 4, 2]
    np.testing.assert_array_equal(batches[2][0]["a"].numpy(), [[8, -8], [9, -9]])
    assert batches[0][1].dtype == tf.float64
    ds = kerasfeed.to_dataset(Samples(), batch_size=4, drop_remainder=True)
    assert [int(b[1].shape[0]) for b in ds] == [4, 4]
    assert ds.element_spec[1].shape.as_list() == [4]


class VarLen:
    """The classic from_indexable recipe: items whose length varies."""

    def __len__(self):
        return 7

    def __getitem__(self, i):
        return np.arange(i + 1, dtype=np.float32), np.int64(i)


def test_variable_shape_unbatched_signature_has_none():
    ds = kerasfeed.to_dataset(VarLen())
    assert ds.element_spec[0].shape.as_list() == [None]
    lengths = [int(x.shape[0]) for x, _ in ds]
    assert lengths == [1, 2, 3, 4, 5, 6, 7]


def test_variable_shape_batched_padded_and_ragged():
    ds = kerasfeed.to_dataset(VarLen(), batch_size=3)
    first = next(iter(ds))[0].numpy()
    np.testing.assert_array_equal(first, [[0, 0, 0], [0, 1, 0], [0, 1, 2]])
    ds = kerasfeed.to_dataset(VarLen(), batch_size=3, ragged=True)
    x, y = next(iter(ds))
    assert isinstance(x, tf.RaggedTensor)
    assert x.to_list() == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
    assert [int(v) for v in y] == [0, 1, 2]


def test_one_padding_value_fits_every_leaf_alike_in_to_dataset_to_loader_and_streams():
    # padded_batch took a scalar only of each leaf's exact dtype: -1 failed on float32 with a bare TypeError.
    class Mixed:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"f": np.arange(i + 1, dtype=np.float32), "u": np.arange(i + 1, dtype=np.uint8)}, np.int32(i)

    def as_lists(batches):
        return [({k: np.asarray(v).tolist() for k, v in x.items()}, np.asarray(y).tolist()) for x, y in batches]

    expected = [({"f": [[0, -1], [0, 1]], "u": [[0, 0], [0, 1]]}, [0, 1]), ({"f": [[0, 1, 2]], "u": [[0, 1, 2]]}, [2])]
    padding = ({"f": -1, "u": 0}, 0)
    assert as_lists(kerasfeed.to_dataset(Mixed(), batch_size=2, padding_values=padding)) == expected
    assert as_lists(kerasfeed.to_loader(Mixed(), batch_size=2, padding_values=padding)) == expected
    streamed = kerasfeed.from_generators(lambda k: iter([Mixed()[k]]), 3, batch_size=2, padding_values=padding)
    assert as_lists(streamed) == expected
    assert as_lists(kerasfeed.to_dataset(Mixed(), batch_size=2, padding_values=0)) == as_lists(
        kerasfeed.to_loader(Mixed(), batch_size=2)
    )
    for make in (kerasfeed.to_dataset, kerasfeed.to_loader):
        with pytest.raises(ValueError, match=r"for field x\['u'\] must fit its dtype uint8.*become 255.*Received: -1$"):
            make(Mixed(), batch_size=2, padding_values=-1)
        with pytest.raises(ValueError, match=r"for field x\['u'\] must fit its dtype uint8.*Received: 0.5$"):
            make(Mixed(), batch_size=2, padding_values=({"f": 0, "u": 0.5}, 0))
        # A leaf no shape of which varies is never padded: a scalar it cannot hold is no error there.
        named = [(np.arange(i + 1, dtype=np.float32), f"s{i}") for i in range(3)]
        (x, names), _ = ((np.asarray(a), np.asarray(b)) for a, b in make(named, batch_size=2, padding_values=-1))
        assert x.tolist() == [[0, -1], [0, 1]] and names.tolist() == [b"s0", b"s1"]
        with pytest.raises(ValueError, match=r"one scalar or a nest shaped like the items \(\(\{'f': array, 'u': arr"):
            make(Mixed(), batch_size=2, padding_values=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"for field x\['f'\] \(float32\) must be a number. Received: 'x'"):
        kerasfeed.to_dataset(Mixed(), batch_size=2, padding_values="x")
    with pytest.raises(ValueError, match=r"give one of them. Received: ragged=True, padding_values=-1"):
        kerasfeed.to_dataset(Mixed(), batch_size=2, ragged=True, padding_values=-1)


def test_dtypes_float64_int_bool_bytes_str():
    class Mixed:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {
                "f64": np.float64(i) / 3,
                "i32": np.array([i], np.int32),
                "u8": np.uint8(i),
                "flag": np.array([i % 2 == 0, True]),
                "name": f"scene-{i}",
                "raw": np.array([b"ab", b"c" * i], dtype=object),
            }

    ds = kerasfeed.to_dataset(Mixed())
    spec = ds.element_spec
    assert spec["name"].dtype == tf.string and spec["flag"].dtype == tf.bool
    items = list(ds)
    assert items[2]["name"].numpy() == b"scene-2"
    assert items[2]["raw"].numpy().tolist() == [b"ab", b"cc"]
    assert items[1]["f64"].dtype == tf.float64 and abs(float(items[1]["f64"]) - 1 / 3) < 1e-12
    assert items[1]["flag"].numpy().tolist() == [False, True]
    assert items[2]["u8"].dtype == tf.uint8


def test_output_signature_overrides_inference():
    sig = (tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64))
    ds = kerasfeed.to_dataset(VarLen(), output_signature=sig, probe=1)
    assert ds.element_spec == sig
    assert len(list(ds)) == 7


def test_device_prefetch_on_cpu_device():
    ds = kerasfeed.to_dataset(Ramp(n=3), device="/cpu:0")
    xs = [x for x, _ in ds]
    assert len(xs) == 3 and "CPU" in xs[0].device
    _tiny_model().fit(ds, epochs=1, verbose=0)


# ---------------------------------------------------------------- errors


class Broken(kerasfeed.SceneSequence):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            self._explode(i)
        return np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32)

    def _explode(self, i):
        raise KeyError(f"scene {i} has no 'points' dataset")


def test_getitem_error_in_iteration_names_index_type_and_traceback():
    ds = kerasfeed.to_dataset(Broken())
    with pytest.raises(tf.errors.OpError) as info:
        list(ds)
    msg = str(info.value)
    assert "Broken[5] raised KeyError" in msg
    assert "scene 5 has no 'points' dataset" in msg
    assert "in _explode" in msg and "Original traceback" in msg


def test_getitem_error_in_model_fit():
    with pytest.raises(tf.errors.OpError, match=r"Broken\[5\] raised KeyError"):
        _tiny_model().fit(kerasfeed.to_dataset(Broken()), epochs=1, verbose=0)


def test_getitem_error_while_probing_is_item_error():
    class FirstFails:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise ValueError("cannot open shard")

    with pytest.raises(kerasfeed.ItemError, match=r"FirstFails\[0\] raised ValueError: cannot open shard") as info:
        kerasfeed.to_dataset(FirstFails())
    assert info.value.index == 0 and info.value.exc_type == "ValueError"


def test_signature_break_names_index_field_expected_and_received():
    class ShapeBreak:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            n = 5 if i == 4 else 2  # the batch dimension (first) may vary; this one may not
            return {"image": np.zeros((4, n), np.float32)}, np.zeros(4, np.int64)

    with pytest.raises(tf.errors.OpError) as info:
        list(kerasfeed.to_dataset(ShapeBreak()))
    msg = str(info.value)
    assert "Item 4, field x['image']: expected shape (None, 2), received shape (4, 5)" in msg

    class DtypeBreak:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return np.zeros(3, np.float64 if i == 3 else np.float32), np.int64(i)

    with pytest.raises(tf.errors.OpError, match=r"Item 3, field x: expected dtype float32, received float64"):
        list(kerasfeed.to_dataset(DtypeBreak()))

    class StructBreak:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return (np.zeros(3), np.zeros(1)) if i != 2 else np.zeros(3)

    with pytest.raises(tf.errors.OpError, match=r"Item 2 does not match the dataset's structure: expected \(array, array\), received array"):
        list(kerasfeed.to_dataset(StructBreak(), output_signature=(tf.TensorSpec([3], tf.float64), tf.TensorSpec([1], tf.float64))))

    class NoneAt(StructBreak):
        def __init__(self, at):
            self.at = at

        def __len__(self):
            return 12

        def __getitem__(self, i):
            return None if i == self.at else (np.zeros(3), np.zeros(1))

    class Compound(StructBreak):  # TensorFlow has no compound dtype: the field and the item are named
        def __getitem__(self, i):
            return {"x": np.zeros(2, "float32"), "rec": np.zeros(2, [("a", "i4")])}

    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 0, field \['rec'\]: Unsupported dtype \[\('a', '<i4'\)\]"):
        kerasfeed.to_dataset(Compound())

    # "received array" / "is array" before, for an item that is None (a probed one, or one after)
    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 7 does not match the loader's structure: expected "
                       r"\(array, array\), received None\."):
        list(kerasfeed.to_loader(NoneAt(7), batch_size=2))
    with pytest.raises(kerasfeed.SignatureError, match=r"item 0 is \(array, array\) but item 2 is None\."):
        kerasfeed.to_loader(NoneAt(2), batch_size=2)

    class GeneratorAt(NoneAt):  # a generator returned by mistake after the probes was "received array"
        def __getitem__(self, i):
            item = (np.zeros(3), np.zeros(1))
            return (x for x in item) if i == self.at else item

    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 7 does not match the loader's structure: expected "
                       r"\(array, array\), received an object of type generator\."):
        list(kerasfeed.to_loader(GeneratorAt(7), batch_size=2))
    # A dtype that changes is no shape: its message said "(None in a shape means any size; ...)"
    with pytest.raises(kerasfeed.SignatureError, match=r"^Item 3, field x: expected dtype float32, received "
                       r"float64\. \(every item must give a field the dtype the probed items gave it\.\)$"):
        list(kerasfeed.to_loader(DtypeBreak(), batch_size=2))


def test_probe_detects_inconsistent_dtypes():
    class Drift:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.zeros(2, np.float32 if i == 0 else np.int32)

    with pytest.raises(kerasfeed.SignatureError, match="Field item changes dtype: item 0 has float32, item 1 has int32"):
        kerasfeed.to_dataset(Drift())


def test_a_string_leaf_where_numbers_were_probed_is_named_as_strings_with_its_value():
    class TextAt:  # str where float32 arrays were: it became an object array, reported as "object" before
        def __init__(self, at):
            self.at = at

        def __len__(self):
            return 64

        def __getitem__(self, i):
            return "oops" if i == self.at else np.zeros(2, np.float32)

    with pytest.raises(kerasfeed.SignatureError, match=r"item 0 has float32, item 1 has object \(strings \(b?'oops'"):
        kerasfeed.to_loader(TextAt(1), batch_size=2)
    with pytest.raises(kerasfeed.SignatureError, match=r"Item 40, field item: expected dtype float32, received "
                                                       r"strings \(b?'oops'\.\.\.\)"):
        list(kerasfeed.to_loader(TextAt(40), batch_size=2, executor="threads"))


def test_bad_sources_and_arguments():
    class Empty:
        def __len__(self):
            return 0

        def __getitem__(self, i):
            raise IndexError(i)

    with pytest.raises(ValueError, match="empty: len\\(Empty\\) is 0"):
        kerasfeed.to_dataset(Empty())
    with pytest.raises(TypeError, match="indexable source.*Received: 42"):
        kerasfeed.to_dataset(42)
    with pytest.raises(TypeError, match="indexable source"):
        kerasfeed.to_dataset(x for x in range(3))
    seq = Ramp(n=2)
    bad = [
        (dict(batch_size=0), ValueError, "batch_size=0"),
        (dict(batch_size="8"), ValueError, "batch_size='8'"),
        (dict(num_parallel_calls=-5), ValueError, "num_parallel_calls=-5"),
        (dict(prefetch=-3), ValueError, "prefetch=-3"),
        (dict(shuffle="yes"), TypeError, "shuffle='yes'"),
        (dict(seed="abc", shuffle=True), TypeError, "Received: seed='abc'"),
        (dict(seed=-1, shuffle=True), ValueError, "Received: seed=-1"),
        (dict(executor="gpu"), ValueError, "Received: 'gpu'"),
        (dict(drop_remainder=True), ValueError, "needs `batch_size`"),
        (dict(padding_values=0), ValueError, "`padding_values` needs `batch_size`; items are already batches"),
        (dict(ragged=True), ValueError, "`ragged` needs `batch_size`; items are already batches"),
        (dict(batch_size=5, drop_remainder=True), ValueError, "each pass has 2 items"),
        (dict(num_shards=3), ValueError, "num_shards=3"),
        (dict(num_shards=2, shard_index=2), ValueError, "shard_index=2"),
        (dict(num_shards=2, shuffle=True), ValueError, "explicit `seed`"),
        (dict(device=0), TypeError, "device=0"),
        (dict(output_signature="float32"), TypeError, "Received: 'float32'"),
    ]
    for kwargs, exc, text in bad:
        with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            kerasfeed.to_dataset(seq, **kwargs)


def test_latency_bound_source_keeps_more_calls_in_flight_than_cores():
    """A waiting source is called concurrently far past the core count.

    Counted, not timed (the benchmark reports the speed-up): the peak number
    of `__getitem__` calls running at once."""

    class Sleepy:
        def __init__(self):
            self.lock, self.running, self.peak = threading.Lock(), 0, 0

        def __len__(self):
            return 300

        def __getitem__(self, i):
            with self.lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            time.sleep(0.005)
            with self.lock:
                self.running -= 1
            return np.float32(i)

    src = Sleepy()
    ds = kerasfeed.to_dataset(src)
    assert [float(x) for x in ds] == list(range(300))
    assert src.peak >= 16, f"only {src.peak} calls in flight at once"


def test_import_is_light_and_public_api_resolves():
    import subprocess
    import sys

    code = (
        "import sys, kerasfeed; "
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules and 'h5py' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'h5py'))[:5]; "
        "print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    for name in kerasfeed.__all__:
        assert getattr(kerasfeed, name) is not None
    # Tab completion shows the API, not what __init__ imports for itself.
    shown = [n for n in dir(kerasfeed) if not n.startswith("_")]
    assert sorted(shown) == sorted(n for n in kerasfeed.__all__ if not n.startswith("_")), shown
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kerasfeed.nope


def test_index_order_validation_and_purity():
    order = kerasfeed.IndexOrder(10, shuffle=True, seed=3)
    np.testing.assert_array_equal(order.indices(4), kerasfeed.IndexOrder(10, shuffle=True, seed=3).indices(4))
    assert kerasfeed.IndexOrder(4).indices(9).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="Received: length=0"):
        kerasfeed.IndexOrder(0)
    with pytest.raises(TypeError, match="Received: seed=1.5"):
        kerasfeed.IndexOrder(3, shuffle=True, seed=1.5)


def test_epoch_numbering_matches_between_fit_seq_and_to_dataset():
    class Epochs(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __len__(self):
            return 2

        def __getitem__(self, i):
            self.seen.append(self.epoch)
            return np.zeros((2, 3), np.float32), np.zeros((2, 1), np.float32)

    a = Epochs()
    _tiny_model().fit(a, epochs=3, shuffle=False, verbose=0)
    b = Epochs()
    _tiny_model().fit(kerasfeed.to_dataset(b, output_signature=(tf.TensorSpec([2, 3]), tf.TensorSpec([2, 1]))), epochs=3, verbose=0, shuffle=False)
    assert sorted(set(a.seen)) == sorted(set(b.seen)) == [0, 1, 2]
    assert a.epoch == b.epoch == 3


def test_executor_of_finds_the_executor_of_derived_datasets():
    import kerasfeed

    class Src:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.full((2,), i, np.float32)

    ds = kerasfeed.to_dataset(Src())
    ex = kerasfeed.executor_of(ds)
    assert ex.name == "threads"
    derived = ds.map(lambda x: x * 2).batch(2).prefetch(1)
    assert kerasfeed.executor_of(derived) is ex
    with pytest.raises(ValueError, match=r"needs a dataset made by kerasfeed\.to_dataset.*Received: _RangeDataset"):
        kerasfeed.executor_of(tf.data.Dataset.range(3))
    # Both lookups name to_loader too: its loaders have an executor and stats.
    with pytest.raises(ValueError, match=r"or a kerasfeed\.to_loader loader\. Received: list"):
        kerasfeed.executor_of([1, 2])
    with pytest.raises(ValueError, match=r"needs a dataset or loader made by kerasfeed \(to_dataset, to_loader,.*Received: list"):
        kerasfeed.stats([1, 2])
    loader = kerasfeed.to_loader(Src())
    assert kerasfeed.executor_of(loader).name == "threads" and kerasfeed.stats(loader)["items"] == 0


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_text_leaves_keep_trailing_nul_bytes(executor):
    """bytes and str items reach TensorFlow byte for byte (numpy's S/U dtypes drop trailing NULs)."""

    class Texts:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"raw": b"ab\x00\x00" * (i + 1), "text": "\u00e9\x00", "many": np.array([b"x\x00", b"\x00"], dtype=object)}

    got = list(kerasfeed.to_dataset(Texts(), executor=executor))
    assert [x["raw"].numpy() for x in got] == [b"ab\x00\x00" * (i + 1) for i in range(3)]
    assert got[0]["text"].numpy() == "\u00e9\x00".encode("utf-8")
    assert list(got[1]["many"].numpy()) == [b"x\x00", b"\x00"]


class _Growing(kerasfeed.SceneSequence):
    def __init__(self):
        super().__init__()
        self.n = 4

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, self.n], "int64")

    def on_epoch_end(self):
        self.n += 2


def test_a_length_changed_in_on_epoch_end_is_said_once(caplog):
    # Later passes read the first length, as before, but no longer in silence.
    with caplog.at_level("WARNING", logger="kerasfeed"):
        with kerasfeed.to_loader(_Growing(), executor="threads", batch_size=2) as loader:
            passes = [[row.tolist() for batch in loader for row in batch] for _ in range(3)]
    assert [[i for i, _ in p] for p in passes] == [[0, 1, 2, 3]] * 3
    said = [r.getMessage() for r in caplog.records if "length changed" in r.getMessage()]
    assert said == ["kerasfeed: _Growing's length changed from 4 to 6 in on_epoch_end; every pass reads 4 items "
                    "(its order was made for that length). Make a new dataset or loader to read the new length."]
