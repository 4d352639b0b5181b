"""The stream functions with a producer stuck mid-stream and no timeout:
deleting the iterator (``del``, ``break``, the end of ``fit``) and Ctrl-C end
the wait, leaving no worker behind; the stuck-wait notice
(docs/reliability.md)."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import numpy as np
import pytest
from test_reliability_consumers import _finish, _gone, _start_script

import kerasfeed
from kerasfeed.execution.waits import NOTICE_ENV, WaitScope, stuck_notice_s

SCRIPT = "stuck_stream.py"


@pytest.mark.parametrize(
    "kind, mode",
    [
        ("generators-processes", "fit"),
        ("files-processes", "delete-break"),
        ("generators-threads", "delete-del"),
        ("queue", "delete-del"),
    ],
)
def test_deleting_a_stream_iterator_and_ctrl_c_end_the_wait_for_a_stuck_producer(kind, mode):
    """Deleting the iterator returns at once, and a producer thread that only
    waits for a worker process ends too (one running the user's generator
    itself cannot be stopped: from_queue's and the threads executor's are not
    counted). Then SIGINT while the main thread waits inside TensorFlow for
    the stuck producer raises a plain KeyboardInterrupt; the script exits and
    no worker is left."""
    proc = _start_script(SCRIPT, kind, mode)
    line = proc.stdout.readline()
    try:
        got = json.loads(line)
    except ValueError:
        proc.kill()
        pytest.fail(f"no report line: {line!r} {proc.communicate()[1][-3000:]}")
    assert got["got"] == [0, 1, 2], got
    # A hang, not a timing figure: the producer never resumes (its sleep is an hour); deleting a tf.data iterator
    # takes seconds on a loaded machine.
    assert got["del_s"] < 30.0, got
    expected_left = ["kerasfeed-generator-shard-0"] if kind == "generators-threads" else []
    assert got["left"] == expected_left, got
    time.sleep(1.0)  # the new pass's items are ready at once: the main thread is blocked in TensorFlow by now
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert "not interrupted" not in out, out
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err, err[-3000:]
    assert "MISMATCH" not in err, err[-3000:]
    assert _gone(got["pids"]), got


@pytest.mark.parametrize("kind", ["generators", "dataset"])
def test_ctrl_c_during_a_pass_on_processes_ends_it_without_a_second_error(kind):
    """Ctrl-C while items come from worker processes: a plain KeyboardInterrupt, no worker left, and no
    WorkerError logged by TensorFlow for a shard a producer opened, or a load in flight, after the exit
    hook closed the pool (it read like a second failure)."""
    proc = _start_script("endless_streams.py", kind)
    line = proc.stdout.readline()
    try:
        pids = json.loads(line)["pids"]
    except ValueError:
        proc.kill()
        pytest.fail(f"no report line: {line!r} {proc.communicate()[1][-3000:]}")
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "WorkerError" not in err and "is closed" not in err, err[-3000:]
    assert len(pids) == 2 and _gone(pids), pids


class _Late:
    """Item 3 comes only once the test sets ``release`` (a stuck item)."""

    def __init__(self):
        self.release = threading.Event()

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 3:
            self.release.wait(30)
        return np.full((2,), i, np.float32)


def _notices(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "kerasfeed" and "looks stuck" in r.getMessage()]


def test_a_stuck_item_logs_one_notice_naming_it(monkeypatch, caplog):
    monkeypatch.setenv(NOTICE_ENV, "0.5")
    src = _Late()
    ds = kerasfeed.to_dataset(src, executor="threads", group_items=1, prefetch=0)

    def release_after_the_notice():  # a fixed 2.5 s raced the first notice on a busy machine
        deadline = time.monotonic() + 30
        while not _notices(caplog) and time.monotonic() < deadline and not src.release.is_set():
            time.sleep(0.05)
        src.release.wait(1.5)  # three more notice intervals: a second notice would come in them
        src.release.set()

    timer = threading.Thread(target=release_after_the_notice)
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kerasfeed"):
            got = [int(x[0]) for x in ds]
    finally:
        src.release.set()
        timer.join()
        kerasfeed.executor_of(ds).close()
    assert got == list(range(6))
    notes = _notices(caplog)
    assert len(notes) == 1, notes
    assert "_Late[3]" in notes[0] and "timeout=" in notes[0] and "Ctrl-C" in notes[0], notes[0]


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_the_stuck_item_notice_names_the_timeout_given(monkeypatch, caplog, executor):
    # A timeout longer than the notice interval: the notice must not say none was given.
    monkeypatch.setenv(NOTICE_ENV, "0.5")
    src = _Slow()
    workers = {"workers": 1} if executor == "processes" else {}
    loader = kerasfeed.to_loader(src, batch_size=None, executor=executor, timeout=30, **workers)
    try:
        with caplog.at_level(logging.WARNING, logger="kerasfeed"):
            got = [int(x[0]) for x in loader]
    finally:
        loader.close()
    assert got == list(range(8))
    notes = _notices(caplog)  # a busy machine may start a worker slower than the interval: a notice for item 0
    assert len([n for n in notes if "_Slow[4]" in n]) == 1, notes
    assert all("timeout=30 s" in n and "no `timeout=`" not in n for n in notes), notes


class _Slow:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:  # not one of the items probed for the signature (0-2 and the last)
            time.sleep(1.5)  # three notice intervals; picklable for worker processes
        return np.full((2,), i, np.float32)


def test_a_stuck_stream_item_logs_one_notice_naming_shard_and_worker(monkeypatch, caplog):
    monkeypatch.setenv(NOTICE_ENV, "0.5")

    def gen(shard):
        for i in range(4):
            if i == 2:
                time.sleep(2.5)  # in the worker process
            yield np.full((2,), i, np.float32)

    import tensorflow as tf

    spec = tf.TensorSpec((2,), tf.float32)
    ds = kerasfeed.from_generators(gen, 1, executor="processes", workers=1, prefetch=0, output_signature=spec)
    stream = ds._kerasfeed_stream
    try:
        with caplog.at_level(logging.WARNING, logger="kerasfeed"):
            got = [int(x[0]) for x in ds]
        pid = stream.pool.pids[0]
    finally:
        stream.close()
    assert got == [0, 1, 2, 3]
    notes = _notices(caplog)
    assert len(notes) == 1, notes
    assert "item 2 of gen(0)" in notes[0] and f"pid {pid}" in notes[0], notes[0]


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf"])
def test_a_bad_notice_interval_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(NOTICE_ENV, value)
    with pytest.raises(ValueError, match=rf"{NOTICE_ENV}.*Received: {NOTICE_ENV}='{value}'"):
        kerasfeed.to_dataset(_Late(), executor="threads")
    monkeypatch.setenv(NOTICE_ENV, "2.5")
    assert stuck_notice_s() == 2.5 and WaitScope().notice_s == 2.5
