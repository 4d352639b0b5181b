"""The tail of every kerasfeed pipeline: shuffle buffer, batching, prefetch, device.

``to_dataset`` and the stream functions take these as flat keyword arguments
and build one ``TailOptions`` from them, checked before anything starts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE

logger = logging.getLogger("kerasfeed")


@dataclasses.dataclass(frozen=True)
class TailOptions:
    """How elements are shuffled, batched and prefetched at the end of a pipeline.

    Args:
        batch_size: None when elements are already batches; an int batches them.
        drop_remainder: with ``batch_size``, drop the last short batch.
        ragged: with ``batch_size``, ragged batches for variable shapes
            instead of zero-padded ones.
        padding_values: passed to ``padded_batch`` for variable shapes.
        shuffle_buffer: shuffle elements in a buffer of this size, reshuffled
            every pass (stream functions only).
        seed: seed of that buffer.
        prefetch: elements prefetched at the end; 0 or None disables;
            ``tf.data.AUTOTUNE`` lets tf.data size the buffer.
        device: e.g. ``"/gpu:0"``: prefetch onto that device as the last step.
        items_per_epoch: items every pass yields, when the caller declares it
            (stream functions only): the batched dataset then has that
            known cardinality (``batches_per_epoch``), so ``model.fit`` knows
            its steps (see ``kerasfeed/streams/declared.py``).

    Raises:
        TypeError, ValueError: a bad value (named, with what was received).

    Example:

    ```python
    tail = TailOptions(batch_size=32, drop_remainder=True)
    ds = tail.apply(tf.data.Dataset.range(100), variable=False)  # 3 batches of 32
    ```
    """

    batch_size: Optional[int] = None
    drop_remainder: bool = False
    ragged: bool = False
    padding_values: Any = None
    shuffle_buffer: Optional[int] = None
    seed: Optional[int] = None
    prefetch: Optional[int] = AUTOTUNE
    device: Optional[str] = None
    items_per_epoch: Optional[int] = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        put("batch_size", _v.positive_int("batch_size", self.batch_size, allow_none=True))
        put("drop_remainder", _v.flag("drop_remainder", self.drop_remainder))
        put("ragged", _v.flag("ragged", self.ragged))
        put("shuffle_buffer", _v.positive_int("shuffle_buffer", self.shuffle_buffer, allow_none=True))
        put("seed", _v.seed("seed", self.seed))
        put("prefetch", _v.prefetch(self.prefetch))
        put("device", _v.device(self.device))
        _v.batching_needs_batch_size(
            self.batch_size, drop_remainder=self.drop_remainder, ragged=self.ragged, padding_values=self.padding_values
        )
        if self.ragged and self.padding_values is not None:
            raise ValueError(
                "`padding_values` pads samples into dense batches, and `ragged=True` batches them without "
                f"padding: give one of them. Received: ragged=True, padding_values={self.padding_values!r}"
            )
        put("items_per_epoch", _v.positive_int("items_per_epoch", self.items_per_epoch, allow_none=True))
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"`items_per_epoch={self.items_per_epoch}` with `batch_size={self.batch_size}` and "
                f"`drop_remainder=True` leaves no batch. Received: items_per_epoch={self.items_per_epoch}"
            )

    @property
    def batches_per_epoch(self) -> Optional[int]:
        """Elements per pass after batching when ``items_per_epoch`` is declared, else None."""
        n, size = self.items_per_epoch, self.batch_size
        if n is None or size is None:
            return n
        return n // size if self.drop_remainder else -(-n // size)

    def shuffle_and_batch(self, ds: Any, *, variable: bool, marked: bool = False) -> Any:
        """The shuffle buffer (if any), then batching; ``variable``: some shape varies;
        ``marked``: elements are ``(item, kept)`` and items left out are dropped
        (``max_skipped``: ``batching.drop_left_out``)."""
        from kerasfeed.tfdata.batching import batch

        if self.shuffle_buffer:
            ds = ds.shuffle(self.shuffle_buffer, seed=self.seed, reshuffle_each_iteration=True)
        ds = batch(ds, self.batch_size, drop_remainder=self.drop_remainder, ragged=self.ragged, variable=variable,
                   padding_values=self.padding_values, marked=marked)
        if self.items_per_epoch is not None:  # a declared length: fit knows its steps
            import tensorflow as tf

            ds = ds.apply(tf.data.experimental.assert_cardinality(self.batches_per_epoch))
        return ds

    def apply(self, ds: Any, *, variable: bool) -> Any:
        """``shuffle_and_batch``, then ``prefetch_tail``."""
        return prefetch_tail(self.shuffle_and_batch(ds, variable=variable), self.prefetch, self.device)


def prefetch_tail(ds: Any, prefetch: Optional[int], device: Optional[str], *, autotune: bool = False) -> Any:
    """Prefetches, then (always last: docs/field_notes.md, *Prefetch to device*) prefetches onto ``device``.

    Unless ``autotune``, it also turns tf.data's autotuning model off: its optimization thread
    takes CPU that worker processes need on a small machine, and deleting an iterator waits for
    it (measured 70-300 ms at the end of one epoch in four on 2 cores, in every tf.data
    pipeline). The parallelism here is fixed anyway, and an AUTOTUNE prefetch buffer still
    adapts (tf.data's legacy prefetch autotuner does not need the model).
    """
    import tensorflow as tf

    from kerasfeed.tfdata import consumers, exit_guard

    # Every kerasfeed dataset passes here: its live iterators must be
    # retired before the interpreter finalizes (see exit_guard), and
    # deleting one must end the waits in progress (see consumers).
    exit_guard.install()
    consumers.install()

    if not autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    if prefetch:
        ds = ds.prefetch(prefetch)
    if device is not None:
        try:
            spec = tf.DeviceSpec.from_string(device)
        except ValueError as e:  # TensorFlow's own words, without what was passed
            message = f"`device` must be a device name such as '/gpu:0': {e} Received: device={device!r}"
            raise ValueError(message) from None
        _warn_if_absent(tf, spec, device)
        try:
            ds = ds.apply(tf.data.experimental.prefetch_to_device(device))
        except tf.errors.InvalidArgumentError as e:  # a job or task this process is not: TensorFlow's stack
            raise ValueError(f"`device` names a device the prefetch cannot be placed on: {e.message.split(' [Op:')[0]} "
                             f"Received: device={device!r}") from None
    return ds


def _warn_if_absent(tf: Any, spec: Any, device: str) -> None:
    """Warns when ``device`` names no device of this process: TensorFlow then prefetches onto the CPU without
    a word (a script written for a GPU still runs on a CPU-only machine, so this is no error)."""
    if spec.device_type is None or spec.job is not None:  # a remote task's device is not listed here
        return
    present = [d.name for d in tf.config.list_logical_devices(spec.device_type.upper())]
    if len(present) <= (spec.device_index or 0):
        logger.warning("kerasfeed: device=%r names no device of this process (its %s devices: %s); TensorFlow "
                       "prefetches onto the CPU instead.", device, spec.device_type.upper(), present or "none")


def own_sharding(ds: Any, parts: int) -> Any:
    """Turns tf.data's auto-sharding off when kerasfeed cut the items into ``parts`` > 1 itself
    (``ShardPlan``, ``kerasfeed/loading/shards.py``): tf.data's DATA fallback would make every
    item on every worker and drop most."""
    import tensorflow as tf

    options = tf.data.Options()
    if parts > 1:
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options)


__all__ = ["TailOptions", "own_sharding", "prefetch_tail"]
