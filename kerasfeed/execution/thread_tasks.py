"""The pool threads' side of the threads executor: tasks, the runner, the thread loop, the pools and their
join at exit.

``ThreadExecutor`` (``threads.py``) plans, hands out and waits; what is here
runs on its pool threads and on those it starts for loads outside the plan.

NOTE [ Pool threads at exit ]
Pool threads are daemon threads: closing an executor (``close``, a timeout,
its ``weakref.finalize``) only queues a stop per thread, and a thread inside
``source[i]`` runs on. Python's finalization ends a daemon thread where it
next asks for the GIL; inside a C++ call (JAX, TensorFlow, torch, a codec)
that is glibc's forced unwind through a ``noexcept`` frame, and the process
aborts ("terminate called ... FATAL: exception not rethrown", rc -6): seen
once at the exit of a JAX process that had run several interrupted fits, with
113-130 ``kerasfeed-thread-*`` threads still alive after the exit hooks (the
abort ``processes/worker_threads.py`` ``close`` describes for a worker's own
threads). So every ``Pool`` (the threads one executor started on one task
queue, its loads outside the plan included) is kept in a weak registry; each
of its threads holds it (its arguments) while it runs, so a pool whose
executor was collected or parked, or whose threads were left behind by a
timeout, is still found. At exit ``join_threads_at_exit`` stops every pool (its
executor closed if it lives, queued items dropped, one stop per thread) and
joins their threads, ``EXIT_JOIN_S`` at most in all: a call stuck for ever
does not hold the exit up, and the threads left are named in a debug log. It
runs from the exit guard's hook before the heap freeze (``tfdata/exit_guard.py``,
which registers this module's hook first, so that it runs after its own), and
from its own ``atexit`` hook, registered when a pool first starts a thread (a
process that never imported TensorFlow: ``to_loader`` under JAX, torch,
numpy); once only.

The other daemon threads that run Python for as long as their owner lives
are in the same registry (``join_at_exit``: the owner has ``stop_at_exit``
and ``alive``; its threads hold it): a stream's producers (the user's
generator or ``from_queue`` producer runs in them; a close does not join
them), the device prefetch thread (``jax.device_put``, torch copies; its
iterator's finalizer only sets a flag; its stop also ends a load waiting on
a worker process, whose pool closes only after this hook), the park watch
(none armed once the exit began: the exit's own close fails the loads that
would arm one) and the export's progress bar. Before, after the hooks: the
producers alive in every run that ended mid-item, the prefetch thread in 3
of 10 runs ending with a live ``loader.jax()``, 6 of 6 after interrupted
fits under JAX. Left out: threads a close joins (a worker's load threads,
the processes executor's readers), the launcher (blocked in a queue nobody
feeds at exit: it never returns into Python), a worker's parent watch (ended
in its sleep: no C++ frame to unwind).
"""

from __future__ import annotations

import _thread
import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed import _nest
from kerasfeed.errors import ItemError
from kerasfeed.execution.fpenv import set_default_fp_env
from kerasfeed.execution.interpreter_races import get_item
from kerasfeed.sources import item_random

logger = logging.getLogger("kerasfeed")

# The exit waits at most this long in all (not per thread) for the threads of every pool (NOTE [ Pool threads
# at exit ]): long enough for calls in progress to return, short enough that one stuck for ever costs little.
EXIT_JOIN_S = 3.0

_owners: "weakref.WeakSet[Any]" = weakref.WeakSet()  # pools and the other owners of threads (join_at_exit)
_exit_lock = threading.Lock()
_exit_hooked = False
_exit_joined = False


def _nbytes(item: Any) -> int:
    if isinstance(item, np.ndarray):
        return item.nbytes
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(x) for x in item)
    if isinstance(item, dict):
        return sum(_nbytes(x) for x in item.values())
    return 0


def item_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by a user's call for an item (``source[i]``, ``augment``), is that item's error:
    any ``Exception``, and a library's ``sys.exit()`` on a bad record too, as on worker processes; Ctrl-C
    reaches the main thread only, and there stays what it is. (``Runner.call``, ``CacheFront._augmented``.)"""
    if isinstance(e, KeyboardInterrupt):
        return threading.current_thread() is not threading.main_thread()
    return isinstance(e, (Exception, SystemExit, GeneratorExit))


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
        except BaseException as e:
            if not item_failure(e):
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


def thread_loop(pool: "Pool", runner: Runner) -> None:
    # Started from whichever thread planned the pass: under to_dataset, a TensorFlow thread
    # (NOTE [ Threads that run the source start with the default floating-point environment ]).
    # ``pool`` stays referenced (by the thread's arguments) until the thread returns: NOTE [ Pool threads at exit ].
    set_default_fp_env()
    me = threading.current_thread()
    tasks = pool.tasks
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


def run_aside_thread(pool: "Pool", runner: Runner, task: Task) -> None:
    set_default_fp_env()  # as thread_loop: the caller may be a TensorFlow thread
    task.thread = threading.current_thread()
    _run(runner, task)


def stop_threads(tasks: "queue.SimpleQueue", count: int) -> None:
    for _ in range(count):
        tasks.put(None)


class Pool:
    """The threads one executor started on one task queue: pool threads (``thread_loop``, until a None) and
    threads for one load outside the plan (NOTE [ Pool threads at exit ]).

    Args:
        shut: how its executor stops (a ``weakref.WeakMethod``: the pool never keeps its executor alive).
    """

    __slots__ = ("tasks", "_threads", "_lock", "_shut", "__weakref__")

    def __init__(self, shut: Optional[Callable[[], Any]] = None):
        self.tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        # Started here: weakly, a running thread is kept by ``threading`` (a closed executor, which TensorFlow
        # may keep long after, keeps no stopped Thread objects).
        self._threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._shut = shut

    def start(self, runner: Runner, name: str, task: Optional[Task] = None) -> threading.Thread:
        """Starts a pool thread, or (``task``) a thread that makes ``task`` alone."""
        target, args = (thread_loop, (self, runner)) if task is None else (run_aside_thread, (self, runner, task))
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        join_at_exit(self)
        thread.start()
        return thread

    def alive(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    def stop_at_exit(self) -> None:
        """Closes the executor (if it lives), drops the items no thread took yet (their loads raise) and
        queues a stop for every thread still alive."""
        shut = self._shut() if self._shut is not None else None
        if shut is not None:
            shut()  # its plan dropped, its waits end: loads in other threads give up
        while True:  # what is left was made for nobody (an executor collected with its plan) or will be refused
            try:
                job = self.tasks.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                task = job[1]
                task.error = RuntimeError(f"kerasfeed: item {task.index} was not made: the interpreter is exiting")
                task.event.set()
        stop_threads(self.tasks, len(self.alive()))


def install_exit_join() -> None:
    """Registers ``join_threads_at_exit`` with ``atexit`` once (NOTE [ Pool threads at exit ])."""
    global _exit_hooked
    with _exit_lock:
        if not _exit_hooked:
            atexit.register(join_threads_at_exit)
            _exit_hooked = True


def join_at_exit(owner: Any) -> None:
    """Has the exit stop ``owner`` (``owner.stop_at_exit()``) and join its threads (``owner.alive()``, a list);
    held weakly: its threads hold it while they run (NOTE [ Pool threads at exit ])."""
    if not _exit_hooked:
        install_exit_join()
    _owners.add(owner)


def exit_begun() -> bool:
    """Whether the exit's join has begun: a thread started now would not be joined."""
    return _exit_joined


def running(*threads: Optional[threading.Thread]) -> list[threading.Thread]:
    """Those of ``threads`` started and not ended: an owner's ``alive()`` (``join_at_exit``)."""
    return [t for t in threads if t is not None and t.is_alive()]


def listed(items: "weakref.WeakSet") -> list:
    """What a weak set holds now (another thread may add to it meanwhile)."""
    for _ in range(10):  # a set changed during the copy raises: read it again
        try:
            return list(items)
        except RuntimeError:
            continue
    return list(items)


def join_threads_at_exit(wait: float = EXIT_JOIN_S) -> list[str]:
    """Stops every live pool (and other owner: ``join_at_exit``) and joins its threads, ``wait`` seconds at
    most in all (NOTE [ Pool threads at exit ]). Runs once (a later call returns at once); returns the names of
    the threads still alive after it (logged at debug). Never raises: it runs at exit."""
    global _exit_joined
    with _exit_lock:
        if _exit_joined:
            return []
        _exit_joined = True
    try:
        deadline = time.monotonic() + wait
        owners = listed(_owners)
        for owner in owners:  # all stopped before any join: a prefetch thread's load ends with its pool
            try:
                owner.stop_at_exit()
            except Exception:  # its threads are still joined below
                logger.debug("kerasfeed: stopping %r at exit failed", owner, exc_info=True)
        me = threading.current_thread()
        threads = [t for owner in owners for t in owner.alive() if t is not me]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
    except Exception:  # at exit: the interpreter goes on as before
        logger.debug("kerasfeed: joining its threads at exit failed", exc_info=True)
        return []
    if left:
        logger.debug("kerasfeed: %d thread(s) still in a call after %.1f s at exit, left to the interpreter: %s",
                     len(left), wait, ", ".join(left))
    return left


__all__ = ["EXIT_JOIN_S", "Done", "Task", "Runner", "Pool", "item_failure", "thread_loop", "run_aside_thread",
           "stop_threads", "install_exit_join", "join_at_exit", "exit_begun", "running", "listed",
           "join_threads_at_exit"]
