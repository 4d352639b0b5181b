"""``kerasfeed.InputStats``: input stats in Keras' epoch logs and in TensorBoard."""

from __future__ import annotations

import os
import time
import warnings
import weakref
from typing import Any, Optional

import keras

from kerasfeed._validation import positive_int
from kerasfeed.integrations.scalars import check_log_dir, scalar_writer
from kerasfeed.integrations.steps import StepCount
from kerasfeed.integrations.summaries import worker_run_dir
from kerasfeed.loading import hosts
from kerasfeed.observe import stats
from kerasfeed.observe.api import collector_of
from kerasfeed.observe.stats import StatsCollector, live_collectors


def input_run_dir(log_dir: "str | os.PathLike") -> str:
    """This process's run directory for input scalars: ``log_dir/input``; under a multi-worker cluster
    (``TF_CONFIG``) or a multi-process Keras distribution (JAX), ``worker_run_dir(log_dir)/input``, beside
    that worker's ``WorkerSummaries`` run (TensorBoard mixes the events of writers that share a run directory)."""
    if not os.environ.get("TF_CONFIG") and hosts.current_processes() is None:
        return os.path.join(os.fspath(log_dir), "input")
    return os.path.join(worker_run_dir(log_dir), "input")


class _Totals:
    """Cumulative figures of a collector at one instant (for interval rates)."""

    def __init__(self, snap: dict, now: float):
        self.now = now
        self.items = snap["items"]
        self.skipped = snap.get("skipped", 0)
        self.wait = snap["wait_total_s"]
        self.busy = {w["id"]: w.get("busy_s") or 0.0 for w in snap["workers"]}
        self.threads_busy_s = snap.get("threads_busy_s")
        self.cache = (snap["cache_hits"], snap["cache_misses"]) if "cache_hits" in snap else None

    def before(self, items: int, wait: float, skipped: int, cache: Optional[tuple] = None) -> "_Totals":
        """These totals less what was picked before them that the epoch counts (a model build's batch); the
        store's counts from where the pass began (``cache``), with its hits and misses."""
        self.items -= items
        self.wait -= wait
        self.skipped -= skipped
        if cache is not None and self.cache is not None:
            self.cache = cache
        return self


def _weak(obj: Any) -> Any:
    """A weak reference to ``obj``, or a callable giving None where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: None


class InputStats(keras.callbacks.Callback):
    """Puts the input pipeline's figures into Keras' logs and TensorBoard.

    At the end of each epoch it adds to the epoch logs (so Keras' progress
    bar and ``History`` show them):

    - ``input_wait_ms``: how long the pipeline's pick-up of items blocked,
      per training step, averaged over the epoch;
    - ``input_wait_share``: that blocked time as a share of the epoch;
    - ``input_skipped``: items left out during the epoch (``max_skipped=``),
      when the dataset may leave any out;
    - with ``cache=``: ``input_cache_hits`` (the share of the epoch's items
      read from the store) and ``input_cache_mb`` (what the store holds).

    The pick-up runs on tf.data's thread; prefetching after it can hide a
    wait from the training step. A wait near zero means the input keeps up.

    With ``log_dir`` it also writes TensorBoard scalars every
    ``every_n_steps`` training steps and at each epoch end, from this (the
    main) process, with one writer, into ``input_run_dir(log_dir)``
    (``log_dir/input``; ``log_dir/worker_<k>/input`` under a multi-worker
    ``TF_CONFIG`` or a multi-process Keras distribution, ``k`` the worker or
    process index), step = global training step. Tags:

    - ``input/wait_ms_mean`` (over the interval), ``input/wait_ms_p50``,
      ``input/wait_ms_p95``, ``input/wait_ms_p99`` (the last 4096 items),
      ``input/wait_ms_per_step``, ``input/ready_fraction``;
    - ``input/make_ms_p50``, ``input/make_ms_p95``, ``input/make_ms_p99``;
    - ``input/items_per_s``, ``input/batches_per_s`` (over the interval);
    - ``input/worker_<k>/busy`` (share of the interval worker ``k`` spent
      making items), ``input/worker_<k>/rss_mb``, ``input/threads_busy``;
    - ``input/ahead``, ``input/in_flight``, ``input/shm_mb``, ``input/errors``,
      ``input/skipped`` (items left out so far: ``max_skipped=``);
    - with ``cache=``: ``input/cache_hits``, ``input/cache_misses`` (items so
      far), ``input/cache_mb``, ``input/cache_fill`` (the share of the
      source's items stored);
    - at epoch ends: ``input/pass_gap_ms``, ``input/first_item_ms``.

    Which dataset: the one given as ``dataset=`` (any kerasfeed dataset or
    one derived from it). Without it, in every ``fit``, the kerasfeed dataset
    that delivered the most items during the first epoch's training steps
    (the training data; a validation set is read after them and never
    counts). When none did (``fit(seq)`` trains through Keras' own
    ``PyDataset`` path, numpy arrays through Keras'), the logs get no input
    figures and a warning says so.

    Args:
        log_dir: where to write TensorBoard scalars (a directory, made if
            missing; without TensorFlow outside its backend:
            ``integrations/scalars.py``); None writes none.
        every_n_steps: training steps between two writes.
        dataset: the kerasfeed dataset to follow; None finds it (above).

    Raises:
        ValueError: a bad ``every_n_steps``, or ``dataset`` is not a
            kerasfeed dataset.

    Example:

    ```python
    ds = kerasfeed.to_dataset(seq, shuffle=True, seed=0)
    history = model.fit(ds, epochs=3, shuffle=False,
                        callbacks=[kerasfeed.InputStats("logs", every_n_steps=20)])
    print(history.history["input_wait_ms"])  # then: tensorboard --logdir logs
    ```
    """

    def __init__(self, log_dir: Optional[str] = None, every_n_steps: int = 50, *, dataset: Any = None):
        super().__init__()
        self.log_dir = None if log_dir is None else check_log_dir(log_dir, owner="InputStats")
        self.every_n_steps = positive_int("every_n_steps", every_n_steps, owner="InputStats")
        # Refused now if it is not a kerasfeed dataset, and looked up again when
        # each fit begins: a loader under the TensorFlow backend reads through
        # a dataset Keras has it make for that fit. A weak reference: the
        # callback must not keep a dataset (and its workers) alive.
        self._given: Optional[StatsCollector] = None if dataset is None else collector_of(dataset)
        self._dataset = None if dataset is None else _weak(dataset)
        self._collector: Optional[StatsCollector] = None
        self._searching = False  # looking for the training data's collector (no `dataset=`)
        self._written_step = -1  # the step of the last TensorBoard write
        self._baseline: dict[int, tuple[StatsCollector, _Totals]] = {}
        self._writer: Any = None
        self.run_dir: Optional[str] = None
        self._steps = StepCount()  # training steps (an execution of steps_per_execution: one call)
        self._epoch_start: Optional[_Totals] = None
        self._last: Optional[_Totals] = None

    # ------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        # A callback used for a second fit follows that fit's data, not the first's.
        dataset = None if self._dataset is None else self._dataset()
        if dataset is not None:
            self._given = collector_of(dataset)
        self._collector, self._last, self._epoch_start = self._given, None, None
        self._searching = self._given is None
        if self._searching:
            now = time.perf_counter()
            self._baseline = {id(c): (c, _Totals(c.snapshot(), now)) for c in live_collectors()}
        if self.log_dir is not None and self._writer is None:
            self.run_dir = input_run_dir(self.log_dir)
            self._writer = scalar_writer(self.run_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._steps.epoch_begins()
        c = self._collector
        self._epoch_start = None if c is None else _Totals(c.snapshot(), time.perf_counter())
        self._count_taken_over()

    def _count_taken_over(self) -> None:
        # Under JAX and torch, Keras builds the model from a batch of the fit's first pass before
        # on_train_begin; the fit's iterator takes that pass over (with that batch) at the epoch's first
        # step: the batch's pick-up is this epoch's. Counted where first seen in the epoch (the collector
        # may be found later in it); one not counted by the epoch's end is dropped there.
        taken = self._collector.take_taken_over() if self._collector is not None else None
        if taken is not None and self._epoch_start is not None:
            self._epoch_start.before(*taken)

    def on_train_batch_end(self, batch, logs=None):
        added = self._steps.batch_ends(self.model, batch, self.params)
        if self._collector is None and not (self._searching and self._find()):
            return
        found = self._epoch_start is None
        if found:  # found during this epoch
            entry = self._baseline.get(id(self._collector))
            # Without an entry, a dataset built after fit began: nothing before.
            empty = {"items": 0, "skipped": 0, "wait_total_s": 0.0, "workers": [], "threads_busy_s": None}
            self._epoch_start = entry[1] if entry else _Totals(empty, time.perf_counter())
        if found or self._steps.epoch == added:  # not per step: a take-over comes before the first one ends
            self._count_taken_over()
        if self._writer is not None and self._steps.crossed(added, self.every_n_steps):
            self._write(self._collector.snapshot(), epoch_end=False)

    def on_test_begin(self, logs=None):
        self._stop_searching()  # validation reads its own dataset from here on

    def on_epoch_end(self, epoch, logs=None):
        self._stop_searching()
        if self._collector is None or self._epoch_start is None:
            return
        self._count_taken_over()
        snap = self._collector.snapshot()
        now = _Totals(snap, time.perf_counter())
        waited = now.wait - self._epoch_start.wait
        steps = max(self._steps.epoch, 1)
        if logs is not None:
            logs["input_wait_ms"] = waited / steps * 1e3
            logs["input_wait_share"] = waited / max(now.now - self._epoch_start.now, 1e-9)
            if self._collector.may_skip:
                logs["input_skipped"] = now.skipped - self._epoch_start.skipped
            if now.cache is not None:
                hits, misses = (a - b for a, b in zip(now.cache, self._epoch_start.cache or (0, 0)))
                logs["input_cache_hits"] = hits / max(hits + misses, 1)
                logs["input_cache_mb"] = snap["cache_bytes"] / 2**20
        if self._writer is not None:
            # Already written at this step: only the epoch-end tags (never two points at one step).
            self._write(snap, epoch_end=True, totals=now, interval=self._written_step != self._steps.total)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    # ------------------------------------------------------------ internals
    def _stop_searching(self) -> None:
        if self._searching and self._collector is None and not stats.ENABLED:
            warnings.warn(
                "InputStats: kerasfeed's stats are switched off (KERASFEED_STATS=0 when kerasfeed was imported), "
                "so the logs get no input figures. Unset it to count them.",
                stacklevel=2,
            )
        elif self._searching and self._collector is None:
            warnings.warn(
                "InputStats: no kerasfeed dataset delivered items to this fit's training steps, so the logs get "
                "no input figures. fit(seq) and numpy arrays go through Keras' own input path: train on "
                "kerasfeed.to_dataset(seq) or kerasfeed.to_loader(seq), or pass it as `dataset=`.",
                stacklevel=2,
            )
        self._searching = False

    def _find(self) -> bool:
        best, grown = None, 0
        for c in live_collectors():
            entry = self._baseline.get(id(c))
            # A model build's batch, picked before the baseline, is the fit's once its iterator takes the pass
            # over: with one batch an epoch nothing else grows (JAX, torch: "no kerasfeed dataset delivered").
            added = c.items - (entry[1].items if entry else 0) + c.taken_over_items
            if added > grown:
                best, grown = c, added
        if best is None:
            return False
        self._collector = best
        return True

    def _write(self, snap: dict, epoch_end: bool, totals: Optional[_Totals] = None, interval: bool = True) -> None:
        now = totals or _Totals(snap, time.perf_counter())
        if not interval:
            scalars = self._epoch_end_scalars(snap)
            if scalars:
                self._writer.scalars(scalars, self._steps.total)
            return
        last = self._last or self._epoch_start
        scalars: dict[str, float] = {}
        dt = now.now - last.now if last is not None else 0.0
        if last is not None and dt > 0:
            items = now.items - last.items
            scalars["input/items_per_s"] = items / dt
            scalars["input/batches_per_s"] = items / dt / snap["items_per_batch"]
            if items > 0:
                scalars["input/wait_ms_mean"] = (now.wait - last.wait) / items * 1e3
                steps = items / snap["items_per_batch"]
                scalars["input/wait_ms_per_step"] = (now.wait - last.wait) / steps * 1e3
            for w in snap["workers"]:
                busy = now.busy.get(w["id"], 0.0) - last.busy.get(w["id"], 0.0)
                scalars[f"input/worker_{w['id']}/busy"] = min(1.0, max(0.0, busy / dt))
            if now.threads_busy_s is not None:
                scalars["input/threads_busy"] = (now.threads_busy_s - (last.threads_busy_s or 0.0)) / dt
        for name, summary in (("wait_ms", snap["wait_ms"]), ("make_ms", snap["make_ms"])):
            if summary:
                for q in ("p50", "p95", "p99"):
                    scalars[f"input/{name}_{q}"] = summary[q]
        for w in snap["workers"]:
            if w.get("rss_mb") is not None:
                scalars[f"input/worker_{w['id']}/rss_mb"] = w["rss_mb"]
        for key in ("ready_fraction", "ahead", "in_flight"):
            if snap[key] is not None:
                scalars[f"input/{key}"] = snap[key]
        if snap["shm_bytes"] is not None:
            scalars["input/shm_mb"] = snap["shm_bytes"] / 2**20
        scalars["input/errors"] = snap["errors"]
        scalars["input/skipped"] = snap["skipped"]
        if "cache_hits" in snap:
            scalars.update({"input/cache_hits": snap["cache_hits"], "input/cache_misses": snap["cache_misses"],
                            "input/cache_mb": snap["cache_bytes"] / 2**20, "input/cache_fill": snap["cache_fill"]})
        if epoch_end:
            scalars.update(self._epoch_end_scalars(snap))
        self._writer.scalars(scalars, self._steps.total)
        self._last, self._written_step = now, self._steps.total

    @staticmethod
    def _epoch_end_scalars(snap: dict) -> dict:
        passes = [p for p in snap["passes"] if p["first_item_s"] is not None]
        if not passes:
            return {}
        p = passes[-1]
        scalars = {"input/first_item_ms": p["first_item_s"] * 1e3}
        if p["gap_s"] is not None:
            scalars["input/pass_gap_ms"] = p["gap_s"] * 1e3
        return scalars


__all__ = ["InputStats", "input_run_dir"]
