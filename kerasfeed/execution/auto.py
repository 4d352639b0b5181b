"""``executor="auto"``: pick threads or worker processes by probing the source.

A few ``__getitem__`` calls in the consumer process answer three questions:

1. **Does it wait?** Thread CPU time well below wall time means I/O or sleeps:
   threads overlap many waiting calls (and cost no transport) -> threads.
   Time spent runnable but waiting for a CPU (a busy machine; Linux
   ``schedstat``) is not counted as waiting.
2. **Does it release the GIL?** The same calls in two threads at once: if
   their CPU time adds up to clearly more than the wall time, they ran in
   parallel, outside the GIL (large numpy ops, C extensions) -> threads.
   Unless its items are large (``LARGE_ITEM_BYTES``): TensorFlow copies every
   array a thread returns, in the consumer; workers hand theirs over without
   a copy -> processes.
3. **Is it transport-bound?** Worker processes pay for moving the item: a
   copy into shared memory in the worker and a round trip (the consumer then
   lends large items to TensorFlow without a copy). Threads pay a copy too:
   TensorFlow copies the unaligned arrays numpy allocates. Processes win only
   if ``workers`` parallel items outrun one thread by enough to pay that.

The choice and the numbers behind it are kept on the executor
(``executor.name``, ``executor.reason``, ``executor.probe``) and logged on the
``kerasfeed`` logger.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from typing import Any, Optional

import numpy as np

from kerasfeed.execution.base import Executor
from kerasfeed.execution.processes.options import PoolOptions, default_workers
from kerasfeed.execution.threads import ThreadExecutor
from kerasfeed.sources.base import source_length

logger = logging.getLogger("kerasfeed")

# Fixed consumer-side cost of one item through a worker process (dispatch,
# answer, bookkeeping), measured at roughly 40-150 us on the 2-core machine.
PROCESS_OVERHEAD_S = 100e-6
WAIT_FRACTION = 0.3  # below this share of CPU time, a call mostly waits (kept low: a busy machine also lowers it)
GIL_FREE_PARALLELISM = 1.5  # two threads using this many CPUs at once: GIL released
PROCESS_MARGIN = 1.2  # processes must be predicted this much faster to be chosen
PROBE_BUDGET_S = 2.0  # skip the concurrent probe when calls are slower than this allows
# Items this large go to processes even when threads could make them in
# parallel: TensorFlow copies every array a thread returns (numpy's are not
# 64-byte aligned) in the consumer, into fresh memory, while worker processes
# hand theirs over without a copy. Measured on the 2-core machine, a 19 MB
# batch: ~4.5 ms of consumer CPU through threads, ~0.8 ms through processes.
LARGE_ITEM_BYTES = 4 * 2**20


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


def _timed_call(source: Any, index: int) -> tuple[float, float, float, Any]:
    q0, c0, t0 = _runqueue_s(), time.thread_time(), time.perf_counter()
    item = source[index]
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


def decide(probe: Probe, workers: int, cpus: int) -> tuple[str, str]:
    """Returns ``(executor_name, reason)`` for a probe (pure function)."""
    p = probe
    ms = f"{p.wall_s * 1e3:.2f} ms/item"
    if cpus < 2 or workers < 2:
        why = f"only {min(cpus, workers)} CPU/worker available, so processes cannot run items in parallel"
        return "threads", f"{ms}; {why}"
    # Waiting for a CPU (a busy machine) is not waiting for I/O.
    frac = min(1.0, p.cpu_s / max(p.wall_s - p.runqueue_s, 1e-9))
    if frac < WAIT_FRACTION:
        return "threads", (
            f"{ms}, of which only {frac:.0%} on the CPU: it mostly waits (I/O, sleep), "
            "and threads keep many such calls in flight without moving data between processes"
        )
    if p.parallelism_2_threads is not None and p.parallelism_2_threads >= GIL_FREE_PARALLELISM:
        if p.nbytes >= LARGE_ITEM_BYTES:
            return "processes", (
                f"{ms}; two threads ran it on {p.parallelism_2_threads:.1f} CPUs at once (it releases the GIL), "
                f"but items carry {p.nbytes / 2**20:.1f} MB: TensorFlow would copy each one in this process "
                "(numpy arrays are not 64-byte aligned), while worker processes hand theirs over without a copy"
            )
        return "threads", (
            f"{ms}; two threads ran it on {p.parallelism_2_threads:.1f} CPUs at once, so it releases the GIL "
            "and threads run it in parallel without transport"
        )
    # GIL-bound (or h5py-lock-bound). Predict the item rates of both options;
    # each pays one copy of the item (see the module docstring).
    threads_rate = 1.0 / max(p.wall_s + p.copy_s, 1e-9)
    par = min(workers, cpus)
    # Workers make items in parallel, each also copying it into shared memory.
    # Those copies share one memory bus, so count them one after the other,
    # plus the consumer's bookkeeping.
    per_item_workers = (p.wall_s + p.copy_s) / par
    per_item_transport = p.copy_s + PROCESS_OVERHEAD_S
    process_rate = 1.0 / max(per_item_workers, per_item_transport)
    gil = (
        f"two threads ran it on only {p.parallelism_2_threads:.1f} CPUs at once (GIL-bound)"
        if p.parallelism_2_threads is not None
        else "it keeps the CPU busy (GIL-bound; the two-thread probe was skipped: items are slow)"
    )
    mb = p.nbytes / 2**20
    if process_rate >= PROCESS_MARGIN * threads_rate:
        return "processes", (
            f"{ms}, {frac:.0%} on the CPU; {gil}; items carry {mb:.1f} MB, cheap to move next to "
            f"the work: {par} workers predicted at ~{process_rate:.0f} items/s vs ~{threads_rate:.0f} with threads"
        )
    return "threads", (
        f"{ms}, {frac:.0%} on the CPU; {gil}; but items carry {mb:.1f} MB and take {p.copy_s * 1e3:.2f} ms to "
        f"copy: moving them between processes would cost about what it saves "
        f"(~{process_rate:.0f} items/s with {par} workers vs ~{threads_rate:.0f} with threads)"
    )


def make_auto_executor(
    source: Any,
    options: Optional[PoolOptions] = None,
    *,
    calls: int = 3,
) -> Executor:
    """Probes ``source`` and returns a ``ThreadExecutor`` or ``ProcessExecutor``.

    The probe calls ``source[i]`` a few times (about ``3 * calls + 1``) in this
    process. The returned executor's ``reason`` says what was chosen and why;
    ``executor.probe`` holds the measurements.

    Args:
        source: the indexable source.
        options: the ``PoolOptions`` of the workers if processes are chosen
            (None: one worker per CPU); its ``timeout`` applies to whichever
            executor is chosen.
        calls: timed probe calls.

    Example:

    ```python
    ex = make_auto_executor(seq)
    print(ex.name, ex.reason)  # e.g. processes: 1.70 ms/item, 99% on the CPU; ...
    ```
    """
    from kerasfeed.execution.processes.executor import ProcessExecutor

    options = options or PoolOptions()
    cpus = default_workers()
    n_workers = options.workers if options.workers is not None else cpus
    probe = probe_source(source, calls=calls)
    name, reason = decide(probe, n_workers, cpus)
    ex: Executor
    if name == "processes":
        try:
            ex = ProcessExecutor.from_options(source, options)
        except TypeError as e:  # cannot be pickled: threads still work
            first = str(e).split(". ")[0]
            name, reason = "threads", f"processes would help ({reason}), but {first}"
            ex = ThreadExecutor(source, timeout=options.timeout)
    else:
        ex = ThreadExecutor(source, timeout=options.timeout)
    ex.reason = f"auto chose {name}: {reason}"
    ex.probe = probe  # type: ignore[attr-defined]
    logger.info("kerasfeed: executor='auto' for %s: %s", type(source).__name__, ex.reason)
    return ex
