"""kerasfeed.from_queue: producer-fed epochs of unknown length."""

import gc
import pickle
import queue
import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from _util import fit_step_counter, wait_until

import kerasfeed

LENGTHS = [5, 3, 8]  # items per epoch; the consumer does not know them


def epochs_producer(lengths=LENGTHS, log=None):
    def produce(put):
        for epoch, n in enumerate(lengths):
            for k in range(n):
                put((np.full(2, epoch, np.float32), np.int64(100 * epoch + k)))
                if log is not None:
                    log.append((epoch, k))
            put(kerasfeed.END_OF_EPOCH)

    return produce


def ids(ds):
    return [int(y) for _, y in ds]



def test_each_pass_reads_one_epoch_and_the_probed_item_is_not_lost():
    ds = kerasfeed.from_queue(epochs_producer(), maxsize=4)
    x_spec, y_spec = ds.element_spec  # inferred from the first item
    assert x_spec.shape.as_list() == [2] and x_spec.dtype == tf.float32 and y_spec.dtype == tf.int64
    for epoch, n in enumerate(LENGTHS):
        got = [(x.numpy(), int(y)) for x, y in ds]
        assert [y for _, y in got] == [100 * epoch + k for k in range(n)]
        assert all(np.all(x == epoch) for x, _ in got)
    # the producer returned: the data is over; the next pass says so instead of being empty
    with pytest.raises(tf.errors.OpError, match=r"has stopped: it returned after 16 items, so epoch 3 has no data"):
        ids(ds)
    with pytest.raises(tf.errors.OpError, match="build a new dataset"):
        ids(ds)


def test_fit_past_the_producer_s_epochs_fails_clearly_instead_of_training_on_nothing():
    ds = kerasfeed.from_queue(epochs_producer([8, 8]), batch_size=4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(tf.errors.OpError) as info:
        model.fit(ds, epochs=3, verbose=0)
    message = str(info.value)
    assert "has stopped" in message and "epoch 2 has no data" in message
    # the documented restart: a new dataset over a new producer reads the data again
    again = kerasfeed.from_queue(epochs_producer([8, 8]), batch_size=4)
    hist = model.fit(again, epochs=2, verbose=0)
    assert len(hist.history["loss"]) == 2


def test_end_of_epoch_is_a_picklable_singleton():
    assert pickle.loads(pickle.dumps(kerasfeed.END_OF_EPOCH)) is kerasfeed.END_OF_EPOCH
    assert repr(kerasfeed.END_OF_EPOCH) == "kerasfeed.END_OF_EPOCH"


def test_a_user_queue_filled_by_a_user_thread():
    q = queue.Queue(maxsize=3)

    def feed():
        for epoch in range(2):
            for k in range(4 + epoch):
                q.put({"value": np.float64(k), "tag": f"e{epoch}"})
            q.put(kerasfeed.END_OF_EPOCH)

    threading.Thread(target=feed, daemon=True).start()
    ds = kerasfeed.from_queue(q, batch_size=2)
    first = list(ds)
    assert [int(b["value"].shape[0]) for b in first] == [2, 2]
    assert [float(v) for b in first for v in b["value"]] == [0, 1, 2, 3]
    second = list(ds)
    assert [t.decode() for b in second for t in b["tag"].numpy()] == ["e1"] * 5


def test_memory_is_bounded_by_back_pressure():
    log = []
    ds = kerasfeed.from_queue(epochs_producer([100_000], log), maxsize=8, prefetch=0)
    it = iter(ds)
    next(it)
    # The producer is blocked, not running on: its count stays put for 0.3 s (a fixed 0.5 s wait raced it).
    produced, still_since, deadline = len(log), time.monotonic(), time.monotonic() + 30
    while time.monotonic() - still_since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        if len(log) != produced:
            produced, still_since = len(log), time.monotonic()
    assert time.monotonic() < deadline, f"the producer never stopped: {len(log)} items"
    # queue (8) + the chunk being built and the two prefetched chunks (3 x 64)
    assert produced <= 8 + 3 * 64 + 2, produced
    del it
    gc.collect()


def test_a_pass_dropped_mid_epoch_resumes_at_the_next_epoch():
    ds = kerasfeed.from_queue(epochs_producer([6, 4, 2]), maxsize=16, output_signature=(
        tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.int64)))
    for _, y in ds:
        assert int(y) == 0
        break  # abandon epoch 0 after one item
    gc.collect()
    assert ids(ds) == [100, 101, 102, 103]  # epoch 1, whole
    assert ids(ds) == [200, 201]


def test_a_pass_started_while_an_earlier_one_is_open_reads_the_next_epoch_whole():
    # A peek kept alive (a notebook, a traceback): the new pass read the tail of
    # epoch 0 while the old iterator's buffer held the rest, lost in silence.
    ds = kerasfeed.from_queue(epochs_producer([20, 20, 4]), maxsize=4)
    old = iter(ds)
    assert int(next(old)[1]) == 0
    time.sleep(0.3)  # the old pass reads ahead into its buffer
    assert ids(ds) == [100 + k for k in range(20)]  # epoch 1, whole
    # The old pass yields what it had buffered, then says why it stopped.
    with pytest.raises(tf.errors.OpError, match=r"a newer pass over this from_queue dataset started while this one was open, after \d+ items") as info:
        for _ in range(30):
            assert int(next(old)[1]) < 20  # never an item of a later epoch
    assert "(epoch 0)" in str(info.value)
    assert ids(ds) == [200, 201, 202, 203]


def test_the_pass_after_a_failed_epoch_reads_the_next_epoch():
    q = queue.Queue(maxsize=16)
    for x in [0, 1, ValueError("bad record"), 2, 3, kerasfeed.END_OF_EPOCH, 10, 11, kerasfeed.END_OF_EPOCH]:
        q.put(np.int64(x) if isinstance(x, int) else x)
    ds = kerasfeed.from_queue(q)
    with pytest.raises(tf.errors.OpError, match=r"\(epoch 0\) raised ValueError after 2 items: bad record"):
        list(ds)
    assert [int(v) for v in ds] == [10, 11]  # not the failed epoch's rest, [2, 3]


def test_variable_shapes_with_probe_and_padded_batches():
    def produce(put):
        for k in range(7):
            put(np.arange(k + 1, dtype=np.int32))
        put(kerasfeed.END_OF_EPOCH)

    ds = kerasfeed.from_queue(produce, probe=2, batch_size=3)
    assert ds.element_spec.shape.as_list() == [None, None]
    batches = [b.numpy() for b in ds]
    assert [b.shape for b in batches] == [(3, 3), (3, 6), (1, 7)]
    np.testing.assert_array_equal(batches[1][0], [0, 1, 2, 3, 0, 0])


def test_producer_error_names_the_producer_and_keeps_earlier_items():
    def flaky(put):
        for k in range(5):
            put(np.float32(k))
        put(kerasfeed.END_OF_EPOCH)
        put(np.float32(10))
        raise ConnectionError("simulator socket closed")

    ds = kerasfeed.from_queue(flaky)
    assert [float(v) for v in ds] == [0, 1, 2, 3, 4]
    got = []
    with pytest.raises(tf.errors.OpError) as info:
        for v in ds:
            got.append(float(v))
    assert got == [10.0]
    msg = str(info.value)
    assert "kerasfeed: the from_queue producer flaky raised ConnectionError after 6 items: simulator socket closed" in msg
    assert "Original traceback" in msg and "raise ConnectionError" in msg


def test_a_put_after_the_producer_returned_is_refused_not_lost():
    # The producer hands `put` to a thread and returns before it is done: its items would follow the
    # end and never be read (and the thread would block for ever once the queue filled).
    late = {}
    go = threading.Event()

    def straggler(put):
        go.wait(30)
        try:
            for k in range(100):
                put(np.float32(100 + k))
        except RuntimeError as e:
            late["error"] = e

    def producer(put):
        for k in range(3):
            put(np.float32(k))
        put(kerasfeed.END_OF_EPOCH)
        late["thread"] = threading.Thread(target=straggler, args=(put,), daemon=True)
        late["thread"].start()

    ds = kerasfeed.from_queue(producer, maxsize=4)
    assert [float(v) for v in ds] == [0, 1, 2]
    producing = [t for t in threading.enumerate() if t.name == "kerasfeed-queue-producer"]
    assert wait_until(lambda: not any(t.is_alive() for t in producing), 30), "the producer did not return"
    go.set()
    late["thread"].join(30)
    assert not late["thread"].is_alive(), "the thread putting after the producer returned blocked"
    assert "put() was called after the from_queue producer producer returned" in str(late["error"])
    assert "Received: a put after 3 items" in str(late["error"])


def test_producer_error_before_any_item_fails_at_creation():
    def broken(put):
        raise PermissionError("no access to /data/stream")

    with pytest.raises(kerasfeed.StreamError, match="the from_queue producer broken raised PermissionError after 0 items: no access"):
        kerasfeed.from_queue(broken)


def test_an_exception_put_into_a_user_queue_fails_the_epoch():
    q = queue.Queue(maxsize=4)
    q.put(np.zeros(2))
    q.put(OSError("disk unplugged"))
    ds = kerasfeed.from_queue(q)
    with pytest.raises(tf.errors.OpError, match=r"the queue Queue \(epoch 0\) raised OSError after 1 item: disk unplugged"):
        list(ds)


def test_timeout_when_a_user_queue_stays_empty():
    q = queue.Queue(maxsize=2)
    with pytest.raises(TimeoutError, match="waited 0.3 s for a first item"):
        kerasfeed.from_queue(q, timeout=0.3)
    ds = kerasfeed.from_queue(q, timeout=0.3, output_signature=tf.TensorSpec([], tf.int64))
    q.put(np.int64(1))
    start = time.perf_counter()
    it = iter(ds)
    assert int(next(it)) == 1
    # Should the timeout never fire, the epoch ends normally after 20 s (the
    # mechanism needs 0.3 s plus one 0.1 s heartbeat; counted from the first
    # item, so building the iterator does not count) and nothing is raised.
    quiet_end = threading.Timer(20, q.put, (kerasfeed.END_OF_EPOCH,))
    quiet_end.start()
    try:
        with pytest.raises(tf.errors.OpError, match=r"the queue Queue raised TimeoutError after 1 item: no item for 0.3 s \(epoch 0, after 1 items\)"):
            next(it, None)
    finally:
        quiet_end.cancel()
    # Never early: the quiet time counts from the first item, taken after `start`.
    assert time.perf_counter() - start >= 0.3


def test_dropping_an_iterator_never_waits_for_an_idle_producer():
    release = threading.Event()
    rescued = threading.Event()

    def idle_after_two(put):
        put(np.int64(1))
        put(np.int64(2))
        release.wait()  # stays idle: no item, no END_OF_EPOCH

    def rescue():
        # Only a drop that waits for the producer is still running after 20 s
        # (the mechanism waits at most one 0.1 s heartbeat): release it.
        rescued.set()
        release.set()

    ds = kerasfeed.from_queue(idle_after_two)
    taken = iter(ds.take(2))
    assert [int(next(taken)), int(next(taken))] == [1, 2]
    never_read = iter(ds)
    dropped = [weakref.ref(taken), weakref.ref(never_read)]
    # Only the drops run under the watchdog: building iterators and
    # gc.collect() (seconds on a starved machine) stay outside it.
    watchdog = threading.Timer(20, rescue)
    watchdog.start()
    try:
        del taken  # its tf.data thread is already asking for a third item
        del never_read
        assert not rescued.is_set(), "dropping an iterator waited for the idle producer"
    finally:
        watchdog.cancel()
        release.set()
    assert [ref() for ref in dropped] == [None, None]  # the drops happened under the watchdog


def test_dropping_the_dataset_stops_the_producer_thread():
    def endless(put):
        k = 0
        while True:
            put(np.int64(k))
            k += 1

    ds = kerasfeed.from_queue(endless, maxsize=2)
    assert [int(v) for v in ds.take(3)] == [0, 1, 2]
    del ds
    gc.collect()
    assert wait_until(lambda: not any(t.name == "kerasfeed-queue-producer" for t in threading.enumerate()))


def test_trains_with_model_fit_one_producer_epoch_per_fit_epoch():
    def produce(put):
        rng = np.random.default_rng(0)
        for _ in range(3):
            for _ in range(24):
                y = rng.integers(0, 2)
                put((rng.normal(2.0 * y - 1.0, 1.0, size=3).astype(np.float32), np.float32(y)))
            put(kerasfeed.END_OF_EPOCH)

    ds = kerasfeed.from_queue(produce, batch_size=8)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.1), "binary_crossentropy")
    counter, steps = fit_step_counter()
    hist = model.fit(ds, epochs=3, verbose=0, callbacks=[counter])
    assert steps == [3, 3, 3]  # each fit epoch is one whole producer epoch (24 items / 8)
    assert hist.history["loss"][-1] < hist.history["loss"][0]


def test_bad_arguments():
    with pytest.raises(TypeError, match="Received: 42"):
        kerasfeed.from_queue(42)
    with pytest.raises(ValueError, match=r"bounded queue.*Received: a queue with maxsize=0"):
        kerasfeed.from_queue(queue.Queue())
    import multiprocessing

    unbounded = multiprocessing.get_context("spawn").Queue()  # its maxsize is CPython's "no limit": it was taken
    with pytest.raises(ValueError, match=r"bounded queue.*Received: a queue with maxsize=2147483647"):
        kerasfeed.from_queue(unbounded)
    with pytest.raises(ValueError, match="Received: maxsize=0"):
        kerasfeed.from_queue(epochs_producer(), maxsize=0)
    with pytest.raises(ValueError, match="Received: timeout=-1"):
        kerasfeed.from_queue(epochs_producer(), timeout=-1)
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        kerasfeed.from_queue(epochs_producer(), batch_size=0)


class _ListPass:
    """A stream pass over a list of items (for ``chunks`` alone)."""

    def __init__(self, items):
        self.items = list(items)

    def take(self, timeout):
        from kerasfeed.streams.options import END

        return (self.items.pop(0), len(self.items)) if self.items else END

    def close(self):
        pass


@pytest.mark.parametrize("shapes", [
    [(500_000, 3) if k % 64 == 63 else (1000, 3) for k in range(256)],  # a large point cloud in every 64
    [(1000, 10) if k % 2 else (10, 1000) for k in range(64)],  # shapes that pad each other to (1000, 1000)
], ids=["outlier", "transposed"])
def test_chunks_of_items_of_varying_shapes_stay_within_the_chunk_bytes(shapes):
    """NOTE [ Chunks of items of varying shapes ]: a chunk padded each variable leaf to its largest shape, and
    counted the items' own bytes: one 6 MB item among 63 of 12 KB made a 384 MB chunk (helper: 784 MB of RSS for
    26 MB of data through from_queue, 5 of 5). The items come back the same, in order."""
    from kerasfeed.tfdata.chunks import CHUNK_BYTES, ChunkCodec, chunks

    items = [np.full(s, k, np.float32) for k, s in enumerate(shapes)]
    width = len(shapes[0])
    codec = ChunkCodec(tf.TensorSpec((None,) * width, tf.float32), "from_queue")
    back = []
    for stacked, true_shapes in chunks(lambda: _ListPass(items), codec, describe=str):
        largest = max(int(np.prod(s)) * 4 for s in true_shapes) if len(true_shapes) else 0
        assert stacked.nbytes <= max(CHUNK_BYTES, largest), (stacked.shape, len(true_shapes))
        back += [stacked[(j, *[slice(0, d) for d in s])] for j, s in enumerate(true_shapes)]
    assert len(back) == len(items) and all(np.array_equal(a, b) for a, b in zip(back, items))
