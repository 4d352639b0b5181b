"""Multi-worker training: each ``tf.distribute`` worker reads only its own shard.

Under ``tf.distribute.MultiWorkerMirroredStrategy`` every worker runs its own
input pipeline. tf.data's default auto-sharding cannot find a file reader in
a ``range -> numpy_function`` pipeline and falls back to sharding by data:
every worker would make every item and throw away the others' (N times the
work, silently). kerasfeed therefore shards its own index space by worker and
turns tf.data's auto-sharding off for its pipelines.

Who this worker is comes from the strategy in scope, or else from the
multi-worker cluster the process joined (a ``MultiWorkerMirroredStrategy``
must be created at program start, before other TensorFlow ops, so a dataset
made afterwards sees it even outside ``strategy.scope()``). The choice is made
when the dataset is created because its number of steps depends on it and
``tf.distribute``/Keras read that number before the first pass.

Workers check that they agree (source length, seed, shard count, batching,
resume state) by all-gathering a few int64s through the cluster's collective
ops when the dataset is created: a mismatch fails on every worker with a
message naming what differs, and a worker that never joins fails after
``AGREEMENT_TIMEOUT_S`` instead of hanging.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading
from typing import Any, Optional

from kerasfeed import _validation as _v

# Collective group of the agreement check; far above the keys tf.distribute
# allocates for its own groups (they count up from 1).
_GROUP_KEY = 0x6B660000
_instance_keys = itertools.count(1)
_instance_lock = threading.Lock()
AGREEMENT_TIMEOUT_S = 120.0


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


def _tf_config_identity() -> Optional[WorkerIdentity]:
    # What TF_CONFIG says this process is, before (or without) a strategy.
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
    that a ``MultiWorkerMirroredStrategy`` created in this process joined.
    """
    import tensorflow as tf

    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        # Only MultiWorkerMirroredStrategy runs an input pipeline per worker
        # in this process; a ParameterServerStrategy coordinator does not.
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return _strategy_identity(strategy)
    return _cluster_identity()


def resolve_shards(
    num_shards: Optional[int], shard_index: Optional[int], input_context: Any, length: int
) -> tuple[int, int, Optional[WorkerIdentity]]:
    """Returns ``(num_shards, shard_index, worker)`` for a pipeline.

    Explicit ``input_context`` or ``num_shards``/``shard_index`` win; with
    neither, a multi-worker strategy gives one shard per worker. ``worker`` is
    set whenever this process is part of a multi-worker cluster (the
    agreement check then runs).

    Raises:
        ValueError: both ways of sharding given, or more workers than items.
    """
    worker = current_worker()
    if input_context is not None or num_shards is not None or shard_index is not None:
        from kerasfeed.loading.arguments import shards_from  # the same reading as to_loader's

        num_shards, shard_index = shards_from(num_shards, shard_index, input_context)
        return 1 if num_shards is None else num_shards, 0 if shard_index is None else shard_index, worker
    if worker is None:
        return 1, 0, None
    if worker.num_workers > length:
        raise ValueError(
            f"The multi-worker strategy has {worker.num_workers} workers but the source has only {length} "
            "items: every worker needs at least one item of its own. Use fewer workers or a longer source. "
            f"Received: len(source)={length}, workers={worker.num_workers}"
        )
    return worker.num_workers, worker.worker_id, worker


def shard_options(num_shards: int):
    """tf.data options turning auto-sharding off when kerasfeed shards itself."""
    import tensorflow as tf

    options = tf.data.Options()
    if num_shards > 1:
        # kerasfeed already gave this worker its own items; tf.data's DATA
        # fallback would make every item on every worker and drop most.
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


def _split_seed(seed: Optional[int]) -> tuple[int, int]:
    if seed is None:
        return -1, -1
    return int(seed) >> 32, int(seed) & 0xFFFFFFFF


def fingerprint(**fields: Any) -> dict:
    """``{name: int}``: what every worker's pipeline must agree on.

    ``seed`` is split in two int64s; None values become -1.
    """
    out = {}
    for name, value in fields.items():
        if name == "seed":
            out["seed (high 32 bits)"], out["seed (low 32 bits)"] = _split_seed(value)
        else:
            out[name] = -1 if value is None else int(value)
    return out


def check_agreement(worker: WorkerIdentity, fields: dict, api: str, timeout: Optional[float] = None) -> None:
    """All-gathers ``fields`` over the cluster; raises if workers disagree.

    Every worker must create its sharded pipelines in the same order (each
    creation is one collective instance); whole-source ones (``num_shards=1``)
    are not checked.

    Raises:
        ValueError: some field differs between workers (names the field and
            every worker's value).
        RuntimeError: not every worker created a matching pipeline within
            ``timeout`` seconds (default ``AGREEMENT_TIMEOUT_S``), or the
            exchange failed.
    """
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    timeout = AGREEMENT_TIMEOUT_S if timeout is None else timeout
    names = list(fields)
    values = tf.constant([[fields[n] for n in names]], tf.int64)
    with _instance_lock:
        instance = next(_instance_keys)
    try:
        with tf.device(worker.device):
            gathered = collective_ops.all_gather_v2(
                values, group_size=worker.num_workers, group_key=_GROUP_KEY, instance_key=instance, timeout=timeout
            )
        table = np.asarray(gathered.numpy())
    except tf.errors.OpError as e:  # timed out, or a peer left: never a hang
        raise RuntimeError(
            f"{api}: worker {worker.worker_id} of {worker.num_workers} waited {timeout:.0f} s for the other workers "
            "to create the same pipeline (the check that they agree on source length, seed and shards). Every worker "
            "must create its sharded kerasfeed datasets in the same order; for a dataset on one worker only, pass "
            "`num_shards=1`. "
            f"Received: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None
    if table.shape != (worker.num_workers, len(names)):
        raise RuntimeError(f"{api}: the agreement check got a table of shape {table.shape}. Received: {table!r}")
    differ = [j for j in range(len(names)) if len(set(table[:, j].tolist())) > 1]
    if differ:
        lines = []
        for j in differ:
            per = ", ".join(f"worker {k}: {int(v)}" for k, v in enumerate(table[:, j]))
            lines.append(f"{names[j]} ({per})")
        raise ValueError(
            f"{api}: the workers disagree on {', '.join(names[j] for j in differ)}. Every worker must build its "
            "pipeline from the same source (same length), the same seed, shard count and batching, and resume "
            f"from the same state; otherwise shards overlap or step counts differ. Received: {'; '.join(lines)}"
        )


def prepare(api: str, length: int, num_shards, shard_index, input_context, order: Any = None, **fields) -> tuple:
    """Resolves the shards of a pipeline and checks that the workers agree.

    Args:
        order: an order object given to the front end: it fixes its own
            shards (``num_shards``/``shard_index``/``input_context`` are
            then passed back for the front end to refuse).

    Returns:
        ``(num_shards, shard_index, tf.data.Options)``: the options turn
        tf.data's auto-sharding off when the pipeline is sharded.
    """
    if order is not None:
        return _prepare_order(api, length, num_shards, shard_index, input_context, order, fields)
    num_shards, shard_index, worker = resolve_shards(num_shards, shard_index, input_context, length)
    # A whole-source pipeline (explicit num_shards=1, e.g. on the chief only)
    # does not involve the other workers.
    if worker is not None and num_shards > 1:
        check_agreement(worker, fingerprint(length=length, num_shards=num_shards, **fields), api)
    return num_shards, shard_index, shard_options(num_shards)


def _prepare_order(api, length, num_shards, shard_index, input_context, order, fields) -> tuple:
    if input_context is not None:  # for the front end's "not both" message
        num_shards, shard_index = input_context.num_input_pipelines, input_context.input_pipeline_id
    shards = getattr(order, "num_shards", 1)
    shards = shards if isinstance(shards, int) and shards > 0 else 1
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
        import hashlib

        from kerasfeed.sampling.protocol import order_fingerprint

        digest = hashlib.blake2b(order_fingerprint(order).encode(), digest_size=7).digest()
        fields = {**fields, "order": int.from_bytes(digest, "big")}
        check_agreement(worker, fingerprint(length=length, num_shards=shards, **fields), api)
    return num_shards, shard_index, shard_options(shards)


def worker_run_dir(log_dir: "str | os.PathLike") -> str:
    """``log_dir/worker_<k>``: this worker's own TensorBoard run directory.

    ``k`` is the worker's index in a multi-worker cluster (the chief, if any,
    is 0), and 0 for a single worker. Two summary writers must never share a
    run directory, so every worker writes under its own.

    Example:

    ```python
    import kerasfeed
    kerasfeed.worker_run_dir("logs")  # 'logs/worker_0' outside a cluster
    ```
    """
    worker = current_worker() or _tf_config_identity()
    return os.path.join(os.fspath(log_dir), f"worker_{0 if worker is None else worker.worker_id}")


def distribute(strategy: Any, source: Any, *, batch_size: Optional[int] = None, **to_dataset_kwargs: Any):
    """``to_dataset`` for every input pipeline of ``strategy``, in one call.

    Wraps ``strategy.distribute_datasets_from_function``: each input pipeline
    (one per worker under ``MultiWorkerMirroredStrategy``) gets a
    ``to_dataset`` over its own disjoint shard of every pass, and every
    element it yields is one replica's batch.

    Args:
        strategy: a ``tf.distribute.Strategy`` (``MultiWorkerMirroredStrategy``,
            ``MirroredStrategy``, ...).
        source: an indexable source, as for ``to_dataset``.
        batch_size: the **global** batch size (summed over all replicas of all
            workers) when items are samples; each replica gets
            ``batch_size // strategy.num_replicas_in_sync`` samples per step
            (it must divide). None: items are already batches, and each item
            is one replica's batch.
        **to_dataset_kwargs: any other argument of ``to_dataset`` (``shuffle``,
            ``seed``, ``executor``, ``workers``, ``drop_remainder``,
            ``initial_state``, ...). Not ``num_shards``, ``shard_index`` or
            ``input_context``: the strategy decides them.

    Returns:
        A ``tf.distribute.DistributedDataset`` to iterate in a custom loop
        (``strategy.run(step, args=(batch,))``). Every worker takes the same
        number of steps per pass (shards are cut to ``len(source) //
        num_workers`` items).

    Raises:
        ValueError: ``batch_size`` not divisible by the number of replicas, a
            sharding argument given, more workers than items, or workers that
            disagree on the source length, seed or batching.

    Example:

    ```python
    import numpy as np
    import tensorflow as tf
    import kerasfeed

    class Samples:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return np.full(3, i, np.float32), np.float32(i)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    dist = kerasfeed.distribute(strategy, Samples(), batch_size=16, shuffle=True, seed=0)
    for x, y in dist:
        strategy.run(lambda x, y: tf.reduce_sum(x), args=(x, y))
    ```
    """
    taken = sorted(k for k in ("num_shards", "shard_index", "input_context") if k in to_dataset_kwargs)
    if taken:
        raise ValueError(
            f"kerasfeed.distribute shards by the strategy's input pipelines; do not pass {', '.join(taken)}. "
            f"Received: {', '.join(f'{k}={to_dataset_kwargs[k]!r}' for k in taken)}"
        )
    from kerasfeed.tfdata.adapter import to_dataset

    batch_size = _v.positive_int("batch_size", batch_size, allow_none=True, owner="kerasfeed.distribute")
    replicas = strategy.num_replicas_in_sync
    if batch_size is not None and batch_size % replicas:
        raise ValueError(
            f"kerasfeed.distribute: `batch_size` is the global batch size and must be divisible by the "
            f"{replicas} replicas in sync. Received: batch_size={batch_size}"
        )

    def dataset_fn(ctx):
        per_replica = None if batch_size is None else ctx.get_per_replica_batch_size(batch_size)
        return to_dataset(source, batch_size=per_replica, input_context=ctx, **to_dataset_kwargs)

    return strategy.distribute_datasets_from_function(dataset_fn)


def shard_probe_indices(order: Any, length: int, probe: int, epoch: int, skip: int, *, batches: bool) -> list[int]:
    """The items a sharded pipeline probes for its signature.

    Its own first items (of its first pass, after the ``skip`` a resumed pass
    leaves out: items it makes anyway), so that no worker makes another
    worker's items; plus the source's last item when items are batches (a
    short last batch may land in any shard in a later pass, so every worker
    must see its shape).
    """
    own = order.indices(epoch)[skip : skip + probe].tolist()
    if batches:
        own.append(length - 1)
    return sorted(set(int(i) for i in own))


__all__ = ["WorkerIdentity", "current_worker", "distribute", "worker_run_dir", "check_agreement", "resolve_shards"]
