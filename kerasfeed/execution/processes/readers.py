"""The reader threads of a worker pool: one per worker, and what a worker's death does.

Part of the ``Dispatcher``, which each function takes as ``d`` and whose lock they take;
failure propagation: NOTE [ Worker process shutdown ] in ``process.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import protocol
from kerasfeed.execution.processes.lanes import WorkerLane
from kerasfeed.execution.processes.process import NO_RESTART, STREAM_NO_RESTART, fresh_error
from kerasfeed.execution.processes.slots import fd_limit_message

logger = logging.getLogger("kerasfeed")

_READER_POLL_S = 1.0


def read_loop(d: Any, lane: WorkerLane) -> None:
    """The reader thread of ``lane``'s worker: answers, stream items, readiness, then its death."""
    proc = lane.process
    try:
        while True:
            if not proc.wait_readable(_READER_POLL_S):
                if not proc.alive():  # died, yet a grandchild holds the socket
                    break
                continue
            t0 = time.thread_time()
            msg, fds = proc.recv()
            _handle(d, lane, msg, fds)
            proc.reader_cpu_s += time.thread_time() - t0
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            # At the fd limit the kernel silently drops passed fds: report that, not a dead worker.
            what = (
                f"a shared-memory segment from worker {lane.id} (pid {proc.pid}) of {d.name} "
                f"could not be received ({e.strerror})"
            )
            d.record_failure(WorkerError(fd_limit_message(what), worker_id=lane.id, pid=proc.pid))
            proc.kill()
    except (EOFError, ValueError):
        pass
    except BaseException:  # never lose the reason silently
        logger.exception("kerasfeed: reader thread of worker %d failed", lane.id)
    finally:
        _worker_gone(d, lane)


def _handle(d: Any, lane: WorkerLane, msg: protocol.ToParent, fds: list[int]) -> None:
    if isinstance(msg, (protocol.ItemDone, protocol.ItemFailed)):
        if isinstance(msg, protocol.ItemDone):
            d.slots.map_segment(lane.id, msg.slot, fds, msg.new_size)
            stats = d.stats
            if stats is not None:  # timed by the worker itself
                stats.made(msg.make_s, lane.id, time.perf_counter(), busy_s=msg.make_s + msg.write_s)
        with d.lock:
            req = lane.pending.pop(msg.request_id, None)
            if req is None:
                return
            if isinstance(msg, protocol.ItemDone):
                req.spec, req.nbytes = msg.spec, msg.nbytes
            else:
                req.error = msg.error
            d.settle(lane, req)
            sends = d.fill_plans()
        req.event.set()
        d.send_requests(sends)
        d.replacements.answered(lane)  # a retiring worker leaves after its last answer
    elif isinstance(msg, protocol.Retire):
        d.replacements.over_memory(lane, msg.rss)
    elif isinstance(msg, (protocol.StreamStarted, protocol.StreamItem, protocol.StreamEnd, protocol.StreamFailed)):
        d.streams.on_message(lane, msg, fds)
    elif isinstance(msg, protocol.Ready):
        lane.process.mark_ready(msg.info, d.name)
    elif isinstance(msg, protocol.InitError):
        lane.process.init_error = msg
    else:
        for fd in fds:
            os.close(fd)


def _not_replaced(d: Any, lane: WorkerLane) -> str:
    """Why the pool fails instead of replacing the worker (with ``retries=`` it replaces those that die
    making items: NOTE [ Replacing a worker ])."""
    if lane.stream is not None:
        return STREAM_NO_RESTART
    if not d.retries:
        return NO_RESTART
    if not lane.process.ready.is_set():
        return (f"Workers that die while starting are not replaced once {d.retries} in a row have "
                f"(retries={d.retries}), nor after a worker_init that raised: fix the cause, or use "
                "executor='threads' to debug the source in the main process.")
    return "It was not replaced (a stream's worker, or a pool that had failed already): create the dataset again."


def _worker_gone(d: Any, lane: WorkerLane) -> None:
    if d.closed:
        return
    proc = lane.process
    code = proc.reap()
    if d.closed or d.replacements.worker_gone(lane, code):  # retired, or replaced (NOTE [ Replacing a worker ])
        return
    head, details = proc.explain_exit(code)
    early = not proc.ready.is_set()  # died while starting: it made no item
    with d.lock:
        first = lane.first_pending()  # the item it died on
        index = first.index if first is not None and not early else None
        during = f" while loading {d.name}[{index}]" if index is not None else (" before it was ready" if early else "")
        err = WorkerError(
            f"kerasfeed: worker {lane.id} (pid {proc.pid}) of {d.name} {head}{during}.\n{_not_replaced(d, lane)}"
            + (f"\n\n{details}" if details else ""),
            worker_id=lane.id,
            pid=proc.pid,
            exitcode=code,
            index=index,
        )
        lane.death = err
        if d.failure is None:
            d.failure = err
        first = d.failure  # e.g. a timeout that made us kill this worker
        # Items pending on the other workers fail too (answers that still come free their slots).
        pending = d.lanes.abandon_pending()
        lane.pending.clear()
        st = lane.stream
        d.cv.notify_all()
    logger.info("%s", str(err).splitlines()[0])
    for req in pending:
        req.error = fresh_error(first)
        req.event.set()
    if st is not None:
        st.queue.put(protocol.WorkerDied(first))
    d.close()  # now, not when collected (NOTE [ Worker process shutdown ])


__all__ = ["read_loop"]
