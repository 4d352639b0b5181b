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
from typing import Any, Callable, Optional, Protocol

import tensorflow as tf

from kerasfeed.errors import SignatureError
from kerasfeed.observe.stats import new_collector
from kerasfeed.streams.declared import counted_passes
from kerasfeed.tfdata.chunks import ChunkCodec, Label, chunks
from kerasfeed.tfdata.inline_map import graph_fn
from kerasfeed.tfdata.structure import infer_signature, normalize_signature
from kerasfeed.tfdata.tail import TailOptions, own_sharding
from kerasfeed.tfdata.unbatching import unbatch_rows


class PassSource(Protocol):
    """What a stream dataset reads: ``ShardedStream`` or ``QueueFeed``."""

    def open_pass(self) -> Any: ...

    def close(self) -> None: ...

    def attach_stats(self, collector: Any) -> None: ...


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


def _assemble(
    open_pass: Callable[[], Any],
    signature: Any,
    describe: Callable[[Any], str],
    api: str,
    tail: TailOptions,
    timeout: Optional[float],
    stats: Any,
    waits: Any = None,
) -> tf.data.Dataset:
    codec = ChunkCodec(signature, api)
    open_pass = counted_passes(open_pass, tail.items_per_epoch, api)  # checked against a declared length
    passes = itertools.count()
    ds = tf.data.Dataset.from_generator(
        lambda: chunks(open_pass, codec, describe, stats, next(passes), timeout, api, waits),
        output_signature=codec.chunk_signature,
    )
    ds = unbatch_rows(ds.prefetch(2))
    if codec.needs_decode:
        ds = ds.map(graph_fn(codec.decode))
    ds = tail.apply(ds, variable=any(codec.variable))
    ds._kerasfeed_stats = stats  # kerasfeed.stats(ds)
    return ds


def stream_dataset(
    source: PassSource,
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
        source: opens one pass per iteration of the dataset.
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
        ds = _assemble(source.open_pass, signature, describe, api, tail, timeout, stats, getattr(source, "waits", None))
        if sharding is not None:
            ds = own_sharding(ds, sharding)
    except BaseException:
        source.close()
        raise
    setattr(ds, tag, source)
    weakref.finalize(ds, source.close)  # producer threads / worker processes stop with the dataset
    return ds
