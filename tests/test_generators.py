"""kerasfeed.from_generators: parallel generators, interleave order, errors."""

import functools
import gc
import os
import pickle
import random
import re
import signal
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from _util import wait_until

import kerasfeed
from kerasfeed.datasets.synthetic_streams import busy_generator, sleepy_image_mask

INT = tf.TensorSpec([], tf.int64)


def numbered(i, sizes=(3, 0, 5, 1, 4, 2, 6), jitter=0.0, seed=None):
    """Shard i yields i*100 + k for k < sizes[i % len(sizes)], with random waits."""
    rng = random.Random(None if seed is None else seed * 1000 + i)
    for k in range(sizes[i % len(sizes)]):
        if jitter:
            time.sleep(rng.random() * jitter)
        yield np.int64(i * 100 + k)


def tf_interleave_reference(num_shards, cycle_length, block_length, sizes=(3, 0, 5, 1, 4, 2, 6)):
    def gen(i):
        return numbered(int(i), sizes)

    ds = tf.data.Dataset.range(num_shards).interleave(
        lambda i: tf.data.Dataset.from_generator(gen, args=(i,), output_signature=INT),
        cycle_length=cycle_length,
        block_length=block_length,
    )
    return [int(v) for v in ds]


def values(ds):
    return [int(v) for v in ds]



def producer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kerasfeed-generator-shard")]


# ---------------------------------------------------------------- the classic case


def test_classic_100_sleepy_generators_overlap():
    """100 generators x 0.1 s run concurrently (from_generator runs them one after another).

    Counted, not timed: the benchmark reports the speed-up."""
    lock, state = threading.Lock(), {"running": 0, "peak": 0}

    def factory(k):
        with lock:
            state["running"] += 1
            state["peak"] = max(state["peak"], state["running"])
        try:
            yield from sleepy_image_mask(k, delay=0.1, size=16)
        finally:
            with lock:
                state["running"] -= 1

    ds = kerasfeed.from_generators(factory, 100)
    assert ds.element_spec[0].shape.as_list() == [16, 16, 3]
    assert ds.element_spec[1].shape.as_list() == [16, 16] and ds.element_spec[1].dtype == tf.int32
    got = [(image.numpy(), mask.numpy()) for image, mask in ds]
    assert len(got) == 100
    assert state["peak"] >= 16, f"only {state['peak']} generators ran at once"
    for i, (image, mask) in enumerate(got):  # every pair once, in shard order, right content
        assert image.shape == (16, 16, 3) and np.all(image == i)
        assert mask.sum() == (16 * 8 if i % 2 else 0)


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("cycle_length,block_length", [(1, 1), (2, 1), (3, 2), (4, 3), (7, 1)])
def test_deterministic_order_equals_tf_interleave(cycle_length, block_length):
    factory = functools.partial(numbered, jitter=0.004, seed=cycle_length)
    ds = kerasfeed.from_generators(
        factory, 9, cycle_length=cycle_length, block_length=block_length, workers=8, output_signature=INT
    )
    expected = tf_interleave_reference(9, cycle_length, block_length)
    assert values(ds) == expected  # the random waits change timing, not order
    assert values(ds) == expected  # and again on the next pass


def test_order_does_not_depend_on_workers_when_cycle_length_is_fixed():
    orders = [
        values(kerasfeed.from_generators(numbered, 7, cycle_length=2, workers=w, output_signature=INT))
        for w in (2, 5, 7)
    ]
    assert orders[0] == orders[1] == orders[2] == tf_interleave_reference(7, 2, 1)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_cycle_longer_than_the_shards_runs_with_the_default_workers(executor):
    """tf.data cycles over the shards there are: cycle_length=5 over 3 shards needs 3 workers, and the
    default gives them (it was refused, naming a `workers=3` the caller never passed)."""
    ds = kerasfeed.from_generators(numbered, 3, cycle_length=5, block_length=2, executor=executor,
                                   output_signature=INT)
    assert values(ds) == tf_interleave_reference(3, 5, 2)
    with pytest.raises(ValueError, match=r"`cycle_length=5` is larger than `workers=2`.*Received: cycle_length=5, workers=2"):
        kerasfeed.from_generators(numbered, 4, cycle_length=5, workers=2, executor=executor)


def test_nondeterministic_mode_delivers_everything_as_it_arrives():
    def slow_first(i):
        if i == 0:
            time.sleep(0.5)
        for k in range(3):
            yield np.int64(i * 100 + k)

    ds = kerasfeed.from_generators(slow_first, 6, deterministic=False, output_signature=INT)
    got = values(ds)
    assert sorted(got) == sorted(i * 100 + k for i in range(6) for k in range(3))
    assert got[0] // 100 != 0  # shard 0 is late: arrival order does not wait for it
    assert got.index(0) < got.index(1) < got.index(2)  # a shard's own items stay in order
    # the deterministic mode waits for shard 0
    assert values(kerasfeed.from_generators(slow_first, 6, output_signature=INT))[0] == 0


def test_prefetch_to_a_device_and_without_prefetch():
    on_device = kerasfeed.from_generators(numbered, 7, cycle_length=2, output_signature=INT, device="/cpu:0")
    plain = kerasfeed.from_generators(numbered, 7, cycle_length=2, output_signature=INT, prefetch=0)
    assert values(on_device) == values(plain) == tf_interleave_reference(7, 2, 1)


def test_every_pass_calls_the_factory_again():
    calls = []

    def factory(i):
        calls.append(i)
        yield np.int64(len(calls))

    ds = kerasfeed.from_generators(factory, 4, output_signature=INT)
    assert len(values(ds)) == 4
    assert len(values(ds)) == 4
    assert sorted(calls) == [0, 0, 1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------- structures and batching


def test_nested_items_variable_shapes_strings_and_batching():
    def records(i):
        for k in range(i + 1):
            n = 1 + (i + k) % 4
            yield {"points": np.full((n, 3), i, np.float32), "name": f"s{i}-{k}"}, np.int32(k)

    ds = kerasfeed.from_generators(records, 4, cycle_length=2)
    spec_x, spec_y = ds.element_spec
    assert spec_x["points"].shape.as_list() == [None, 3]  # probed across shards
    assert spec_x["name"].dtype == tf.string and spec_y.dtype == tf.int32
    items = [(x["points"].numpy(), x["name"].numpy().decode(), int(y)) for x, y in ds]
    assert sorted(name for _, name, _ in items) == sorted(f"s{i}-{k}" for i in range(4) for k in range(i + 1))
    for points, name, k in items:
        i = int(name[1])
        assert points.shape == (1 + (i + k) % 4, 3) and np.all(points == i)

    padded = list(kerasfeed.from_generators(records, 4, cycle_length=2, batch_size=4))
    assert [int(b[1].shape[0]) for b in padded] == [4, 4, 2]
    first = padded[0][0]["points"].numpy()
    assert first.shape[1] == max(p.shape[0] for p, _, _ in items[:4])
    ragged = list(kerasfeed.from_generators(records, 4, cycle_length=2, batch_size=4, ragged=True))
    assert isinstance(ragged[0][0]["points"], tf.RaggedTensor)
    np.testing.assert_array_equal(ragged[0][0]["points"][1].numpy(), items[1][0])
    dropped = list(kerasfeed.from_generators(records, 4, cycle_length=2, batch_size=4, drop_remainder=True))
    assert len(dropped) == 2


def test_trains_with_model_fit():
    def samples(i):
        rng = np.random.default_rng(i)
        for _ in range(8):
            y = rng.integers(0, 2)
            yield rng.normal(2.0 * y - 1.0, 1.0, size=4).astype(np.float32), np.float32(y)

    ds = kerasfeed.from_generators(samples, 8, batch_size=8, shuffle_buffer=32, seed=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", metrics=[keras.metrics.BinaryAccuracy()])
    hist = model.fit(ds, epochs=4, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert hist.history["binary_accuracy"][-1] > 0.7


# ---------------------------------------------------------------- errors


def _explode(i):
    raise ValueError(f"sensor {i} went offline")


def broken(i):
    yield np.int64(i)
    yield np.int64(i + 1)
    if i == 2:
        _explode(i)
    yield np.int64(i + 2)


def test_generator_error_names_shard_items_and_original_traceback():
    ds = kerasfeed.from_generators(broken, 4, cycle_length=1, output_signature=INT)
    it = iter(ds)
    before = [int(next(it)) for _ in range(8)]  # shards 0, 1 and shard 2's first two items
    assert before == [0, 1, 2, 1, 2, 3, 2, 3]
    with pytest.raises(tf.errors.OpError) as info:
        next(it)
    msg = str(info.value)
    assert "kerasfeed: broken(2) (generator shard 2 of 4) raised ValueError after 2 items: sensor 2 went offline" in msg
    assert "Original traceback" in msg and "in _explode" in msg


def test_generator_error_reaches_model_fit():
    def samples(i):
        for k in range(4):
            if i == 3 and k == 2:
                raise KeyError("label file missing")
            yield np.zeros(2, np.float32), np.float32(k)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    ds = kerasfeed.from_generators(samples, 5, batch_size=2, probe=2)
    with pytest.raises(tf.errors.OpError, match=r"samples\(3\) \(generator shard 3 of 5\) raised KeyError after 2 items: 'label file missing'"):
        model.fit(ds, epochs=1, verbose=0)


def test_factory_error_while_probing_is_a_stream_error():
    def factory(i):
        raise FileNotFoundError(f"shard-{i}.bin")

    with pytest.raises(kerasfeed.StreamError, match=r"factory\(0\) \(generator shard 0 of 3\) raised FileNotFoundError after 0 items: shard-0.bin") as info:
        kerasfeed.from_generators(factory, 3)
    err = info.value
    assert err.index == 0 and err.items_before == 0 and err.exc_type == "FileNotFoundError"
    assert isinstance(err, kerasfeed.ItemError)
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.what == err.what


def test_inconsistent_items_name_shard_item_field_expected_and_received():
    def shape_break(i):
        for k in range(3):
            n = 5 if (i, k) == (1, 2) else 4
            yield np.zeros(n, np.float32), np.int64(k)

    with pytest.raises(tf.errors.OpError) as info:
        list(kerasfeed.from_generators(shape_break, 3, probe=2))
    assert (
        "Item 2 of shape_break(1) (generator shard 1 of 3), field x: expected shape (4,), received shape (5,)"
        in str(info.value)
    )
    assert "to from_generators" in str(info.value)

    def dtype_break(i):
        yield {"a": np.zeros(2, np.float64 if i == 2 else np.float32)}

    with pytest.raises(tf.errors.OpError, match=r"Item 0 of dtype_break\(2\) \(generator shard 2 of 3\), field \['a'\]: expected dtype float32, received float64"):
        list(kerasfeed.from_generators(dtype_break, 3, probe=1))

    def struct_break(i):
        yield (np.zeros(2), np.zeros(1)) if i != 1 else np.zeros(2)

    with pytest.raises(tf.errors.OpError, match=r"Item 0 of struct_break\(1\) \(generator shard 1 of 2\) does not match the dataset's structure: expected \(array, array\), received array"):
        list(kerasfeed.from_generators(struct_break, 2, probe=1))

    # seen while probing: a plain SignatureError naming both items
    def drift(i):
        yield np.zeros(2, np.float64 if i == 2 else np.float32)

    with pytest.raises(kerasfeed.SignatureError, match=r"Field item changes dtype: item 0 of drift\(0\) \(generator shard 0 of 3\) has float32, item 0 of drift\(2\) \(generator shard 2 of 3\) has float64"):
        kerasfeed.from_generators(drift, 3)


def test_no_items_at_all_asks_for_a_signature():
    with pytest.raises(ValueError, match="produced no items. Pass `output_signature="):
        kerasfeed.from_generators(lambda i: iter(()), 3)
    ds = kerasfeed.from_generators(lambda i: iter(()), 3, output_signature=INT)
    assert values(ds) == []


def test_bad_arguments():
    bad = [
        (dict(factory=42), TypeError, "Received: factory=42"),
        (dict(num_shards=0), ValueError, "Received: num_shards=0"),
        (dict(num_shards="4"), ValueError, "Received: num_shards='4'"),
        (dict(executor="gpu"), ValueError, "Received: executor='gpu'"),
        (dict(workers=0), ValueError, "Received: workers=0"),
        (dict(cycle_length=8, workers=2), ValueError, "Received: cycle_length=8, workers=2"),
        (dict(block_length=0), ValueError, "Received: block_length=0"),
        (dict(buffer_size=-1), ValueError, "Received: buffer_size=-1"),
        (dict(deterministic="yes"), TypeError, "Received: deterministic='yes'"),
        (dict(batch_size=0), ValueError, "Received: batch_size=0"),
        (dict(shuffle_buffer=0), ValueError, "Received: shuffle_buffer=0"),
        (dict(drop_remainder=True), ValueError, "needs `batch_size`"),
        (dict(ragged=True), ValueError, "Received: ragged=True, batch_size=None"),
        (dict(prefetch=-3), ValueError, "Received: prefetch=-3"),
        (dict(device=1), TypeError, "Received: device=1"),
        (dict(probe=0), ValueError, "Received: probe=0"),
        (dict(seed="x"), TypeError, "Received: seed='x'"),
        (dict(executor="processes", workers=1, cycle_length=2), ValueError, "Received: cycle_length=2, workers=1"),
        (dict(worker_init=print), ValueError, "executor='threads' has none"),
        (dict(output_signature="int64"), TypeError, "Received: 'int64'"),
        (dict(output_signature=tf.TensorSpec(None, tf.int64)), ValueError, "unknown rank"),
    ]
    for kwargs, exc, text in bad:
        args = {"factory": numbered, "num_shards": 4}
        args.update(kwargs)
        with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            kerasfeed.from_generators(args.pop("factory"), args.pop("num_shards"), **args)


# ---------------------------------------------------------------- resources


def test_break_stops_the_generators_and_buffers_are_bounded():
    made = []
    closed = []

    def endless(i):
        try:
            k = 0
            while True:
                made.append(i)
                yield np.int64(k)
                k += 1
        finally:
            closed.append(i)

    ds = kerasfeed.from_generators(endless, 4, buffer_size=5, output_signature=INT, prefetch=0)
    it = iter(ds)
    next(it)
    time.sleep(0.3)
    # 4 running shards x 5 buffered, plus one chunk and the two prefetched chunks
    # of the pull (3 x 64): bounded, while the generators never end.
    assert len(made) <= 4 * 5 + 3 * 64 + 4
    del it
    gc.collect()
    assert wait_until(lambda: sorted(closed) == [0, 1, 2, 3]), closed
    assert wait_until(lambda: not producer_threads())


def test_dropping_an_iterator_does_not_wait_for_slow_generators():
    def slow(i):
        yield np.int64(i)
        time.sleep(30 if i == 0 else 0)  # shard 0's second item would take 30 s
        yield np.int64(i)

    ds = kerasfeed.from_generators(slow, 3, cycle_length=1, output_signature=INT)
    start = time.perf_counter()
    for v in ds:
        break
    del v
    gc.collect()
    assert time.perf_counter() - start < 15  # 0.8 s here, the first iterator's build included; a wait is 30 s


# ---------------------------------------------------------------- worker processes
# The generators below are defined inside the tests: cloudpickle sends them by
# value, so the workers import numpy, not this module (and its TensorFlow).


@pytest.fixture
def closing():
    """Closes the worker pools of the datasets a test registers, even if it fails."""
    datasets = []
    yield datasets.append
    for ds in datasets:
        ds._kerasfeed_stream.close()


def test_processes_run_generators_in_workers_in_the_same_order(closing):
    def pid_and_value(i):
        for k in range(3):
            yield np.int64(os.getpid()), np.int64(i * 10 + k)

    threads = kerasfeed.from_generators(pid_and_value, 5, cycle_length=2, output_signature=(INT, INT))
    procs = kerasfeed.from_generators(pid_and_value, 5, executor="processes", workers=2, cycle_length=2)
    closing(procs)
    got = [(int(p), int(v)) for p, v in procs]
    assert [v for _, v in got] == [int(v) for _, v in threads]
    pids = {p for p, _ in got}
    assert len(pids) == 2 and os.getpid() not in pids
    assert pids <= set(procs._kerasfeed_stream.pool.pids)
    # a second pass reuses the same workers (persistent)
    assert {int(p) for p, _ in procs} == pids
    assert not any(s["tensorflow_imported"] for s in procs._kerasfeed_stream.pool.stats()["per_worker"])


def test_processes_a_new_pass_supersedes_an_open_one_instead_of_waiting_for_its_workers(closing):
    """An iterator kept after a peek held both workers: the next pass waited for one for ever (8 of 8), its
    timeout not counting, and fit with validation_data on the same dataset hung."""

    def values(i):
        yield from (np.int64(1000 * i + k) for k in range(100))

    ds = kerasfeed.from_generators(values, 4, executor="processes", workers=2, timeout=5)
    closing(ds)
    kept = iter(ds)
    assert int(next(kept)) == 0
    assert sorted(int(v) for v in ds) == [1000 * i + k for i in range(4) for k in range(100)]
    with pytest.raises(tf.errors.OpError, match=r"generator shards of values: pass 0 was closed when pass 1 of the "
                                                r"same dataset began: on worker processes a stream reads one pass"):
        for _ in kept:  # what it had buffered, then the refusal: never a silent short pass
            pass
    assert sorted(int(v) for v in ds) == [1000 * i + k for i in range(4) for k in range(100)]  # and the next
    # Fewer shards than workers: an open pass leaves a worker free, and two passes read side by side as before.
    few = kerasfeed.from_generators(values, 2, executor="processes", workers=4, timeout=5)
    closing(few)
    pairs = [(int(a), int(b)) for a, b in zip(few, few)]
    assert len(pairs) == 200 and all(a == b for a, b in pairs)


def test_processes_with_a_closure_and_cpu_bound_generators(closing):
    scale = 3.0  # captured by value: the closure travels with cloudpickle

    def scaled(i):
        for x, y in busy_generator(i, items=2, work=2000):
            yield x * scale, y

    ds = kerasfeed.from_generators(scaled, 6, executor="processes", workers=2, batch_size=4)
    closing(ds)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ds])
    ys = np.concatenate(ys)
    assert sorted(ys.tolist()) == list(range(12))
    ref = {int(y): x for i in range(6) for x, y in busy_generator(i, items=2, work=2000)}
    for x, y in zip(np.concatenate(xs), ys):
        np.testing.assert_allclose(x, ref[int(y)] * scale)


def test_processes_error_names_shard_worker_pid_and_traceback(closing):
    def remote_failure(i):
        yield np.int64(i)
        if i == 1:
            raise RuntimeError("bad block in shard 1")
        yield np.int64(i)

    ds = kerasfeed.from_generators(remote_failure, 3, executor="processes", workers=2, output_signature=INT)
    closing(ds)
    with pytest.raises(tf.errors.OpError) as info:
        list(ds)
    msg = str(info.value)
    assert "remote_failure(1) (generator shard 1 of 3) raised RuntimeError after 1 item in worker" in msg
    assert "(pid " in msg and "bad block in shard 1" in msg and "in remote_failure" in msg


def test_processes_dead_worker_fails_fast_naming_pid_and_signal(closing):
    def killed_worker(i):
        yield np.int64(i)
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
        yield np.int64(i)

    ds = kerasfeed.from_generators(killed_worker, 4, executor="processes", workers=2, output_signature=INT)
    closing(ds)
    start = time.perf_counter()
    with pytest.raises(tf.errors.OpError) as info:
        list(ds)
    assert time.perf_counter() - start < 10
    msg = str(info.value)
    assert "WorkerError" in msg and "pid" in msg and "SIGKILL" in msg
    assert "killed_worker(1) (generator shard 1 of 4)" in msg


def test_processes_unpicklable_factory_names_the_culprit():
    lock = threading.Lock()

    def locked(i):
        with lock:
            yield np.int64(i)

    with pytest.raises(TypeError, match=r"cannot be pickled.*lock"):
        kerasfeed.from_generators(locked, 2, executor="processes", workers=1)


def test_processes_stop_when_the_dataset_is_dropped():
    import psutil

    def values_only(i):
        yield from range(i, i + 3)

    ds = kerasfeed.from_generators(values_only, 2, executor="processes", workers=2, output_signature=INT)
    pids = ds._kerasfeed_stream.pool.pids
    assert sorted(values(ds)) == [0, 1, 1, 2, 2, 3]
    del ds
    gc.collect()

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_until(lambda: all(gone(p) for p in pids))


def test_processes_a_first_pass_waiting_for_the_probe_s_workers_does_not_time_out(closing):
    """The signature probe's generators run on in the workers after it (each finishing its item): pass 0
    waited up to 1 s for a free worker, then 1 s for its item, and failed "no item for timeout=1.2 s
    after 0 items" although no item took 1.2 s (pass 1 passed)."""
    def slow_items(i):
        for k in range(2):
            time.sleep(1.0)
            yield np.float32(10 * i + k)

    ds = kerasfeed.from_generators(slow_items, 3, executor="processes", workers=3, timeout=1.2, probe=3)
    closing(ds)
    for _ in range(2):
        assert sorted(ds.as_numpy_iterator()) == [10 * i + k for i in range(3) for k in range(2)]


def test_processes_a_worker_stuck_in_a_stopped_stream_is_stopped_and_the_next_pass_runs(closing, tmp_path):
    """A worker still making an item of the probe's run, which nobody reads any more, is stopped
    ``timeout`` s after that run was stopped (a pass waiting for it never hangs); the next pass starts
    new workers (a stream dataset's pool kept a dead worker's failure for every later pass)."""
    marks = str(tmp_path)

    def stuck_after_the_probe(i):
        first = not os.path.exists(f"{marks}/{i}")  # the probe's run
        open(f"{marks}/{i}", "a").close()
        for k in range(4):
            if k == 1 and first:  # made while the probe reads item 0: its worker is still in it after
                open(f"{marks}/stuck-{i}", "a").close()
                time.sleep(600)
            time.sleep(0 if first else 0.3)  # a shard of a pass holds its worker over 1 s
            yield np.float32(10 * i + k)

    ds = kerasfeed.from_generators(stuck_after_the_probe, 3, executor="processes", workers=3, timeout=1, probe=3)
    closing(ds)
    # One at least (a worker may see the probe's stop before it begins item 1).
    assert wait_until(lambda: any(os.path.exists(f"{marks}/stuck-{i}") for i in range(3)), timeout=10)
    t0 = time.monotonic()
    with pytest.raises(tf.errors.OpError, match=r"\(pid (\d+)\) still made an item of stuck_after_the_probe\(\d\) .*"
                       r"stopped earlier, 1.0 s later \(timeout=1.0 s\)") as e:
        list(ds.as_numpy_iterator())
    assert time.monotonic() - t0 < 15
    stopped = int(re.search(r"\(pid (\d+)\) still made", str(e.value)).group(1))
    assert sorted(ds.as_numpy_iterator()) == [10 * i + k for i in range(3) for k in range(4)]
    assert wait_until(lambda: not os.path.exists(f"/proc/{stopped}"), timeout=5)
