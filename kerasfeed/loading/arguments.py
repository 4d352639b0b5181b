"""The pass arguments every front end resolves the same way (TF-free).

``to_dataset`` and ``to_loader`` take the same order, shard and resume
arguments and must turn them into the same passes (the same order, the same
number of batches, the same resumed first pass), so both resolve them here:
``shards_from`` reads a ``tf.distribute.InputContext`` (duck-typed: no
TensorFlow needed) or ``num_shards``/``shard_index``, and ``resolve_passes``
makes the order and counts a pass's batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from kerasfeed import _validation as _v
from kerasfeed.sampling.protocol import check_resume_order, resolve_order
from kerasfeed.sampling.state import ResumeState


def _where(owner: Optional[str]) -> str:
    return f"{owner}: " if owner else ""


def shards_from(
    num_shards: Optional[int], shard_index: Optional[int], input_context: Any, *, owner: Optional[str] = None
) -> tuple[Optional[int], Optional[int]]:
    """``(num_shards, shard_index)`` from an input context or the explicit pair.

    Args:
        num_shards, shard_index: as given (None: not given).
        input_context: None, or an object with ``num_input_pipelines`` and
            ``input_pipeline_id`` (a ``tf.distribute.InputContext``): this
            pipeline reads shard ``input_pipeline_id`` of
            ``num_input_pipelines``.
        owner: the front end's name, for messages.

    Returns:
        The explicit pair, checked, with None where not given (the caller
        picks the default); or the context's pair.

    Raises:
        ValueError: both given, or a bad value.
        TypeError: ``input_context`` lacks those attributes.
    """
    if input_context is None:
        if num_shards is not None:
            num_shards = _v.positive_int("num_shards", num_shards, owner=owner)
        if shard_index is not None:
            shard_index = _v.non_negative_int("shard_index", shard_index, owner=owner)
        return num_shards, shard_index
    if num_shards is not None or shard_index is not None:
        raise ValueError(
            f"{_where(owner)}Pass either `input_context` or `num_shards`/`shard_index`, not both. "
            f"Received: num_shards={num_shards}, shard_index={shard_index}, input_context={input_context}"
        )
    try:
        pipelines, pipeline_id = input_context.num_input_pipelines, input_context.input_pipeline_id
    except AttributeError:
        raise TypeError(
            f"{_where(owner)}`input_context` must be a tf.distribute.InputContext (or any object with "
            f"`num_input_pipelines` and `input_pipeline_id`). Received: input_context={input_context!r}"
        ) from None
    pipelines = _v.positive_int("input_context.num_input_pipelines", pipelines, owner=owner)
    pipeline_id = _v.non_negative_int("input_context.input_pipeline_id", pipeline_id, owner=owner)
    if pipeline_id >= pipelines:
        raise ValueError(
            f"{_where(owner)}`input_context.input_pipeline_id` must be below `num_input_pipelines`. "
            f"Received: input_pipeline_id={pipeline_id}, num_input_pipelines={pipelines}"
        )
    return pipelines, pipeline_id


@dataclasses.dataclass(frozen=True)
class Passes:
    """What a pipeline's passes are, from its arguments.

    Attributes:
        order: the order of every pass (``shard_length``, ``indices(epoch)``);
            None for an endless source.
        items: items in a whole pass (None: endless).
        per_pass: batches (elements) in a whole pass (None: endless).
        first_pass: batches in the first pass (fewer when resumed inside it).
        resume: the resume state the first pass starts from.
        skip: items of the first pass already consumed (``resume.batches``
            batches).
    """

    order: Any
    items: Optional[int]
    per_pass: Optional[int]
    first_pass: Optional[int]
    resume: ResumeState
    skip: int


def count_batches(items: int, batch_size: Optional[int], drop_remainder: bool) -> int:
    """Batches ``items`` items make (each item is a batch when ``batch_size`` is None)."""
    if batch_size is None:
        return items
    return items // batch_size if drop_remainder else -(-items // batch_size)


def resume_state(initial_state: Optional[Mapping[str, int]]) -> ResumeState:
    return ResumeState.from_dict(initial_state or {"epoch": 0, "batches": 0})


def resolve_passes(
    total: Optional[int],
    *,
    order: Any,
    shuffle: bool,
    seed: Optional[int],
    num_shards: int,
    shard_index: int,
    batch_size: Optional[int],
    drop_remainder: bool,
    resume: ResumeState,
    owner: Optional[str] = None,
) -> Passes:
    """Makes the order (``resolve_order``) and counts the batches of a pass.

    Args:
        total: items in the source; None for an endless one (no order, no
            counts: its passes read ``shard_index``, ``shard_index +
            num_shards``, ...).
        order, shuffle, seed, num_shards, shard_index: as for ``resolve_order``.
        batch_size, drop_remainder: the front end's batching.
        resume: from ``resume_state(initial_state)``.
        owner: the front end's name, for messages.

    Raises:
        ValueError: ``drop_remainder`` leaves no batch; the resume state is
            past the end of a pass; the order and the order arguments both
            given, or the resume state saved with another order.
    """
    if total is None:
        return Passes(None, None, None, None, resume, resume.batches * (batch_size or 1))
    order = resolve_order(total, order, shuffle=shuffle, seed=seed, num_shards=num_shards, shard_index=shard_index)
    n = order.shard_length
    if batch_size is not None and drop_remainder and batch_size > n:
        raise ValueError(
            f"{_where(owner)}`batch_size={batch_size}` with `drop_remainder=True` leaves no batch: each pass has "
            f"{n} items. Received: batch_size={batch_size}"
        )
    check_resume_order(resume, order)
    per_pass = count_batches(n, batch_size, drop_remainder)
    if resume.batches >= per_pass:
        raise ValueError(
            f"{_where(owner)}`initial_state` resumes after {resume.batches} batches but a pass has only {per_pass}; "
            f"resume at the next epoch instead. Received: initial_state={resume.to_dict()}"
        )
    skip = resume.batches * (batch_size or 1)
    return Passes(order, n, per_pass, count_batches(n - skip, batch_size, drop_remainder), resume, skip)


__all__ = ["Passes", "count_batches", "resolve_passes", "resume_state", "shards_from"]
