"""Which shard of every pass a pipeline reads, for every front end.

A pipeline reads one of ``num_shards`` disjoint shards of every pass (``IndexOrder``), by
precedence: an ``input_context`` (a ``tf.distribute.InputContext``, or any object with
``num_input_pipelines`` and ``input_pipeline_id``) or explicit ``num_shards``/``shard_index``
(``shards_from``); else one shard per worker of a multi-worker ``tf.distribute`` cluster
(``current_worker``); else the whole source.

Under ``MultiWorkerMirroredStrategy`` tf.data's auto-sharding finds no file reader in a ``range ->
numpy_function`` pipeline and falls back to sharding by data: every worker would make every item and
throw away the others' (N times the work, silently). So kerasfeed shards its own index space by
worker (``ShardPlan.parts`` tells a tf.data front end to turn auto-sharding off), when the pipeline
is created: its number of steps depends on the shards, and ``tf.distribute``/Keras read it before
the first pass. The workers then check that they agree (``agreement.check_workers``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed.loading.agreement import check_workers
from kerasfeed.sampling.protocol import order_fingerprint, order_shard, order_shards
from kerasfeed.sampling.views import pass_view


def shards_from(
    num_shards: Optional[int], shard_index: Optional[int], input_context: Any, *, owner: Optional[str] = None
) -> tuple[Optional[int], Optional[int]]:
    """``(num_shards, shard_index)`` from an input context or the explicit pair.

    Args:
        num_shards, shard_index: as given (None: not given).
        input_context: None, or an object with ``num_input_pipelines`` and
            ``input_pipeline_id`` (a ``tf.distribute.InputContext``): this
            pipeline reads shard ``input_pipeline_id`` of
            ``num_input_pipelines``.
        owner: the front end's name, for messages.

    Returns:
        The explicit pair, checked, with None where not given (the caller
        picks the default); or the context's pair.

    Raises:
        ValueError: both given, or a bad value.
        TypeError: ``input_context`` lacks those attributes.
    """
    if input_context is None:
        if num_shards is not None:
            num_shards = _v.positive_int("num_shards", num_shards, owner=owner)
        if shard_index is not None:
            shard_index = _v.non_negative_int("shard_index", shard_index, owner=owner)
        return num_shards, shard_index
    if num_shards is not None or shard_index is not None:
        raise ValueError(
            f"{_v._where(owner)}Pass either `input_context` or `num_shards`/`shard_index`, not both. "
            f"Received: num_shards={num_shards}, shard_index={shard_index}, input_context={input_context}"
        )
    try:
        pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
    except AttributeError:
        raise TypeError(
            f"{_v._where(owner)}`input_context` must be a tf.distribute.InputContext (or any object with "
            f"`num_input_pipelines` and `input_pipeline_id`). Received: input_context={input_context!r}"
        ) from None
    pipelines = _v.positive_int("input_context.num_input_pipelines", pipelines, owner=owner)
    pipeline_id = _v.non_negative_int("input_context.input_pipeline_id", pipeline_id, owner=owner)
    if pipeline_id >= pipelines:
        raise ValueError(
            f"{_v._where(owner)}`input_context.input_pipeline_id` must be below `num_input_pipelines`. "
            f"Received: input_pipeline_id={pipeline_id}, num_input_pipelines={pipelines}"
        )
    return pipelines, pipeline_id


# -- who this worker is ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerIdentity:
    """This process in a multi-worker cluster: ``worker_id`` of ``num_workers``.

    ``worker_id`` numbers the chief (if any) first, then the workers, as
    ``tf.distribute.InputContext.input_pipeline_id`` does. ``device`` is this
    worker's CPU as the collective ops name it.
    """

    num_workers: int
    worker_id: int
    task_type: str
    task_id: int

    @property
    def device(self) -> str:
        return f"/job:{self.task_type}/replica:0/task:{self.task_id}/device:CPU:0"


def _identity(jobs: dict, task_type: Optional[str], task_id: Optional[int]) -> Optional[WorkerIdentity]:
    chiefs, workers = jobs.get("chief", 0), jobs.get("worker", 0)
    if task_type not in ("chief", "worker") or task_id is None or chiefs + workers < 2:
        return None
    worker_id = int(task_id) if task_type == "chief" else chiefs + int(task_id)
    return WorkerIdentity(chiefs + workers, worker_id, task_type, int(task_id))


def _strategy_identity(strategy: Any) -> Optional[WorkerIdentity]:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return None
    try:
        spec = resolver.cluster_spec().as_dict()
    except Exception:  # noqa: BLE001 - a resolver that cannot say: not multi-worker
        return None
    jobs = {name: len(tasks) for name, tasks in spec.items()}
    return _identity(jobs, resolver.task_type, resolver.task_id)


def tf_config_worker() -> Optional[WorkerIdentity]:
    """What ``TF_CONFIG`` says this process is, before (or without) a strategy."""
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        jobs = {name: len(tasks) for name, tasks in config.get("cluster", {}).items()}
        task = config.get("task", {})
        return _identity(jobs, task.get("type"), task.get("index"))
    except (ValueError, TypeError, AttributeError):
        return None


def _cluster_identity() -> Optional[WorkerIdentity]:
    # Set when a MultiWorkerMirroredStrategy joined this process to a cluster
    # (``context.enable_collective_ops``); there is no public accessor.
    from tensorflow.python.eager import context

    server_def = getattr(context.context(), "_collective_ops_server_def", None)
    if server_def is None:
        return None
    jobs = {job.name: len(job.tasks) for job in server_def.cluster.job}
    return _identity(jobs, server_def.job_name, server_def.task_index)


def current_worker() -> Optional[WorkerIdentity]:
    """This worker under a multi-worker strategy, or None (one worker).

    The strategy in scope decides when there is one; otherwise the cluster
    that a ``MultiWorkerMirroredStrategy`` created in this process joined (it
    must be created at program start, before other TensorFlow ops, so a
    dataset made afterwards sees it even outside ``strategy.scope()``).
    Without TensorFlow imported there is neither; it is never imported here
    (seconds, and it may not be installed under JAX or PyTorch).
    """
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        # Only MultiWorkerMirroredStrategy runs an input pipeline per worker
        # in this process; a ParameterServerStrategy coordinator does not.
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return _strategy_identity(strategy)
    return _cluster_identity()


# -- the shards of one pipeline -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """The shards one pipeline reads.

    Attributes:
        num_shards, shard_index: the pipeline's shard of every pass. With an
            ``order`` (which fixes its own shards) they are passed back as
            given, for the front end to refuse.
        parts: into how many disjoint parts the items are cut over all the
            pipelines of a run (the order's own shard count with an
            ``order``); above 1 a tf.data front end turns tf.data's
            auto-sharding off.
        order: the order object the pipeline reads: the one given (None:
            none, ``IndexOrder`` from ``shuffle``/``seed``/the shards), or
            this process's cut of it (``hosts.py``).
        equal_batches: set when the pipeline is one of several processes'
            shards whose batches one step joins: who they are, for messages.
            Items that are whole batches must then all have the same leading
            size (``host_batches.EqualItemBatches``).
    """

    num_shards: Optional[int]
    shard_index: Optional[int]
    parts: int
    order: Any = None
    equal_batches: Optional[str] = None


def cluster_shard_index(owner: str, num_shards: int, size: int, index: int, members: str) -> int:
    """The default ``shard_index`` when ``num_shards`` is given without it in
    a cluster of ``size`` processes (``members``: "processes", "workers"):
    this one's own ``index`` when there is one shard per member, 0 for a
    single shard (the whole source). Any other count has no default: shard 0
    on every member would make them all read the same items.

    Raises:
        ValueError: ``num_shards`` is neither 1 nor ``size``.
    """
    if num_shards == 1:
        return 0
    if num_shards == size:
        return index
    member = {"processes": "process", "workers": "worker"}.get(members, members)
    raise ValueError(
        f"{owner}: `num_shards={num_shards}` without `shard_index` in a cluster of {size} {members}: the default "
        f"shard is this {member}'s own only when `num_shards` equals the number of {members} ({size}), and shard 0 "
        f"on every {member} would make them all read the same items. Pass `shard_index` (this {member} is "
        f"{index}), or num_shards={size}. Received: num_shards={num_shards}, shard_index=None, {members}={size}"
    )


def check_context_pipelines(owner: str, length: int, pipelines: int) -> None:
    """Refuses an ``input_context`` with more input pipelines than the
    source has items, in its own words (not the ``IndexOrder``'s it builds)."""
    if pipelines > length:
        raise ValueError(
            f"{owner}: the `input_context` has {pipelines} input pipelines but the source has only {length} items: "
            "every input pipeline (one per worker, or per replica) needs at least one. Use fewer workers or a "
            f"longer source. Received: input_context.num_input_pipelines={pipelines}, len(source)={length}"
        )


def resolve_shards(
    num_shards: Optional[int], shard_index: Optional[int], input_context: Any, length: int, owner: str = "to_dataset"
) -> tuple[int, int, Optional[WorkerIdentity]]:
    """Returns ``(num_shards, shard_index, worker)`` for a pipeline.

    Explicit ``input_context`` or ``num_shards``/``shard_index`` win, else one
    shard per worker of a multi-worker strategy; ``num_shards`` alone gives
    this worker's shard when it equals the workers (``cluster_shard_index``).
    ``worker`` is set whenever this process is in a multi-worker cluster (the
    agreement check then runs).

    Raises:
        ValueError: both ways of sharding given, more workers (or input
            pipelines) than items, or ``num_shards`` without ``shard_index``
            in a cluster of another size.
    """
    worker = current_worker()
    if input_context is not None or num_shards is not None or shard_index is not None:
        num_shards, shard_index = shards_from(num_shards, shard_index, input_context, owner=owner)
        if input_context is not None:
            check_context_pipelines(owner, length, num_shards)
        elif num_shards is not None and shard_index is None and worker is not None:
            shard_index = cluster_shard_index(owner, num_shards, worker.num_workers, worker.worker_id, "workers")
        return 1 if num_shards is None else num_shards, 0 if shard_index is None else shard_index, worker
    if worker is None:
        return 1, 0, None
    if worker.num_workers > length:
        # A stream's shards are its generators or files (from_generators(gen, 1) said "only 1 items").
        unit = {"from_generators": "generators", "from_files": "files"}.get(owner, "items")
        raise ValueError(
            f"{owner}: the multi-worker strategy has {worker.num_workers} workers but the source has only {length} "
            f"{unit}: every worker needs at least one of its own. Use fewer workers or more {unit}. "
            f"Received: {unit}={length}, workers={worker.num_workers}"
        )
    return worker.num_workers, worker.worker_id, worker


def check_shard_pair(api: str, length: int, num_shards: int, shard_index: int, given: bool) -> None:
    """Refuses a shard that does not exist or a pass too short for every shard
    to get an item, in the front end's words (not the order's it builds)."""
    if shard_index >= num_shards:
        default = "" if given else " (the default: `num_shards` not given)"
        raise ValueError(
            f"{api}: `shard_index` must be in [0, {num_shards}) for num_shards={num_shards}{default}. "
            f"Received: shard_index={shard_index}"
        )
    if num_shards > length:
        raise ValueError(
            f"{api}: `num_shards` is more than the source's {length} items: every shard needs at least one. "
            f"Received: num_shards={num_shards}, len(source)={length}"
        )


def plan_shards(
    api: str, length: int, num_shards: Any, shard_index: Any, input_context: Any, order: Any = None, **fields: Any
) -> ShardPlan:
    """Resolves the shards of a pipeline and checks that the workers agree.

    Args:
        api: the public function's name, for messages.
        length: items in the source (any large number for an endless one).
        num_shards, shard_index, input_context: as given to the front end.
        order: an order object given to the front end: it fixes its own
            shards (``num_shards``/``shard_index``/``input_context`` are
            then passed back for the front end to refuse).
        **fields: what else the workers must agree on (seed, batching,
            resume position...), as ints or None.

    Raises:
        ValueError: both ways of sharding given, more workers than items,
            or workers that disagree.
        RuntimeError: the other workers did not create a matching pipeline
            in time.
    """
    if order is not None:
        return _plan_order(api, length, num_shards, shard_index, input_context, order, fields)
    given = num_shards
    try:
        num_shards, shard_index, worker = resolve_shards(num_shards, shard_index, input_context, length, api)
        if input_context is None:  # a context's pair is tf.distribute's
            check_shard_pair(api, length, num_shards, shard_index, given is not None)
    except ValueError:
        _tell_failed(api, given, input_context)
        raise
    # A whole-source pipeline (explicit num_shards=1, e.g. on the chief only)
    # does not involve the other workers.
    if worker is not None and num_shards > 1:
        # Each worker's shard, so that two given the same shard_index by hand are refused (their items twice,
        # another shard's never); a context's pairs are tf.distribute's, and fewer shards than workers are shared.
        one_each = input_context is None and num_shards == worker.num_workers
        pair = {"worker": worker.worker_id, "shard_index": shard_index} if one_each else {}
        check_workers(worker, {"length": length, "num_shards": num_shards, **fields, **pair}, api,
                      shards=("worker", "shard_index") if pair else None)
    return ShardPlan(num_shards, shard_index, num_shards)


def _tell_failed(api: str, num_shards: Any, input_context: Any) -> None:
    """This worker's pipeline failed before the agreement check: the other workers, whose own check of it
    (sharded by default, or by ``num_shards`` above 1) waits for this worker's row, learn it at once instead
    of waiting ``AGREEMENT_TIMEOUT_S`` and blaming the order of creation. Its own error is raised after."""
    worker = current_worker()
    if worker is None or input_context is not None or num_shards == 1:
        return
    try:
        check_workers(worker, None, api)
    except Exception:  # the worker's own error is the one to raise
        logging.getLogger("kerasfeed").debug("kerasfeed: telling the other workers failed", exc_info=True)


def _plan_order(api, length, num_shards, shard_index, input_context, order, fields) -> ShardPlan:
    if input_context is not None:  # for the front end's "not both" message
        num_shards, shard_index = input_context.num_input_pipelines, input_context.input_pipeline_id
    shards = order_shards(order)
    worker = current_worker()
    if worker is not None and shards == 1 and num_shards is None and input_context is None:
        # An order object cannot be re-cut here; say so instead of letting
        # tf.data's DATA fallback make every item on every worker.
        logging.getLogger("kerasfeed").warning(
            "%s: the `order` is not sharded but this is worker %d of %d of a MultiWorkerMirroredStrategy: every "
            "worker will read the whole order. Build it with num_shards=%d, shard_index=%d to read one shard each.",
            api, worker.worker_id, worker.num_workers, worker.num_workers, worker.worker_id,
        )
    if worker is not None and shards > 1:
        facts = {"length": length, "num_shards": shards, **fields, "order": order_fingerprint(order),
                 "worker": worker.worker_id, "order shard_index": order_shard(order)}
        check_workers(worker, facts, api, shards=("worker", "order shard_index"))
    return ShardPlan(num_shards, shard_index, shards, order)


def cluster_shards(options: Any, length: int) -> ShardPlan:
    """``to_dataset``'s shards: as given, else one per worker of a ``tf.distribute`` cluster, whose
    workers then check that they agree on the source length, seed, shuffle, batching and resume position.

    Args:
        options: the front end's ``LoadOptions``.
        length: items in the source (``feed.ENDLESS`` for an endless one).
    """
    resume = options.resume
    plan = plan_shards(
        options.api, length, options.num_shards, options.shard_index, options.input_context, order=options.order,
        seed=options.seed, shuffle=options.shuffle, batch_size=options.batch_size,
        drop_remainder=options.drop_remainder, epoch=resume.epoch, batches=resume.batches,
    )
    worker = current_worker() if options.input_context is None and resume.batches else None
    if worker is not None and plan.num_shards > 1 and options.api == "to_dataset":
        # Wrapped in strategy.experimental_distribute_dataset, each of these batches is split over the replicas:
        # W steps a batch. A TrainingProgress state counts steps, so passed here it resumed W times too far,
        # skipping data in silence (or was refused as past the pass).
        logging.getLogger("kerasfeed").warning(
            "to_dataset: initial_state resumes after %d of this dataset's batches of batch_size=%s. Under "
            "strategy.experimental_distribute_dataset a step takes 1/%d of such a batch from each worker, and a "
            "TrainingProgress state counts steps: passed here it resumes %d times too far. Pass it to "
            "kerasfeed.distribute instead, whose batches are steps (docs/multiworker.md, Exact resume across workers).",
            resume.batches, options.batch_size, worker.num_workers, worker.num_workers)
    return plan


def given_shards(options: Any, length: int, cluster: Any = None) -> ShardPlan:
    """``to_loader``'s shards: those given (``num_shards``/``shard_index``
    or ``input_context``), else this process's among JAX processes (``cluster``) or
    ``tf.distribute`` workers (``cluster_shards``, when TensorFlow is imported), else the whole source.

    Args:
        options: the front end's ``LoadOptions``.
        length: items in the source.
        cluster: the JAX processes this one belongs to
            (``hosts.ProcessShards``: ``num_processes``, ``process_index``,
            ``source``), or None. ``num_shards`` alone then reads this
            process's shard (``cluster_shard_index``), and a loader that
            reads one of several shards needs items of one batch size
            (``ShardPlan.equal_batches``).
    """
    if cluster is None and current_worker() is not None:
        # A tf.distribute worker (a custom loop): its shard, as ``to_dataset``'s, not the whole source everywhere.
        return cluster_shards(options, length)
    order, context = options.order, options.input_context
    num_shards, shard_index = shards_from(options.num_shards, options.shard_index, context, owner=options.owner)
    if cluster is not None and num_shards is not None and shard_index is None and order is None and context is None:
        shard_index = cluster_shard_index(options.api, num_shards, cluster.num_processes, cluster.process_index,
                                          "processes")
    given, num_shards, shard_index = num_shards is not None, num_shards or 1, shard_index or 0
    if order is None and context is None:
        check_shard_pair(options.api, length, num_shards, shard_index, given)
    elif order is None:
        check_context_pipelines(options.api, length, num_shards)
    together = joined_shards(cluster, max(num_shards, order_shards(order)))
    return ShardPlan(num_shards, shard_index, num_shards, order, together)


def joined_shards(cluster: Any, parts: int) -> Optional[str]:
    """``ShardPlan.equal_batches``: who reads the shards a step joins, when
    several processes (``hosts.ProcessShards``, or None) read ``parts > 1``."""
    if cluster is None or cluster.num_processes <= 1 or parts <= 1:
        return None
    return f"the {cluster.num_processes} processes of the {cluster.source}, each reading its own shard"


def shard_probe_indices(order: Any, length: int, probe: int, epoch: int, skip: int, *, batches: bool) -> list[int]:
    """The items a sharded pipeline probes for its signature: its own first items (of its first
    pass, after the ``skip`` a resumed pass leaves out: items it makes anyway), so that no worker
    makes another worker's items; plus the source's last item when items are batches (a short last
    batch may land in any shard in a later pass, so every worker must see its shape)."""
    own = pass_view(order, epoch).window(skip, skip + probe).tolist()
    if batches:
        own.append(length - 1)
    return sorted(set(int(i) for i in own))


__all__ = [
    "ShardPlan", "WorkerIdentity", "check_context_pipelines", "cluster_shard_index", "cluster_shards", "current_worker",
    "given_shards", "joined_shards", "order_shards", "plan_shards", "resolve_shards", "shard_probe_indices",
    "shards_from", "tf_config_worker",
]
