"""kerasfeed.export under bad input: full or read-only disks, damaged shards, bad items, Ctrl-C, killed workers."""

import contextlib
import json
import logging
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
from _export_sources import Slow
from _util import wait_until

import kerasfeed

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _files(directory):
    return sorted(p.name for p in pathlib.Path(directory).iterdir())


def _manifest(directory):
    return json.loads((pathlib.Path(directory) / "manifest.json").read_text())


def _shard_tmps(directory):
    """Shards being written (created by the workers)."""
    return [n for n in (_files(directory) if pathlib.Path(directory).exists() else []) if n.startswith("shard-") and n.endswith(".tmp")]


def _ids(directory):
    return [int(i) for i, _ in kerasfeed.load_export(directory).as_numpy_iterator()]


@contextlib.contextmanager
def _tmpfs(path, options):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"this machine does not let the tests mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_target_directory_must_be_empty_or_an_export(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not empty \(1 entries.*overwrite=True.*resume=True.*Received: directory="):
        kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    with pytest.raises(ValueError, match=r"files that no export wrote \(\['notes.txt'\]\); they are not deleted"):
        kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False, overwrite=True)
    out = tmp_path / "out"
    kerasfeed.export(Slow(4), out, num_shards=2, executor="threads", progress=False)
    kerasfeed.export(Slow(6), out, num_shards=3, executor="threads", progress=False, overwrite=True)
    assert _ids(out) == list(range(6)) and len(_files(out)) == 4
    with pytest.raises(kerasfeed.ExportError, match="num_shards is 3 there and 2 now.*Received: num_shards=2"):
        kerasfeed.export(Slow(6), out, num_shards=2, executor="threads", progress=False, resume=True)
    with pytest.raises(ValueError, match="not both"):
        kerasfeed.export(Slow(6), out, num_shards=2, overwrite=True, resume=True)
    with pytest.raises(ValueError, match="must be at most len\\(source\\) = 6. Received: num_shards=7"):
        kerasfeed.export(Slow(6), out, num_shards=7)


def test_damaged_shards_are_named(tmp_path):
    kerasfeed.export(Slow(12, size=100), tmp_path, num_shards=3, executor="threads", progress=False)
    shard = tmp_path / "shard-00001-of-00003.tfrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size, one bit changed
    shard.write_bytes(bytes(data))
    with pytest.raises(kerasfeed.ExportError, match="shard-00001-of-00003.tfrecord: its CRC32C is .* the manifest says"):
        kerasfeed.verify_export(tmp_path)
    with pytest.raises(kerasfeed.ExportError, match="1 shard\\(s\\) fail.*shard-00001-of-00003.tfrecord: its CRC32C"):
        kerasfeed.load_export(tmp_path, verify="checksum")
    import tensorflow as tf

    ds = kerasfeed.load_export(tmp_path)  # sizes match: TFRecord's own record CRC catches it while reading
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"kerasfeed: damaged shard shard-00001-of-00003.tfrecord: one of its 4 records failed its TFRecord checksum.*verify_export.*resume=True.*Received: file={re.escape(str(shard))}"):
        list(ds)
    shard.write_bytes(bytes(data[:-7]))  # truncated: the default up-front check names it
    with pytest.raises(kerasfeed.ExportError, match="shard-00001-of-00003.tfrecord: the file has .* bytes, the manifest says"):
        kerasfeed.load_export(tmp_path)
    shard.unlink()
    with pytest.raises(kerasfeed.ExportError, match="shard-00001-of-00003.tfrecord: the file is missing"):
        kerasfeed.load_export(tmp_path)
    # resume keeps the two good shards and rewrites the damaged one
    before = {n: (tmp_path / n).stat().st_mtime_ns for n in ("shard-00000-of-00003.tfrecord", "shard-00002-of-00003.tfrecord")}
    kerasfeed.export(Slow(12, size=100), tmp_path, num_shards=3, executor="threads", progress=False, resume=True)
    assert {n: (tmp_path / n).stat().st_mtime_ns for n in before} == before
    assert kerasfeed.verify_export(tmp_path)["items"] == 12 and _ids(tmp_path) == list(range(12))


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_same_size_corruption_is_named_while_reading(tmp_path, compression):
    """A byte changed in the middle of a shard (same size) passes the default size check; iterating
    load_export then fails naming the shard file, after yielding only intact items in index order."""
    import tensorflow as tf

    kerasfeed.export(Slow(120, size=200), tmp_path, num_shards=3, executor="threads", progress=False,
                     compression=compression)  # fmt: skip
    shard = tmp_path / "shard-00001-of-00003.tfrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    message = rf"kerasfeed: damaged shard shard-00001-of-00003.tfrecord: .*Received: file={re.escape(str(shard))}"
    got = []
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        for i, _ in kerasfeed.load_export(tmp_path).as_numpy_iterator():
            got.append(int(i))
    assert got == list(range(len(got))) and len(got) < 61  # item 61 is shard 1's record 20, mid-file
    assert len(got) % 32 == 0  # records are checked 32 at a time: it comes at the start of the bad group
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):  # every way of reading it
        list(kerasfeed.load_export(tmp_path, shuffle_files=True, seed=3, num_shards=3, shard_index=1))
    if compression is None:  # the error reaches model.fit's caller too
        import keras

        model = keras.Sequential([keras.Input((200,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        xy = kerasfeed.load_export(tmp_path).map(lambda i, x: (tf.cast(x, "float32"), tf.cast(i, "float32")))
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            model.fit(xy.batch(8), epochs=1, verbose=0, shuffle=False)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_bad_items_name_their_index(tmp_path, executor):
    workers = 2 if executor == "processes" else None
    with pytest.raises(kerasfeed.SignatureError, match=r"Item 7, field y: expected shape \(16,\), received shape \(17,\)\. \(the export's spec was inferred from items \[0, 1, 2, 11\]"):
        kerasfeed.export(Slow(12, bad={7: "shape"}), tmp_path / "a", num_shards=3, executor=executor, workers=workers, progress=False)
    for at in (0, 7):  # probed, and mid-pass: named, not a bare internal UnsupportedLeaf
        with pytest.raises(kerasfeed.SignatureError, match=rf"^Item {at}, field y is None\. .* Received: None$"):
            kerasfeed.export(Slow(12, bad={at: "none"}), tmp_path / f"n{at}", num_shards=3, executor=executor,
                             workers=workers, progress=False)
    with pytest.raises(kerasfeed.ItemError, match=r"Slow\[9\] raised KeyError.*no row 9") as info:
        kerasfeed.export(Slow(12, bad={9: "raise"}), tmp_path / "b", num_shards=3, executor=executor, workers=workers, progress=False)
    assert info.value.index == 9
    for d in ("a", "b"):  # nothing that looks like a shard of a bad item, no temporary file
        m = _manifest(tmp_path / d)
        assert not m["complete"] and not any(n.endswith(".tmp") for n in _files(tmp_path / d))
        assert set(_files(tmp_path / d)) == {"manifest.json"} | {s["file"] for s in m["shards"] if s}
        with pytest.raises(kerasfeed.ExportError, match="is incomplete.*resume=True"):
            kerasfeed.load_export(tmp_path / d)
    if executor == "threads":  # a wider spec given up front takes the odd item
        import tensorflow as tf

        wide = (tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.uint8))
        kerasfeed.export(Slow(12, bad={7: "shape"}), tmp_path / "c", num_shards=3, executor=executor, progress=False, output_signature=wide)
        sizes = [len(x) for _, x in kerasfeed.load_export(tmp_path / "c").as_numpy_iterator()]
        assert sizes == [16] * 7 + [17] + [16] * 4


def test_full_disk_and_read_only_directory(tmp_path):
    with _tmpfs(tmp_path / "small", "size=1m") as small:
        # The disk may fill up in a shard's write or in the manifest's update after a shard: either way
        # the error names the failed write and ENOSPC.
        full = "(writing shard \\d .* failed while writing item \\d+|cannot write in the target directory)"
        with pytest.raises(kerasfeed.ExportError, match=full + ": OSError: .*No space left on device"):
            kerasfeed.export(Slow(40, size=100_000), small, num_shards=4, executor="processes", workers=2, progress=False)
        m = _manifest(small)
        assert not m["complete"] and not any(n.endswith(".tmp") for n in _files(small))
        assert set(_files(small)) == {"manifest.json"} | {s["file"] for s in m["shards"] if s}
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        with pytest.raises(kerasfeed.ExportError, match="cannot write in the target directory: OSError: .*Read-only file system"):
            kerasfeed.export(Slow(4), ro, num_shards=2, executor="threads", progress=False)


def test_a_worker_that_dies_is_told_by_the_shard_it_was_writing(tmp_path):
    """Item 7 is in shard 3 of 4: the message named the shard this process waited for first (1 or 2)."""
    with pytest.raises(kerasfeed.WorkerError, match=r"shard file 'shard-00003-of-00004.tfrecord' was not written: "
                                                      r".*Received: shard 3 of 4$") as died:
        kerasfeed.export(Slow(40, bad={7: "exit"}), tmp_path, num_shards=4, executor="processes", workers=2,
                         progress=False)
    assert died.value.index == 3


def test_a_replaced_worker_is_logged_by_the_export_s_shard_not_an_internal_class(tmp_path, caplog):
    """With retries=, the log line of a replaced worker said "of ShardTask ... while loading ShardTask[3]"."""
    caplog.set_level(logging.WARNING, logger="kerasfeed")
    with pytest.raises(kerasfeed.WorkerError):
        kerasfeed.export(Slow(40, bad={7: "exit"}), tmp_path, num_shards=4, executor="processes", workers=2,
                         progress=False, retries=1)
    assert "of export(Slow) shard exited unexpectedly with exit code 3 while loading export(Slow) shard[3]; a new " \
        "worker took its place" in caplog.text and "ShardTask" not in caplog.text, caplog.text


def test_overwrite_replaces_no_manifest_an_export_did_not_write(tmp_path):
    """``overwrite=True`` deletes only what an export wrote: a user's own ``manifest.json`` (told by its
    name alone) was replaced without a word."""
    for mine in ({"my": "dataset index"}, [1, 2]):
        (tmp_path / "manifest.json").write_text(json.dumps(mine))
        with pytest.raises(ValueError, match=r"files that no export wrote \(\['manifest.json'\]\)"):
            kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False, overwrite=True)
        assert json.loads((tmp_path / "manifest.json").read_text()) == mine
    (tmp_path / "manifest.json").unlink()
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    kerasfeed.export(Slow(6), tmp_path, num_shards=2, executor="threads", progress=False, overwrite=True)
    assert _ids(tmp_path) == list(range(6))


def test_killed_workers_then_resume_writes_every_item_once(tmp_path):
    me = psutil.Process()

    def kill_workers_after_first_shard():
        wait_until(lambda: (tmp_path / "manifest.json").exists() and any(_manifest(tmp_path)["shards"]), timeout=60)
        for child in me.children():
            if "kerasfeed" in " ".join(child.cmdline()):
                child.kill()

    killer = threading.Thread(target=kill_workers_after_first_shard)
    killer.start()
    with pytest.raises(kerasfeed.WorkerError, match="killed by signal SIGKILL") as died:
        kerasfeed.export(Slow(48, delay=0.02), tmp_path, num_shards=8, executor="processes", workers=2, progress=False)
    # Told as the export's: the shard file, the user's source, the export's remedies (not the pool's internals).
    text = str(died.value)
    assert re.match(r"kerasfeed.export: shard file 'shard-0000\d-of-00008.tfrecord' was not written: ", text), text
    assert "Slow" in text and "ShardTask" not in text and "does not replace" not in text, text
    assert "retries=N" in text and "resume=True" in text and died.value.pid is not None, text
    killer.join()
    done = [s for s in _manifest(tmp_path)["shards"] if s]
    assert 1 <= len(done) < 8 and not any(n.endswith(".tmp") for n in _files(tmp_path))
    kept = {s["file"]: (tmp_path / s["file"]).stat().st_mtime_ns for s in done}
    kerasfeed.export(Slow(48, delay=0.02), tmp_path, num_shards=8, executor="processes", workers=2, progress=False, resume=True)
    assert {n: (tmp_path / n).stat().st_mtime_ns for n in kept} == kept  # finished shards were not rewritten
    assert kerasfeed.verify_export(tmp_path)["items"] == 48
    assert _ids(tmp_path) == list(range(48))  # every item exactly once, in order


_EXPORT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import kerasfeed
    from _export_sources import Slow
    kerasfeed.export(Slow(60, delay=0.05), {out!r}, num_shards=6, executor="processes", workers=2, resume=True)
    """
)


def test_ctrl_c_and_a_crash_of_the_exporting_process_then_resume(tmp_path):
    out = tmp_path / "out"
    script = _EXPORT_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: _shard_tmps(out), timeout=60)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "export: 100%" not in err  # interrupted: the progress bar stopped short
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive
    assert not any(n.endswith(".tmp") or n.startswith(".") for n in _files(out))
    assert not _manifest(out)["complete"]
    # A crash (SIGKILL: no clean-up at all) leaves .tmp files, never a shard that looks whole;
    # the workers leave by themselves when their parent dies.
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _shard_tmps(out), timeout=60)
        workers = psutil.Process(proc.pid).children()
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _shard_tmps(out)
    m = _manifest(out)
    unfinished = {f"shard-{k:05d}-of-00006.tfrecord" for k, s in enumerate(m["shards"]) if s is None}
    assert unfinished and not unfinished & set(_files(out))
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    kerasfeed.export(Slow(60, delay=0.05), out, num_shards=6, executor="processes", workers=2, progress=False, resume=True)
    assert _ids(out) == list(range(60)) and not any(n.endswith(".tmp") or n.startswith(".") for n in _files(out))


def test_damaged_arrayrecord_shard_is_named_while_reading(tmp_path):
    """A shard damaged after ExportSource was built (so its size check passed): Riegeli's own error names
    no file; src[i] names the shard file, the record and the item, and says how to check and repair."""
    kerasfeed.export(Slow(12), tmp_path, num_shards=3, executor="threads", progress=False, format="arrayrecord")
    src = kerasfeed.ExportSource(tmp_path)
    shard = tmp_path / "shard-00001-of-00003.arrayrecord"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # the header of the chunk of record 0 (item 1): same size
    shard.write_bytes(bytes(data))
    where = rf"Record 0 of shard file '{re.escape(str(shard))}' \(item 1\) cannot be read: RuntimeError: .*"
    advice = r"verify_export\(directory\) checks every shard of .*export\(\.\.\., resume=True\) rewrites the damaged"
    with pytest.raises(kerasfeed.ExportError, match=where + advice + r".* Received: index=-11$"):
        src[-11]
    assert int(src[3][0]) == 3  # the other shards still read
    with pytest.raises(kerasfeed.ItemError, match=r"ExportSource\[1\] raised ExportError: Record 0 of shard file"):
        list(kerasfeed.to_dataset(src, executor="threads"))
    shard.unlink()  # gone: the reader cannot even open it
    fresh = kerasfeed.ExportSource(tmp_path, verify=False)
    with pytest.raises(kerasfeed.ExportError, match=r"Record 0 of shard file .*shard-00001-of-00003.arrayrecord' \(item 1\) cannot be read: RuntimeError: open\(\) failed"):
        fresh[1]
    kerasfeed.export(Slow(12), tmp_path, num_shards=3, executor="threads", progress=False, format="arrayrecord", resume=True)
    assert [int(kerasfeed.ExportSource(tmp_path)[i][0]) for i in range(12)] == list(range(12))


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda m: [m], "it holds a JSON list, not an object. Received: \\[\\{"),
        (lambda m: {k: v for k, v in m.items() if k != "num_items"}, "the manifest has no 'num_items'.*Received: keys \\["),
        (lambda m: {**m, "num_shards": "2"}, "the manifest\\['num_shards'\\] must be of type int, not str.*Received: '2'$"),
        (lambda m: {**m, "shards": m["shards"][:1]}, "it lists 1 shards for num_shards=2"),
        (lambda m: {**m, "shards": [m["shards"][0], {"file": "x"}]}, "shards\\[1\\] has no 'count'.*Received: keys \\['file'\\]$"),
        (lambda m: {**m, "compression": "LZ4"}, "its file_format and compression must be one of .*Received: file_format='tfrecord', compression='LZ4'$"),
        (lambda m: {**m, "element_spec": {"fields": []}}, "element_spec has no 'structure'"),
    ],
)
def test_a_foreign_or_hand_edited_manifest_is_named(tmp_path, edit, problem):
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(edit(_manifest(tmp_path))))
    prefix = rf"'{re.escape(str(path))}' (is not a kerasfeed export manifest|is damaged or not written by kerasfeed\.export): "
    for read in (kerasfeed.load_export, kerasfeed.verify_export):
        with pytest.raises(kerasfeed.ExportError, match=prefix + problem):
            read(tmp_path)
    with pytest.raises(kerasfeed.ExportError, match=prefix + problem):
        kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False, resume=True)


def test_output_signature_of_numpy_arrays_is_named(tmp_path):
    """Arrays have a dtype and a shape, as a TensorSpec: AttributeError "'tuple' object has no attribute 'as_list'"."""
    for given, at in ((np.zeros(3, np.float32), r"\[\]"), ((np.zeros(3, np.float32),), r"\[0\]")):
        with pytest.raises(TypeError, match=rf"`output_signature` must be a nest of tf.TensorSpec; the entry at {at} is "
                                            r"not. Received: array\("):
            kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", output_signature=given)
    import tensorflow as tf

    # A RaggedTensorSpec has a dtype and a shape too: it was taken as a dense spec, read back dense.
    ragged = (tf.TensorSpec([], tf.int64), tf.RaggedTensorSpec([None, None], tf.uint8))
    with pytest.raises(TypeError, match=r"`output_signature` at \[1\] is a RaggedTensorSpec: export writes each leaf "
                                        r".*tf.TensorSpec\(\[None, None\], 'uint8'\). Received: RaggedTensorSpec"):
        kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", output_signature=ragged)


def test_output_signature_of_unknown_rank_is_refused(tmp_path):
    import tensorflow as tf

    signature = (tf.TensorSpec([], tf.int64), tf.TensorSpec(None, tf.uint8))
    with pytest.raises(ValueError, match=r"`output_signature` at \[1\] has an unknown rank; .*tf\.TensorSpec\(\[None, 3\], 'uint8'\)\. Received: TensorSpec\(shape=<unknown>"):
        kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", output_signature=signature)


_GONE = textwrap.dedent("""
    import os, sys
    import numpy as np
    import kerasfeed

    class S:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return np.full((2,), i, np.float32)

    d = sys.argv[1]
    kerasfeed.export(S(), d, num_shards=2, executor="threads", progress=False)
    ds = kerasfeed.load_export(d, verify=sys.argv[2] == "size" and "size")
    os.remove(os.path.join(d, "shard-00001-of-00002.tfrecord"))  # after load_export returned (a cleanup job)
    try:
        list(ds.as_numpy_iterator())
    except Exception as e:
        print("RAISED", type(e).__name__, e)
""")


def test_a_second_export_into_a_directory_being_written_is_refused(tmp_path):
    # Two at once each deleted the other's shards and temporary files and stopped its workers; both failed,
    # naming neither ("shard 2 was stopped", "cannot write in the target directory").
    first: dict = {}

    def run_first():
        try:
            first["manifest"] = kerasfeed.export(Slow(16, delay=0.4), tmp_path, num_shards=4, executor="threads",
                                                 progress=False)  # ~1.6 s: the second comes well within it
        except Exception as e:  # noqa: BLE001 - asserted below
            first["error"] = e

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        assert wait_until(lambda: (tmp_path / "manifest.json").exists(), 30)
        with pytest.raises(kerasfeed.ExportError, match=r"another export is writing in '.*' now"):
            kerasfeed.export(Slow(8), tmp_path, num_shards=4, executor="threads", overwrite=True, progress=False)
    finally:
        thread.join(60)
    assert "error" not in first, first
    assert first["manifest"]["complete"] and _ids(tmp_path) == list(range(16))
    # Once it is done the directory is free again.
    kerasfeed.export(Slow(8), tmp_path, num_shards=4, executor="threads", overwrite=True, progress=False)


def test_an_export_under_a_path_with_glob_and_escape_characters_reads_back(tmp_path):
    # TensorFlow's file matcher takes a backslash as an escape: the healthy shards were read as damaged.
    d = tmp_path / "back\\slash [1] *?"
    kerasfeed.export(Slow(6), d, num_shards=2, executor="threads", progress=False)
    assert _ids(d) == list(range(6))


@pytest.mark.parametrize("verify", ["size", "none"])
def test_a_shard_gone_after_load_export_is_named_while_reading(tmp_path, verify):
    # Its reader failed at every call without moving on, and ignore_errors() called it again for ever: the
    # iteration hung at 100 % CPU (with verify=False, also for a file gone before load_export).
    d = tmp_path / "e[1]"  # glob characters in the path: the check for the file takes them literally
    out = subprocess.run([sys.executable, "-c", _GONE, str(d), verify], capture_output=True, text=True, timeout=180)
    assert "RAISED InvalidArgumentError" in out.stdout, (out.stdout[-800:], out.stderr[-1500:])
    assert "damaged shard shard-00001-of-00002.tfrecord" in out.stdout


def test_overwrite_deletes_only_the_exports_own_files(tmp_path):
    """Names that merely look like shards (a user's backup copy, notes) are not the export's: refused, kept."""
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    mine = ["shard-00000-of-00002.tfrecord.bak", "shard-notes.tfrecord.txt", "shard-1-of-2.tfrecord"]
    for name in mine:
        (tmp_path / name).write_text("my notes")
    for again in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(ValueError, match="shard-00000-of-00002.tfrecord.bak"):
            kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False, **again)
        assert all((tmp_path / name).read_text() == "my notes" for name in mine)


class _Locked(Slow):
    def __init__(self, n):
        super().__init__(n)
        self.lock = threading.Lock()  # cannot be pickled for worker processes


@pytest.mark.parametrize("source, kwargs, error", [
    (Slow(4), {"executor": "threads", "workers": 2}, r"^export: `workers` and `worker_init` apply to worker"),
    (Slow(4), {"executor": "threads", "worker_init": print}, r"^export: `workers` and `worker_init` apply"),
    (Slow(4), {"executor": "processes", "worker_init": "setup"}, r"worker_init"),
    (_Locked(4), {"executor": "processes"}, r"`source.lock` \(_thread.lock\) cannot be pickled"),
])
def test_bad_executor_arguments_are_refused_before_an_earlier_export_is_deleted(tmp_path, source, kwargs, error):
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    before = {name: (tmp_path / name).read_bytes() for name in _files(tmp_path)}
    with pytest.raises((ValueError, TypeError), match=error):
        kerasfeed.export(source, tmp_path, num_shards=2, overwrite=True, progress=False, **kwargs)
    assert {name: (tmp_path / name).read_bytes() for name in _files(tmp_path)} == before
    assert kerasfeed.verify_export(tmp_path)["items"] == 4


@pytest.mark.parametrize("field, value, problem", [
    ("dtype", "float99", r"\['dtype'\] must be 'string' or one of .*float32.*; export again .*Received: 'float99'$"),
    ("shape", [None, "x"], r"\['shape'\] must hold sizes \(ints >= 0\) or null; export again .*Received: \[None, 'x'\]$"),
    ("shape", [-2], r"\['shape'\] must hold sizes .*Received: \[-2\]$"),
])
def test_a_manifest_field_of_a_wrong_value_is_named(tmp_path, field, value, problem):
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    manifest = _manifest(tmp_path)
    manifest["element_spec"]["fields"][0][field] = value
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(kerasfeed.ExportError, match=r"element_spec\['fields'\]\[0\]" + problem):
        kerasfeed.load_export(tmp_path)


@pytest.mark.parametrize("same_stamp", [False, True])
def test_an_export_source_refuses_shards_exported_again_after_it_was_made(tmp_path, monkeypatch, same_stamp):
    """Shards already open read the old files; one opened after a new export would read the new one: refused.

    same_stamp: the new file got the old one's inode and times (a freed inode is often reused; CI saw it):
    the manifest's entry for the shard still tells them apart."""
    if same_stamp:
        from kerasfeed.exporting import arrayrecord
        monkeypatch.setattr(arrayrecord, "_stamp", lambda path: ("same",))
    kerasfeed.export(Slow(8), tmp_path, num_shards=2, executor="threads", progress=False, format="arrayrecord")
    src = kerasfeed.ExportSource(tmp_path)
    assert int(src[0][0]) == 0  # shard 0 open
    class Later(Slow):
        def __getitem__(self, i):
            first, payload = super().__getitem__(i)
            return first + 100, payload

    kerasfeed.export(Later(8), tmp_path, num_shards=2, executor="threads", progress=False, format="arrayrecord",
                     overwrite=True)
    assert int(src[2][0]) == 2  # the open shard 0: the old file, whole
    with pytest.raises(kerasfeed.ExportError, match=r"shard-00001-of-00002.arrayrecord' was replaced after this "
                       r"ExportSource was made .*Make the ExportSource again\. Received: shard 1$"):
        src[1]
    assert [int(kerasfeed.ExportSource(tmp_path)[i][0]) for i in range(8)] == list(range(100, 108))


def test_load_export_and_export_source_arguments_that_would_be_ignored_are_refused(tmp_path):
    kerasfeed.export(Slow(4), tmp_path, num_shards=2, executor="threads", progress=False)
    with pytest.raises(ValueError, match=r"only shuffle_files=True shuffles.*Received: seed=1, shuffle_files=False$"):
        kerasfeed.load_export(tmp_path, seed=1)
    for odd in (0, 1, True, "SIZE"):  # 0 == False: it passed as "check nothing"
        with pytest.raises(ValueError, match=rf"`verify` must be 'size', 'checksum' or False. Received: verify={odd!r}$"):
            kerasfeed.load_export(tmp_path, verify=odd)
    assert len(list(kerasfeed.load_export(tmp_path, verify=False, shuffle_files=True, seed=1))) == 4
