"""``to_dataset``: any indexable source as a real ``tf.data.Dataset``."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import tensorflow as tf

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE
from kerasfeed.execution.base import Executor
from kerasfeed.execution.factory import make_executor
from kerasfeed.execution.processes.options import PoolOptions
from kerasfeed.loading.arguments import resolve_passes, resume_state
from kerasfeed.loading.endless import EndlessPipeline, check_endless_arguments
from kerasfeed.loading.groups import GroupLoader, RunLoader
from kerasfeed.loading.pipeline import PassPipeline, probe_indices, weak_method
from kerasfeed.loading.shards import plan_shards, shard_probe_indices
from kerasfeed.sources.base import source_length
from kerasfeed.tfdata.grouped import group_size, grouped_items, open_leading, run_items, uniform_leading
from kerasfeed.tfdata.inline_map import graph_fn, inline_map
from kerasfeed.tfdata.structure import (
    ItemChecker,
    flatten,
    infer_signature,
    normalize_signature,
    open_leading_dimension,
)
from kerasfeed.tfdata.tail import TailOptions, own_sharding

# The length an endless source counts as when shards are resolved: items for
# any number of workers.
_ENDLESS = 2**62

def to_dataset(
    source: Any,
    *,
    batch_size: Optional[int] = None,
    shuffle: bool = False,
    seed: Optional[int] = None,
    executor: Union[str, Executor] = "threads",
    workers: Optional[int] = None,
    worker_init: Optional[Callable[[], None]] = None,
    num_parallel_calls: Optional[int] = None,
    prefetch: Optional[int] = AUTOTUNE,
    device: Optional[str] = None,
    drop_remainder: bool = False,
    output_signature: Any = None,
    ragged: bool = False,
    padding_values: Any = None,
    probe: int = 3,
    num_shards: Optional[int] = None,
    shard_index: Optional[int] = None,
    input_context: Optional[tf.distribute.InputContext] = None,
    initial_state: Optional[Mapping[str, int]] = None,
    order: Any = None,
    group_items: Optional[int] = None,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    """Turns an indexable source into a ``tf.data.Dataset``.

    Item ``i`` is ``source[i]``, run by ``executor`` and fed into tf.data by a
    ``tf.numpy_function`` map that keeps index order. The executor gets each
    pass's order when the pass starts and makes items ahead (on its threads or
    worker processes), so the map itself runs sequentially. Every pass over
    the returned dataset (every epoch of ``model.fit``) reads all items once,
    calls ``set_epoch``/``on_epoch_begin``/``on_epoch_end`` on the source when
    it has them, and, with ``shuffle=True``, uses a new permutation drawn from
    ``(seed, pass number)``.

    Args:
        source: an object with ``__len__`` and ``__getitem__``, such as a
            ``kerasfeed.SceneSequence`` or ``keras.utils.PyDataset``.
        batch_size: None when items are already batches (the Keras
            convention); an int to treat items as samples and batch them.
        shuffle: read items in a new seeded random order every pass.
        seed: seed of the shuffle; the same seed gives the same sequence of
            per-pass orders.
        executor: ``"threads"``, ``"processes"``, ``"auto"`` or an
            ``Executor`` instance: where ``source[i]`` runs.
        workers: number of worker processes (process executors only).
        worker_init: called once in each worker process (process executors).
        num_parallel_calls: None (the default): the executor makes items
            ahead (64 in flight for threads, 2 per worker process) and the map
            is sequential. An int or ``tf.data.AUTOTUNE``: a parallel,
            deterministic map with that many calls in flight instead
            (AUTOTUNE also keeps tf.data's autotuning model on).
        prefetch: elements prefetched at the end; 0 disables.
        device: e.g. ``"/gpu:0"``: prefetch onto that device as the last step.
        drop_remainder: with ``batch_size``, drop the last short batch.
        output_signature: a nest of ``tf.TensorSpec`` describing one item;
            inferred by probing items when None.
        ragged: with ``batch_size``, batch variable-shape samples into ragged
            tensors instead of zero-padding them.
        padding_values: passed to ``padded_batch`` for variable shapes.
        probe: number of leading items probed (the last item is probed too)
            to infer the signature; dimensions that differ become None.
        num_shards: split every pass into this many disjoint, equal shards
            (see ``IndexOrder``); this dataset yields shard ``shard_index``.
            None (with ``shard_index=None``): one shard per worker when the
            dataset is created under a multi-worker strategy (in its scope,
            or in a process that created a ``MultiWorkerMirroredStrategy``;
            tf.data's auto-sharding is then turned off for this pipeline),
            otherwise the whole source.
        shard_index: the shard this dataset yields (None: 0, or this
            worker's under a multi-worker strategy).
        input_context: a ``tf.distribute.InputContext`` (as given to the
            function of ``strategy.distribute_datasets_from_function``); sets
            ``num_shards``/``shard_index`` to its input pipelines.
        initial_state: ``{"epoch": e, "batches": b}`` (from
            ``TrainingProgress.state()``): the first pass is pass ``e`` and
            starts after its first ``b`` elements, exactly where the saved run
            stopped; later passes are whole. Use the same source, seed,
            batch size and shards as the saved run, and
            ``model.fit(..., initial_epoch=e)``. A state that carries an
            order fingerprint (``TrainingProgress(order=...)``) is refused
            with a different order.
        order: the index order of every pass instead of
            ``shuffle``/``seed``/``num_shards``/``shard_index``: any object
            with ``shard_length`` and ``indices(epoch)``, such as
            ``kerasfeed.BalancedOrder`` or ``kerasfeed.WeightedOrder`` (see
            ``kerasfeed.sampling.protocol``). Indices may repeat.
        group_items: items handed to tf.data per Python call. None (the
            default): up to 64 small items (at most 64 KB each, 1 MB per
            call, every dimension but the leading batch one fixed) when the
            executor makes items ahead, else 1. Batches of one size (a short
            one anywhere is fine) are stacked into dense runs; batches whose
            size varies throughout are concatenated and split back as ragged
            rows. Each call costs the
            consumer process ~0.3 ms of CPU and a GIL hand-off whatever the
            item's size, which ``model.fit``'s own Python competes for;
            grouping spreads that over the group (see
            ``docs/performance.md``). 1 turns it off. An item error inside a
            group surfaces at the item's own position (for batches of varying
            size, an error in a pass's last group drops the items before it
            in that group).

        timeout: seconds one item may take, counted from when its thread or
            worker process is ready to run it (start-up and ``worker_init``
            are not counted); the pass then fails (``TimeoutError`` from
            threads, ``kerasfeed.WorkerError`` from a worker, which is
            killed). None (the default) waits as long as the worker lives.
            Ignored when ``executor`` is an ``Executor`` instance.

    Returns:
        A ``tf.data.Dataset`` with known cardinality. Its executor is
        available as ``dataset._kerasfeed_executor``.

    Raises:
        TypeError, ValueError: a non-indexable or empty source, or bad
            arguments.
        kerasfeed.ItemError: ``source[i]`` raised while probing. During
            iteration TensorFlow re-raises it as ``tf.errors.UnknownError``
            carrying the same message (index, type, message, traceback).
        kerasfeed.SignatureError: an item does not fit the signature.

    Example:

    ```python
    import numpy as np
    import kerasfeed

    class Points(kerasfeed.SceneSequence):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.random.rand(4, 3).astype("float32"), np.int64(i % 2)

    ds = kerasfeed.to_dataset(Points(), batch_size=4, shuffle=True, seed=0)
    for x, y in ds:
        print(x.shape, y.shape)  # (4, 4, 3) (4,) ... then (2, 4, 3) (2,)
    ```
    """
    total = source_length(source, allow_infinite=True, owner="to_dataset")
    endless = total is None  # num_batches is None: one endless pass per iterator
    # Built (and checked) once here, used whole by every process executor.
    pool_options = PoolOptions(workers=workers, worker_init=worker_init, seed=seed, timeout=timeout)
    tail = TailOptions(
        batch_size=batch_size,
        drop_remainder=drop_remainder,
        ragged=ragged,
        padding_values=padding_values,
        prefetch=prefetch,
        device=device,
    )
    _v.positive_int("num_parallel_calls", num_parallel_calls, allow_none=True, allow_autotune=True)
    _v.positive_int("probe", probe)
    _v.positive_int("group_items", group_items, allow_none=True)
    _v.flag("shuffle", shuffle)
    resume = resume_state(initial_state)
    if endless:
        check_endless_arguments(source, shuffle, initial_state, order)
    # One shard per worker under a multi-worker strategy unless told otherwise
    # (an `order` fixes its own shards); the workers check that they agree
    # (see loading/shards.py). An endless source has items for any number of
    # workers.
    shards = plan_shards(
        "to_dataset", _ENDLESS if endless else total, num_shards, shard_index, input_context, order=order, seed=seed,
        shuffle=shuffle, batch_size=batch_size, drop_remainder=drop_remainder, epoch=resume.epoch,
        batches=resume.batches,
    )
    num_shards, shard_index = shards.num_shards, shards.shard_index
    sharded = order is None and num_shards > 1 and not endless  # this pipeline reads one shard of an IndexOrder
    passes = resolve_passes(
        None if endless else total, order=order, shuffle=shuffle, seed=seed, num_shards=num_shards,
        shard_index=shard_index, batch_size=batch_size, drop_remainder=drop_remainder, resume=resume,
    )
    order, n, per_pass, skip = passes.order, passes.items, passes.per_pass, passes.skip

    ex = make_executor(executor, source, pool_options)
    probes: list = []
    try:
        if output_signature is None:
            if endless:
                at = range(shard_index, shard_index + probe * num_shards, num_shards)
            elif sharded:
                at = shard_probe_indices(
                    order, total, probe, resume.epoch, skip, batches=batch_size is None
                )
            else:
                at = probe_indices(total, probe)
            probes = [(i, ex.load(i, 0)) for i in at]
            signature = infer_signature(probes)
            if batch_size is None:
                # Items are batches: their size may vary anywhere (a short
                # batch mid-pass), as under Keras, which keeps it open too.
                signature = open_leading_dimension(signature)
        else:
            signature = normalize_signature(output_signature)
    except BaseException:
        if ex is not executor:  # ours: do not leave workers behind
            ex.close()
        raise
    checker = ItemChecker(signature)
    if endless:
        pipeline = EndlessPipeline(source, ex, checker, num_shards, shard_index)
    else:
        pipeline = PassPipeline(source, order, ex, checker, resume.epoch, skip)
    if pipeline.stats is not None:  # kerasfeed.stats(ds): batches/s from items/s
        pipeline.stats.kind, pipeline.stats.items_per_batch = "to_dataset", batch_size or 1
    begin, load = weak_method(pipeline, "begin"), weak_method(pipeline, "load")
    flat_specs = checker.specs
    out_types = [s.dtype for s in flat_specs]

    @graph_fn
    def index_stream(_):
        idx, epoch = tf.numpy_function(begin, [], (tf.int64, tf.int64), stateful=True, name="kerasfeed_begin_pass")
        idx = tf.ensure_shape(idx, [None if skip else n])
        return tf.data.Dataset.from_tensor_slices((idx, tf.fill(tf.shape(idx), epoch)))

    @graph_fn
    def endless_stream(_):
        epoch = tf.numpy_function(begin, [], tf.int64, stateful=True, name="kerasfeed_begin_pass")
        indices = tf.data.Dataset.counter(start=pipeline.first_index(), step=pipeline.step())
        return indices.map(graph_fn(lambda i: (i, epoch)))

    @graph_fn
    def load_item(i, epoch):
        flat = tf.numpy_function(load, [i, epoch], out_types, stateful=True, name="kerasfeed_load")
        for t, spec in zip(flat, flat_specs):
            t.set_shape(spec.shape)
        return checker.pack(list(flat))

    # An executor that prefetches makes each pass's items ahead by itself
    # (see Executor.plan): a sequential map then just picks them up, without
    # a tf.data thread per call in flight.
    sequential = num_parallel_calls is None and ex.prefetches
    parallel = None if sequential else num_parallel_calls or ex.parallel_calls()
    try:
        if endless and group_items not in (None, 1):
            raise ValueError(
                f"`group_items={group_items}` cannot group the items of an endless source "
                f"(num_batches=None); use group_items=1 or None. Received: group_items={group_items}"
            )
        probed = [(i, [np.asarray(leaf) for _, leaf in flatten(item)[1]]) for i, item in probes]  # once, for both
        largest = max((sum(a.nbytes for a in leaves) for _, leaves in probed), default=None)
        group = 1 if endless else group_size(group_items, flat_specs, sequential, largest)
    except BaseException:
        if ex is not executor:
            ex.close()
        raise
    groups = None
    opened = open_leading(flat_specs)
    if group > 1 and any(opened) and uniform_leading(probed, opened, total):
        # Batches of one size (but perhaps the last): dense runs, no ragged rows.
        empty = [np.zeros([0] + [d or 0 for d in s.shape.as_list()], s.dtype.as_numpy_dtype) for s in flat_specs]
        groups = RunLoader(pipeline.begin, pipeline.load, opened, group, empty)  # owned by the dataset
        ds = run_items((weak_method(groups, "begin"), weak_method(groups, "load")), checker)
    elif group > 1:
        groups = GroupLoader(pipeline.load, opened)  # owned by the dataset, held weakly by TensorFlow
        ds = grouped_items(begin, weak_method(groups, "load"), checker, n, skip, group)
    else:
        ds = tf.data.Dataset.range(1).flat_map(endless_stream if endless else index_stream)
        if sequential:
            ds = inline_map(ds, load_item)
        else:
            ds = ds.map(load_item, num_parallel_calls=parallel, deterministic=True)

    variable = any(None in s.shape.as_list() for s in flat_specs if s.shape.rank)
    ds = tail.shuffle_and_batch(ds, variable=variable)
    if endless:
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif not skip:  # a resumed dataset's first pass is shorter than the others
        ds = ds.apply(tf.data.experimental.assert_cardinality(per_pass))

    options = tf.data.Options()
    options.deterministic = True
    if parallel is not None:
        # tf.data's shared pool caps Python calls in flight near the core count
        # (docs/field_notes.md, *tf.data thread pool*); a private pool lets `parallel` calls really overlap.
        pool = 64 if parallel == AUTOTUNE else parallel
        options.threading.private_threadpool_size = max(int(pool) + 4, 8)
    ds = own_sharding(ds.with_options(options), shards.parts)
    # The autotuning model only when the caller asked for AUTOTUNE calls.
    ds = tail.finish(ds, autotune=parallel == AUTOTUNE)
    ds._kerasfeed_pipeline = pipeline  # the owning reference (see PassPipeline)
    ds._kerasfeed_executor = ex
    ds._kerasfeed_groups = groups
    ds._kerasfeed_group_items = group
    return ds


__all__ = ["to_dataset"]
