"""``ShardedStream``: shards ``task(arg)`` run in threads or worker processes.

``from_generators`` uses ``task = factory`` and ``arg = shard index``;
``from_files`` uses ``task = read_fn`` and ``arg = path``. Each pass over the
dataset is one ``ShardPass`` (``interleave.py``) with new generators.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional, Sequence

from kerasfeed import _validation as _v
from kerasfeed.errors import StreamError
from kerasfeed.execution.waits import WaitScope
from kerasfeed.sampling.order import IndexOrder
from kerasfeed.sampling.views import pass_view
from kerasfeed.sources.base import GeneratorsSeen
from kerasfeed.streams.interleave import ShardPass
from kerasfeed.streams.options import END, NOT_READY, InterleaveOptions

# Latency-bound generators (network, sleeps) need many running at once; the
# same default as the threads executor of ``to_dataset``.
DEFAULT_THREAD_WORKERS = 64
EXECUTORS = ("threads", "processes")


def _task_name(task: Callable) -> str:
    """``make_gen``, ``Reader.read``; ``functools.partial`` shows its function."""
    func = getattr(task, "func", task)  # functools.partial
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    return name.rpartition("<locals>.")[2]


class ShardedStream:
    """The shards of a dataset and where they run.

    Args:
        task: ``task(arg)`` returns an iterable of items (a generator, a list).
        args: one argument per shard (a shard index, a file path).
        kind: ``"generator shard"`` or ``"file"``: how messages name a shard.
        executor: ``"threads"`` (the task runs in producer threads of this
            process) or ``"processes"`` (in persistent worker processes; the
            task and args travel by value with cloudpickle).
        workers: shards running at once: producer threads, or worker
            processes. None: ``min(len(args), 64)`` threads, or
            ``default_workers()`` processes (2 on 2 cores, 14 on 16).
        cycle_length: shards interleaved at a time; None = ``workers``
            (capped by the number of shards).
        block_length: consecutive items from one shard.
        deterministic: interleave order, or arrival order.
        buffer_size: items each running shard may make ahead.
        shuffle: open the shards in a new seeded order every pass.
        seed: seed of that order (and of the worker processes' RNGs).
        worker_init: run once in each worker process.
        num_workers, worker_index: this input pipeline opens only the shards
            ``worker_index, worker_index + num_workers, ...`` of each pass's
            order (``len(args) // num_workers`` of them), as one worker of a
            multi-worker strategy.
        timeout: seconds a worker process may take for an item, from when it
            is ready (processes executor; the pass-level check is in tf.data).

    Raises:
        TypeError, ValueError: bad arguments; TypeError also when the task
            cannot be pickled for worker processes (the message names what).
    """

    def __init__(
        self, task: Callable[[Any], Any], args: Sequence[Any], *, kind: str, executor: str = "threads",
        workers: Optional[int] = None, cycle_length: Optional[int] = None, block_length: int = 1,
        deterministic: bool = True, buffer_size: int = 8, shuffle: bool = False, seed: Optional[int] = None,
        worker_init: Optional[Callable[[], None]] = None, num_workers: int = 1, worker_index: int = 0,
        timeout: Optional[float] = None,
    ):
        if not callable(task):
            raise TypeError(f"The shard task must be callable. Received: {task!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"`executor` must be one of {EXECUTORS}. Received: executor={executor!r}")
        workers = _v.positive_int("workers", workers, allow_none=True)
        cycle_length = _v.positive_int("cycle_length", cycle_length, allow_none=True)
        _v.optional_callable("worker_init", worker_init)
        seed = _v.seed("seed", seed)
        if executor == "threads" and worker_init is not None:
            raise ValueError(
                "`worker_init` runs in worker processes; executor='threads' has none. "
                f"Received: worker_init={worker_init!r}"
            )
        self.task, self.args, self.kind, self.executor = task, list(args), kind, executor
        n = len(self.args)
        self.pool = None
        if workers is None:
            if executor == "threads":
                base = DEFAULT_THREAD_WORKERS
            else:
                from kerasfeed.execution.processes.options import default_workers

                base = default_workers()
            # Room for the cycle: every generator of it needs a thread or process of its own.
            workers = min(n, max(base, cycle_length or 0))
        self.workers = workers
        if cycle_length is not None and min(cycle_length, n) > workers:  # tf.data cycles over n shards at most
            raise ValueError(
                f"`cycle_length={cycle_length}` is larger than `workers={workers}`: every generator of the "
                f"cycle needs a thread or process of its own. Received: cycle_length={cycle_length}, "
                f"workers={workers}"
            )
        processes = executor == "processes"
        self.options = InterleaveOptions(
            cycle_length=min(n, workers if cycle_length is None else cycle_length),
            block_length=block_length,
            deterministic=deterministic,
            # A worker process that finished its shard starts the next one even
            # while the consumer still drains the first (from the buffer):
            # twice as many shards open as workers, opened in order (see
            # InterleaveOptions.ordered_start) so that this cannot deadlock.
            max_open=2 * workers if processes else workers,
            buffer_size=buffer_size,
            ordered_start=processes,
        )
        # Under a multi-worker strategy this worker opens only its own shards:
        # every num_workers-th of each pass's order, cut to equal counts.
        self.order = (
            IndexOrder(n, shuffle=shuffle, seed=seed, num_shards=num_workers, shard_index=worker_index)
            if shuffle or num_workers > 1 else None
        )
        self.timeout = timeout  # the threads' own (``probe``; a pass's in ``tfdata/chunks.py``)
        self._lock = threading.Lock()
        self._generators = GeneratorsSeen()
        self._passes = 0
        self._build_next = False  # the next pass is a model build's (``model_build_iterator``)
        self._open_pass: Optional[tuple] = None  # (pass, weak ref) of the last pass opened on worker processes
        self._stats: Any = None
        if executor == "processes":
            from kerasfeed.execution.pickling import dumps_task
            from kerasfeed.execution.processes.executor import ProcessExecutor
            from kerasfeed.execution.processes.options import PoolOptions

            # Fail now, naming the culprit, rather than in the first pass.
            dumps_task(task, self.args[0], self.describe(0))
            # The consumer-side buffer (buffer_size) does the read-ahead; two
            # slots let a worker make the next item while one travels.
            options = PoolOptions(workers=workers, worker_init=worker_init, seed=seed, in_flight_per_worker=2,
                                  timeout=timeout)
            self.pool = ProcessExecutor.from_options(None, options, name=f"{kind}s of {_task_name(task)}")
        # Deleting the last iterator over the stream, or Ctrl-C, ends its waits (``execution/waits.py``;
        # counted by ``tfdata/consumers.py``): the pool's with worker processes.
        self.waits: Any = self.pool.waits if self.pool is not None else WaitScope(timeout)

    def __len__(self) -> int:
        return len(self.args)

    def describe(self, shard: int) -> str:
        """``"make_gen(3) (generator shard 3 of 100)"`` / ``"read('a.jsonl') (file 0 of 3)"``."""
        return f"{_task_name(self.task)}({self.args[shard]!r}) ({self.kind} {shard} of {len(self.args)})"

    def _open_shard(self, shard: int):
        if self.pool is not None:
            return self.pool.stream(self.task, self.args[shard], name=self.describe(shard))
        return self._generators.check(iter(self.task(self.args[shard])))

    def open_pass(self) -> ShardPass:
        """Starts the next pass (new generators; a new shard order if shuffled)."""
        with self._lock:
            epoch, build, self._build_next = self._passes, self._build_next, False
            if not build:  # a model build's pass is read again by the next one (its generators made anew)
                self._passes += 1
        if self.pool is not None:
            self.pool.fresh_if_failed()  # after a dead worker failed the last pass: new workers
            self._supersede_open_pass(epoch)
        n = len(self.args)
        order = range(n) if self.order is None else pass_view(self.order, epoch)
        p = ShardPass(
            order, self._open_shard, self.options, self.describe, name=self.kind.replace(" ", "-"),
            stats=self._stats if self.pool is None else None,  # a worker process times its own items
        )
        if self.pool is not None:
            self._open_pass = (epoch, weakref.ref(p))
        return p

    def model_build_iterator(self) -> None:
        """The next pass is a model build's (NOTE [ A model build's pass over a stream ], ``tfdata/consumers.py``):
        it does not count, so the fit's first epoch reads pass 0."""
        with self._lock:
            self._build_next = True

    def _supersede_open_pass(self, epoch: int) -> None:
        """On worker processes a pass's shards hold the workers until they end: a pass still open (an
        iterator kept after a peek; fit's training iterator while validation reads the same dataset)
        left the new one waiting for a worker for ever, its timeout not counting. The newer pass wins,
        as from_queue's does, and the older one says why if it is read again."""
        older, self._open_pass = self._open_pass, None
        p = older[1]() if older is not None else None
        shards = len(self.args) if self.order is None else self.order.shard_length
        if p is not None and min(shards, self.options.max_open) >= self.workers:  # else a worker stays free
            p.supersede(
                f"{self.kind}s of {_task_name(self.task)}: pass {older[0]} was closed when pass {epoch} of the same "
                "dataset began: on worker processes a stream reads one pass at a time (its shards hold the workers). "
                "Read one iterator to its end (or delete it) before the next, or use executor='threads', which reads "
                "several at once. Received: a read of pass " + str(older[0]))

    def attach_stats(self, collector: Any) -> None:
        """Reports each item's make time to ``collector`` (a ``StatsCollector``): timed by the producer
        thread that runs the shard, or by the worker process (per worker, with its shared-memory write in
        its busy time), and the worker processes' instant figures (``ProcessExecutor.gauges``)."""
        collector.executor = self.executor
        self._stats = collector
        if self.pool is not None:
            self.pool.attach_stats(collector)

    def probe(self, count: int) -> list[tuple[Any, tuple[int, int]]]:
        """Returns up to ``count`` items for signature inference: a short pass, apart from the real
        ones, takes one item from each of the first ``count`` shards in turn (started together), so the
        items show how shapes vary between shards.

        Raises:
            kerasfeed.StreamError: a shard raised.
        """
        cycle = max(1, min(count, len(self.args) if self.order is None else self.order.shard_length, self.workers))
        opts = InterleaveOptions(
            cycle_length=cycle, block_length=1, max_open=cycle, buffer_size=1, ordered_start=self.pool is not None
        )
        # This pipeline's own shards (the first pass's order) when sharded.
        order = range(len(self.args)) if self.order is None else pass_view(self.order, 0)
        p = ShardPass(order, self._open_shard, opts, self.describe, name="probe")
        items = []
        wait = self.timeout if self.pool is None else None  # a worker process keeps its own timeout
        try:
            while len(items) < count:
                r = p.take(timeout=wait)
                if r is END:
                    break
                if r is NOT_READY:  # a stuck generator or reader: the dataset is not made (it waited for ever)
                    raise StreamError(
                        f"{self.kind}s of {_task_name(self.task)} (probe)", "TimeoutError",
                        f"no item for timeout={wait} s while reading the first items for the signature; a "
                        f"generator or reader is stuck. Received: timeout={wait}",
                        "(none: nothing raised, no item came)\n", None, len(items),
                    )
                items.append(r)
        finally:
            p.close()
        return items

    def close(self) -> None:
        """Stops the worker processes (processes executor). Idempotent."""
        if self.pool is not None:
            self.pool.close()

    def __repr__(self) -> str:
        return (
            f"<ShardedStream {len(self.args)} {self.kind}s of {_task_name(self.task)} "
            f"executor={self.executor!r} workers={self.workers}>"
        )
