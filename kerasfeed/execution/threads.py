"""Run items in the consumer process, on a pool of Python threads."""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any, Optional, Sequence

from kerasfeed import _validation as _v
from kerasfeed.errors import ItemError, ItemTimeout, WorkerError
from kerasfeed.execution.base import Executor
from kerasfeed.execution.parking import ParkWatch
from kerasfeed.execution.plan import PassPlan, rest_of_pass
from kerasfeed.execution.retries import Attempts, RetryCounts
from kerasfeed.execution.thread_tasks import Pool, Runner, Task, stop_threads
from kerasfeed.execution.waits import WaitScope
from kerasfeed.sources import item_random
from kerasfeed.sources.base import source_name

# Latency-bound sources (network stores, sleeps) need many calls in flight; tf.data's default
# pool stops near the core count (docs/field_notes.md, *tf.data thread pool*).
DEFAULT_THREAD_PARALLELISM = 64
# Items made ahead hold memory: with large items (3D volumes, big batches) fewer are made ahead, at least 2.
DEFAULT_BYTES_AHEAD = 256 * 2**20
# A load waits in slices of this long, so that closing the executor (at exit, a stuck pass) and ``timeout`` get through.
_WAIT_SLICE_S = 0.1


class ThreadExecutor(Executor):
    """Calls ``source[index]`` in this process, on a pool of Python threads.

    Best for sources that release the GIL: I/O waits, sleeps, large numpy
    operations. Pure-Python and h5py work does not scale with threads.

    When a pass starts (``plan``), up to ``parallelism`` items of it are
    started ahead on the pool, in the pass's order; ``load`` then picks them
    up, so tf.data maps sequentially instead of running ``parallelism``
    ``numpy_function`` calls on its own threads (each costs the consumer more
    CPU than a Python thread). A ``load`` outside the current plan runs on a
    thread started for it (in the calling thread when that is the main
    thread and there is no timeout); once the executor is closed, only the
    main thread's loads still run. Items made ahead and not taken yet are
    bounded by ``parallelism`` and by ``bytes_ahead`` (counted with the
    largest item seen, at least 2).

    Every call is item ``index`` of the load's or plan's pass for
    ``kerasfeed.item_rng()``, seeded from ``seed``; the global
    ``random``/``numpy.random`` are shared by the threads and not reseeded.
    The pool's threads start with the default floating-point environment,
    whichever thread (a TensorFlow one: flush-to-zero) started them.

    Args:
        source: the indexable source.
        parallelism: items in flight at once (pool threads).
        bytes_ahead: memory that items made ahead may take.
        timeout: seconds one item may run (counted from when a pool thread
            starts it) before its load fails with ``kerasfeed.errors.ItemTimeout``
            (a ``TimeoutError``); None waits as long as it takes. A thread
            cannot be stopped: the stuck call runs on; without ``retries``
            the executor is closed (the pass fails).
        seed: the seed of ``kerasfeed.item_rng()`` (with the pass and the
            index); None draws one from the OS once (draws differ per run).
        retries: further attempts of an item whose call raised or ran past
            ``timeout`` (NOTE [ Retries happen in the load that waits for the
            item ] in ``execution/retries.py``). Each retry runs on a thread
            started for it. A timed-out call's thread is left behind, running,
            counted in ``gauges()`` (``abandoned_threads``), and a new pool
            thread takes its place.
    """

    lends_source_arrays = True

    name = "threads"
    prefetches = True

    def __init__(
        self,
        source: Any,
        parallelism: int = DEFAULT_THREAD_PARALLELISM,
        bytes_ahead: int = DEFAULT_BYTES_AHEAD,
        timeout: Optional[float] = None,
        seed: Optional[int] = None,
        retries: int = 0,
    ):
        seed = _v.seed("seed", seed, owner="ThreadExecutor")
        self._runner = Runner(source, source_name(source), item_random.ItemSeeds(seed))
        self.item_seed = seed
        self._timeout = _v.seconds("timeout", timeout)
        self._retries = _v.non_negative_int("retries", retries, owner="ThreadExecutor")
        if self._retries and self._timeout is not None:
            self._runner.abandon_lock = threading.Lock()
        self.counts = RetryCounts()
        self._abandoned: list[threading.Thread] = []  # left running a timed-out call
        self._parallelism = _v.positive_int("parallelism", parallelism, owner="ThreadExecutor")
        self._bytes_ahead = _v.positive_int("bytes_ahead", bytes_ahead, owner="ThreadExecutor")
        self._lock = threading.Lock()
        self._plan: Optional[PassPlan] = None
        # Its threads and their task queue, found at exit even once this executor is gone (NOTE [ Pool threads at
        # exit ] in thread_tasks.py); ``_tasks`` is its queue.
        self._pool = Pool(weakref.WeakMethod(self._shut))
        self._tasks: "queue.SimpleQueue" = self._pool.tasks
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._user_closed = False  # by ``close``, not by a timeout (see ``item_skipped``)
        self._failure: Optional[TimeoutError] = None
        self._failed_plan: Optional[PassPlan] = None  # the plan a timeout closed
        self._failed_tasks: list = []  # its items started and not taken
        self._hooked = False  # a source hook ran since the last plan (its items made before are stale)
        self._finalizer: Optional[weakref.finalize] = None
        self._loads = 0  # loads started (for parking)
        self._watch = ParkWatch(self)
        self.waits = WaitScope(self._timeout)

    @classmethod
    def from_options(cls, source: Any, options: Any) -> "ThreadExecutor":
        """The executor for ``source`` from a front end's ``PoolOptions`` (its ``timeout``,
        ``seed``, ``retries``, and with cache= the ``item_cache`` its item calls go through)."""
        ex = cls(source, timeout=options.timeout, seed=options.seed, retries=options.retries)
        ex._runner.cache = options.item_cache
        ex._runner.copy = options.copy_items
        return ex

    @property
    def source(self) -> Any:
        """The source the threads call."""
        return self._runner.source

    def load(self, index: int, epoch: int) -> Any:
        # The consumer's source already saw set_epoch for this pass.
        if self._failure is not None:  # a timed-out item stopped the executor: its error again, an ItemTimeout
            raise self._failure.with_traceback(None)
        if self._user_closed:  # as worker processes refuse (it made every item inline, one at a time)
            raise self._closed_error(index)
        if self._threads and os.getpid() != self._threads_pid:
            raise self._forked_error()
        task = self._take(index, epoch)
        if not self._retries:
            try:
                return self._attempt(task, index, epoch)
            except ItemError:
                self.counts.add("failed_items")  # its only attempt
                raise
        attempts = Attempts(index, self._retries)
        while True:
            try:
                return self._attempt(task, index, epoch)
            except ItemError as e:
                if not attempts.again(e):
                    self.counts.add("failed_items")
                    raise attempts.final(e)  # its cause: the original traceback
            self.counts.add("retried_items")
            task = None  # made again outside the plan, on a thread of its own

    def _attempt(self, task: Optional[Task], index: int, epoch: int) -> Any:
        """One attempt at the item: the plan's ``task``, or made now (None)."""
        if task is None:
            if self._timeout is None and threading.current_thread() is threading.main_thread():
                return self._runner.call(index, epoch)  # Ctrl-C reaches the main thread in Python code
            if self._closed:  # at exit, or the front end stopped: start no more calls into the source
                raise self._closed_error(index)
            task = self._run_aside(index, epoch)
        self._wait(task)
        if task.error is not None:
            raise task.error
        value, task.value = task.value, None
        return value

    def _run_aside(self, index: int, epoch: int) -> Task:
        # NOTE [ Loads outside the plan run on a thread of their own ]
        # A load of an item the pool has not started (a parallel map ahead of a window of slow items, a load
        # after the plan was dropped), made in the calling thread, would hold it in the source's code where no
        # wait can end it (``timeout=``, Ctrl-C, the consumer leaving), and at exit TensorFlow's join of that
        # map thread hung the interpreter. So it is made on a daemon thread started for it and waited for like
        # any other item. The main thread without a timeout still makes it itself (the signature probe, direct
        # calls): Ctrl-C interrupts Python code there. Once the executor is closed (the exit guard does so
        # first), other threads start none.
        task = Task(index, epoch)
        self._pool.start(self._runner, "kerasfeed-thread-aside", task)
        return task

    def _wait(self, task: Task) -> None:
        # In slices: a closed executor, a timeout, the iterator deleted or Ctrl-C ends it (execution/waits.py).
        if task.event.is_set():
            return
        wait = self.waits.begin()
        while not task.event.wait(_WAIT_SLICE_S):
            wait.check(f"{self._runner.name}[{task.index}]")
            if self._closed:
                raise RuntimeError(
                    f"kerasfeed: the thread executor of {self._runner.name} was closed while "
                    f"{self._runner.name}[{task.index}] was loading. Received: index={task.index}"
                )
            started = task.started
            if self._timeout is not None and started is not None and time.perf_counter() - started > self._timeout:
                self._timed_out(task)  # raises, unless the call returned just now

    def _timed_out(self, task: Task) -> None:
        name, index, timeout = self._runner.name, task.index, self._timeout
        head = (
            f"kerasfeed: {name}[{index}] did not return within timeout={timeout} s (counted from when a thread "
            "started it); "
        )
        received = f" Received: index={index}, timeout={timeout}"
        if not self._retries:
            self._failure = ItemTimeout(
                index, f"{head}the call runs on in its thread and the dataset's executor is closed.{received}", name
            )
            with self._lock:
                self._failed_plan = self._plan  # the rest of the pass, should the item be skipped
                self._failed_tasks = [] if self._plan is None else self._plan.pending_handles()
                self._left_behind(task)
            self._shut()  # the pass cannot go on without this item
            raise self._failure
        if self._abandon(task):
            raise ItemTimeout(index, f"{head}the call runs on in its thread, left behind.{received}", name)

    def _abandon(self, task: Task) -> bool:
        """Leaves a timed-out call running in its thread (Python cannot stop one) and starts a pool
        thread in its place; False if it returned just now (then it did not time out)."""
        with self._runner.abandon_lock:
            if task.event.is_set():
                return False
            task.abandoned = True  # its thread leaves the pool when (if ever) the call returns
        thread = task.thread
        with self._lock:
            self._left_behind(task)
            if thread in self._threads and not self._closed:
                k = self._threads.index(thread)
                self._threads[k] = self._new_thread(k)
        return True

    def _left_behind(self, task: Task) -> None:
        # With the lock held: counted, and watched while it runs (gauges).
        self.counts.add("abandoned_threads")
        if task.thread is not None:
            self._abandoned.append(task.thread)

    def item_skipped(self, index: int, epoch: int) -> None:
        # Only a timeout without retries closed the executor: open it again, make the rest of the pass.
        with self._lock:
            if self._failure is None or self._user_closed:
                return
            plan, self._failed_plan = self._failed_plan, None
            tasks, self._failed_tasks = self._failed_tasks, []
            self._failure, self._closed = None, False
            # The closed pool's threads were told to stop on its queue (a stuck one never reads it): a new pool.
            self._pool = Pool(weakref.WeakMethod(self._shut))
            self._tasks = self._pool.tasks
        if plan is not None and plan.epoch == int(epoch) and not plan.finished:
            # The closed pool's threads finish what they started: those items are taken over, not made again.
            made = [t for t in tasks if t.started is not None and not t.abandoned and t.index != int(index)]
            self._watch.pass_started(plan.epoch)
            self._new_plan(plan.epoch, rest_of_pass(plan.indices, plan.taken, int(index)), made)

    def ready(self, index: int, epoch: int) -> bool:
        if self._failure is not None:
            return True  # load raises at once
        with self._lock:
            plan = self._plan
            task = None if plan is None else plan.peek(index, epoch)
        if task is None or not task.event.is_set():
            return False
        return task.error is None or not self._retries  # a failed one is made again first

    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        # ``next_pass`` is never started: the threads share the source, whose on_epoch_begin must run first.
        self._watch.pass_started(int(epoch))  # the consumer goes on
        self._new_plan(epoch, indices, None)

    def before_hook(self, name: str) -> None:
        self._hooked = True  # the threads share the source: what the hook changes, items made before lack

    def _made_again(self, epoch: int, indices: Sequence[int]) -> list[Task]:
        """With the lock held: the items the current plan started and no load took, when it is the same pass
        in the same order and no hook ran since: a pass begun again (NOTE [ A pass begun again keeps what was
        made ])."""
        plan, hooked, self._hooked = self._plan, self._hooked, False
        if hooked or plan is None or plan.cancelled or not plan.is_pass(epoch, indices):
            return []
        return [t for t in plan.pending_handles() if t.started is not None and not t.abandoned]

    def _new_plan(self, epoch: int, indices: Sequence[int], made: Optional[Sequence[Task]]) -> None:
        """Plans pass ``epoch`` in the order ``indices``, with the items ``made`` (started by a plan of it that
        a timeout closed; None: by the current plan, if this is its pass begun again) taken over."""
        with self._lock:
            if self._closed:
                return
            if made is None:
                made = self._made_again(epoch, indices)
            if self._plan is not None:
                self._plan.drop()  # its tasks not taken yet are skipped by the threads
            self._start_threads()
            self._plan = PassPlan(epoch, indices, self._parallelism)
            for task in made:
                self._plan.adopt(task.index, task)
            self._fill(self._plan)

    def _start_threads(self) -> None:
        # With the lock held; started on the first plan only.
        if self._threads:
            return
        self._threads_pid = os.getpid()
        self._threads = [self._new_thread(k) for k in range(self._parallelism)]
        self._finalizer = weakref.finalize(self, stop_threads, self._tasks, len(self._threads))

    def _forked_error(self) -> WorkerError:
        # A forked child has none of its parent's threads: the items it queued were made by none, and
        # the pass waited for ever (a fork-based multiprocessing.Pool after a loader was read).
        return WorkerError(
            f"kerasfeed: the threads of the executor of {self._runner.name} belong to process {self._threads_pid}; it "
            f"cannot be used from the forked process {os.getpid()}. Create the dataset in that process instead.")

    def _new_thread(self, k: int) -> threading.Thread:
        return self._pool.start(self._runner, f"kerasfeed-thread-{k}")

    def _window(self, plan: PassPlan) -> int:
        size = self._runner.item_bytes  # known from the probe calls, usually
        if not size:
            return plan.window
        return max(2, min(plan.window, self._bytes_ahead // size))

    def _fill(self, plan: PassPlan) -> None:
        # With the lock held.
        window = self._window(plan)
        while plan.can_start(window):
            index = plan.next_index()
            if index is None:
                break
            task = Task(index, plan.epoch)
            plan.started(index, task)
            self._tasks.put((plan, task))

    def _take(self, index: int, epoch: int) -> Optional[Task]:
        with self._lock:
            self._loads += 1
            plan = self._plan
            if plan is None:
                return None
            planned, task = plan.take(index, epoch)
            if not planned:
                return None
            if task is not None:
                task.taken = True
            if plan.finished:
                self._plan = None
            self._fill(plan)
            return task  # None: not started yet, the caller runs it

    def pass_failed(self, epoch: int) -> None:
        self._watch.arm(int(epoch))

    def activity(self) -> tuple[int, int]:
        return self._loads, 0  # a load waiting for a task it took is safe from parking (the task still runs)

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        """Drops the plan and ends the pool threads (the next ``plan`` starts new ones) after the queue's
        earlier entries, so tasks already taken by a load still run; a load of the dropped plan's items
        is made outside the plan (NOTE [ Loads outside the plan run on a thread of their own ])."""
        with self._lock:
            if self._closed:
                return True
            if activity is not None and tuple(activity) != (self._loads, 0):
                return False
            if self._plan is not None:
                self._plan.drop()
                self._plan = None
            self._threads = []
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()  # one stop entry per thread, after the queued tasks
        return True

    def parallel_calls(self) -> int:
        return self._parallelism

    def caller_augment_seeds(self) -> Optional[item_random.ItemSeeds]:
        # Not with a timeout (only a pool thread's call can be left behind) or copy= (made on the pool threads).
        return self._runner.seeds if self._timeout is None and not self._runner.copy else None

    def attach_stats(self, collector: Any) -> None:
        super().attach_stats(collector)
        self._runner.stats = collector

    def gauges(self) -> dict:
        """``ahead``, ``in_flight``, the retry counts threads have (``retried_items``, ``failed_items``,
        ``abandoned_threads``) and ``abandoned_threads_running``: left-behind calls still running."""
        with self._lock:
            plan = self._plan
            tasks = [] if plan is None else plan.pending_handles()
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            running = len(self._abandoned)
        done = sum(1 for t in tasks if t.event.is_set())
        counts = self.counts.as_dict(("retried_items", "failed_items", "abandoned_threads"))
        return {"ahead": done, "in_flight": len(tasks) - done, **counts, "abandoned_threads_running": running}

    def _closed_error(self, index: int) -> RuntimeError:
        return RuntimeError(f"kerasfeed: the thread executor of {self._runner.name} is closed; create the dataset (or "
                            f"loader) again. Received: index={index}")

    def close(self) -> None:
        self._user_closed = True
        self._shut()

    def _shut(self) -> None:
        self._watch.disarm()
        with self._lock:
            self._closed = True
            if self._plan is not None:
                self._plan.drop()
                self._plan = None
            # TensorFlow may keep the dataset's function (and this executor) long after: keep no stopped
            # Thread objects or full sample rings.
            self._threads = []
        if self._finalizer is not None:
            self._finalizer()
        stats = self._runner.stats
        if stats is not None:
            stats.compact()
