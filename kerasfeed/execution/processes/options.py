"""Options of a worker pool: built once from the public keywords, checked, passed whole.

``to_dataset`` (and ``ProcessExecutor``) build one ``PoolOptions`` from their keyword
arguments; the executor factory, ``executor="auto"``, the executor and the pool take it
as it is (Grain's options style).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

from kerasfeed import _validation as _v

# NOTE [ Default worker count ]
# Workers share the machine with the process that consumes their items, which
# under model.fit needs CPU of its own: the training loop's Python (one core,
# GIL-bound), the framework's runtime threads (XLA / PJRT dispatch and
# host-to-device copies, TensorFlow's inter-op pool), and kerasfeed's threads
# (one reader per worker, the device prefetch). Workers on every core take
# those cores exactly when the step needs them (15 busy workers on 16 cores
# fed the H100 slower than 8). So the default leaves the consumer room: on 2
# cores both (the 2-core benchmarks use 2; the consumer's share there is small
# and workers are niced), up to 8 cores one less, beyond that two less, and at
# most MAX_DEFAULT_WORKERS: past that each worker adds start-up, ~50 MB plus
# the source, items in shared memory and a reader thread, for sources that
# rarely need it. ``workers=`` gives more. Whatever is asked, an executor
# starts at most one worker per item of its source: a small validation set
# gets a few workers, not the machine's worth.
MAX_DEFAULT_WORKERS = 32
# Nice steps below the owner (os.nice) unless told: under contention the kernel prefers the consumer.
DEFAULT_WORKER_NICE = 10
NICE_ENV = "KERASFEED_WORKER_NICE"
# A worker's interpreter with numpy and kerasfeed takes ~40-60 MB before the
# source: a lower ``worker_max_rss`` would replace workers after every item.
MIN_WORKER_MAX_RSS = 64 * 2**20


def usable_cpus() -> int:
    """The number of CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_workers(cpus: Optional[int] = None) -> int:
    """Worker processes when ``workers=None`` (see NOTE [ Default worker count ]).

    Args:
        cpus: the CPUs to plan for; None = ``usable_cpus()``.

    Returns:
        ``cpus`` up to 2, ``cpus - 1`` up to 8, then ``cpus - 2``, at most
        ``MAX_DEFAULT_WORKERS``: 2 on 2 cores, 7 on 8, 14 on 16, 32 on 64.
    """
    cpus = usable_cpus() if cpus is None else max(1, int(cpus))
    if cpus <= 2:
        return cpus
    if cpus <= 8:
        return cpus - 1
    return min(cpus - 2, MAX_DEFAULT_WORKERS)


def workers_for(workers: Optional[int], items: Optional[int], cpus: Optional[int] = None) -> int:
    """The workers a process executor starts: ``workers`` (None: ``default_workers(cpus)``),
    at most one per item of a finite source (``items``; None: endless): a pass cannot keep
    more busy, they would only cost start-up and memory (NOTE [ Default worker count ])."""
    wanted = default_workers(cpus) if workers is None else workers
    return wanted if items is None else max(1, min(wanted, items))


def _nice_from_env() -> int:
    raw = os.environ.get(NICE_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_WORKER_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ValueError(f"`{NICE_ENV}` must be an int from 0 to 19 (0: no change). Received: {NICE_ENV}={raw!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """Options of a ``ProcessExecutor``'s workers, checked when built.

    Args:
        workers: number of worker processes; None = ``default_workers()``
            (2 on 2 cores, 14 on 16, 32 on 64; see ``resolved``).
        worker_init: run once in each worker after the source arrives.
        seed: the seed of the items' random numbers. Given, the workers
            reseed ``random`` and ``numpy.random`` before each item from
            (seed, pass, index), and ``kerasfeed.item_rng()`` is seeded from
            the same three (NOTE [ Random augmentation is a function of (seed,
            pass, index) ] in ``sources/item_random.py``). None draws one
            from the OS (see ``resolved``) for ``item_rng()``, and worker
            ``k`` seeds the globals once with ``seed + k``.
        in_flight_per_worker: items requested from one worker at a time (one
            being made, the next queued); bounds memory and latency.
        timeout: seconds one item may take before the pass fails with a
            ``WorkerError``; None waits as long as the worker is alive.
        worker_nice: nice steps (0-19) below this process the workers run
            (``os.nice``; Linux/Unix), so that the consumer's threads (the
            training loop, the framework's runtime) win contended CPUs; 0
            keeps the owner's priority. None = ``$KERASFEED_WORKER_NICE``,
            else ``DEFAULT_WORKER_NICE`` (10).
        retries: how many more times an item is tried after an attempt that
            raised, ran past ``timeout``, or whose worker died (0: the first
            failure fails the item). A worker that died or hung is replaced
            (the pool keeps its size) and the pass goes on in order; see
            NOTE [ Retries happen in the load that waits for the item ]
            (``execution/retries.py``) and NOTE [ Replacing a worker ]
            (``processes/replacement.py``). The threads executor takes it too.
        worker_max_items: a worker sent this many items finishes them and is
            replaced by a fresh one (None: never). Worker processes only.
        worker_max_rss: resident bytes past which a worker (checking after
            each item; its own pages, not the shared memory it writes items
            into) finishes the items sent to it and is replaced (None:
            never; at least ``MIN_WORKER_MAX_RSS``, 64 MB). Processes only.
        seed_given: whether ``seed`` is the user's; None until ``resolved``
            sets it (and keeps it resolving its own result: a parked pool's successor).

    Raises:
        TypeError, ValueError: a bad value (see ``kerasfeed._validation``).

    Example:

    ```python
    opts = PoolOptions(workers=2, seed=0)
    opts.resolved().workers  # 2; PoolOptions().resolved().workers is default_workers()
    ```
    """

    workers: Optional[int] = None
    worker_init: Optional[Callable[[], None]] = None
    seed: Optional[int] = None
    in_flight_per_worker: int = 2
    timeout: Optional[float] = None
    worker_nice: Optional[int] = None
    retries: int = 0
    worker_max_items: Optional[int] = None
    worker_max_rss: Optional[int] = None
    seed_given: Optional[bool] = dataclasses.field(default=None, compare=False, repr=False)
    # cache=: the cached_items.ItemCache the workers' items go through (its store's fds travel with Init).
    item_cache: Any = dataclasses.field(default=None, compare=False, repr=False)
    # to_loader's copy=True: threads copy each item's arrays as it is made (a source reusing its buffers would
    # have overwritten it by the time the consumer copies); a worker process's items are copies anyway.
    copy_items: bool = dataclasses.field(default=False, compare=False, repr=False)

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("workers", _v.positive_int("workers", self.workers, allow_none=True))
        _v.optional_callable("worker_init", self.worker_init)
        put("seed", _v.seed("seed", self.seed))
        put("in_flight_per_worker", _v.positive_int("in_flight_per_worker", self.in_flight_per_worker))
        put("timeout", _v.seconds("timeout", self.timeout))
        nice = _v.non_negative_int("worker_nice", self.worker_nice, allow_none=True)
        if nice is not None and nice > 19:
            raise ValueError(
                f"`worker_nice` must be an int from 0 to 19 (0: no change), or None. Received: worker_nice={nice!r}"
            )
        put("worker_nice", _nice_from_env() if nice is None else nice)
        put("retries", _v.non_negative_int("retries", self.retries))
        put("worker_max_items", _v.positive_int("worker_max_items", self.worker_max_items, allow_none=True))
        rss = _v.positive_int("worker_max_rss", self.worker_max_rss, allow_none=True)
        if rss is not None and rss < MIN_WORKER_MAX_RSS:
            raise ValueError(
                f"`worker_max_rss` is in bytes and must be at least {MIN_WORKER_MAX_RSS} (64 MB): a worker's "
                f"interpreter alone takes about 50 MB, so a lower limit would replace workers after every item. "
                f"Received: worker_max_rss={rss!r}"
            )
        put("worker_max_rss", rss)
        if self.seed_given is not None and not isinstance(self.seed_given, bool):
            raise TypeError(f"`seed_given` must be a bool or None. Received: seed_given={self.seed_given!r}")

    @property
    def recycles(self) -> bool:
        """Whether workers are replaced at a limit (``worker_max_items``/``worker_max_rss``)."""
        return self.worker_max_items is not None or self.worker_max_rss is not None

    @property
    def replaces_workers(self) -> bool:
        """Whether a pool may start workers after its first ones (retries, recycling)."""
        return self.retries > 0 or self.recycles

    @property
    def given(self) -> bool:
        """Whether process-only options (``workers``, ``worker_init``) were set."""
        return self.workers is not None or self.worker_init is not None

    def resolved(self) -> "PoolOptions":
        """These options with ``workers`` and ``seed`` made concrete (a pool's own copy);
        ``seed_given`` says whether the seed was the user's."""
        workers = default_workers() if self.workers is None else self.workers
        seed = int.from_bytes(os.urandom(7), "little") if self.seed is None else self.seed
        given = (self.seed is not None) if self.seed_given is None else self.seed_given
        return dataclasses.replace(self, workers=workers, seed=seed, seed_given=given)
