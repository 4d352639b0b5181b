"""The pass arguments every front end resolves the same way (TF-free).

``to_dataset`` and ``to_loader`` must turn the same order, shard and resume
arguments into the same passes (order, batch counts, resumed first pass):
``resolve_passes`` does it for both (the shards come from ``shards.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from kerasfeed._validation import _where
from kerasfeed.sampling.protocol import check_resume_order, resolve_order
from kerasfeed.sampling.state import ResumeState


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
            batches, and with ``batch_size=None`` the items the saved run
            left out before them).
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
    # Only None is a fresh start: {}, 0 or False were taken as one, in silence.
    return ResumeState.from_dict({"epoch": 0, "batches": 0} if initial_state is None else initial_state)


def resolve_passes(
    total: Optional[int], *, order: Any, shuffle: bool, seed: Optional[int], num_shards: int, shard_index: int,
    batch_size: Optional[int], drop_remainder: bool, resume: ResumeState, owner: Optional[str] = None,
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
        resume.check_batching(batch_size, owner=_where(owner))
        return Passes(None, None, None, None, resume, resume.batches * (batch_size or 1))
    order = resolve_order(total, order, shuffle=shuffle, seed=seed, num_shards=num_shards, shard_index=shard_index)
    n = order.shard_length
    if batch_size is not None and drop_remainder and batch_size > n:
        raise ValueError(
            f"{_where(owner)}`batch_size={batch_size}` with `drop_remainder=True` leaves no batch: each pass has "
            f"{n} items. Received: batch_size={batch_size}"
        )
    check_resume_order(resume, order)
    resume.check_batching(batch_size, owner=_where(owner))
    per_pass = count_batches(n, batch_size, drop_remainder)
    if resume.batches >= per_pass:
        raise ValueError(
            f"{_where(owner)}`initial_state` resumes after {resume.batches} batches but a pass has only {per_pass}; "
            f"resume at the next epoch instead. Received: initial_state={resume.to_dict()}"
        )
    skip = resume.batches * (batch_size or 1)
    if batch_size is None:
        # Items left out before the saved position were batches Keras never counted (loading/skips.py).
        skip += len(resume.skipped_in(resume.epoch))
        if skip >= n:
            raise ValueError(
                f"{_where(owner)}`initial_state` resumes after {resume.batches} batches and {skip - resume.batches} "
                f"items left out, but a pass has only {n} items; resume at the next epoch instead. "
                f"Received: initial_state={resume.to_dict()}"
            )
    return Passes(order, n, per_pass, count_batches(n - skip, batch_size, drop_remainder), resume, skip)


__all__ = ["Passes", "count_batches", "resolve_passes", "resume_state"]
