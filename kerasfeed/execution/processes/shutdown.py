"""Parking and closing a pool, in the order NOTE [ Worker process shutdown ] (``process.py``) gives.

Part of the ``Dispatcher``, which each function takes as ``d`` and whose lock they take.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol
from kerasfeed.execution.processes.process import GRACE_S


def park(d: Any, activity: Optional[tuple[int, int]] = None) -> bool:
    """Closes the pool if no load started or ran since ``activity`` (``(loads, loading)``; None: at
    once); later calls raise, and the executor starts a new pool (NOTE [ Parking after a failed pass ]).
    Returns whether the pool is closed now (True for a pool closed already)."""
    if os.getpid() != d.owner_pid:
        return False
    with d.lock:
        if d.closed:
            return True
        busy = any(lane.stream is not None for lane in d.lanes)
        if busy or (activity is not None and (d.loads, d.loading) != tuple(activity)):
            return False
        d.parked = True
        pending, streams, lanes = _mark_closed(d)
    _shut_down(d, pending, streams, lanes)
    return True


def close(d: Any) -> None:
    """See NOTE [ Worker process shutdown ] in process.py (this is its order)."""
    if os.getpid() != d.owner_pid:
        # A forked copy (a fork-based multiprocessing worker): the sockets and processes are the
        # parent's; touching them (shutdown() acts on the shared socket) would break its pool.
        return
    with d.lock:
        marked = None if d.closed else _mark_closed(d)
        # A close under way in another thread: its closer, and the readers it joins, do not wait for it.
        busy = set() if marked is not None else {d.closer, *(lane.process.reader for lane in d.lanes.every())}
    if marked is not None:
        _shut_down(d, *marked)
    elif threading.current_thread() not in busy:
        # Another thread closes it (a worker's reader, on that worker's death): its workers exit before this
        # returns too, as when this call closes it.
        d.shut_down.wait(2 * GRACE_S + 3)


def _mark_closed(d: Any) -> tuple[list, list, list]:
    # With the lock held: from here on every call raises (check_usable).
    d.closed, d.closer = True, threading.current_thread()
    d.unfinished = d.plans.unfinished()  # for a pool started after a skipped item (ProcessExecutor.item_skipped)
    d.plans.forget()
    lanes = d.lanes.every()  # retired lanes still running too
    pending = [req for lane in lanes for req in lane.pending.values()]
    for lane in lanes:
        lane.pending.clear()
    streams = [lane.stream for lane in lanes if lane.stream is not None]
    d.replacements.stop_launching()
    d.cv.notify_all()
    return pending, streams, lanes


_INTERRUPTS_ABSORBED = 5  # Ctrl-Cs during one shutdown that still let it finish (then the next one is raised)


def _shut_down(d: Any, pending: list, streams: list, lanes: list) -> None:
    """``_stop``, finished even when Ctrl-C comes during it: interrupted after its first lane, it left the
    other workers running for good (the pool counted as closed: a second ``close()`` did nothing). Each step
    is idempotent, so it runs again from the start; the KeyboardInterrupt is raised once it is done."""
    interrupted: Optional[KeyboardInterrupt] = None
    try:
        for attempt in range(_INTERRUPTS_ABSORBED + 1):
            try:
                _stop(d, pending, streams, lanes)
                break
            except KeyboardInterrupt as e:
                if attempt == _INTERRUPTS_ABSORBED:
                    raise
                interrupted = e
    finally:
        d.shut_down.set()
    if interrupted is not None:
        raise interrupted


def _stop(d: Any, pending: list, streams: list, lanes: list) -> None:
    for req in pending:
        if req.error is None:  # a worker's failure may have told it why already
            req.error = WorkerError(
                f"kerasfeed: the worker pool of {d.name} was closed while {d.name}[{req.index}] was loading."
            )
        req.event.set()
    for st in streams:
        st.queue.put(protocol.WorkerDied(WorkerError(f"kerasfeed: the worker pool of {d.name} was closed.")))
    for lane in lanes:
        lane.process.ask_to_stop()
    deadline = time.monotonic() + GRACE_S
    for lane in lanes:
        lane.process.terminate_after(deadline)
    for lane in lanes:
        lane.process.kill_after(GRACE_S)
    for lane in lanes:
        lane.process.release()
    for wid in sorted({lane.id for lane in lanes}):
        d.slots.close_segments(wid)


__all__ = ["close", "park"]
