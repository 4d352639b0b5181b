"""The arguments every front end shares, resolved once into one options object (TF-free).

``to_dataset`` and ``to_loader`` take the same batching, order, shard, resume and executor
arguments, into a ``LoadOptions`` with their own fields added (``tfdata/options.py``,
``loader/options.py``). It is checked once, when built (before any item is loaded or any worker
starts), and passed whole to every later stage (``feed.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

from kerasfeed import _validation as _v
from kerasfeed._validation import _where
from kerasfeed.cache.options import resolve_cache
from kerasfeed.execution.base import Executor
from kerasfeed.execution.processes.options import PoolOptions
from kerasfeed.loading.arguments import resume_state
from kerasfeed.loading.skips import check_max_skipped
from kerasfeed.sampling.state import ResumeState


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """The arguments a front end shares with every other, checked once.

    Attributes (as the public functions document them):
        batch_size, drop_remainder, padding_values: the batching (``batch_size`` None: items are batches).
        shuffle, seed, order: the order of every pass (``order`` instead of ``shuffle``/``seed``/shards).
        num_shards, shard_index, input_context: as given (None: not given);
            ``shards.py`` resolves them once the source length is known.
        initial_state: where a saved run stopped (``resume`` holds it checked).
        executor: ``"threads"``, ``"processes"``, ``"auto"`` or an ``Executor`` instance.
        workers, worker_init, timeout, retries, worker_max_items, worker_max_rss: the worker
            options (``pool`` holds them checked, with ``seed``; retries and worker limits:
            ``execution/retries.py``).
        max_skipped: items of a pass that may fail (after their retries) and be left out: an int
            count or a float fraction of a pass; 0 (the default) fails fast (``loading/skips.py``).
        probe: leading items (and the last) probed for the structure.
        cache: ``"memory"``, a directory, a ``kerasfeed.Cache`` or None; held as a ``Cache`` (or
            None) once checked (``cache/options.py``).

    Derived (not arguments):
        pool: the ``PoolOptions`` every process executor uses whole.
        resume: the ``ResumeState`` of ``initial_state``.

    Raises:
        TypeError, ValueError: a bad value; the message names the argument
            and ends with what was received.
    """

    # The public function's name (messages of the shard agreement, stats),
    # the prefix of argument messages (None: none), and who takes the items
    # (for executor="auto": "tensorflow" or "numpy").
    api: ClassVar[str] = "kerasfeed"
    owner: ClassVar[Optional[str]] = None
    handover: ClassVar[str] = "tensorflow"

    batch_size: Optional[int] = None
    drop_remainder: bool = False
    padding_values: Any = None
    shuffle: bool = False
    seed: Optional[int] = None
    order: Any = None
    num_shards: Optional[int] = None
    shard_index: Optional[int] = None
    input_context: Any = None
    initial_state: Optional[Mapping[str, int]] = None
    executor: Union[str, Executor] = "threads"
    workers: Optional[int] = None
    worker_init: Optional[Callable[[], None]] = None
    timeout: Optional[float] = None
    retries: int = 0
    max_skipped: Union[int, float] = 0
    worker_max_items: Optional[int] = None
    worker_max_rss: Optional[int] = None
    probe: int = 3
    cache: Any = None
    pool: PoolOptions = dataclasses.field(init=False, repr=False, compare=False)
    resume: ResumeState = dataclasses.field(init=False, repr=False, compare=False)

    def _put(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __post_init__(self):
        # The items' random numbers (item_rng(), the workers' globals) follow seed=, or a given order's own seed.
        item_seed = self.seed if self.seed is not None else order_seed(self.order)
        self._put("pool", PoolOptions(workers=self.workers, worker_init=self.worker_init, seed=item_seed,
                                      timeout=self.timeout, retries=self.retries,
                                      worker_max_items=self.worker_max_items, worker_max_rss=self.worker_max_rss))
        self._put("max_skipped", check_max_skipped(self.max_skipped, self.owner))
        self._check_own()
        owner = self.owner
        self._put("batch_size", _v.positive_int("batch_size", self.batch_size, allow_none=True, owner=owner))
        self._put("drop_remainder", _v.flag("drop_remainder", self.drop_remainder, owner=owner))
        _v.batching_needs_batch_size(
            self.batch_size, owner=owner, drop_remainder=self.drop_remainder, padding_values=self.padding_values
        )
        self._put("probe", _v.positive_int("probe", self.probe, owner=owner))
        self._put("cache", resolve_cache(self.cache, owner))
        self._put("shuffle", _v.flag("shuffle", self.shuffle, owner=owner))
        self._put("resume", resume_state(self.initial_state))
        if self.max_skipped and self.batch_size == 1:
            raise ValueError(
                f"{_where(owner)}`max_skipped` with `batch_size=1` would leave every skipped item's batch empty, and a "
                "batch of no samples cannot be trained on: use batch_size=None (each item a batch; a skipped one is "
                "left out of the pass) or a larger batch_size. "
                f"Received: max_skipped={self.max_skipped!r}, batch_size=1"
            )

    def _check_own(self) -> None:
        """The front end's own arguments, checked after the worker options
        and before the shared ones (a subclass's hook)."""


def order_seed(order: Any) -> Optional[int]:
    """The seed an ``order=`` was given (``IndexOrder``, ``BalancedOrder``, ``WeightedOrder``; None: it drew its
    own, or says nothing): with ``order=`` a pipeline takes no ``seed=``, and ``item_rng()`` would draw anew
    every run, so augmentation under a seeded order was not reproducible."""
    seed = getattr(order, "seed", None)
    if getattr(order, "seed_drawn", True) or not isinstance(seed, int) or isinstance(seed, bool):
        return None
    return seed


__all__ = ["LoadOptions", "order_seed"]
