"""``from_generators``, ``from_files``, ``from_queue``: streams as ``tf.data``.

The Python side (``kerasfeed.streams``) runs the generators ahead in threads
or worker processes and hands items out in order. The tf.data side pulls
them in *chunks* (``chunks.py``): every item that is ready, stacked, in one
Python call, unbatched again in C++.

Pipeline of one pass::

    from_generator(chunks of one pass)     # new generators every pass
      -> prefetch(2)                       # see chunks.HEARTBEAT_S
      -> unbatch -> map(slice padded leaves back, pack the structure)
      -> [shuffle(shuffle_buffer, seed)] -> [batch | padded_batch | ragged_batch]
      -> [prefetch] -> [prefetch_to_device]
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import tensorflow as tf

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE
from kerasfeed.errors import SignatureError
from kerasfeed.observe.stats import new_collector
from kerasfeed.streams.queue import END_OF_EPOCH, QueueFeed
from kerasfeed.streams.shards import ShardedStream
from kerasfeed.tfdata.chunks import ChunkCodec, Label, chunks
from kerasfeed.tfdata.inline_map import graph_fn
from kerasfeed.tfdata.structure import infer_signature, normalize_signature
from kerasfeed.tfdata.tail import TailOptions


def _infer(probes: list, describe: Callable[[Any], str], api: str) -> Any:
    if not probes:
        raise ValueError(
            f"{api} could not infer the element signature: the data produced no items. "
            "Pass `output_signature=` (a nest of tf.TensorSpec) to create the dataset anyway."
        )
    try:
        return infer_signature([(Label(origin, describe), item) for item, origin in probes])
    except SignatureError as e:
        raise SignatureError(
            f"{e} (while probing the first items; pass `output_signature=` to {api} to set it)"
        ) from None


def _assemble(
    open_pass: Callable[[], Any],
    signature: Any,
    describe: Callable[[Any], str],
    api: str,
    tail: TailOptions,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    codec = ChunkCodec(signature, api)
    stats = new_collector(api, tail.batch_size or 1)
    passes = itertools.count()
    ds = tf.data.Dataset.from_generator(
        lambda: chunks(open_pass, codec, describe, stats, next(passes), timeout, api),
        output_signature=codec.chunk_signature,
    )
    ds = ds.prefetch(2).unbatch()
    if codec.needs_decode:
        ds = ds.map(graph_fn(codec.decode))
    ds = tail.apply(ds, variable=any(codec.variable))
    ds._kerasfeed_stats = stats  # kerasfeed.stats(ds)
    return ds


def _tail_options(arguments: dict) -> TailOptions:
    """The ``TailOptions`` among a stream function's (flat, public) arguments."""
    return TailOptions(**{f.name: arguments[f.name] for f in dataclasses.fields(TailOptions)})


def _describe_item(stream: ShardedStream):
    def describe(origin: tuple) -> str:
        shard, n = origin
        return f"{n} of {stream.describe(shard)}"

    return describe


def _worker_shards(api: str, n: int, **fields) -> tuple:
    """``(num_workers, worker_index, options)``: this worker's part of the shards.

    One part per worker under a multi-worker strategy (the workers check
    that they agree); ``(1, 0, options)`` otherwise.
    """
    from kerasfeed.integrations import distribute

    return distribute.prepare(api, n, None, None, None, **fields)


def _sharded_dataset(
    stream: ShardedStream,
    api: str,
    output_signature: Any,
    probe: int,
    tail: TailOptions,
    shard_options: Any = None,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    describe = _describe_item(stream)
    try:
        if output_signature is None:
            signature = _infer(stream.probe(probe), describe, api)
        else:
            signature = normalize_signature(output_signature)
        ds = _assemble(stream.open_pass, signature, describe, api, tail, timeout)
        if shard_options is not None:
            ds = ds.with_options(shard_options)
    except BaseException:
        stream.close()
        raise
    ds._kerasfeed_stream = stream
    weakref.finalize(ds, stream.close)  # worker processes stop with the dataset
    return ds


def from_generators(
    factory: Callable[[int], Iterable[Any]],
    num_shards: int,
    *,
    executor: str = "threads",
    workers: Optional[int] = None,
    cycle_length: Optional[int] = None,
    block_length: int = 1,
    deterministic: bool = True,
    buffer_size: int = 8,
    output_signature: Any = None,
    probe: int = 8,
    batch_size: Optional[int] = None,
    drop_remainder: bool = False,
    ragged: bool = False,
    padding_values: Any = None,
    shuffle_buffer: Optional[int] = None,
    seed: Optional[int] = None,
    worker_init: Optional[Callable[[], None]] = None,
    prefetch: Optional[int] = AUTOTUNE,
    device: Optional[str] = None,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    """Runs ``factory(i)`` generators in parallel and interleaves their items.

    Each of the ``num_shards`` generators runs ahead in its own producer
    (a thread, or a worker process) with a bounded buffer, so slow generators
    overlap; tf.data pulls whatever is ready. Every pass over the dataset
    (every epoch) calls ``factory`` again for new generators.

    Under ``MultiWorkerMirroredStrategy`` (a dataset created in a worker
    process) each worker runs only its own generators: shards ``k, k + W,
    ...`` (``num_shards // W`` of them), with tf.data's auto-sharding off;
    the workers check that they agree on ``num_shards``, ``seed`` and
    batching (see ``docs/multiworker.md``).

    Order: with ``deterministic=True`` the items come in exactly the order of
    ``tf.data.Dataset.range(num_shards).interleave(..., cycle_length,
    block_length)``, run after run, whatever the timing; with
    ``deterministic=False`` they come as they are ready.

    Args:
        factory: ``factory(shard_index)`` returns an iterable of items (a
            generator, a list). Items are arrays, tuples ``(x, y)`` /
            ``(x, y, sample_weight)`` or dicts/nests of arrays.
        num_shards: how many generators; ``factory`` gets ``0 .. num_shards-1``.
        executor: ``"threads"`` for generators that wait (I/O, network,
            sleeps, large numpy calls); ``"processes"`` for pure-Python,
            CPU-bound generators (real CPU parallelism: the factory is sent to
            persistent worker processes by value with cloudpickle, and items
            come back through shared memory).
        workers: generators running at once (threads or processes). Default:
            ``min(num_shards, 64)`` threads, or one process per usable CPU.
        cycle_length: generators interleaved at a time in the deterministic
            order; at most ``workers``. Default: ``min(num_shards, workers)``.
            The order depends only on ``num_shards``, ``cycle_length`` and
            ``block_length``: fix ``cycle_length`` to get the same order on any
            machine.
        block_length: consecutive items taken from one generator.
        deterministic: fixed order (True) or arrival order (False).
        buffer_size: items each running generator may make ahead.
        output_signature: a nest of ``tf.TensorSpec`` for one item; inferred
            from the first ``probe`` items otherwise.
        probe: items read (from different generators, in a short separate
            run) to infer the signature; a dimension that differs becomes None.
        batch_size: batch the items (zero-padded when shapes vary).
        drop_remainder: drop the last short batch.
        ragged: batch variable shapes into ``tf.RaggedTensor``s instead.
        padding_values: passed to ``padded_batch``.
        shuffle_buffer: shuffle items in a buffer of this size (per pass,
            reshuffled every pass; seeded by ``seed``).
        seed: seed of the shuffle buffer (and of worker processes' RNGs).
        worker_init: run once in every worker process (processes only).
        prefetch: elements prefetched at the end; 0 disables.
        device: e.g. ``"/gpu:0"``: prefetch onto that device as the last step.
        timeout: seconds a pass may go without an item before it fails with
            a ``StreamError`` (worker processes: an item taking longer, counted
            from when the worker is ready, also stops that worker). None (the
            default) waits as long as it takes.

    Returns:
        A ``tf.data.Dataset`` of unknown cardinality.

    Raises:
        TypeError, ValueError: bad arguments, or a factory that cannot be
            pickled for ``executor="processes"`` (the message names what).
        kerasfeed.StreamError: a generator raised while probing. During
            iteration TensorFlow re-raises it as a ``tf.errors.OpError`` with
            the same message: the shard, items made before, the original
            type, message and traceback (and worker pid for processes).
        kerasfeed.SignatureError: an item does not fit the signature (named
            by item number, shard and field).
        kerasfeed.WorkerError: a worker process died (fails the pass at once).

    Example:

    ```python
    import time
    import numpy as np
    import kerasfeed

    def make_gen(i):
        time.sleep(0.1)  # e.g. a slow object-store request
        yield np.full((8, 8, 3), i, np.float32), np.zeros((8, 8), np.int64)

    ds = kerasfeed.from_generators(make_gen, 100, batch_size=10)  # ~0.2 s, not 10 s
    for image, mask in ds:
        print(image.shape)  # (10, 8, 8, 3)
    ```
    """
    if not callable(factory):
        raise TypeError(f"`factory` must be a callable returning an iterable of items. Received: factory={factory!r}")
    num_shards = _v.positive_int("num_shards", num_shards)
    tail = _tail_options(locals())
    _v.positive_int("probe", probe)
    _v.flag("deterministic", deterministic)
    num_workers, worker_index, shard_options = _worker_shards(
        "from_generators", int(num_shards), seed=seed, batch_size=batch_size, drop_remainder=drop_remainder,
        shuffle_buffer=shuffle_buffer, cycle_length=cycle_length, block_length=block_length,
    )
    stream = ShardedStream(
        factory,
        range(int(num_shards)),
        kind="generator shard",
        executor=executor,
        workers=workers,
        cycle_length=cycle_length,
        block_length=block_length,
        deterministic=bool(deterministic),
        buffer_size=buffer_size,
        seed=seed,
        worker_init=worker_init,
        num_workers=num_workers,
        worker_index=worker_index,
        timeout=_v.seconds("timeout", timeout),
    )
    return _sharded_dataset(
        stream,
        "from_generators",
        output_signature,
        probe,
        tail,
        shard_options,
        timeout=timeout,
    )


def from_files(
    paths: Sequence[Union[str, os.PathLike]],
    read_fn: Callable[[Any], Iterable[Any]],
    *,
    executor: str = "threads",
    workers: Optional[int] = None,
    cycle_length: Optional[int] = None,
    block_length: int = 1,
    deterministic: bool = True,
    shuffle_files: bool = False,
    seed: Optional[int] = None,
    shuffle_buffer: Optional[int] = None,
    batch_size: Optional[int] = None,
    drop_remainder: bool = False,
    ragged: bool = False,
    padding_values: Any = None,
    buffer_size: int = 8,
    output_signature: Any = None,
    probe: int = 8,
    worker_init: Optional[Callable[[], None]] = None,
    prefetch: Optional[int] = AUTOTUNE,
    device: Optional[str] = None,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    """Reads files in parallel with ``read_fn`` and flattens them to samples.

    ``read_fn(path)`` returns a list of samples or yields them; how many and
    their shapes may vary from file to file. Files are read in parallel
    (threads or worker processes), their samples interleaved (like
    ``from_generators``, one file per shard), optionally shuffled in a buffer
    and batched: zero-padded by default when shapes vary, or ragged. Under
    ``MultiWorkerMirroredStrategy`` each worker reads only its own files of
    every pass (``len(paths) // W`` of them), as in ``from_generators``.

    Args:
        paths: the files (str or ``os.PathLike``), at least one.
        read_fn: ``read_fn(path)`` returns or yields the file's samples.
        executor: ``"threads"`` (I/O-bound readers, numpy/C parsers) or
            ``"processes"`` (pure-Python parsing such as ``json``).
        workers, cycle_length, block_length, deterministic, buffer_size,
            output_signature, probe, worker_init, prefetch, device, timeout:
            as in ``from_generators`` (a shard is a file).
        shuffle_files: open the files in a new seeded order every pass.
        seed: seed of the file order and of the shuffle buffer: the same seed
            gives the same sequence of per-pass orders.
        shuffle_buffer: shuffle samples in a buffer of this size.
        batch_size: batch the samples.
        drop_remainder: drop the last short batch.
        ragged: ragged batches instead of zero-padded ones.
        padding_values: passed to ``padded_batch``.

    Returns:
        A ``tf.data.Dataset`` of samples (or batches), of unknown cardinality.

    Raises:
        TypeError, ValueError: bad paths or arguments.
        kerasfeed.StreamError: ``read_fn`` raised; the message names the
            file, the samples read before and the original error (through
            tf.data as a ``tf.errors.OpError`` with the same message).
        kerasfeed.SignatureError: a sample does not fit the signature.

    Example:

    ```python
    import json
    import numpy as np
    import kerasfeed

    def read_jsonl(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                yield np.asarray(rec["tokens"], np.int32), np.int32(rec["label"])

    ds = kerasfeed.from_files(["a.jsonl", "b.jsonl"], read_jsonl, batch_size=4,
                              shuffle_files=True, shuffle_buffer=64, seed=0)
    ```
    """
    if isinstance(paths, (str, bytes, os.PathLike)) or not hasattr(paths, "__len__"):
        raise TypeError(f"`paths` must be a list of file paths. Received: paths={paths!r}")
    paths = list(paths)
    if not paths:
        raise ValueError("`paths` is empty: from_files needs at least one file. Received: paths=[]")
    for i, p in enumerate(paths):
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"`paths[{i}]` must be a str or os.PathLike. Received: paths[{i}]={p!r}")
    if not callable(read_fn):
        raise TypeError(f"`read_fn` must be a callable `read_fn(path)`. Received: read_fn={read_fn!r}")
    paths = [os.fspath(p) for p in paths]
    tail = _tail_options(locals())
    _v.positive_int("probe", probe)
    _v.flag("deterministic", deterministic)
    _v.flag("shuffle_files", shuffle_files)
    num_workers, worker_index, shard_options = _worker_shards(
        "from_files", len(paths), seed=seed, shuffle=shuffle_files, batch_size=batch_size,
        drop_remainder=drop_remainder, shuffle_buffer=shuffle_buffer, cycle_length=cycle_length,
        block_length=block_length,
    )
    stream = ShardedStream(
        read_fn,
        paths,
        kind="file",
        executor=executor,
        workers=workers,
        cycle_length=cycle_length,
        block_length=block_length,
        deterministic=bool(deterministic),
        buffer_size=buffer_size,
        shuffle=bool(shuffle_files),
        seed=seed,
        worker_init=worker_init,
        num_workers=num_workers,
        worker_index=worker_index,
        timeout=_v.seconds("timeout", timeout),
    )
    return _sharded_dataset(
        stream,
        "from_files",
        output_signature,
        probe,
        tail,
        shard_options,
        timeout=timeout,
    )


def from_queue(
    producer: Any,
    *,
    maxsize: int = 64,
    output_signature: Any = None,
    probe: int = 1,
    timeout: Optional[float] = None,
    batch_size: Optional[int] = None,
    drop_remainder: bool = False,
    ragged: bool = False,
    padding_values: Any = None,
    shuffle_buffer: Optional[int] = None,
    seed: Optional[int] = None,
    prefetch: Optional[int] = AUTOTUNE,
    device: Optional[str] = None,
) -> tf.data.Dataset:
    """A dataset fed by a producer that does not know the epoch length.

    The producer marks the end of each epoch with ``kerasfeed.END_OF_EPOCH``;
    every pass over the dataset (every ``fit`` epoch) reads one epoch. A pass
    dropped mid-epoch (a ``break``) makes the next pass skip the rest of that
    epoch. The queue is bounded: the producer waits while it is full.

    Args:
        producer: either a callable ``producer(put)`` that kerasfeed runs in a
            daemon thread across epochs (``put(item)`` blocks while the queue
            is full; returning ends the data: a later pass raises a
            ``StreamError`` saying the producer has stopped; raising
            fails the pass that reaches that point), or a bounded queue
            (``queue.Queue(maxsize=N)``, ``multiprocessing.Queue(N)``) filled
            by your own threads; put an exception instance into it to fail
            the epoch with that error.
        maxsize: the bound of the queue kerasfeed creates for a callable.
        output_signature: a nest of ``tf.TensorSpec``; otherwise inferred from
            the first ``probe`` items (which wait in the queue for the first
            pass: nothing is lost). Shapes that vary need ``probe`` > 1 or an
            explicit signature with None dimensions.
        probe: items looked at to infer the signature.
        timeout: seconds a pass (or the signature probe) may wait for an item
            before failing; None waits as long as it takes. Useful with a
            queue object, whose producer kerasfeed cannot watch.
        batch_size, drop_remainder, ragged, padding_values, shuffle_buffer,
            seed, prefetch, device: as in ``from_generators``.

    Returns:
        A ``tf.data.Dataset`` of unknown cardinality. Dropping it stops a
        callable producer (its next ``put`` raises). Note that ``model.fit``
        learns the number of steps from the first epoch (and warns that the
        input "ran out of data", as for any dataset of unknown length); a
        later, longer epoch is cut at that many steps and its rest skipped;
        a shorter one ends early. When every epoch has the same, known number
        of batches ``n``, ``ds.apply(tf.data.experimental.assert_cardinality(n))``
        tells Keras, and it does not warn.

    Raises:
        TypeError, ValueError: bad arguments or an unbounded queue.
        kerasfeed.StreamError: the producer raised (through tf.data as a
            ``tf.errors.OpError`` with the same message).

    Example:

    ```python
    import numpy as np
    import kerasfeed

    def simulate(put):
        for epoch in range(3):
            for _ in range(np.random.randint(5, 10)):  # unknown length
                put(np.random.rand(4).astype("float32"))
            put(kerasfeed.END_OF_EPOCH)

    ds = kerasfeed.from_queue(simulate, maxsize=16, batch_size=2)
    for epoch in range(3):
        print(sum(1 for _ in ds))  # batches of this epoch
    ```
    """
    tail = _tail_options(locals())
    _v.positive_int("probe", probe)
    feed = QueueFeed(producer, maxsize=maxsize, timeout=timeout)

    def describe(origin: tuple) -> str:
        epoch, n = origin
        return f"{n} of epoch {epoch} from {feed.name}"

    try:
        if output_signature is None:
            peeked = feed.peek(probe)
            signature = _infer([(item, (0, i)) for i, item in enumerate(peeked)], describe, "from_queue")
        else:
            signature = normalize_signature(output_signature)
        ds = _assemble(
            feed.open_pass,
            signature,
            describe,
            "from_queue",
            tail,
        )
    except BaseException:
        feed.close()
        raise
    ds._kerasfeed_feed = feed
    weakref.finalize(ds, feed.close)
    return ds


__all__ = ["from_generators", "from_files", "from_queue", "END_OF_EPOCH"]
