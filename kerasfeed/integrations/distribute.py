"""``kerasfeed.distribute``: ``to_dataset`` for every input pipeline of a ``tf.distribute`` strategy.

This module only wraps the strategy's call; how shards are resolved through the ``input_context`` the
strategy hands to its dataset function, and how the workers check that they agree, is the front end's
(``kerasfeed/loading/shards.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed.observe.api import STATS_ATTR
from kerasfeed.observe.lookup import EXECUTOR_ATTR, PIPELINE_ATTR
from kerasfeed.tfdata.adapter import to_dataset


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
        num_workers`` items). ``kerasfeed.stats`` and ``kerasfeed.executor_of``
        take it as they take a dataset (this process's pipeline).

    Raises:
        TypeError: ``strategy`` is not a ``tf.distribute.Strategy``.
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
    import tensorflow as tf

    if not isinstance(strategy, (tf.distribute.Strategy, tf.compat.v1.distribute.Strategy)):
        raise TypeError(
            "kerasfeed.distribute: `strategy` must be a tf.distribute.Strategy (e.g. "
            "tf.distribute.MirroredStrategy()). "
            f"Received: strategy={strategy!r} of type {type(strategy).__name__}"
        )
    taken = sorted(k for k in ("num_shards", "shard_index", "input_context") if k in to_dataset_kwargs)
    if taken:
        raise ValueError(
            f"kerasfeed.distribute shards by the strategy's input pipelines; do not pass {', '.join(taken)}. "
            f"Received: {', '.join(f'{k}={to_dataset_kwargs[k]!r}' for k in taken)}"
        )
    batch_size = _v.positive_int("batch_size", batch_size, allow_none=True, owner="kerasfeed.distribute")
    replicas = strategy.num_replicas_in_sync
    if batch_size is not None and batch_size % replicas:
        raise ValueError(
            f"kerasfeed.distribute: `batch_size` is the global batch size and must be divisible by the "
            f"{replicas} replicas in sync. Received: batch_size={batch_size}"
        )

    made: list = []

    def dataset_fn(ctx):
        if to_dataset_kwargs.get("order") is not None and ctx.num_input_pipelines > 1:
            # to_dataset's own refusal named shuffle/seed/num_shards the user never passed, and advised the
            # sharded order they had built.
            raise ValueError(
                f"kerasfeed.distribute: `order` with {ctx.num_input_pipelines} input pipelines would hand every "
                "pipeline the same order, which fixes its own shard. Call kerasfeed.to_dataset on each worker with "
                "that worker's sharded order instead (num_shards=<workers>, shard_index=<this worker>), and "
                f"strategy.experimental_distribute_dataset. Received: order={to_dataset_kwargs['order']!r}")
        per_replica = None if batch_size is None else ctx.get_per_replica_batch_size(batch_size)
        made.append(to_dataset(source, batch_size=per_replica, input_context=ctx, **to_dataset_kwargs))
        return made[-1]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    # This process's pipeline, as on a dataset: for kerasfeed.stats(dist) and executor_of(dist) (its close()
    # releases a kept cache's directory: a notebook cell run again), which refused a DistributedDataset.
    if len(made) == 1:
        for attr in (PIPELINE_ATTR, EXECUTOR_ATTR, STATS_ATTR):
            if getattr(made[0], attr, None) is not None:
                setattr(dist, attr, getattr(made[0], attr))
    return dist


__all__ = ["distribute"]
