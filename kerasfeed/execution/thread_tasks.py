"""The pool threads' side of the threads executor: tasks, the runner, the thread loop.

``ThreadExecutor`` (``threads.py``) plans, hands out and waits; what is here
runs on its pool threads and on those it starts for loads outside the plan.
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
from typing import Any, Optional

import numpy as np

from kerasfeed import _nest
from kerasfeed.errors import ItemError
from kerasfeed.execution.fpenv import set_default_fp_env
from kerasfeed.execution.interpreter_races import get_item
from kerasfeed.sources import item_random


def _nbytes(item: Any) -> int:
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(x) for x in item)
    if isinstance(item, dict):
        return sum(_nbytes(x) for x in item.values())
    return 0


class Done:
    """A one-shot ``threading.Event``: ``set`` once, then ``is_set`` and every ``wait`` return True.

    One lock, held until ``set``: creating, setting and waiting cost ~0.2 us where an ``Event`` (a
    ``Condition``, its lock, a deque, a new lock per wait) costs ~4 us, and it leaves no objects for the
    cyclic GC. The thread executor makes one per item (docs/performance.md, *Picking up an item*).
    """

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:  # one thread sets a task's (its maker, or the one skipping a dropped pass)
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether it is set, after waiting up to ``timeout`` seconds (None: for ever)."""
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else timeout):
            self._lock.release()  # later waits pass at once
            return True
        return self._set


class Task:
    """One call of ``source[index]`` on a thread, and its result once made."""

    __slots__ = ("index", "epoch", "event", "value", "error", "taken", "started", "thread", "abandoned")

    def __init__(self, index: int, epoch: int):
        self.index = index
        self.epoch = epoch
        self.event = Done()
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.taken = False
        self.started: Optional[float] = None  # when a pool thread began it
        self.thread: Optional[threading.Thread] = None  # the thread making it
        self.abandoned = False  # timed out with retries: its thread leaves when (if ever) the call returns


class Runner:
    """What the pool threads hold: the source, not the executor, so that an
    executor nobody uses any more is collected (and its threads stopped)."""

    def __init__(self, source: Any, name: str, seeds: item_random.ItemSeeds):
        self.source = source
        self.name = name
        self.seeds = seeds  # for item_rng(): NOTE [ Random augmentation is a function of (seed, pass, index) ]
        self.item_bytes = 0  # the largest item seen so far
        self.stats: Any = None  # a StatsCollector, once attached
        # With ``retries`` and a ``timeout`` (a timed-out call may be left behind): makes deciding that and
        # the thread's own check atomic.
        self.abandon_lock: Optional[threading.Lock] = None
        self.cache: Any = None  # cache=: a cached_items.ItemCache (NOTE [ An item with cache= ])
        self.copy = False  # copy each item's arrays here, as made (PoolOptions.copy_items)

    def call(self, index: int, epoch: int, started: Optional[float] = None) -> Any:
        """``source[index]`` as item ``index`` of pass ``epoch``; ``started``: the caller's
        ``perf_counter()`` just before, reused as the make time's start."""
        stats = self.stats
        if stats is not None and started is None:
            started = time.perf_counter()
        previous = item_random.enter(self.seeds, epoch, index)
        try:
            item = get_item(self.source, index, self.name, self.cache)
        except Exception as e:  # noqa: BLE001 - re-raised as ItemError (its cause: the original traceback)
            raise ItemError.from_exception(index, e, source_name=self.name)
        except (SystemExit, GeneratorExit, KeyboardInterrupt) as e:
            # A library's sys.exit() on a bad record is the item's failure, as on worker processes; Ctrl-C
            # reaches the main thread only, and there stays what it is.
            if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise
            raise ItemError.from_exception(index, e, source_name=self.name) from e
        finally:
            item_random.leave(previous)
        if self.copy:
            skeleton, leaves = _nest.flatten(item, index=index)
            item = _nest.pack(skeleton, [np.array(v, copy=True) if isinstance(v, np.ndarray) else v
                                         for _, v in leaves])
        if stats is not None:
            end = time.perf_counter()
            lane = threading.current_thread().name if stats.timeline is not None else None
            stats.made(end - started, None, end, lane)
        size = _nbytes(item)
        if size > self.item_bytes:
            self.item_bytes = size
        return item


def thread_loop(tasks: "queue.SimpleQueue", runner: Runner) -> None:
    # Started from whichever thread planned the pass: under to_dataset, a TensorFlow thread
    # (NOTE [ Threads that run the source start with the default floating-point environment ]).
    set_default_fp_env()
    me = threading.current_thread()
    while True:
        job = tasks.get()
        if job is None:
            return
        plan, task = job
        if plan.cancelled and not task.taken:
            task.event.set()  # a dropped pass: nobody will ask for it
            continue
        task.thread = me
        _run(runner, task)
        lock = runner.abandon_lock
        if lock is not None:
            with lock:
                if task.abandoned:
                    return  # timed out and left behind: a new thread took this one's place
        del job, plan, task


def _run(runner: Runner, task: Task) -> None:
    task.started = started = time.perf_counter()  # for the timeout, and the make time's start
    try:
        task.value = runner.call(task.index, task.epoch, started)
    except BaseException as e:  # noqa: BLE001 - re-raised by the load that takes it
        task.error = e
    task.event.set()


def run_aside_thread(runner: Runner, task: Task) -> None:
    set_default_fp_env()  # as thread_loop: the caller may be a TensorFlow thread
    task.thread = threading.current_thread()
    _run(runner, task)


def stop_threads(tasks: "queue.SimpleQueue", count: int) -> None:
    for _ in range(count):
        tasks.put(None)


__all__ = ["Done", "Task", "Runner", "thread_loop", "run_aside_thread", "stop_threads"]
