"""``executor="auto"``: pick threads or worker processes by probing the source.

From a few ``__getitem__`` calls timed in the consumer process
(``auto_probe.py``) ``decide`` predicts both executors' item rates **at the
worker count and on the number of CPUs they will run with** and picks the
faster (NOTE [ Predicting threads and processes ]). The choice, both
predictions and the figures are kept on the executor (``name``, ``reason``,
``probe``) and logged on the ``kerasfeed`` logger. With ``cache=`` auto probes
what the executor will run per item instead (the stored stage, ``augment``, or
nothing): NOTE [ Auto with cache= ] in ``auto_cached.py``.

NOTE [ Predicting threads and processes ]
=========================================

One call takes ``w`` seconds of wall time, ``c`` of them on the CPU; the
rest it waits (I/O, sleeps). Of the CPU time, ``g`` holds the GIL (or
another process-wide lock: h5py's) and ``c - g`` runs in parallel (numpy,
C extensions that release the GIL).

- **The GIL-held part** comes from the two-thread probe (Amdahl's law): two
  calls at once take ``2c / P2`` of wall time (``P2``: the CPUs the two
  threads used at once), one alone ``w``, so the part they could not overlap
  is ``g = 2c / P2 - w`` (clamped to ``[0, c]``). 1.6 CPUs on a 19 ms call
  (``decode`` on the 16-core machine) puts ~5 ms under the GIL.
- **Threads** (``ThreadExecutor``: 64 calls in flight, fewer for large
  items) take ``max(g + (c - g) / min(threads, cpus), w / threads)`` per
  item: the GIL-held parts one after the other, the rest spread over the
  cores, waits overlapped. So two threads seeing 1.6 CPUs say nothing about
  16 cores: the 5 ms GIL-held part caps threads near 3.3x one thread on any
  machine, while 15 processes run 15 calls at once. ``to_dataset`` adds a
  copy: TensorFlow copies each array a thread returns (numpy's are not
  64-byte aligned) in the consumer, under the GIL; ``to_loader`` hands numpy
  arrays over as they are (``handover="numpy"``: no copy).
- **Processes** take ``max((w + copy) / workers, (c + copy) / min(workers,
  cpus), copy + write + overhead, (c + copy + overhead) / cpus)`` per item:
  each worker makes its items one at a time and copies each into shared
  memory; those copies share one memory bus with writing the items, so they
  count one after the other (``write``: the part of making the item two
  threads could not overlap, up to a copy's worth; processes do not speed
  the bus up); the consumer picks every item up (``PROCESS_OVERHEAD_S``)
  and shares the CPUs. Both front ends hand large items over without a copy.
- Processes are chosen when predicted ``PROCESS_MARGIN`` times faster (they
  cost start-up, memory and a pickled source). A call that mostly waits
  (CPU under ``WAIT_FRACTION`` of its wall time) goes to threads at once:
  threads keep many waits in flight, a worker waits for one call at a time.
- **Under ``to_loader``** a thread's item reaches the consumer without a
  copy, a worker's goes over the memory bus twice more (written, then copied
  into shared memory). An item made in at most ``BUS_COPIES`` copies' worth
  of time is memory-bound whatever two threads made of it: ``write`` is then
  ``min(c, BUS_COPIES * copy)``, for processes and as a floor for threads
  (one bus however many threads write).

What the model leaves out: the probe cannot tell the GIL from the memory bus
(both stop two threads from overlapping), and a busy machine makes two
threads overlap less (they also wait for a CPU). The ``to_loader`` rule keeps
memory-bound items in threads whatever the probe made of the GIL (a 19 MB
``np.full`` probed on a busy machine read as GIL-bound and went to processes
at 0.5-0.7 of threads' rate; 2 cores: threads 332 vs processes 185 batches/s
measured quiet), while slow GIL-bound items still go to processes. Queued
time is taken out of the one call's wall time.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from kerasfeed.execution import own_state
from kerasfeed.execution.auto_cached import cached_work
from kerasfeed.execution.auto_probe import Probe, item_at, probe_source
from kerasfeed.execution.base import Executor
from kerasfeed.execution.processes.options import PoolOptions, usable_cpus, workers_for
from kerasfeed.execution.threads import DEFAULT_BYTES_AHEAD, DEFAULT_THREAD_PARALLELISM, ThreadExecutor
from kerasfeed.sources.base import source_length

logger = logging.getLogger("kerasfeed")

# Consumer cost of one item through a worker process (dispatch, answer, bookkeeping): 40-150 us measured, 2 cores.
PROCESS_OVERHEAD_S = 100e-6
WAIT_FRACTION = 0.3  # below this share of CPU time, a call mostly waits (kept low: a busy machine also lowers it)
GIL_FREE_PARALLELISM = 1.5  # two threads using this many CPUs at once: mostly outside the GIL
PROCESS_MARGIN = 1.2  # processes must be predicted this much faster to be chosen
# Under to_loader, an item made in at most this many copies' worth of time is memory-bus work (a fresh array
# is zeroed by the kernel, then filled).
BUS_COPIES = 3
# What ``kerasfeed.profile`` calls transport-bound; ``decide`` weighs the copy of every item instead.
LARGE_ITEM_BYTES = 4 * 2**20
HANDOVERS = ("tensorflow", "numpy")  # who takes the items: to_dataset, to_loader (see the NOTE)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Items per second ``decide`` expects of each executor (NOTE [ Predicting threads and processes ]).

    Attributes:
        threads: items/s of the thread executor.
        processes: items/s of ``workers`` worker processes.
        workers: the worker count predicted for.
        cpus: the CPUs predicted for.
        thread_cores: CPUs the threads' parallel part can use (``min(threads in flight, cpus)``).
        gil_s: seconds of one call that hold the GIL (the serial part).
        parallel_s: CPU seconds of one call outside the GIL.
        wait_s: seconds of one call off the CPU (I/O, sleeps).
        transport_s: seconds per item of processes' transport that cannot run in parallel (copies
            on one memory bus, the pick-up).
    """

    threads: float
    processes: float
    workers: int
    cpus: int
    thread_cores: int
    gil_s: float
    parallel_s: float
    wait_s: float
    transport_s: float

    @property
    def thread_ceiling(self) -> float:
        """How many times one thread's rate any number of threads can reach (Amdahl)."""
        call = self.gil_s + self.parallel_s
        return call / self.gil_s if self.gil_s > 0 else float("inf")


def _threads_in_flight(nbytes: int) -> int:
    # ThreadExecutor's window: 64 calls, fewer when items are large.
    if nbytes <= 0:
        return DEFAULT_THREAD_PARALLELISM
    return max(2, min(DEFAULT_THREAD_PARALLELISM, DEFAULT_BYTES_AHEAD // nbytes))


def predict(probe: Probe, workers: int, cpus: int, handover: str = "tensorflow") -> Prediction:
    """Predicts threads' and processes' item rates (pure function).

    Args:
        probe: what ``probe_source`` measured.
        workers: worker processes the executor would run.
        cpus: CPUs this process may use.
        handover: ``"tensorflow"`` (``to_dataset``) or ``"numpy"`` (``to_loader``); see ``HANDOVERS``.

    Returns:
        A ``Prediction`` (see NOTE [ Predicting threads and processes ]).
    """
    if handover not in HANDOVERS:
        raise ValueError(f"`handover` must be one of {HANDOVERS}. Received: handover={handover!r}")
    wall = max(probe.wall_s - probe.runqueue_s, probe.cpu_s, 1e-9)  # time queued for a CPU is not the call's
    cpu = min(probe.cpu_s, wall)
    if probe.parallelism_2_threads is None or probe.parallelism_2_threads <= 0:
        gil = cpu  # not measured (slow items): counted as GIL-bound
    else:
        gil = min(cpu, max(0.0, 2 * cpu / probe.parallelism_2_threads - wall))
    in_flight = _threads_in_flight(probe.nbytes)
    thread_cores = max(1, min(in_flight, cpus))
    workers, cpus = max(1, workers), max(1, cpus)
    if handover == "numpy":  # making the item is all its trips over the memory bus in threads, not in processes
        front, write = 0.0, min(cpu, BUS_COPIES * probe.copy_s)
        per_item_threads = max(gil + (cpu - gil) / thread_cores, wall / in_flight, write)
    else:  # TensorFlow copies a thread's arrays in the consumer; a worker's copy is counted up to the GIL-held part
        front, write = probe.copy_s, min(gil, probe.copy_s)
        per_item_threads = max(gil + (cpu - gil) / thread_cores, wall / in_flight) + front
    # The copies share one memory bus, after writing the item; the consumer picks each item up.
    transport = probe.copy_s + write + PROCESS_OVERHEAD_S
    per_item_processes = max(
        (wall + probe.copy_s) / workers,  # each worker makes its items one at a time
        (cpu + probe.copy_s) / min(workers, cpus),  # on the cores it can have
        transport,
        (cpu + probe.copy_s + PROCESS_OVERHEAD_S) / cpus,  # everything shares the CPUs
    )
    return Prediction(
        threads=1.0 / max(per_item_threads, 1e-9),
        processes=1.0 / max(per_item_processes, 1e-9),
        workers=workers,
        cpus=cpus,
        thread_cores=thread_cores,
        gil_s=gil,
        parallel_s=cpu - gil,
        wait_s=wall - cpu,
        transport_s=transport,
    )


def _gil_text(probe: Probe, pred: Prediction) -> str:
    par = probe.parallelism_2_threads
    if par is None and probe.concurrent_error:
        return ("it keeps the CPU busy (taken as GIL-bound: the two-thread probe failed, an item made on a second "
                f"thread raised {probe.concurrent_error})")
    if par is None:
        return "it keeps the CPU busy (GIL-bound; the two-thread probe was skipped: items are slow)"
    share = pred.gil_s / max(pred.gil_s + pred.parallel_s, 1e-12)
    if par >= GIL_FREE_PARALLELISM:
        head = f"two threads ran it on {par:.1f} CPUs at once (it releases the GIL"
    else:
        head = f"two threads ran it on only {par:.1f} CPUs at once (GIL-bound"
    ceiling = pred.thread_ceiling
    cap = f", so threads reach at most {ceiling:.1f}x one thread" if ceiling < 100 else ""
    return f"{head}: about {share:.0%} of its CPU time holds the GIL{cap})"


def decide(probe: Probe, workers: int, cpus: int, handover: str = "tensorflow") -> tuple[str, str]:
    """Returns ``(executor_name, reason)`` for a probe (pure function).

    Args:
        probe: what ``probe_source`` measured.
        workers: worker processes the executor would run.
        cpus: CPUs this process may use.
        handover: ``"tensorflow"`` (``to_dataset``) or ``"numpy"`` (``to_loader``).

    Returns:
        ``("threads" | "processes", reason)``; the reason names both predictions (``workers``, ``cpus``).

    Example:

    ```python
    probe = Probe(wall_s=0.019, cpu_s=0.019, runqueue_s=0.0, nbytes=1_769_472, copy_s=1e-4,
                  parallelism_2_threads=1.6, calls=10)
    name, reason = decide(probe, workers=15, cpus=16)
    # 'processes', '19.00 ms/item, ... 15 workers predicted at ~785 items/s vs ~174 with threads on 16 CPUs'
    ```
    """
    ms = f"{probe.wall_s * 1e3:.2f} ms/item"
    if cpus < 2 or workers < 2:
        why = f"only {min(cpus, workers)} CPU/worker available, so processes cannot run items in parallel"
        return "threads", f"{ms}; {why}"
    pred = predict(probe, workers, cpus, handover)
    numbers = (
        f"{pred.workers} workers predicted at ~{pred.processes:,.0f} items/s vs ~{pred.threads:,.0f} with threads "
        f"on {pred.cpus} CPUs"
    )
    # Waiting for a CPU (a busy machine) is not waiting for I/O.
    frac = min(1.0, probe.cpu_s / max(probe.wall_s - probe.runqueue_s, 1e-9))
    if frac < WAIT_FRACTION:
        return "threads", (
            f"{ms}, of which only {frac:.0%} on the CPU: it mostly waits (I/O, sleep), "
            f"and threads keep many such calls in flight without moving data between processes ({numbers})"
        )
    gil = _gil_text(probe, pred)
    mb = probe.nbytes / 2**20
    head = f"{ms}, {frac:.0%} on the CPU; {gil}"
    if pred.processes >= PROCESS_MARGIN * pred.threads:
        copy_in_front = handover == "tensorflow" and probe.copy_s > 0.25 / pred.threads
        why = (
            f"items carry {mb:.1f} MB: TensorFlow would copy each one a thread returns in this process "
            "(numpy arrays are not 64-byte aligned), while worker processes hand theirs over without a copy"
            if copy_in_front
            else f"items carry {mb:.1f} MB, cheap to move next to the work"
        )
        return "processes", f"{head}; {why}: {numbers}"
    if pred.transport_s >= 0.5 / pred.processes:
        why = (
            f"items carry {mb:.1f} MB and take {probe.copy_s * 1e3:.2f} ms to copy: moving them between processes "
            "would cost about what it saves"
        )
        if handover == "numpy":
            why += " (to_loader hands a thread's arrays over without a copy)"
    elif pred.thread_ceiling >= min(pred.workers, pred.cpus) / PROCESS_MARGIN:
        why = "threads run it in parallel without transport"
    else:
        why = f"{pred.workers} workers would not gain enough over threads to pay for processes"
    return "threads", f"{head}; {why}: {numbers}"


def make_auto_executor(
    source: Any,
    options: Optional[PoolOptions] = None,
    *,
    calls: int = 3,
    handover: str = "tensorflow",
) -> Executor:
    """Probes ``source`` and returns a ``ThreadExecutor`` or ``ProcessExecutor``.

    The probe calls ``source[i]`` a few times in this process (``3 * calls + 1``, more for fast calls),
    or what the executor will run per item with ``cache=``. The executor's ``reason`` says what was
    chosen and why; ``executor.probe`` holds the measurements (None when nothing was probed).

    Args:
        source: the indexable source.
        options: the ``PoolOptions`` of the workers if processes are chosen
            (None: ``default_workers()``); its ``timeout`` applies to
            whichever executor is chosen. The decision is made for that
            worker count on this process's CPUs.
        calls: timed probe calls.
        handover: who takes the items: ``"tensorflow"`` (``to_dataset``) or ``"numpy"`` (``to_loader``).

    Example:

    ```python
    ex = make_auto_executor(seq)
    print(ex.name, ex.reason)  # e.g. processes: 1.70 ms/item, 99% on the CPU; ...
    ```
    """
    from kerasfeed.execution.processes.executor import ProcessExecutor

    options = options or PoolOptions()
    cpus = usable_cpus()
    items = source_length(source, allow_infinite=True, owner="executor='auto'")
    n_workers = workers_for(options.workers, items, cpus)  # what ProcessExecutor would start
    # With cache=, what the executor will run per item (NOTE [ Auto with cache= ] in auto_cached.py).
    with own_state.undone(source):  # what the probe made for this process is not the workers' (its NOTE)
        cache = options.item_cache
        work, note = (source, "") if cache is None else cached_work(source, cache, calls + 1)
        probe = None if work is None else probe_source(work, calls=calls, at=cache and cache.probe_at)
        keep = getattr(work, "keep_made", None)
        if callable(keep):
            keep()  # with cache=: what the probe made is stored, not made again in pass 0
    name, reason = ("threads", note) if probe is None else decide(probe, n_workers, cpus, handover)
    reason += f"; {note}" if note and probe is not None else ""
    ex: Executor
    if name == "processes":
        try:
            ex = ProcessExecutor.from_options(source, options)
        except TypeError as e:  # cannot be pickled: threads still work
            first = str(e).split(". ")[0]
            name, reason = "threads", f"processes would help ({reason}), but {first}"
            ex = ThreadExecutor.from_options(source, options)
    else:
        ex = ThreadExecutor.from_options(source, options)
    ex.reason = f"auto chose {name}: {reason}"
    ex.probe = probe  # type: ignore[attr-defined]
    logger.info("kerasfeed: executor='auto' for %s: %s", type(source).__name__, ex.reason)
    return ex


__all__ = [
    "GIL_FREE_PARALLELISM", "HANDOVERS", "LARGE_ITEM_BYTES", "PROCESS_MARGIN", "PROCESS_OVERHEAD_S", "WAIT_FRACTION",
    "Prediction", "Probe", "decide", "item_at", "make_auto_executor", "predict", "probe_source",
]
