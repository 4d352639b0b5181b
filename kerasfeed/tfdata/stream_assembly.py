"""One stream dataset from a source of passes: signature, chunks, tail, lifetime.

Shared by the stream functions (``sharded_datasets.py``: ``from_generators``,
``from_files``; ``queue_dataset.py``: ``from_queue``). The Python side
(``kerasfeed.streams``) runs the producers ahead in threads or worker
processes and hands items out in order. The tf.data side pulls them in
*chunks* (``chunks.py``): every item that is ready, stacked, in one Python
call, unbatched again in C++.

Pipeline of one pass::

    from_generator(chunks of one pass)     # a new pass of the source every time
      -> prefetch(2)                       # see chunks.HEARTBEAT_S
      -> unbatch -> map(slice padded leaves back, pack the structure)
      -> [shuffle(shuffle_buffer, seed)] -> [batch | padded_batch | ragged_batch]
      -> [prefetch] -> [prefetch_to_device]
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable, Optional

import tensorflow as tf

from kerasfeed.errors import SignatureError
from kerasfeed.observe.stats import new_collector
from kerasfeed.streams.declared import counted_passes
from kerasfeed.tfdata.chunks import ChunkCodec, Label, chunks
from kerasfeed.tfdata.functions import map_each
from kerasfeed.tfdata.structure import infer_signature, normalize_signature
from kerasfeed.tfdata.tail import TailOptions, own_sharding
from kerasfeed.tfdata.unbatching import unbatch_rows


def tail_options(arguments: dict) -> TailOptions:
    """The ``TailOptions`` among a stream function's (flat, public) arguments."""
    return TailOptions(**{f.name: arguments[f.name] for f in dataclasses.fields(TailOptions)})


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


def stream_dataset(
    source: Any,
    *,
    api: str,
    tag: str,
    describe: Callable[[Any], str],
    probes: Callable[[], list],
    output_signature: Any,
    tail: TailOptions,
    sharding: Optional[int] = None,
    timeout: Optional[float] = None,
) -> tf.data.Dataset:
    """The dataset of ``source``'s passes; the source closes with the dataset.

    Args:
        source: a ``ShardedStream`` or ``QueueFeed``: ``open_pass()`` per iteration of the
            dataset, ``close()``, ``attach_stats(collector)``, perhaps ``waits``.
        api: the public function's name, for messages and stats.
        tag: the dataset attribute that keeps ``source`` (the exit guard
            and ``kerasfeed.executor_of`` look it up).
        describe: ``describe(origin)`` names an item in messages.
        probes: returns ``[(item, origin), ...]`` to infer the signature from
            (called only when ``output_signature`` is None).
        output_signature: a nest of ``tf.TensorSpec``, or None to infer it.
        tail: shuffle / batch / prefetch options of the end of the pipeline.
        sharding: into how many parts the stream's shards are cut over the
            workers of a multi-worker strategy (``ShardPlan.parts``: above 1
            turns tf.data's auto-sharding off), or None.
        timeout: seconds a pass may go without an item, or None.

    Raises:
        ValueError: nothing to infer the signature from.
        kerasfeed.SignatureError: the probed items do not agree.
    """
    try:
        stats = new_collector(api, tail.batch_size or 1)
        if stats is not None:  # make times, timed where items are made (probed ones too)
            source.attach_stats(stats)
        if output_signature is None:
            signature = _infer(probes(), describe, api)
        else:
            signature = normalize_signature(output_signature)
        codec = ChunkCodec(signature, api)
        declared, size = tail.items_per_epoch, tail.batch_size
        needed = declared // size * size if declared is not None and size and tail.drop_remainder else None
        open_pass = counted_passes(source.open_pass, declared, api, needed)  # checked against a declared length
        passes, waits = itertools.count(), getattr(source, "waits", None)
        ds = tf.data.Dataset.from_generator(
            lambda: chunks(open_pass, codec, describe, stats, next(passes), timeout, api, waits),
            output_signature=codec.chunk_signature,
        )
        ds = unbatch_rows(ds.prefetch(2))
        if codec.needs_decode:
            ds = map_each(ds, codec.decode)
        ds = tail.apply(ds, variable=any(codec.variable))
        ds._kerasfeed_stats = stats  # kerasfeed.stats(ds)
        if sharding is not None:
            ds = own_sharding(ds, sharding)
    except BaseException:
        source.close()
        raise
    setattr(ds, tag, source)
    weakref.finalize(ds, source.close)  # producer threads / worker processes stop with the dataset
    return ds
