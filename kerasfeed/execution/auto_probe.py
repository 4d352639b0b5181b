"""The probe of ``executor="auto"``: a few ``source[i]`` calls timed in this process (see ``auto.py``).

One call alone (wall and CPU time, time queued for a CPU, bytes, the cost of one copy), then the same
calls on two threads at once: how many CPUs they used together says how much of a call holds the GIL
(NOTE [ Predicting threads and processes ] in ``auto.py``). Fast calls are repeated so that each thread
runs ~``CONCURRENT_S``, timed inside the threads, else thread start-up and a busy machine's scheduling
decide the figure (``h5aug``'s 0.3 ms ``augment``: 0.1-0.5 CPUs in three calls timed from outside,
0.8-1.2 repeated).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from kerasfeed.errors import ItemError
from kerasfeed.sources.base import source_length, source_name
from kerasfeed.sources.item_random import item_scope

PROBE_BUDGET_S = 2.0  # skip the concurrent probe when calls are slower than this allows
CONCURRENT_S = 0.02  # each thread of the concurrent probe runs about this long (fast calls are repeated)


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
        concurrent_error: why the two-thread run failed (an item raised on a second thread), or None.
    """

    wall_s: float
    cpu_s: float
    runqueue_s: float
    nbytes: int
    copy_s: float
    parallelism_2_threads: Optional[float]
    calls: int
    concurrent_error: Optional[str] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def item_arrays(item: Any, out: Optional[list] = None) -> list[np.ndarray]:
    """The item's numeric arrays (what moving it between processes copies)."""
    out = [] if out is None else out
    if isinstance(item, np.ndarray):
        if not item.dtype.hasobject:
            out.append(item)
    elif isinstance(item, (dict, list, tuple)):
        for v in item.values() if isinstance(item, dict) else item:
            item_arrays(v, out)
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


def probe_source(source: Any, calls: int = 3, at: Optional[Sequence[int]] = None) -> Probe:
    """Times a few ``source[i]`` calls in this process (see module doc).

    Args:
        source: the indexable source.
        calls: timed calls, after one untimed warm-up call (which may open files lazily).
        at: the items to call, cycled (a shard's own first items); None: items 0, 1, 2...

    Returns:
        A ``Probe``.
    """
    n = source_length(source, allow_infinite=True, owner="executor='auto'")
    if at:
        first, indices = at[0], [at[i % len(at)] for i in range(1, calls + 1)]
    else:
        first, indices = 0, [i % n if n is not None else i for i in range(1, calls + 1)]
    *_, item = _timed_call(source, first)  # warm-up: lazy opens, caches, imports
    timed = []  # (wall, cpu, queued) per call
    for i in indices:
        *times, item = _timed_call(source, i)
        timed.append(times)
    wall, cpu, runq = (statistics.median(column) for column in zip(*timed))
    arrays = item_arrays(item)
    nbytes = int(sum(a.nbytes for a in arrays))
    copy_s = copy_time(arrays)
    parallelism, concurrent, error = _two_threads(source, indices, wall * len(indices))
    return Probe(wall, cpu, runq, nbytes, copy_s, parallelism, 1 + len(indices) + concurrent, error)


def copy_time(arrays: list, tries: int = 1) -> float:
    """Seconds to copy ``arrays`` (an item's, ``item_arrays``), the fastest of ``tries``: what moving the
    item costs (the first copy's page faults included unless ``tries`` > 1)."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        for a in arrays:
            np.array(a, copy=True)
        best = min(best, time.perf_counter() - t0)
    return best


def _two_threads(source: Any, indices: list, walls: float) -> tuple[Optional[float], int, Optional[str]]:
    """``(CPUs two threads used at once, calls made, why it failed)``; the CPUs None when not measured.

    Both threads run ``indices`` repeated until each runs ~``CONCURRENT_S``
    (within ``PROBE_BUDGET_S``; ``walls``: ``indices`` one after another at
    the median call's time, so one slow call on a busy machine does not cut
    the repeats), timed from the barrier to the last one's end. A busy
    machine still lowers the figure towards "GIL-bound" (both threads also
    wait for a CPU): scaling it by one thread's time queued for a CPU was
    tried and read a pure-Python source as running on 1.8 CPUs when the load
    came in bursts (threads at half the rate); reading a free source as
    GIL-bound costs less (processes, or threads where moving items would
    cost what it saves). Each thread stops at ``PROBE_BUDGET_S / 2`` whatever the repeats: one slow item
    among fast ones (repeated as a fast one) made a start-up of minutes.
    """
    if walls * 2 > PROBE_BUDGET_S:
        return None, 0, None
    reps = max(1, min(int(CONCURRENT_S / max(walls, 1e-9)), int(PROBE_BUDGET_S / (2 * max(walls, 1e-9)))))
    calls = indices * reps
    errors: list[BaseException] = []
    spans: list[tuple[float, float, float]] = []  # (start, end, cpu) per thread
    start, made = threading.Barrier(2), [0, 0]  # calls made per thread

    def run(k):
        try:
            start.wait()
            t0, c0 = time.perf_counter(), time.thread_time()
            deadline = t0 + PROBE_BUDGET_S / 2
            for i in calls:
                with item_scope(i):
                    source[i]
                made[k] += 1
                if time.perf_counter() > deadline:
                    break
            spans.append((t0, time.perf_counter(), time.thread_time() - c0))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or len(spans) != 2:
        return None, sum(made), (f"{type(errors[0]).__name__}: {str(errors[0])[:200]}" if errors else None)
    both = max(max(end for _, end, _ in spans) - min(begin for begin, _, _ in spans), 1e-9)
    return sum(c for _, _, c in spans) / both, sum(made), None


__all__ = ["CONCURRENT_S", "PROBE_BUDGET_S", "Probe", "copy_time", "item_arrays", "item_at", "probe_source"]
