"""``from_generators`` and ``from_files``: sharded streams as ``tf.data``.

Both run ``task(arg)`` per shard (``kerasfeed.streams.ShardedStream``: a
generator factory and shard indices, or a reader and file paths) in threads
or worker processes, interleaved in a fixed order; ``stream_assembly.py``
turns the stream into a dataset.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import tensorflow as tf

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE
from kerasfeed.loading.shards import plan_shards
from kerasfeed.streams.shards import ShardedStream
from kerasfeed.tfdata.stream_assembly import stream_dataset, tail_options

# Arguments passed through to ``ShardedStream`` under the same name.
_STREAM_ARGUMENTS = ("executor", "workers", "cycle_length", "block_length", "buffer_size", "seed", "worker_init")


def _sharded_dataset(
    api: str,
    task: Callable[[Any], Iterable[Any]],
    args: Sequence[Any],
    kind: str,
    arguments: dict,
    shuffle: Optional[bool] = None,
) -> tf.data.Dataset:
    """The dataset of ``task(arg)`` shards, from the public function's arguments.

    Args:
        arguments: the public function's (checked) arguments, by name.
        shuffle: open the shards in a new seeded order every pass (None: the
            function has no such argument; it is then not part of what the
            workers of a multi-worker strategy check they agree on).
    """
    a = arguments
    tail = tail_options(a)
    _v.positive_int("probe", a["probe"])
    _v.flag("deterministic", a["deterministic"])
    timeout = _v.seconds("timeout", a["timeout"])
    # One part of the shards per worker under a multi-worker strategy (the
    # workers check that they agree); all of them otherwise.
    agreement = {"seed": a["seed"]}
    if shuffle is not None:
        agreement["shuffle"] = shuffle
    for name in ("batch_size", "drop_remainder", "shuffle_buffer", "cycle_length", "block_length"):
        agreement[name] = a[name]
    shards = plan_shards(api, len(args), None, None, None, **agreement)
    stream = ShardedStream(
        task,
        args,
        kind=kind,
        deterministic=bool(a["deterministic"]),
        shuffle=bool(shuffle),
        num_workers=shards.num_shards,
        worker_index=shards.shard_index,
        timeout=timeout,
        **{name: a[name] for name in _STREAM_ARGUMENTS},
    )
    return stream_dataset(
        stream,
        api=api,
        tag="_kerasfeed_stream",
        describe=lambda origin: f"{origin[1]} of {stream.describe(origin[0])}",  # origin: (shard, n)
        probes=lambda: stream.probe(a["probe"]),
        output_signature=a["output_signature"],
        tail=tail,
        sharding=shards.parts,
        timeout=timeout,
    )


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
    items_per_epoch: Optional[int] = None,
) -> tf.data.Dataset:
    """Runs ``factory(i)`` generators in parallel and interleaves their items.

    Each of the ``num_shards`` generators runs ahead in its own producer
    (a thread, or a worker process) with a bounded buffer, so slow generators
    overlap; tf.data pulls whatever is ready. Every pass over the dataset
    (every epoch) calls ``factory`` again for new generators, and the
    signature probe calls it for the first shards: it must make a new
    generator every call (a generator, or any iterator such as a ``map``, runs
    once; one returned before fails its shard with a ``StreamError`` saying so, rather than giving no items).

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
            ``min(num_shards, 64)`` threads, or ``default_workers()`` processes
            (2 on 2 cores, 14 on 16; see ``PoolOptions``); at least
            ``min(num_shards, cycle_length)`` when ``cycle_length`` is given.
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
        items_per_epoch: the number of items every pass yields (all shards
            together; under a multi-worker strategy, this worker's part), if
            you know it. The dataset then has a known cardinality
            (``ceil(items_per_epoch / batch_size)`` batches, or floor with
            ``drop_remainder``), so ``model.fit`` knows its steps and does not
            warn "Your input ran out of data"; a pass with another count
            fails with a ``kerasfeed.StreamError`` naming both counts. None
            (the default): unknown length.

    Returns:
        A ``tf.data.Dataset`` of unknown cardinality (known with
        ``items_per_epoch``).

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
    num_shards = int(_v.positive_int("num_shards", num_shards))
    return _sharded_dataset("from_generators", factory, range(num_shards), "generator shard", locals())


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
    items_per_epoch: Optional[int] = None,
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
        read_fn: ``read_fn(path)`` returns or yields the file's samples
            (a new generator every call, as ``factory`` in ``from_generators``).
        executor: ``"threads"`` (I/O-bound readers, numpy/C parsers) or
            ``"processes"`` (pure-Python parsing such as ``json``).
        workers, cycle_length, block_length, deterministic, buffer_size,
            output_signature, probe, worker_init, prefetch, device, timeout,
            items_per_epoch: as in ``from_generators`` (a shard is a file;
            ``items_per_epoch`` counts the samples of all files).
        shuffle_files: open the files in a new seeded order every pass.
        seed: seed of the file order and of the shuffle buffer: the same seed
            gives the same sequence of per-pass orders.
        shuffle_buffer: shuffle samples in a buffer of this size.
        batch_size: batch the samples.
        drop_remainder: drop the last short batch.
        ragged: ragged batches instead of zero-padded ones.
        padding_values: passed to ``padded_batch``.

    Returns:
        A ``tf.data.Dataset`` of samples (or batches), of unknown cardinality
        (known with ``items_per_epoch``).

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
    _v.flag("shuffle_files", shuffle_files)
    return _sharded_dataset("from_files", read_fn, paths, "file", locals(), shuffle=bool(shuffle_files))


__all__ = ["from_generators", "from_files"]
