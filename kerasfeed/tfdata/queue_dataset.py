"""``from_queue``: a producer that does not know the epoch length, as ``tf.data``.

``kerasfeed.streams.queue.QueueFeed`` cuts the producer's items into epochs
at ``END_OF_EPOCH``; ``stream_assembly.py`` turns the feed into a dataset.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE
from kerasfeed.streams.queue import END_OF_EPOCH, QueueFeed
from kerasfeed.tfdata.stream_assembly import stream_dataset, tail_options


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
    items_per_epoch: Optional[int] = None,
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
            the epoch with that error (the next pass reads the next epoch).
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
        items_per_epoch: the number of items the producer puts in every
            epoch, if it is always the same: the dataset then has a known
            cardinality, ``model.fit`` knows its steps and does not warn; an
            epoch with another count fails with a ``kerasfeed.StreamError``.

    Returns:
        A ``tf.data.Dataset`` of unknown cardinality (known with
        ``items_per_epoch``). Dropping it stops a callable producer (its next
        ``put`` raises). Without ``items_per_epoch``, ``model.fit`` (Keras
        3.15, TensorFlow) learns the number of steps from the first epoch,
        one too many, and warns "Your input ran out of data" at the end of
        every epoch; a later, longer epoch is cut at that many steps and its
        rest skipped; a shorter one ends early.

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
    tail = tail_options(locals())
    _v.positive_int("probe", probe)
    feed = QueueFeed(producer, maxsize=maxsize, timeout=timeout)
    # The feed times its own waits (and the probe's): no pass-level timeout.
    return stream_dataset(
        feed,
        api="from_queue",
        tag="_kerasfeed_feed",
        describe=lambda origin: f"{origin[1]} of epoch {origin[0]} from {feed.name}",  # origin: (epoch, n)
        probes=lambda: [(item, (0, i)) for i, item in enumerate(feed.peek(probe))],
        output_signature=output_signature,
        tail=tail,
    )


__all__ = ["from_queue", "END_OF_EPOCH"]
