"""``kerasfeed.profile(source)``: time a source every way, classify it, recommend a setup (TF-free).

The method (the ``auto`` probe's categories, the timed runs, the recommendation) is in
docs/observability.md, *kerasfeed.profile*.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import numpy as np

from kerasfeed._validation import positive_int
from kerasfeed.execution.auto import (
    GIL_FREE_PARALLELISM,
    LARGE_ITEM_BYTES,
    WAIT_FRACTION,
    decide,
    item_at,
    probe_source,
)
from kerasfeed.observe.cache_advice import cache_advice, probe_load
from kerasfeed.observe.stats import StatsCollector
from kerasfeed.sources.base import source_length, source_name

CATEGORIES = ("waiting", "transport-bound", "GIL-releasing", "GIL-bound")
TRANSPORT_COPY_SHARE = 0.5  # a copy costing this share of a call: transport-bound
NEAR_BEST = 0.9  # the smallest count reaching this share of the best rate is recommended
DEFAULT_PASS_S = 2.0  # default `items`: what a serial pass over them takes, by the probe (64 at most, 4 at least)


def _cpus() -> int:
    from kerasfeed.execution.processes.options import usable_cpus

    return usable_cpus()


def classify(probe: Any) -> tuple[str, str]:
    """``(category, the figures that decided it)`` for an ``auto`` probe."""
    p = probe
    frac = min(1.0, p.cpu_s / max(p.wall_s - p.runqueue_s, 1e-9))
    par = p.parallelism_2_threads
    par_text = "not measured (slow items)" if par is None else f"{par:.2f} CPUs"
    figures = (
        f"{p.wall_s * 1e3:.2f} ms/item, {frac:.0%} on the CPU, two threads at once on {par_text}, "
        f"{p.nbytes / 2**20:.2f} MB/item, one copy {p.copy_s * 1e3:.2f} ms"
    )
    if frac < WAIT_FRACTION:
        why = f"only {frac:.0%} of the call is on the CPU (< {WAIT_FRACTION:.0%})"
        return "waiting", f"{why}; {figures}"
    if p.nbytes >= LARGE_ITEM_BYTES or p.copy_s >= TRANSPORT_COPY_SHARE * p.wall_s:
        why = (
            f"items carry {p.nbytes / 2**20:.1f} MB (>= {LARGE_ITEM_BYTES / 2**20:.0f} MB)"
            if p.nbytes >= LARGE_ITEM_BYTES
            else f"one copy takes {p.copy_s / max(p.wall_s, 1e-9):.0%} of a call"
        )
        return "transport-bound", f"{why}; {figures}"
    if par is not None and par >= GIL_FREE_PARALLELISM:
        return "GIL-releasing", f"two threads ran it on {par:.2f} CPUs at once (>= {GIL_FREE_PARALLELISM}); {figures}"
    return "GIL-bound", f"two threads ran it on {par_text} at once (< {GIL_FREE_PARALLELISM}); {figures}"


def _time_executor(ex: Any, indices: Sequence[int], copy: bool) -> tuple[float, StatsCollector]:
    """One planned pass through ``ex`` (pass 1; pass 0 warmed it up)."""
    from kerasfeed.execution.auto_probe import item_arrays

    stats = StatsCollector("profile")
    ex.attach_stats(stats)
    stats.timeline = []
    t0 = time.perf_counter()
    ex.plan(1, indices)
    for i in indices:
        item = ex.load(i, 1)
        if copy:
            for a in item_arrays(item):
                np.array(a, copy=True)
    seconds = time.perf_counter() - t0
    stats.timeline = [(lane, s - t0, e - t0) for lane, s, e in stats.timeline if e >= t0]
    return seconds, stats


def _run_threads(source: Any, indices: Sequence[int], count: int) -> dict:
    from kerasfeed.execution.threads import ThreadExecutor

    ex = ThreadExecutor(source, parallelism=count)
    try:
        ex.plan(0, indices[:count])  # starts the threads
        for i in indices[:count]:
            ex.load(i, 0)
        seconds, stats = _time_executor(ex, indices, copy=True)
    finally:
        ex.close()
    lanes = sorted({lane for lane, _, _ in stats.timeline}, key=lambda n: int(str(n).rsplit("-", 1)[-1]))
    rename = {lane: k for k, lane in enumerate(lanes)}
    timeline = [(rename[lane], s, e) for lane, s, e in stats.timeline]
    return {"executor": "threads", "count": count, "seconds": seconds, "items_per_s": len(indices) / seconds,
            "startup_s": None, "timeline": timeline}


def _run_processes(source: Any, indices: Sequence[int], count: int) -> dict:
    from kerasfeed.execution.processes.executor import ProcessExecutor

    t0 = time.perf_counter()
    ex = ProcessExecutor(source, workers=count)
    try:
        ex.wait_ready()
        startup = time.perf_counter() - t0
        warm = indices[: 2 * count]
        ex.plan(0, warm)
        for i in warm:
            ex.load(i, 0)
        seconds, stats = _time_executor(ex, indices, copy=False)
    finally:
        ex.close()
    return {"executor": "processes", "count": count, "seconds": seconds, "items_per_s": len(indices) / seconds,
            "startup_s": startup, "timeline": stats.timeline}


@dataclasses.dataclass
class ProfileReport:
    """What ``kerasfeed.profile`` measured and recommends.

    Attributes:
        source: the source's name.
        items: items timed per run.
        batch_size: items per batch (1 when items are batches).
        category: ``"waiting"``, ``"transport-bound"``, ``"GIL-releasing"`` or ``"GIL-bound"``.
        evidence: the figures that decided the category.
        probe: the probe's measurements (``kerasfeed.execution.auto.Probe`` as a dict).
        serial_items_per_s: a plain loop over ``source[i]``.
        runs: one dict per run: ``executor``, ``count``, ``seconds``,
            ``items_per_s``, ``startup_s`` (processes), ``timeline``
            (``(lane, start_s, end_s)`` per item, relative to the pass start).
        executor, workers: the recommendation (``workers``: threads in
            flight for threads, worker processes for processes).
        items_per_s, batches_per_s: the rate measured for the recommendation.
        reason: why.
        skipped: runs that could not be made, with the reason.
        cache: whether ``cache=`` would pay, and with what (``cache_advice``).
    """

    source: str
    items: int
    batch_size: int
    category: str
    evidence: str
    probe: dict
    serial_items_per_s: float
    runs: list
    executor: str
    workers: int
    items_per_s: float
    batches_per_s: float
    reason: str
    skipped: list
    cache: str = ""

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["runs"] = [{k: v for k, v in r.items() if k != "timeline"} for r in self.runs]
        return out

    def table(self) -> str:
        """A short table for a terminal."""
        serial = self.serial_items_per_s
        lines = [
            f"kerasfeed profile: {self.source} ({self.items} items per run)",
            f"  {self.category}: {self.evidence}",
            "",
            f"  {'executor':<10} {'count':>5} {'items/s':>10} {'x serial':>9} {'start-up s':>10}",
            f"  {'serial':<10} {1:>5} {serial:>10,.1f} {1.0:>9.2f} {'':>10}",
        ]
        for r in self.runs:
            start = "" if r["startup_s"] is None else f"{r['startup_s']:.2f}"
            mark = " <" if (r["executor"], r["count"]) == (self.executor, self.workers) else ""
            lines.append(
                f"  {r['executor']:<10} {r['count']:>5} {r['items_per_s']:>10,.1f} "
                f"{r['items_per_s'] / serial:>9.2f} {start:>10}{mark}"
            )
        lines += [f"  ({s})" for s in self.skipped]
        knob = "threads in flight" if self.executor == "threads" else "workers"
        lines += [
            "",
            f"  recommend: executor={self.executor!r}, {knob}={self.workers}: "
            f"~{self.batches_per_s:,.1f} batches/s ({self.items_per_s:,.1f} items/s) measured here",
            f"  why: {self.reason}",
        ]
        if self.cache:
            lines.append(f"  cache: {self.cache}")
        return "\n".join(lines)

    def plot(self, path: Optional[str] = None):
        """A matplotlib figure: items/s against count per executor, and the
        per-worker timeline of the recommended run's pass; saved to ``path``."""
        from kerasfeed.observe.profile_chart import plot_report

        _matplotlib("ProfileReport.plot", f"path={path!r}")  # a clear error, not plot_report's bare one
        return plot_report(self, path)


def _recommend(probe: Any, runs: list, cpus: int) -> tuple[str, int, float, str]:
    by_exec: dict[str, list] = {}
    for r in runs:
        by_exec.setdefault(r["executor"], []).append(r)
    max_workers = max((r["count"] for r in by_exec.get("processes", [])), default=cpus)
    # What executor="auto" chooses on this probe (to_dataset's hand-over), nothing else: a rule of its
    # own here (items >= 4 MB: processes) recommended processes where auto chose threads.
    name, reason = decide(probe, max(2, max_workers), cpus)
    if name not in by_exec:  # auto's choice was not measured: the faster of what was, saying so
        chosen, name = name, max(by_exec, key=lambda e: max(r["items_per_s"] for r in by_exec[e]))
        reason = (f"the faster of the executors measured; executor='auto' would choose {chosen} here ({reason}), "
                  f"but no {chosen} run was made (not asked for, or not possible: see skipped)")
    candidates = sorted(by_exec[name], key=lambda r: r["count"])
    best = max(r["items_per_s"] for r in candidates)
    pick = next(r for r in candidates if r["items_per_s"] >= NEAR_BEST * best)
    if name == "processes" and not reason.startswith("the faster") and pick["count"] != max(2, max_workers):
        # The reason's prediction at the count recommended (not the largest timed), for 2 at least.
        again, why = decide(probe, max(2, pick["count"]), cpus)
        reason = why if again == name else reason
        if pick["count"] < 2:
            top = max(candidates, key=lambda r: r["items_per_s"])
            reason += (f"; measured, 1 worker made {pick['items_per_s']:,.0f} items/s, within {NEAR_BEST:g} of the "
                       f"best ({top['items_per_s']:,.0f} with {top['count']}), so 1 is recommended")
    rival = max((r for r in runs if r["executor"] != name), key=lambda r: r["items_per_s"], default=None)
    if rival is not None and rival["items_per_s"] > 1.2 * pick["items_per_s"]:
        reason += (f". Note: {rival['executor']} x{rival['count']} measured faster here ({rival['items_per_s']:,.0f} "
                   "items/s); timings on a busy machine vary, the probe decides")
    return name, pick["count"], pick["items_per_s"], reason


def _counts(name: str, value: Any) -> list:
    """``workers=``/``threads=`` as a list of counts, checked: one int is one count (it was a bare TypeError)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [value]
    try:
        value = list(value)
    except TypeError:
        raise TypeError(f"profile: `{name}` must be a sequence of ints (or one int, or None). "
                        f"Received: {name}={value!r}") from None
    return [positive_int(name, v, owner="profile") for v in value]


def _matplotlib(needs: str, received: str, remedy: str = "") -> Any:
    """``matplotlib``, or an error that says what needs it and how to install it (it is optional)."""
    try:
        import matplotlib.figure
    except ModuleNotFoundError as e:
        if e.name != "matplotlib" and not (e.name or "").startswith("matplotlib."):
            raise
        # setup.cfg has it only in the `dev` extra (with the whole test toolchain): name both.
        raise ModuleNotFoundError(
            f"{needs} needs matplotlib, which is not installed: pip install matplotlib (or 'kerasfeed[dev]', "
            f"which has it){remedy}. Received: {received}",
            name="matplotlib",
        ) from e
    return matplotlib


def _check_chart(chart: Any) -> None:
    # The argument's type first: a wrong one is the caller's mistake whether or not matplotlib is installed.
    if not isinstance(chart, (str, os.PathLike)) or not os.fspath(chart):
        raise TypeError(f"profile: `chart` must be a file path (or None). Received: chart={chart!r}")
    path = os.fspath(chart)
    matplotlib = _matplotlib("profile: `chart`", f"chart={path!r}", ", or pass chart=None for the report alone")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"profile: the folder of `chart` does not exist: {folder!r}. Received: chart={path!r}")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = matplotlib.figure.Figure().canvas.get_supported_filetypes()
    if ext and ext not in formats:
        raise ValueError(
            f"profile: matplotlib cannot save a chart as {ext!r}; use one of {sorted(formats)}. "
            f"Received: chart={path!r}"
        )


def profile(
    source: Any, *, items: Optional[int] = None, batch_size: Optional[int] = None,
    workers: Optional[Sequence[int]] = None, threads: Optional[Sequence[int]] = None, chart: Optional[str] = None,
) -> ProfileReport:
    """Times ``source`` every way, classifies it and recommends a setup.

    Runs ``source[i]`` serially, on the thread executor and on short-lived
    worker processes at several counts (the method: docs/observability.md).

    Args:
        source: an indexable source (``__len__`` and ``__getitem__``).
        items: items per timed run (default: ``min(len(source), 64)``, fewer for slow items: as many as a
            serial loop runs in ~2 s by the probe, at least 4).
        batch_size: items per batch when items are samples (as given to
            ``to_dataset``); None when items are batches.
        workers: worker process counts (default 1, 2, the CPU count and
            twice it).
        threads: thread counts (default 1, 4, 16, 64).
        chart: if given, the chart is saved there (PNG, SVG...).

    Returns:
        A ``ProfileReport``: ``print(report.table())``; ``report.plot()``.

    Raises:
        TypeError, ValueError: a non-indexable or empty source, bad counts.
        ModuleNotFoundError: ``chart`` given without matplotlib installed.
        kerasfeed.ItemError: ``source[i]`` raised.

    Example:

    ```python
    report = kerasfeed.profile(seq, items=32, chart="profile.png")
    print(report.table())
    ds = kerasfeed.to_dataset(seq, executor=report.executor,
                              **({"workers": report.workers} if report.executor == "processes" else {}))
    ```
    """
    n = source_length(source)
    count = None if items is None else positive_int("items", items, owner="profile")
    per_batch = positive_int("batch_size", batch_size, allow_none=True, owner="profile") or 1
    cpus = _cpus()
    workers = sorted({1, 2, cpus, 2 * cpus}) if workers is None else _counts("workers", workers)
    threads = [1, 4, 16, 64] if threads is None else _counts("threads", threads)
    if not workers and not threads:
        raise ValueError(
            "profile: `workers` and `threads` are both empty: nothing to time (None gives the defaults). "
            f"Received: workers={workers!r}, threads={threads!r}"
        )
    if chart is not None:
        _check_chart(chart)  # before the minutes of timing, not after
    probe = probe_source(source)
    category, evidence = classify(probe)
    if count is None:  # a serial pass of ~DEFAULT_PASS_S (at least 4 items): slow items do not make it take minutes
        count = min(n, 64, max(4, int(DEFAULT_PASS_S / max(probe.wall_s, 1e-9))))
    indices = [i % n for i in range(count)]
    # What cache= stores: load(i) on an augment(load(i)) source, timed and sized alone.
    stored = probe_load(source, n)
    t0 = time.perf_counter()
    for i in indices:
        item_at(source, i)
    serial = count / (time.perf_counter() - t0)
    runs, skipped = [_run_threads(source, indices, k) for k in sorted(set(threads))], []
    for k in sorted(set(workers)):
        try:
            runs.append(_run_processes(source, indices, k))
        except TypeError as e:  # cannot be pickled
            skipped.append(f"processes: {str(e).split('. ')[0]}")
            break
    if not runs:
        raise ValueError(
            f"profile: nothing could be timed: {'; '.join(skipped)}. Time threads too (threads=None gives "
            f"1, 4, 16, 64). Received: threads={threads!r}"
        )
    name, best_count, rate, reason = _recommend(probe, runs, cpus)
    report = ProfileReport(
        source=source_name(source), items=count, batch_size=per_batch, category=category, evidence=evidence,
        probe=probe.as_dict(), serial_items_per_s=serial, runs=runs, executor=name, workers=best_count,
        items_per_s=rate, batches_per_s=rate / per_batch, reason=reason, skipped=skipped,
        cache=cache_advice(probe, n, source, stored=stored),
    )
    if chart is not None:
        import matplotlib.pyplot as plt

        plt.close(report.plot(chart))
    return report


__all__ = ["profile", "ProfileReport", "classify", "CATEGORIES"]
