"""``to_dataset``: any indexable source as a real ``tf.data.Dataset``.

``to_dataset`` resolves its arguments once (``DatasetOptions``) and assembles
the dataset in named stages: the front end's feed (shards, passes, executor:
``kerasfeed/loading/feed.py``), the item signature from probed items, the pass
pipeline, the items (``items.py``: one ``tf.numpy_function`` call per item or
per group), then the tail (batching, cardinality, options, prefetch).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Union

import tensorflow as tf

from kerasfeed._keras_fit import remember_fit
from kerasfeed._validation import AUTOTUNE
from kerasfeed.execution.base import Executor
from kerasfeed.loading.feed import Feed, open_feed
from kerasfeed.loading.shards import cluster_shards
from kerasfeed.sources.base import source_length
from kerasfeed.tfdata.items import item_dataset
from kerasfeed.tfdata.options import DatasetOptions
from kerasfeed.tfdata.structure import ItemChecker, infer_signature, normalize_signature, open_leading_dimension
from kerasfeed.tfdata.tail import own_sharding, prefetch_tail


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
    retries: int = 0,
    max_skipped: Union[int, float] = 0,
    worker_max_items: Optional[int] = None,
    worker_max_rss: Optional[int] = None,
    cache: Any = None,
    copy: bool = False,
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
            ``Executor`` instance made with this very ``source``: where
            ``source[i]`` runs.
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
            worker's under a multi-worker strategy: with ``num_shards``
            given, when it equals the number of workers; another count but
            1 is then refused).
        input_context: a ``tf.distribute.InputContext`` (as given to the
            function of ``strategy.distribute_datasets_from_function``); sets
            ``num_shards``/``shard_index`` to its input pipelines.
        initial_state: ``{"epoch": e, "batches": b}`` (from
            ``TrainingProgress.state()``): the first pass is pass ``e`` and
            starts after its first ``b`` elements, exactly where the saved run
            stopped; later passes are whole. Use the same source, seed, batch
            size and shards as the saved run, and ``model.fit(...,
            initial_epoch=e)``. A state carrying an order fingerprint
            (``TrainingProgress(order=...)``) is refused with another order.
        order: the index order of every pass instead of
            ``shuffle``/``seed``/``num_shards``/``shard_index``: any object
            with ``shard_length`` and ``indices(epoch)``, such as
            ``kerasfeed.BalancedOrder`` or ``kerasfeed.WeightedOrder`` (see
            ``kerasfeed.sampling.protocol``). Indices may repeat. Its seed
            (one given to it) seeds ``kerasfeed.item_rng()`` as ``seed`` does.
        group_items: items handed to tf.data per Python call. None (the
            default): up to 64 small items (at most 64 KB each, 1 MB per
            call, every dimension but the leading batch one fixed) when the
            executor makes items ahead, else 1; 1 turns it off. Batches of
            one size (a short one anywhere is fine) are stacked into dense
            runs; batches whose size varies throughout are concatenated and
            split back as ragged rows. Each call costs the consumer process
            ~0.3 ms of CPU and a GIL hand-off whatever the item's size, which
            ``model.fit``'s own Python competes for; grouping spreads that
            over the group (``docs/performance.md``). A call waits for its
            first item only and takes later ones only if made already, so
            every item arrives as soon as it and the items before it are
            made; an item error surfaces in its place, after every item before it.
        timeout: seconds one item may take, counted from when its thread or
            worker process is ready to run it (start-up and ``worker_init``
            are not counted); the pass then fails (``TimeoutError`` from
            threads, ``kerasfeed.WorkerError`` from a worker, which is
            killed). None (the default) waits as long as the worker lives.
            Ignored when ``executor`` is an ``Executor`` instance.
        retries: how many more times an item is tried after an attempt that
            raised, ran past ``timeout`` or whose worker died (the worker is
            replaced); 0 (the default): the first failure fails the item.
        max_skipped: items of a pass that may still fail after their retries
            and be left out instead of ending the pass: an int count, or a
            float in (0, 1), a fraction of the pass; 0 (the default): none.
            With ``batch_size`` the batch that held a skipped item is one
            sample shorter and a pass keeps its number of batches; with
            ``batch_size=None`` the pass is one batch shorter per skipped
            item (Keras then warns that the input ran out of data at that
            epoch's end). Each skip is logged once (``kerasfeed`` logger),
            counted in ``kerasfeed.stats`` and kept with resume states; past
            the budget the error is raised, naming every item skipped
            (``docs/reliability.md``).
        worker_max_items, worker_max_rss: a worker process that was sent
            this many items, or whose resident memory passed this many bytes,
            finishes its items and is replaced (None: never; worker
            processes only).
        cache: keep items once made, so that later passes read them instead
            of making them again: ``"memory"`` (RAM, freed with the
            pipeline), a directory path (kept on local disk and reused by the
            next run while the source is unchanged), a ``kerasfeed.Cache``
            (its ``max_bytes`` and ``version``), or None (the default). With a
            source that defines ``load(i)`` and ``augment(item)``, only
            ``load`` is stored and ``augment`` runs every pass. Items are
            bit-identical to an uncached run's. See ``docs/cache.md``.
        copy: False (the default): an item's arrays reach tf.data as
            ``source[i]`` returned them (threads; TensorFlow may use their
            memory without a copy), or from the worker's shared memory
            (processes). True: each item's arrays are copied by the thread
            that made it, as it is made: for a source that reuses its
            buffers (one per thread, say), which would otherwise hold a
            later item by the time tf.data reads them (the threads run up
            to 64 items ahead). As ``to_loader``'s ``copy``.

    Returns:
        A ``tf.data.Dataset`` with known cardinality (resumed:
        ``dataset.cardinality()`` is a whole pass, which ``model.fit`` reads;
        the first pass is shorter). Its executor is available as
        ``dataset._kerasfeed_executor``.

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
    arguments = dict(locals())  # every argument but `source` is a DatasetOptions field of the same name
    del arguments["source"]
    total = source_length(source, allow_infinite=True, owner="to_dataset")
    return assemble(source, total, DatasetOptions(**arguments))


def assemble(source: Any, total: Optional[int], options: DatasetOptions) -> tf.data.Dataset:
    """The dataset of ``source`` (``total`` items, None: endless) under ``options``, stage by stage."""
    # One shard per worker under a multi-worker strategy unless told otherwise (an `order` fixes
    # its own shards); the workers check that they agree (loading/shards.py). An endless source
    # has items for any number of workers.
    feed = open_feed(source, total, options, cluster_shards)
    with feed.closing_on_error():
        probes, checker = probe_signature(feed, options)
        pipeline = feed.pipeline(checker)
        # An executor that prefetches makes each pass's items ahead by itself
        # (see Executor.plan): a sequential map then just picks them up, without
        # a tf.data thread per call in flight.
        sequential = options.num_parallel_calls is None and feed.executor.prefetches
        parallel = None if sequential else options.num_parallel_calls or feed.executor.parallel_calls()
        items = item_dataset(feed, pipeline, checker, probes, sequential, parallel)
        ds = finish(items.dataset, feed, checker, parallel)
    pipeline.length_checked = not feed.endless and not _shorter(feed)
    tags = {"_kerasfeed_pipeline": pipeline,  # the owning reference (see PassPipeline)
            "_kerasfeed_executor": feed.executor, "_kerasfeed_groups": items.groups,
            "_kerasfeed_group_items": items.group}
    for attr, value in tags.items():
        setattr(ds, attr, value)
    unchecked = getattr(ds, "_kerasfeed_unchecked", None)
    if unchecked is not None:
        ds._kerasfeed_unchecked = functools.partial(_unchecked_passes, unchecked, tags)
    return ds


def probe_signature(feed: Feed, options: DatasetOptions) -> tuple[list, ItemChecker]:
    """The probed items (none when ``output_signature`` is given) and the checker of every item."""
    if options.output_signature is not None:
        return [], ItemChecker(normalize_signature(options.output_signature))
    probes = feed.probe(feed.probe_indices())
    signature = infer_signature(probes)
    if options.batch_size is None:
        # Items are batches: their size may vary anywhere (a short batch mid-pass), as under Keras.
        signature = open_leading_dimension(signature)
    return probes, ItemChecker(signature)


def finish(ds: tf.data.Dataset, feed: Feed, checker: ItemChecker, parallel: Optional[int]) -> tf.data.Dataset:
    """The tail: shuffle buffer and batching, the known cardinality, tf.data options, prefetch."""
    tail = feed.options.tail
    variable = any(None in s.shape.as_list() for s in checker.specs if s.shape.rank)
    marked = bool(feed.options.max_skipped)  # elements (item, kept): items left out are dropped
    ds = tail.shuffle_and_batch(ds, variable=variable, marked=marked)
    shorter = _shorter(feed)
    unchecked = None  # the passes without tf.data's length check (``_unchecked_passes``)
    if feed.endless:
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    elif not shorter:
        unchecked, ds = ds, ds.apply(tf.data.experimental.assert_cardinality(feed.passes.per_pass))
    options = tf.data.Options()
    options.deterministic = True
    if parallel is not None:
        # tf.data's shared pool caps Python calls in flight near the core count
        # (docs/field_notes.md, *tf.data thread pool*); a private pool lets `parallel` calls really overlap.
        pool = 64 if parallel == AUTOTUNE else parallel
        options.threading.private_threadpool_size = max(int(pool) + 4, 8)
    parts, prefetch, device = feed.shards.parts, tail.prefetch, tail.device

    def last_stages(d: tf.data.Dataset) -> tf.data.Dataset:
        # The autotuning model only when the caller asked for AUTOTUNE calls.
        return prefetch_tail(own_sharding(d.with_options(options), parts), prefetch, device,
                             autotune=parallel == AUTOTUNE)

    ds = last_stages(ds)
    tell_keras_the_whole_pass(ds, feed.passes.per_pass if shorter and not feed.endless else None)
    if unchecked is not None:  # made when needed (``assemble`` tags it)
        ds._kerasfeed_unchecked = functools.partial(last_stages, unchecked)
    return ds


def _unchecked_passes(last_stages: Callable[[], tf.data.Dataset], tags: dict) -> tf.data.Dataset:
    """The dataset without tf.data's check of a whole pass's length, tagged as the checked one: the
    same pipeline, whose passes end where they end. Keras reads an epoch resumed inside its pass
    from it where Keras would read past that pass's end (``_keras_epoch_iterator.start_epoch_at``).
    Holds the tags, never the checked dataset (no cycle: a dataset dropped stops its workers at once)."""
    ds = last_stages()
    for attr, value in tags.items():
        setattr(ds, attr, value)
    return ds


def _shorter(feed: Feed) -> bool:
    """A resumed dataset's first pass is shorter than the others; so is a pass that left items out that were
    batches (NOTE [ A skipped item and its batch ], loading/skips.py): no length check of a whole pass."""
    return bool(feed.passes.skip or (feed.options.max_skipped and feed.options.batch_size is None))


def tell_keras_the_whole_pass(ds: tf.data.Dataset, per_pass: Optional[int]) -> None:
    """``ds.cardinality()``, which Keras calls on the thread of its ``fit``: notes that ``fit``
    (``remember_fit``: NOTE [ Another thread's frames ]) and, for a resumed dataset
    (``per_pass``), says a whole pass's batches.

    NOTE [ A resumed dataset's length for Keras ]: its first pass is shorter
    than the others, so tf.data's own cardinality stays unknown (an asserted
    one would fail the short pass). Keras (3.15) reads ``ds.cardinality()``
    once per ``fit`` call; when unknown, it learns the steps of every later
    epoch from the first (one more than the resumed pass had) and cuts each
    later pass short: 5, 6, 6 batches of 8. Told the whole pass, one call
    trains 5, 8, 8: the resumed epoch ends early with Keras' "ran out of
    data" warning, every later one is whole. Only this method (and so
    ``len(ds)``) says so: tf.data's ops and derived datasets still see an
    unknown length. The tensor is made at each call, so it is never one of a
    graph the dataset was built in. Which method Keras reads is private
    Keras structure: where a fit's epoch iterator counts fewer steps than a
    pass, the pass it would cut is refused (``_keras_fit.check_epoch_length``).
    """
    # The dataset's variant (its C++ graph), not the dataset: no reference cycle through the dataset (a
    # dropped one stops its workers at once), and `to_dataset(...).cardinality()`, which looks the method up
    # on a dataset nothing else holds, still answers (a weak reference to the dataset had it freed first).
    variant = tf.data.experimental.to_variant(ds)

    def cardinality() -> tf.Tensor:
        remember_fit()
        if per_pass is not None:
            return tf.constant(per_pass, tf.int64)
        return tf.raw_ops.DatasetCardinality(input_dataset=variant)

    ds.cardinality = cardinality


__all__ = ["assemble", "to_dataset"]
