"""``kerasfeed.export``: write any source to sharded TFRecord (or ArrayRecord) files in parallel."""

from __future__ import annotations

import numbers
import os
import pathlib
import re
import threading
import time
from typing import Any, Callable, Optional

from kerasfeed import _validation as _v
from kerasfeed.errors import ItemError, WorkerError
from kerasfeed.execution.processes.process import NO_RESTART
from kerasfeed.execution.thread_tasks import join_at_exit, running
from kerasfeed.exporting import manifest as mf
from kerasfeed.exporting.encoding import require_crc32c
from kerasfeed.exporting.spec import ExportSpec
from kerasfeed.exporting.writer import Progress, ShardTask
from kerasfeed.loading.pipeline import probe_indices
from kerasfeed.sources.base import set_epoch, source_length, source_name
from kerasfeed.sources.item_random import item_scope

_EXECUTORS = ("threads", "processes", "auto")


def export(
    source: Any,
    directory: Any,
    *,
    num_shards: int,
    executor: str = "processes",
    workers: Optional[int] = None,
    compression: Optional[str] = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    format: str = "tfrecord",
    output_signature: Any = None,
    worker_init: Optional[Callable[[], None]] = None,
    retries: int = 0,
    max_skipped: Any = 0,
    worker_max_items: Optional[int] = None,
    worker_max_rss: Optional[int] = None,
) -> dict:
    """Writes every item of ``source`` once to ``num_shards`` files in ``directory``.

    Item ``i`` (``source[i]``, a nest of arrays: any dtype including
    bytes/str, any shape, shapes may vary) becomes one ``tf.train.Example``
    record, losslessly, in shard ``i % num_shards``. Each shard is one task on
    the executor, whose thread or worker process makes the shard's items in
    order and writes them with its own writer (never shared): loading,
    encoding, compression and checksums all run in parallel. A shard is
    written to ``<name>.tmp``, fsync'd, and renamed by this process once
    complete; ``manifest.json`` (element spec, per-shard counts, byte sizes
    and CRC32C, kerasfeed version) is rewritten after every shard, so a crash
    never leaves a shard that looks whole and ``resume=True`` can go on from
    the finished ones.

    Args:
        source: an indexable source (``__len__``/``__getitem__``), e.g. a
            ``kerasfeed.SceneSequence``. Its items are the ones
            ``to_dataset(source)`` yields in its first pass: ``set_epoch(0)``
            is called before they are probed and made, and a source with
            an integer ``epoch`` gets it back when ``export`` ends.
        directory: the target directory; created if needed; must be empty
            unless ``overwrite`` or ``resume``.
        num_shards: number of files, at most ``len(source)``. Use a multiple
            of ``workers`` (and of the number of training workers that will
            read it) so that every worker gets the same share.
        executor: ``"processes"`` (worker processes: past the GIL and
            h5py's lock), ``"threads"``, or ``"auto"``: probe a few
            ``source[i]`` calls here and choose as ``to_dataset`` does
            (threads for sources that wait or release the GIL, processes
            for GIL-bound ones; the choice and why is logged on the
            ``kerasfeed`` logger). Items never move between processes in an
            export, so the transport terms of that choice are left out.
        workers: number of worker processes; None = the usable CPU count
            (at most one per shard).
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"`` (TFRecord);
            ``None``, ``"ZSTD"``, ``"SNAPPY"`` or ``"BROTLI"`` (ArrayRecord).
        overwrite: replace an existing export in ``directory``.
        resume: keep the shards of an earlier, interrupted run that pass
            their checksum and write the rest (same source and settings).
        progress: show a progress bar (tqdm, else Keras' Progbar).
        format: ``"tfrecord"`` (read with ``load_export``: pure TensorFlow)
            or ``"arrayrecord"`` (random access: ``ExportSource``).
        output_signature: a nest of ``tf.TensorSpec`` (of known rank) for one item; inferred
            from items 0, 1, 2 and the last when None (a dimension that
            differs becomes None).
        worker_init: run once in each worker process.
        retries: how many more times ``source[i]`` is called after a call
            that raised (in the same worker, with the same item seeds); a
            shard whose worker died is written again from its start by a
            fresh worker, up to ``retries`` times. 0 (the default): the first
            failure fails the export.
        max_skipped: must stay 0: an export writes every item (its layout,
            which ``ExportSource[i]``, ``load_export``'s order and
            ``resume=True`` read, would shift past an item left out).
        worker_max_items, worker_max_rss: a worker process that was sent
            this many shards, or whose resident memory passed this many bytes
            after a shard, is replaced by a fresh one (None: never; worker
            processes only).

    Returns:
        The manifest (also in ``directory/manifest.json``) as a dict.

    Raises:
        ValueError, TypeError: bad arguments, or a non-empty ``directory``
            without ``overwrite``/``resume``.
        kerasfeed.ItemError: ``source[i]`` raised (``.index`` is ``i``).
        kerasfeed.SignatureError: item ``i`` does not fit the element spec.
        kerasfeed.ExportError: a write failed (disk full, read-only
            directory), or ``resume`` found an export of other settings.
        kerasfeed.WorkerError: a worker process died.
        KeyboardInterrupt: Ctrl-C. In every failure the workers are stopped,
            no ``.tmp`` file is left, and the finished shards stay recorded.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Squares(kerasfeed.SceneSequence):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": np.full((i + 1, 2), i, "float32"), "name": f"item-{i}"}

    kerasfeed.export(Squares(), "/tmp/squares", num_shards=2, executor="threads", overwrite=True)
    ds = kerasfeed.load_export("/tmp/squares")   # x: (None, 2) float32, name: string
    ```
    """
    n = source_length(source)
    directory = pathlib.Path(_v.path("directory", directory, owner="export"))
    num_shards = _v.positive_int("num_shards", num_shards, owner="export")
    if num_shards > n:
        raise ValueError(f"export: `num_shards` must be at most len(source) = {n}. Received: num_shards={num_shards}")
    if executor not in (*_EXECUTORS, "ray"):  # "ray": Ray actors (the `ray` extra; the shards' directory shared)
        raise ValueError(f"export: `executor` must be one of {_EXECUTORS}. Received: executor={executor!r}")
    workers = _v.positive_int("workers", workers, allow_none=True, owner="export")
    overwrite, resume = _v.flag("overwrite", overwrite, owner="export"), _v.flag("resume", resume, owner="export")
    progress = _v.flag("progress", progress, owner="export")
    retries = _v.non_negative_int("retries", retries, owner="export")
    if not (isinstance(max_skipped, int) and not isinstance(max_skipped, bool) and max_skipped == 0):
        raise ValueError(
            "export: `max_skipped` must be 0: an export writes every item, in a layout (item i is record "
            "i // num_shards of shard i % num_shards) that ExportSource[i], load_export's order and resume=True's "
            "per-shard counts all read, so an item left out would move every later record of its shard. Fix the "
            "item, or export a source without it (retries= tries a failing item again). "
            f"Received: max_skipped={max_skipped!r}"
        )
    if overwrite and resume:
        raise ValueError(
            "export: pass `overwrite=True` (start again) or `resume=True` (go on), not both. "
            "Received: overwrite=True, resume=True"
        )
    if format not in mf.FORMATS:
        raise ValueError(f"export: `format` must be one of {tuple(mf.FORMATS)}. Received: format={format!r}")
    given, compression = compression, compression.upper() if isinstance(compression, str) else compression
    if compression not in mf.COMPRESSIONS[format]:
        raise ValueError(
            f"export: `compression` for format={format!r} must be one of {mf.COMPRESSIONS[format]}. "
            f"Received: compression={given!r}"
        )
    require_crc32c()
    name = source_name(source)

    # The writers set epoch 0 (the items are pass 0's); the spec and the "auto" probe
    # must see those items too, not the pass the caller's source was left at.
    before = _current_epoch(source)
    set_epoch(source, 0)
    try:
        return _export(source, directory, name, n=n, num_shards=num_shards, executor=executor, workers=workers,
                       compression=compression, overwrite=overwrite, resume=resume, progress=progress,
                       file_format=format, output_signature=output_signature, worker_init=worker_init,
                       limits=dict(retries=retries, worker_max_items=worker_max_items,
                                   worker_max_rss=worker_max_rss))  # fmt: skip
    finally:
        # Leave the caller's source as it was (the threads executor runs on this very object).
        if before is not None and _current_epoch(source) != before:
            set_epoch(source, before)


def _current_epoch(source: Any) -> Optional[int]:
    """The pass ``source`` says it is at (``SceneSequence.epoch``), or None when it says none."""
    epoch = getattr(source, "epoch", None)
    return int(epoch) if isinstance(epoch, numbers.Integral) and not isinstance(epoch, bool) else None


def _export(source: Any, directory: pathlib.Path, name: str, *, n: int, num_shards: int, executor: str,
            workers: Optional[int], compression: Optional[str], overwrite: bool, resume: bool, progress: bool,
            file_format: str, output_signature: Any, worker_init: Any, limits: dict) -> dict:  # fmt: skip
    """``export`` once its arguments are checked and ``source`` is at epoch 0; ``limits``: the
    ``PoolOptions`` of retries and recycled workers."""
    _check_pool(source, executor, workers, worker_init, limits)  # before any file is touched
    spec, probed = _spec(source, n, output_signature)
    hint = (
        f" (the export's spec was inferred from items {probed}; pass `output_signature=` to export to widen it)"
        if probed else " (the spec given as `output_signature`)"
    )  # fmt: skip
    auto = executor == "auto"
    if auto:
        executor = _auto_executor(source, workers)
        if executor == "threads":  # as in to_dataset: the process options do not apply
            workers = worker_init = None
            limits = dict(limits, worker_max_items=None, worker_max_rss=None)
    try:
        with mf.exclusive(directory):
            manifest = _prepare(directory, spec, n=n, num_shards=num_shards, file_format=file_format,
                                compression=compression, source=name, overwrite=overwrite, resume=resume)  # fmt: skip
            todo = [k for k, s in enumerate(manifest["shards"]) if s is None]
            if todo:
                task = ShardTask(source, directory, spec, num_items=n, num_shards=num_shards,
                                 file_format=file_format, compression=compression, source_name=name, hint=hint,
                                 retries=limits["retries"])  # fmt: skip
                _run(task, directory, manifest, todo, executor=executor, workers=workers, worker_init=worker_init,
                     progress=progress, auto=auto, limits=limits)
            manifest["complete"] = True
            mf.write_manifest(directory, manifest)
    except OSError as e:  # the main process's own writes: directory, manifest, renames
        raise mf.ExportError(
            f"kerasfeed.export: cannot write in the target directory: {type(e).__name__}: {e}. No shard is left "
            f"looking complete; finished shards stay in the manifest. Received: directory='{directory}'"
        ) from e
    return manifest


def _check_pool(source: Any, executor: str, workers: Optional[int], worker_init: Any, limits: dict) -> None:
    """The executor's options, and for worker processes the source's pickling: refused before ``_prepare``
    deletes an earlier export (``overwrite=True``), not after."""
    from kerasfeed.execution.pickling import dumps_for_workers
    from kerasfeed.execution.processes.options import PoolOptions

    pool = PoolOptions(workers=workers, worker_init=worker_init, **limits)
    if executor == "threads" and pool.given:
        raise ValueError(
            "export: `workers` and `worker_init` apply to worker processes; executor='threads' received "
            f"workers={workers!r}, worker_init={worker_init!r}"
        )
    if executor == "threads" and pool.recycles:
        raise ValueError(
            "export: `worker_max_items` and `worker_max_rss` recycle worker processes; threads cannot be replaced "
            f"that way (use executor='processes'). Received: worker_max_items={pool.worker_max_items!r}, "
            f"worker_max_rss={pool.worker_max_rss!r}"
        )
    if executor in ("processes", "ray"):  # "auto" falls back to threads instead (``_run``)
        dumps_for_workers(source, worker_init, executor)


def _auto_executor(source: Any, workers: Optional[int]) -> str:
    """``executor="auto"``: ``to_dataset``'s choice, from a probe of ``source`` (not of the shard tasks)."""
    import dataclasses

    from kerasfeed.execution.auto import decide, logger, probe_source
    from kerasfeed.execution.processes.options import usable_cpus

    cpus = usable_cpus()
    probe = probe_source(source)
    # Each item is written where it is made: no copy into shared memory, no hand-over
    # (an export's workers use every CPU: nothing trains beside them).
    name, reason = decide(dataclasses.replace(probe, copy_s=0.0), workers or cpus, cpus, "numpy")
    logger.info("kerasfeed: export(executor='auto') for %s: auto chose %s: %s", source_name(source), name, reason)
    return name


def _spec(source: Any, n: int, output_signature: Any) -> tuple[ExportSpec, list]:
    if output_signature is not None:
        return ExportSpec.from_tensor_specs(output_signature), []
    indices = probe_indices(n, 3)
    probes = []
    for i in indices:
        try:
            with item_scope(i):  # kerasfeed.item_rng() works in probed items too
                probes.append((i, source[i]))
        except Exception as e:
            raise ItemError.from_exception(i, e, source_name=source_name(source)) from e
    return ExportSpec.infer(probes), indices


def _prepare(directory: pathlib.Path, spec: ExportSpec, *, n: int, num_shards: int, file_format: str,
             compression: Optional[str], source: str, overwrite: bool, resume: bool) -> dict:  # fmt: skip
    """Checks the target directory; returns the manifest to complete (finished shards kept on resume)."""
    entries = sorted(os.listdir(directory))  # made, and checked to be a directory, by ``mf.exclusive``
    if entries and not (overwrite or resume):
        raise ValueError(
            f"export: the target directory is not empty ({len(entries)} entries, e.g. {entries[:3]}); pass "
            "overwrite=True to replace it or resume=True to finish an interrupted export. "
            f"Received: directory='{directory}'"
        )
    foreign = [e for e in entries if not mf.is_own_file(e)]
    if overwrite and mf.MANIFEST in entries and not mf.is_export_manifest(directory):  # (resume names its fault)
        foreign.append(mf.MANIFEST)
    if foreign:
        raise ValueError(
            f"export: the target directory holds files that no export wrote ({foreign[:5]}); they are not deleted: "
            f"choose an empty directory or remove them. Received: directory='{directory}'"
        )
    fresh = mf.new_manifest(
        spec, num_items=n, num_shards=num_shards, file_format=file_format, compression=compression, source=source
    )
    keep: set = set()
    if resume and (directory / mf.MANIFEST).is_file():
        _, old = mf.read_manifest(directory, need_complete=False)
        for key in ("num_items", "num_shards", "file_format", "compression", "element_spec"):
            if old.get(key) != fresh[key]:
                raise mf.ExportError(
                    f"export(resume=True): the export in '{directory}' was written with other settings: {key} is "
                    f"{old.get(key)!r} there and {fresh[key]!r} now; use overwrite=True to start again. "
                    f"Received: {key}={fresh[key]!r}"
                )
        bad = {name for name, _ in mf.bad_shards(directory, old, checksum=True)}
        fresh["created"] = old.get("created", fresh["created"])
        for k, entry in enumerate(old["shards"]):
            if entry is not None and entry["file"] not in bad:
                fresh["shards"][k] = entry
                keep.add(entry["file"])
    for e in entries:
        if e not in keep and e != mf.MANIFEST:
            (directory / e).unlink(missing_ok=True)
    mf.write_manifest(directory, fresh)
    return fresh


def _run(task: ShardTask, directory: pathlib.Path, manifest: dict, todo: list, *, executor: str,
         workers: Optional[int], worker_init: Any, progress: bool, auto: bool, limits: dict) -> None:  # fmt: skip
    from kerasfeed.execution.factory import make_executor
    from kerasfeed.execution.processes.options import PoolOptions, usable_cpus

    if executor == "processes":  # one worker per shard at most: a shard is one task
        workers = max(1, min(workers or usable_cpus(), len(todo)))
    total = sum(mf.shard_count(k, task.num_shards, task.num_items) for k in todo)
    shared = bar = ex = None
    try:
        shared = Progress(directory / mf.PROGRESS, task.num_shards, create=True)
        bar = _Bar(shared, todo, total) if progress else None
        try:
            # A shard is one executor item: a retried one (its worker died) is written again from its start.
            ex = make_executor(executor, task, PoolOptions(workers=workers, worker_init=worker_init, **limits))
        except TypeError as e:  # "auto" chose processes, but the source cannot be sent to them
            if not auto:
                raise
            from kerasfeed.execution.auto import logger

            logger.info("kerasfeed: export(executor='auto') falls back to threads: %s", str(e).split(". ")[0])
            ex = make_executor("threads", task, PoolOptions(retries=limits["retries"]))
        ex.plan(0, todo)
        for k in todo:
            try:
                report = ex.load(k, 0)
            except WorkerError as e:
                raise _worker_died(e, task, k) from e
            if "error" in report:
                raise report["error"]
            if report.get("stopped"):  # pragma: no cover - only after a stop this process asked for
                raise mf.ExportError(f"export: shard {k} was stopped. Received: directory='{directory}'")
            final = directory / report["file"]
            os.replace(directory / (report["file"] + mf.TMP), final)
            mf.fsync(directory)
            manifest["shards"][k] = {key: report[key] for key in ("file", "count", "bytes", "crc32c")}
            try:
                mf.write_manifest(directory, manifest)
            except OSError:
                # The manifest could not list the shard (e.g. the disk filled up): a shard it does not list
                # must not stay under its final name, where it would look complete.
                manifest["shards"][k] = None
                final.unlink(missing_ok=True)
                raise
    finally:
        if shared is not None:
            shared.stop()  # tasks still running stop at their next item
        if ex is not None:
            ex.close()
        deadline = time.monotonic() + 30
        while task.active and time.monotonic() < deadline:  # threads cannot be killed: wait for them
            time.sleep(0.01)
        if bar is not None:
            bar.close()
        if shared is not None:
            shared.close()
        for e in os.listdir(directory):
            if e.endswith(mf.TMP) or e == mf.PROGRESS:
                (directory / e).unlink(missing_ok=True)


def _worker_died(error: WorkerError, task: ShardTask, k: int) -> WorkerError:
    """``error`` told as the export's: the shard and the source, and the export's remedies (a pool of
    shard tasks is internal, and export can replace workers: ``retries``). The shard is the one the
    worker died making (``error.index``), not ``k``, the one this process waits for first."""
    k = error.index if error.index is not None else k
    name = mf.shard_name(k, task.num_shards, task.file_format)
    cause = str(error).split(NO_RESTART)[0].strip().removeprefix("kerasfeed: ")
    # "of export(S) shard ... while loading export(S) shard[k]": the pool's item is a shard, named above
    cause = re.sub(rf" while loading {re.escape(task.kerasfeed_name)}\[\d+\]", "", cause).rstrip(".")
    cause = cause.replace(task.kerasfeed_name, task.source_name)
    return WorkerError(
        f"kerasfeed.export: shard file '{name}' was not written: {cause}. Pass retries=N to replace a worker that "
        "dies and write its shard again, or run the same export with resume=True: the shards already written are "
        f"kept. Received: shard {k} of {task.num_shards}",
        error.worker_id, error.pid, error.exitcode, error.index, error.attempts, error.causes,
    )


class _Bar:
    """A progress bar fed from the shared per-shard counts by a small thread."""

    def __init__(self, shared: Progress, todo: list, total: int):
        self._shared, self._todo, self._done = shared, todo, 0
        try:
            import tqdm

            self._bar = tqdm.tqdm(total=total, unit="item", desc="export", smoothing=0.1, mininterval=0.5)
            self._tqdm = True
        except ImportError:  # pragma: no cover - the `export` extra installs tqdm
            import keras

            self._bar = keras.utils.Progbar(total, unit_name="item")
            self._tqdm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kerasfeed-export-progress", daemon=True)
        join_at_exit(self)  # an exception in export's cleanup skips close(): NOTE [ Pool threads at exit ]
        self._thread.start()

    def stop_at_exit(self) -> None:
        self._stop.set()

    def alive(self) -> list[threading.Thread]:
        return running(self._thread)

    def _update(self) -> None:
        counts = self._shared.counts()
        done = sum(counts[k] for k in self._todo)
        self._bar.update(done - self._done if self._tqdm else done)  # tqdm counts steps, Progbar the total
        self._done = done

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._update()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._update()
        if self._tqdm:
            self._bar.close()
