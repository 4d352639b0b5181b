"""The stage every front end starts with: a source, its passes and its executor (TF-free).

``open_feed`` resolves, in this order, what an endless source cannot do, the shards (the front
end's own way), the passes and the executor. The front end then probes items (``Feed.probe``) and
builds the pass pipeline (``Feed.pipeline``) its assembly drives: a ``tf.data`` graph for
``to_dataset``, plain Python for ``to_loader``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from kerasfeed.cache.options import open_store
from kerasfeed.execution.base import OUTSIDE_PASSES, Executor
from kerasfeed.execution.cache_front import CacheFront
from kerasfeed.execution.cached_items import ItemCache
from kerasfeed.execution.cached_split import check_split
from kerasfeed.execution.factory import make_executor
from kerasfeed.loading.arguments import Passes, resolve_passes
from kerasfeed.loading.endless import EndlessPipeline, check_endless_arguments
from kerasfeed.loading.host_batches import EqualItemBatches, equal_probed_batches
from kerasfeed.loading.hosts import job_member
from kerasfeed.loading.options import LoadOptions
from kerasfeed.loading.pipeline import PassPipeline, probe_indices
from kerasfeed.loading.shards import ShardPlan, order_shards, shard_probe_indices
from kerasfeed.loading.skips import SkipBudget, logger, skippable
from kerasfeed.sampling.views import pass_view
from kerasfeed.sources.base import check_shardable
from kerasfeed.sources.item_random import ItemSeeds

# The length an endless source counts as when shards are resolved: items for any number of workers.
ENDLESS = 2**62

# Items tried in place of a probed item that fails, with max_skipped.
PROBE_TRIES = 8

# How a front end resolves its shards: (options, source length) -> ShardPlan (``shards.cluster_shards``,
# ``shards.given_shards`` or ``hosts.process_shard_plan(processes)``).
ShardResolver = Callable[[LoadOptions, int], ShardPlan]


class Feed:
    """One front end's source, shards, passes and executor, resolved once.

    Attributes:
        source: the indexable source.
        total: its number of items (None: endless).
        options: the front end's options object.
        shards: the shards this pipeline reads.
        passes: its order and batch counts (``arguments.Passes``).
        executor: where ``source[i]`` runs.
        item_batch_size: with items that are whole batches read by one of
            several processes that each read their own shard
            (``ShardPlan.equal_batches``), the leading size per leaf that
            every item must have, from the probes; else None.
    """

    def __init__(self, source: Any, total: Optional[int], options: LoadOptions, shards: ShardPlan, passes: Passes,
                 executor: Executor):
        self.source = source
        self.total = total
        self.options = options
        self.shards = shards
        self.passes = passes
        self.executor = executor
        self.item_batch_size: Optional[tuple] = None
        self._probed: Any = None  # the first probed index, for messages

    @property
    def endless(self) -> bool:
        return self.total is None

    @property
    def owns_executor(self) -> bool:
        """Made here (not an ``Executor`` the caller passed): closed by its owner."""
        return self.executor is not self.options.executor

    def probe_indices(self) -> list[int]:
        """The items this pipeline probes: its own first items when it reads
        one shard of several (no worker makes another worker's items), the
        leading and last items otherwise."""
        probe, shards = self.options.probe, self.shards
        if self.endless:
            return list(range(shards.shard_index, shards.shard_index + probe * shards.num_shards, shards.num_shards))
        if (shards.order is None and shards.num_shards > 1) or order_shards(shards.order) > 1:  # or a sharded order
            passes = self.passes
            return shard_probe_indices(passes.order, self.total, probe, passes.resume.epoch, passes.skip,
                                       batches=self.options.batch_size is None)
        return probe_indices(self.total, probe)

    def probe(self, at: Any) -> list:
        """``[(i, source[i]), ...]`` for ``i`` in ``at``, made by the executor.

        Raises:
            ValueError: items that are whole batches of different sizes
                where several processes' batches make one step
                (``host_batches.equal_probed_batches``).
        """
        if self.options.max_skipped:
            probes = [self._probe_around(i) for i in at]
        else:
            probes = [(i, self.executor.load(i, 0)) for i in at]
        why = self.shards.equal_batches
        if why and self.options.batch_size is None and probes:
            self.item_batch_size = equal_probed_batches(probes, why, self.options.api)
            self._probed = probes[0][0]
        return probes

    def _probe_around(self, i: int) -> tuple:
        """``(j, source[j])`` for ``i`` or, with ``max_skipped``, the nearest of the
        next items (the previous ones for the last) when it fails as an item may:
        a corrupt item among the probed must not keep a long run from starting."""
        last = self.total is not None and i == self.total - 1
        step = self.shards.num_shards if self.endless else 1
        failed = None
        for k in range(PROBE_TRIES):
            j = i - k * step if last else i + k * step
            if j < 0 or (self.total is not None and j >= self.total):
                break
            try:
                return j, self.executor.load(j, 0)
            except Exception as e:
                if not skippable(e, j):
                    raise
                failed = failed or e
                self.executor.item_skipped(j, OUTSIDE_PASSES)  # the pool starts again; pass 0 makes j again
                logger.warning("kerasfeed: probing item %d failed (%s); max_skipped is set, so item %d is probed "
                               "instead.", j, e, j - step if last else j + step)
        raise failed

    def pipeline(self, checker: Any) -> PassPipeline:
        """The pass pipeline the front end drives (``EndlessPipeline`` for an endless source).

        Args:
            checker: turns an item into its flat arrays (``flat_arrays``),
                refusing one that does not fit.
        """
        passes, shards, options = self.passes, self.shards, self.options
        if self.item_batch_size is not None:  # refuses an item of another size, as it is read
            checker = EqualItemBatches(checker, self.item_batch_size, self._probed, shards.equal_batches, options.api)
        if self.endless:
            pipeline = EndlessPipeline(self.source, self.executor, checker, shards.num_shards, shards.shard_index)
        else:
            # No initial_state given: passes begun under model.fit are its epochs (kerasfeed/_keras_fit.py).
            pipeline = PassPipeline(self.source, passes.order, self.executor, checker, passes.resume.epoch, passes.skip,
                                    follow_keras=options.initial_state is None)
        # What TrainingProgress(order=<this front end>) records: items per batch, and batches per pass.
        pipeline.items_per_batch, pipeline.batches_per_pass = options.batch_size or 1, passes.per_pass
        # Pipelines reading their own shards make one step together (processes, tf.distribute workers).
        pipeline.num_shards = shards.num_shards if shards.order is None else 1
        if pipeline.stats is not None:  # kerasfeed.stats(...): batches/s from items/s
            pipeline.stats.kind, pipeline.stats.items_per_batch = options.api, pipeline.items_per_batch
        if options.max_skipped:  # failed items left out, up to a budget per pass (loading/skips.py)
            pipeline.skips = SkipBudget(options.max_skipped, passes.items, options.batch_size, options.drop_remainder)
            if pipeline.stats is not None:
                pipeline.stats.may_skip = True
            # A resumed pass continues the saved run's count (its position already counts those items).
            pipeline.resume_skipped(passes.resume.epoch, passes.resume.skipped_in(passes.resume.epoch))
        return pipeline

    @contextlib.contextmanager
    def closing_on_error(self) -> Iterator[None]:
        """When the block (the front end) raises: stops the executor if it was made here (no workers
        left behind), then re-raises."""
        try:
            yield
        except BaseException:
            if self.owns_executor:
                self.executor.close()
            raise


def open_feed(source: Any, total: Optional[int], options: LoadOptions, shards: ShardResolver) -> Feed:
    """Resolves the shards, the passes and the executor of one pipeline.

    Args:
        source: the indexable source.
        total: ``source_length(source)`` (None: endless).
        options: the front end's options object, checked.
        shards: the front end's way of resolving shards.

    Raises:
        ValueError: what an endless source cannot do (``shuffle``, ``order``,
            ``initial_state``), bad shards, an order that does not fit, a
            resume state past the end of a pass.
    """
    if total is None:
        check_endless_arguments(source, options.shuffle, options.initial_state, options.order, options.max_skipped)
    plan = shards(options, ENDLESS if total is None else total)
    check_shardable(source, plan.parts, options.api)
    if options.max_skipped and plan.equal_batches:
        raise ValueError(
            f"{options.api}: `max_skipped` cannot be used by {plan.equal_batches}: a step joins every process's "
            "batch, and an item left out on one process would make its batch (or, with batch_size=None, its pass) "
            "differ from the others'. Use retries= to try failing items again instead. "
            f"Received: max_skipped={options.max_skipped!r}"
        )
    passes = resolve_passes(
        total, order=plan.order, shuffle=options.shuffle, seed=options.seed, num_shards=plan.num_shards,
        shard_index=plan.shard_index, batch_size=options.batch_size, drop_remainder=options.drop_remainder,
        resume=options.resume, owner=options.owner,
    )
    if options.cache is not None:
        executor = cached_executor(source, total, options, plan, passes)
    else:
        executor = make_executor(options.executor, source, options.pool, handover=options.handover)
    return Feed(source, total, options, plan, passes, executor)


_PROBED_ITEMS = 8  # a shard's first items that checks and auto's probe may make (its timed calls cycle over them)


def cached_executor(
    source: Any, total: Optional[int], options: LoadOptions, plan: ShardPlan, passes: Optional[Passes] = None
) -> Executor:
    """The executor of a pipeline with ``cache=``: the store opened for ``source``, the executor's
    item calls going through it, and the front that serves the items stored before each pass
    (NOTE [ Serving hits in the consumer ], ``execution/cache_front.py``).

    Raises:
        ValueError: an endless source, or an ``Executor`` instance given (its item calls are its own).
        RuntimeError: a kept cache's directory in use by another run.
    """
    if total is None:
        raise ValueError(
            f"{options.api}: `cache` needs a source with a length (items are stored by index); this one is endless. "
            f"Received: cache={options.cache!r}"
        )
    if isinstance(options.executor, Executor):
        raise ValueError(
            f"{options.api}: `cache` needs an executor kerasfeed makes (its item calls go through the store); pass "
            f"executor='threads', 'processes', 'auto' or 'ray'. Received: executor={options.executor!r}"
        )
    shard = _store_shard(plan)
    store, close = open_store(options.cache, source, total, shard, _sharing_process(shard))
    try:
        item_cache = ItemCache.for_source(source, store)
        item_cache.whole_source = shard == (0, 1)  # a shard's store keeps no item of other shards
        if not item_cache.whole_source and passes is not None and passes.order is not None:
            item_cache.probe_at = pass_view(passes.order, passes.resume.epoch).window(
                passes.skip, passes.skip + _PROBED_ITEMS).tolist()  # its own first items (made in pass 0 anyway)
        # NOTE [ A class's own __getitem__ beside load and augment ]: one item's load, stored (loaded once)
        first = item_cache.probe_at[0] if item_cache.probe_at else 0
        loaded = check_split(source, options.api, first) if item_cache.augment else None
        if loaded is not None:
            item_cache.keep(first, loaded)
        if passes is not None and passes.order is not None:  # for auto: nothing to make in the first pass?
            item_cache.first_pass_stored = store.holds_all(pass_view(passes.order, passes.resume.epoch))
        pool = dataclasses.replace(options.pool, item_cache=item_cache)
        inner = make_executor(options.executor, source, pool, handover=options.handover)
    except BaseException:
        close()
        raise
    first = None if passes is None or passes.order is None else (
        lambda: pass_view(passes.order, passes.resume.epoch))
    return CacheFront(inner, item_cache, source, remote=inner.name == "ray", seeds=ItemSeeds(options.pool.seed),
                      on_close=close, retries=options.pool.retries, first_pass=first)


def _store_shard(plan: ShardPlan) -> tuple:
    """``(index, count)`` of this process's share of a kept cache: the pipeline's shard, else that of the
    order it reads (``plan.order``): one sharded by the user (``IndexOrder(..., num_shards=n, shard_index=k,
    fixed_shards=True)`` on n processes, which the pipeline sees as one shard) or this process's cut of an
    unsharded one (``hosts.py``): each process its own subdirectory. With an order, the plan's own
    shard count is None (the order fixes the shards)."""
    count, index = getattr(plan.order, "num_shards", 1), getattr(plan.order, "shard_index", 0)
    if plan.num_shards in (None, 1) and isinstance(count, int) and isinstance(index, int) and count > 1:
        return index, count
    return (0, 1) if plan.num_shards is None else (plan.shard_index, plan.num_shards)


def _sharing_process(shard: tuple) -> Optional[tuple]:
    """``(index, count)`` of this process among the job's (JAX processes, ``tf.distribute`` workers) when more
    of them than shards read the source, so that some read the same shard (a ``ModelParallel`` mesh whose
    processes each read the whole pass, ``num_shards=1`` on every one): a kept directory then needs the
    process in its name too, as only one process may hold it. None when each process's shard is its own."""
    member = job_member()
    return member if member is not None and member[1] > shard[1] else None


__all__ = ["ENDLESS", "Feed", "ShardResolver", "open_feed"]
