"""TensorBoard scalars without TensorFlow (``integrations/scalars.py``), and the paths the callbacks
write to: refused when the callback is made, not in the middle of ``fit``.

The callbacks writing these files under each backend, read back with tbparse, are in
``tests/backends`` (JAX without TensorFlow, PyTorch with TensorFlow blocked).
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest

import kerasfeed
from kerasfeed import _records
from kerasfeed.integrations import scalars

CASES = [("input/wait_ms_p95", 1.5, 3), ("epoch/loss", float("nan"), 0), ("big", 3e38, 2**40),
         ("batch/loss", -2.25, 7), ("input/worker_0/busy", 0.1, 1), ("ünï/códe", float("-inf"), 5)]


def _events(run_dir):
    import tensorflow as tf

    (path,) = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    # TensorFlow's reader checks both CRCs of every record.
    return list(tf.compat.v1.train.summary_iterator(path))


@pytest.mark.parametrize("crc", ["c", "python"])
def test_event_files_are_byte_for_byte_what_tf_summary_writes(tmp_path, monkeypatch, crc):
    import tensorflow as tf

    writer = tf.summary.create_file_writer(str(tmp_path / "tf"))
    with writer.as_default():
        for tag, value, step in CASES:
            tf.summary.scalar(tag, value, step=step)
    writer.close()
    monkeypatch.setattr(_records, "_FAST", crc == "c")
    ours = scalars.EventFile(str(tmp_path / "ours"))
    for tag, value, step in CASES:
        ours.scalars({tag: value}, step)
    ours.close()
    theirs, mine = _events(str(tmp_path / "tf")), _events(str(tmp_path / "ours"))
    assert len(mine) == len(theirs) == len(CASES) + 1
    assert mine[0].file_version == theirs[0].file_version == "brain.Event:2"
    for a, b in zip(theirs[1:], mine[1:]):
        b.wall_time = a.wall_time
        assert b.SerializeToString() == a.SerializeToString(), (a, b)


def test_event_file_writes_out_of_float32_range_as_infinity_and_refuses_after_close(tmp_path):
    from tbparse import SummaryReader

    ours = scalars.EventFile(str(tmp_path))
    ours.scalars({"a": 1e300, "b": -1e300, "c": 2}, step=4)
    ours.close()
    frame = SummaryReader(str(tmp_path), pivot=False).tensors
    assert dict(zip(frame["tag"], frame["value"])) == {"a": np.inf, "b": -np.inf, "c": 2.0}
    assert set(frame["step"]) == {4}
    with pytest.raises(ValueError, match="closed"):
        ours.scalars({"a": 1.0}, step=5)


def test_python_crc32c_is_google_crc32c(monkeypatch):
    import google_crc32c

    rng = np.random.default_rng(0)
    monkeypatch.setattr(_records, "_FAST", False)
    for n in (0, 1, 9, 255, 4097):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _records.crc32c(data) == google_crc32c.value(data), n
        half = _records.crc32c(data[: n // 2])
        assert _records.crc32c(data[n // 2 :], half) == google_crc32c.value(data), n


def test_writer_is_tf_summary_under_tensorflow_or_for_a_url_and_event_files_otherwise(tmp_path, monkeypatch):
    monkeypatch.setattr(scalars, "_tensorflow_backend", lambda: False)
    writer = scalars.scalar_writer(str(tmp_path / "run"))
    assert isinstance(writer, scalars.EventFile)
    writer.close()
    monkeypatch.setattr(scalars, "_tensorflow_backend", lambda: True)
    writer = scalars.scalar_writer(str(tmp_path / "run2"))
    assert isinstance(writer, scalars.TFSummary)
    writer.close()


@pytest.mark.parametrize("name", ["InputStats", "WorkerSummaries"])
def test_a_log_dir_that_cannot_hold_runs_is_refused_when_the_callback_is_made(tmp_path, monkeypatch, name):
    make = getattr(kerasfeed, name)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=rf"^{name}: `log_dir` must be a directory .* is a file\. Received: "):
        make(str(afile))
    with pytest.raises(ValueError, match=rf"^{name}: .* is under '{re.escape(str(afile))}', which is a file"):
        make(str(afile / "logs" / "run"))
    with pytest.raises(TypeError, match=rf"^{name}: `log_dir` must be a directory path. Received: log_dir=3"):
        make(3)
    assert make(tmp_path / "new" / "logs").log_dir == str(tmp_path / "new" / "logs")  # made when training starts
    # A URL is written through TensorFlow's file systems: refused where there are none.
    monkeypatch.setattr(scalars, "_tensorflow_backend", lambda: False)
    monkeypatch.setattr(scalars.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=rf"^{name}: `log_dir` 'gs://bucket/logs' is a URL.*not installed"):
        make("gs://bucket/logs")


def test_training_progress_refuses_a_path_that_is_no_file_and_reads_only_states(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    for path, message in [
        (tmp_path, "names the JSON file the resume state is written to, not a directory"),
        (f"{tmp_path / 'run'}{os.sep}", "not a directory; e.g. '.*data_state.json'"),
        (tmp_path / "afile" / "state.json", "is under '.*afile', which is a file"),
    ]:
        with pytest.raises(ValueError, match=rf"^TrainingProgress: `path` .*{message}"):
            kerasfeed.TrainingProgress(path=path)
        with pytest.raises(ValueError, match=r"^TrainingProgress.load: `path` "):
            kerasfeed.TrainingProgress.load(path)
    state = tmp_path / "state.json"
    for text, message in [("", "not JSON"), ('{"epoch": 1, "batches"', "not JSON"),
                          ("[1, 2]", "a dict with exactly the keys 'epoch' and 'batches'")]:
        state.write_text(text)
        with pytest.raises(ValueError, match=rf"^TrainingProgress.load: '{re.escape(str(state))}'.*{message}"):
            kerasfeed.TrainingProgress.load(state)
    # A save that fails leaves no temporary file behind, and the state before it stands.
    progress = kerasfeed.TrainingProgress({"epoch": 2, "batches": 5}, path=state)
    progress.save(state)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        progress.save(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "state.json"]
    monkeypatch.undo()
    assert kerasfeed.TrainingProgress.load(state) == {"epoch": 2, "batches": 5}
