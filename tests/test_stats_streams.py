"""Live input stats of stream datasets: make times where items are made, per-worker figures.

Sleeping workloads with known per-item times; bounds are loose (a shared
machine overshoots sleeps), never tight timing. Generators and readers are
module-level so that worker processes can import them.
"""

from __future__ import annotations

import queue
import time

import numpy as np

import kerasfeed

DELAY = 0.005


def sleepy_shard(k, items=6, delay=DELAY):
    """Shard ``k``: ``items`` small vectors, ``delay`` seconds each."""
    for j in range(items):
        time.sleep(delay)
        yield np.full((2,), k * 10 + j, np.float32)


def sleepy_lines(path):
    """Reads a text file, one sample per line, ``DELAY`` seconds per line."""
    with open(path) as f:
        for line in f:
            time.sleep(DELAY)
            yield np.float32(line)


def drain(ds):
    return sum(1 for _ in ds)


def check_make_time(s, items, low_ms=4.5, high_ms=60.0):
    assert s["items"] == items
    assert s["items_made"] >= items, s["items_made"]
    m = s["make_ms"]
    assert m is not None and low_ms <= m["p50"] <= high_ms, m
    assert m["p50"] <= m["p95"] <= m["p99"] <= m["max"]


def test_generator_threads_report_make_time_and_threads_busy():
    ds = kerasfeed.from_generators(sleepy_shard, 4)
    assert drain(ds) == 24
    s = kerasfeed.stats(ds.map(lambda x: x))
    assert s["kind"] == "from_generators" and s["executor"] == "threads"
    check_make_time(s, 24)
    # Four generators sleep at once: more than one producer thread busy on average, at most four.
    assert 0.0 < s["threads_busy"] <= 4.5, s["threads_busy"]
    assert s["threads_busy_s"] >= 24 * DELAY * 0.9
    assert s["workers"] == []


def test_generator_processes_report_worker_timed_make_time_and_per_worker_busy():
    ds = kerasfeed.from_generators(sleepy_shard, 4, executor="processes", workers=2)
    try:
        assert drain(ds) == 24
        s = kerasfeed.stats(ds)
        assert s["executor"] == "processes"
        check_make_time(s, 24)
        workers = s["workers"]
        assert sorted(w["id"] for w in workers) == [0, 1], workers
        assert sum(w["items"] for w in workers) == s["items_made"]
        for w in workers:
            assert w["items"] > 0 and w["busy_s"] >= w["items"] * DELAY * 0.9, w
            assert 0.0 < w["busy"] <= 1.0, w
            assert w["alive"] and w["pid"] > 0 and w["rss_mb"] > 5, w
        assert s["shm_bytes"] > 0
        assert s["threads_busy"] is None and s["threads_busy_s"] is None  # a documented key: None, not missing
    finally:
        ds._kerasfeed_stream.close()


def test_file_reader_threads_report_make_time_per_sample(tmp_path):
    paths = []
    for k in range(3):
        p = tmp_path / f"part{k}.txt"
        p.write_text("".join(f"{k}.{j}\n" for j in range(5)))
        paths.append(str(p))
    ds = kerasfeed.from_files(paths, sleepy_lines, batch_size=5)
    assert drain(ds) == 3
    s = kerasfeed.stats(ds)
    assert s["kind"] == "from_files" and s["executor"] == "threads"
    check_make_time(s, 15)
    assert s["threads_busy"] > 0


def test_a_reader_returning_a_list_counts_its_call_into_the_first_sample(tmp_path):
    def read_all(path):
        time.sleep(0.03)  # the whole file's work happens in the call
        return [np.float32(v) for v in open(path).read().split()]

    p = tmp_path / "a.txt"
    p.write_text("1 2 3 4")
    ds = kerasfeed.from_files([str(p)], read_all)
    assert drain(ds) == 4
    m = kerasfeed.stats(ds)["make_ms"]
    assert m["max"] >= 25.0 and m["p50"] < 25.0, m


def test_queue_producer_reports_its_make_time_and_busy_share():
    def producer(put):
        for _ in range(2):
            for j in range(10):
                time.sleep(DELAY)
                put(np.float32(j))
            put(kerasfeed.END_OF_EPOCH)

    ds = kerasfeed.from_queue(producer, maxsize=4)
    assert drain(ds) == 10 and drain(ds) == 10
    s = kerasfeed.stats(ds)
    assert s["kind"] == "from_queue"
    assert s["items_made"] == 20  # the probed item too (it is the first pass's first)
    m = s["make_ms"]
    assert 4.5 <= m["p50"] <= 60.0, m
    assert 0.0 < s["threads_busy"] <= 1.05, s["threads_busy"]  # one producer thread


def test_queue_object_has_no_make_times():
    q = queue.Queue(maxsize=8)
    for j in range(3):
        q.put(np.float32(j))
    q.put(kerasfeed.END_OF_EPOCH)
    ds = kerasfeed.from_queue(q)
    assert drain(ds) == 3
    s = kerasfeed.stats(ds)
    assert s["items"] == 3 and s["items_made"] == 0 and s["make_ms"] is None
    assert s["threads_busy"] is None and s["threads_busy_s"] is None and s["workers"] == []


def test_every_kind_of_dataset_has_every_count_key_none_where_it_does_not_apply():
    """A stream had none of the retry and worker counts, threads no `replaced_workers`, worker processes no
    `abandoned_threads`: code reading one of them worked on one kind and raised KeyError on another."""
    def gen(shard):
        yield from (np.array([j]) for j in range(3))

    keys = ("retried_items", "failed_items", "replaced_workers", "recycled_workers", "requeued_items",
            "abandoned_threads", "abandoned_threads_running", "ahead", "in_flight", "shm_bytes", "process")
    stream = kerasfeed.from_generators(gen, 2)
    list(stream)
    threads = kerasfeed.to_dataset([np.zeros(2, np.float32)] * 4, executor="threads")
    list(threads)
    for ds in (stream, threads):
        s = kerasfeed.stats(ds)
        assert all(k in s for k in keys), [k for k in keys if k not in s]
    assert kerasfeed.stats(stream)["replaced_workers"] is None
    assert kerasfeed.stats(threads)["replaced_workers"] is None and kerasfeed.stats(threads)["retried_items"] == 0
    kerasfeed.executor_of(threads).close()
