"""``executor="auto"``: pick threads or worker processes by probing the source.

A few ``__getitem__`` calls in the consumer process measure one call (wall
and CPU time, time queued for a CPU, bytes, the cost of one copy) and the
same calls on two threads at once. From those figures ``decide`` predicts
the item rate of both executors **at the worker count and on the number of
CPUs they will run with**, and picks the faster (see NOTE [ Predicting
threads and processes ]). The choice, both predictions and the figures are
kept on the executor (``executor.name``, ``executor.reason``,
``executor.probe``) and logged on the ``kerasfeed`` logger.

NOTE [ Predicting threads and processes ]
=========================================

One call takes ``w`` seconds of wall time, ``c`` of them on the CPU; the
rest it waits (I/O, sleeps). Of the CPU time, ``g`` holds the GIL (or
another process-wide lock: h5py's) and ``c - g`` runs in parallel (numpy,
C extensions that release the GIL).

- **The GIL-held part** comes from the two-thread probe (Amdahl's law): two
  calls at once take ``2c / P2`` of wall time, where ``P2`` is the CPUs the
  two threads used at once; one call alone takes ``w``, so the part the two
  could not overlap is ``g = 2c / P2 - w`` (clamped to ``[0, c]``). A probe
  that saw 1.6 CPUs on a 19 ms call (``decode`` on the 16-core machine) puts
  ~5 ms under the GIL.
- **Threads** (``ThreadExecutor``: 64 calls in flight, fewer for large
  items) take ``max(g + (c - g) / min(threads, cpus), w / threads)`` per
  item: the GIL-held parts one after the other, the rest spread over the
  cores, waits overlapped. That is why two threads seeing 1.6 CPUs say
  nothing about 16 cores: the 5 ms GIL-held part caps threads near 3.3x
  one thread on any machine, while 15 processes run 15 calls at once.
  The front end adds its own copy: ``to_dataset`` hands arrays to
  TensorFlow, which copies each array a thread returns (numpy's are not
  64-byte aligned) in the consumer, under the GIL; ``to_loader`` hands
  numpy arrays over as they are (``handover="numpy"``: no copy).
- **Processes** take ``max((w + copy) / workers, (c + copy) / min(workers,
  cpus), copy + min(g, copy) + overhead, (c + copy + overhead) / cpus)``
  per item: each worker makes its items one at a time and copies each into
  shared memory; those copies share one memory bus, so they are counted one
  after the other, and so is the part of making the item that two threads
  could not overlap, up to a copy's worth (writing a large array is bound
  by the bus, not the GIL, and processes do not speed that up); the
  consumer picks every item up (``PROCESS_OVERHEAD_S``) and shares the
  CPUs. Large items are then handed over without a copy by both front ends.
- Processes are chosen when predicted ``PROCESS_MARGIN`` times faster (they
  cost start-up, memory and a pickled source). A call that mostly waits
  (CPU under ``WAIT_FRACTION`` of its wall time) goes to threads at once:
  threads keep many waits in flight, a worker waits for one call at a time.

What the model leaves out: the probe cannot tell the GIL from the memory bus
(both stop two threads from overlapping); counting up to a copy's worth of
the serial part as bus time keeps a cheap 19 MB ``np.full`` in threads under
``to_loader`` (2 cores: threads 332 vs processes 185 batches/s measured),
while slow GIL-bound items still go to processes. Timings taken on a busy
machine are noisy; queued time is taken out of the wall time.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from typing import Any, Optional

import numpy as np

from kerasfeed.errors import ItemError
from kerasfeed.execution.base import Executor
from kerasfeed.execution.item_random import item_scope
from kerasfeed.execution.processes.options import PoolOptions, usable_cpus, workers_for
from kerasfeed.execution.threads import DEFAULT_BYTES_AHEAD, DEFAULT_THREAD_PARALLELISM, ThreadExecutor
from kerasfeed.sources.base import source_length, source_name

logger = logging.getLogger("kerasfeed")

# Fixed consumer-side cost of one item through a worker process (dispatch,
# answer, bookkeeping), measured at roughly 40-150 us on the 2-core machine.
PROCESS_OVERHEAD_S = 100e-6
WAIT_FRACTION = 0.3  # below this share of CPU time, a call mostly waits (kept low: a busy machine also lowers it)
GIL_FREE_PARALLELISM = 1.5  # two threads using this many CPUs at once: mostly outside the GIL
PROCESS_MARGIN = 1.2  # processes must be predicted this much faster to be chosen
PROBE_BUDGET_S = 2.0  # skip the concurrent probe when calls are slower than this allows
# What ``kerasfeed.profile`` calls transport-bound. ``decide`` itself weighs
# the copy of every item instead (NOTE [ Predicting threads and processes ]).
LARGE_ITEM_BYTES = 4 * 2**20
# Who takes the items: "tensorflow" (to_dataset: TensorFlow copies each array
# a thread returns) or "numpy" (to_loader: arrays handed over as they are).
HANDOVERS = ("tensorflow", "numpy")


@dataclasses.dataclass
class Probe:
    """What the probe measured (per ``__getitem__`` call, medians).

    Attributes:
        wall_s: wall time of one call.
        cpu_s: CPU time of the calling thread during one call.
        runqueue_s: time the thread was runnable but waited for a CPU (other
            processes), 0 where the OS does not report it.
        nbytes: bytes of array data in one item.
        copy_s: time to copy one item's arrays once.
        parallelism_2_threads: CPU time of two threads running the calls at
            once divided by their wall time: about 1 when the GIL (or another
            lock) serialises them, up to 2 when they run in parallel; None
            when not measured.
        calls: number of ``__getitem__`` calls the probe made.
    """

    wall_s: float
    cpu_s: float
    runqueue_s: float
    nbytes: int
    copy_s: float
    parallelism_2_threads: Optional[float]
    calls: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _arrays(item: Any, out: Optional[list] = None) -> list[np.ndarray]:
    out = [] if out is None else out
    if isinstance(item, np.ndarray):
        if not item.dtype.hasobject:
            out.append(item)
    elif isinstance(item, dict):
        for v in item.values():
            _arrays(v, out)
    elif isinstance(item, (list, tuple)):
        for v in item:
            _arrays(v, out)
    return out


def _runqueue_s() -> float:
    """Seconds this thread has waited for a CPU while runnable (Linux), else 0."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def item_at(source: Any, index: int) -> Any:
    """``source[index]``; what it raises becomes an ``ItemError`` naming the index (as in every executor)."""
    try:
        with item_scope(index):  # kerasfeed.item_rng() works in probed items too
            return source[index]
    except Exception as e:  # noqa: BLE001 - any error of the source is the item's
        raise ItemError.from_exception(index, e, source_name=source_name(source))


def _timed_call(source: Any, index: int) -> tuple[float, float, float, Any]:
    q0, c0, t0 = _runqueue_s(), time.thread_time(), time.perf_counter()
    item = item_at(source, index)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return wall, cpu, _runqueue_s() - q0, item


def probe_source(source: Any, calls: int = 3) -> Probe:
    """Times a few ``source[i]`` calls in this process (see module doc).

    Args:
        source: the indexable source.
        calls: timed calls, after one untimed warm-up call (which may open
            files lazily).

    Returns:
        A ``Probe``.
    """
    n = source_length(source, allow_infinite=True, owner="executor='auto'")
    indices = [i % n if n is not None else i for i in range(1, calls + 1)]
    _, _, _, item = _timed_call(source, 0)  # warm-up: lazy opens, caches, imports
    walls, cpus, queued = [], [], []
    for i in indices:
        wall, cpu, runq, item = _timed_call(source, i)
        walls.append(wall)
        cpus.append(cpu)
        queued.append(runq)
    wall = statistics.median(walls)
    cpu = statistics.median(cpus)
    runq = statistics.median(queued)
    arrays = _arrays(item)
    nbytes = int(sum(a.nbytes for a in arrays))
    t0 = time.perf_counter()
    for a in arrays:
        np.array(a, copy=True)
    copy_s = time.perf_counter() - t0
    made = 1 + len(indices)

    parallelism = None
    if sum(walls) * 2 <= PROBE_BUDGET_S:
        errors: list[BaseException] = []
        cpu_used: list[float] = []
        start = threading.Barrier(2)

        def run():
            try:
                start.wait()
                c0 = time.thread_time()
                for i in indices:
                    with item_scope(i):
                        source[i]
                cpu_used.append(time.thread_time() - c0)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        both = time.perf_counter() - t0
        made += 2 * len(indices)
        if not errors and both > 0:
            parallelism = sum(cpu_used) / both
    return Probe(wall, cpu, runq, nbytes, copy_s, parallelism, made)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Items per second ``decide`` expects of each executor (NOTE [ Predicting threads and processes ]).

    Attributes:
        threads: items/s of the thread executor.
        processes: items/s of ``workers`` worker processes.
        workers: the worker count predicted for.
        cpus: the CPUs predicted for.
        thread_cores: CPUs the threads' parallel part can use
            (``min(threads in flight, cpus)``).
        gil_s: seconds of one call that hold the GIL (the serial part).
        parallel_s: CPU seconds of one call outside the GIL.
        wait_s: seconds of one call off the CPU (I/O, sleeps).
        transport_s: seconds per item of processes' transport that cannot
            run in parallel (copies on one memory bus, the pick-up).
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
        handover: ``"tensorflow"`` (``to_dataset``) or ``"numpy"``
            (``to_loader``); see ``HANDOVERS``.

    Returns:
        A ``Prediction`` (see NOTE [ Predicting threads and processes ]).
    """
    if handover not in HANDOVERS:
        raise ValueError(f"`handover` must be one of {HANDOVERS}. Received: handover={handover!r}")
    p = probe
    wall = max(p.wall_s - p.runqueue_s, p.cpu_s, 1e-9)  # time queued for a CPU is not the call's
    cpu = min(p.cpu_s, wall)
    if p.parallelism_2_threads is None or p.parallelism_2_threads <= 0:
        gil = cpu  # not measured (slow items): counted as GIL-bound
    else:
        gil = min(cpu, max(0.0, 2 * cpu / p.parallelism_2_threads - wall))
    in_flight = _threads_in_flight(p.nbytes)
    thread_cores = max(1, min(in_flight, cpus))
    front = p.copy_s if handover == "tensorflow" else 0.0
    per_item_threads = max(gil + (cpu - gil) / thread_cores, wall / in_flight) + front
    workers, cpus = max(1, workers), max(1, cpus)
    # The copies share one memory bus, and so may writing the item (what two
    # threads could not overlap, up to a copy's worth); the consumer picks
    # each item up.
    transport = p.copy_s + min(gil, p.copy_s) + PROCESS_OVERHEAD_S
    per_item_processes = max(
        (wall + p.copy_s) / workers,  # each worker makes its items one at a time
        (cpu + p.copy_s) / min(workers, cpus),  # on the cores it can have
        transport,
        (cpu + p.copy_s + PROCESS_OVERHEAD_S) / cpus,  # everything shares the CPUs
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
        handover: ``"tensorflow"`` (``to_dataset``) or ``"numpy"``
            (``to_loader``).

    Returns:
        ``("threads" | "processes", reason)``; the reason names both
        predictions at ``workers`` workers on ``cpus`` CPUs.

    Example:

    ```python
    probe = Probe(wall_s=0.019, cpu_s=0.019, runqueue_s=0.0, nbytes=1_769_472, copy_s=1e-4,
                  parallelism_2_threads=1.6, calls=10)
    name, reason = decide(probe, workers=15, cpus=16)
    # 'processes', '19.00 ms/item, ... 15 workers predicted at ~785 items/s vs ~174 with threads on 16 CPUs'
    ```
    """
    p = probe
    ms = f"{p.wall_s * 1e3:.2f} ms/item"
    if cpus < 2 or workers < 2:
        why = f"only {min(cpus, workers)} CPU/worker available, so processes cannot run items in parallel"
        return "threads", f"{ms}; {why}"
    pred = predict(p, workers, cpus, handover)
    numbers = (
        f"{pred.workers} workers predicted at ~{pred.processes:,.0f} items/s vs ~{pred.threads:,.0f} with threads "
        f"on {pred.cpus} CPUs"
    )
    # Waiting for a CPU (a busy machine) is not waiting for I/O.
    frac = min(1.0, p.cpu_s / max(p.wall_s - p.runqueue_s, 1e-9))
    if frac < WAIT_FRACTION:
        return "threads", (
            f"{ms}, of which only {frac:.0%} on the CPU: it mostly waits (I/O, sleep), "
            f"and threads keep many such calls in flight without moving data between processes ({numbers})"
        )
    gil = _gil_text(p, pred)
    mb = p.nbytes / 2**20
    head = f"{ms}, {frac:.0%} on the CPU; {gil}"
    if pred.processes >= PROCESS_MARGIN * pred.threads:
        copy_in_front = handover == "tensorflow" and p.copy_s > 0.25 / pred.threads
        why = (
            f"items carry {mb:.1f} MB: TensorFlow would copy each one a thread returns in this process "
            "(numpy arrays are not 64-byte aligned), while worker processes hand theirs over without a copy"
            if copy_in_front
            else f"items carry {mb:.1f} MB, cheap to move next to the work"
        )
        return "processes", f"{head}; {why}: {numbers}"
    if pred.transport_s >= 0.5 / pred.processes:
        why = (
            f"items carry {mb:.1f} MB and take {p.copy_s * 1e3:.2f} ms to copy: moving them between processes "
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

    The probe calls ``source[i]`` a few times (about ``3 * calls + 1``) in this
    process. The returned executor's ``reason`` says what was chosen and why;
    ``executor.probe`` holds the measurements.

    Args:
        source: the indexable source.
        options: the ``PoolOptions`` of the workers if processes are chosen
            (None: ``default_workers()``); its ``timeout`` applies to
            whichever executor is chosen. The decision is made for that
            worker count on this process's CPUs.
        calls: timed probe calls.
        handover: who takes the items: ``"tensorflow"`` (``to_dataset``)
            or ``"numpy"`` (``to_loader``); see ``decide``.

    Example:

    ```python
    ex = make_auto_executor(seq)
    print(ex.name, ex.reason)  # e.g. processes: 1.70 ms/item, 99% on the CPU; ...
    ```
    """
    from kerasfeed.execution.processes.executor import ProcessExecutor

    options = options or PoolOptions()
    cpus = usable_cpus()
    probe = probe_source(source, calls=calls)
    items = source_length(source, allow_infinite=True, owner="executor='auto'")
    n_workers = workers_for(options.workers, items, cpus)  # what ProcessExecutor would start
    name, reason = decide(probe, n_workers, cpus, handover)
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
