"""Where a pipeline stands: a small JSON-able state for exact resume."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """The next element to deliver: batch ``batches`` of pass ``epoch``.

    Pass orders are pure functions of ``(seed, epoch)`` (``IndexOrder``), so
    this pair, the seed and the source are all it takes to continue a run
    exactly where it stopped. ``to_dict()`` is plain JSON.

    Args:
        epoch: the pass to resume in (equal to Keras' epoch number).
        batches: elements of that pass already consumed.
    """

    epoch: int = 0
    batches: int = 0

    def __post_init__(self):
        for name in ("epoch", "batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ResumeState.{name} must be a non-negative int. Received: {name}={value!r}")

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "batches": self.batches}

    @classmethod
    def from_dict(cls, state: Any) -> "ResumeState":
        if isinstance(state, ResumeState):
            return state
        if not isinstance(state, Mapping) or set(state) != {"epoch", "batches"}:
            raise ValueError(
                "A resume state is a dict with exactly the keys 'epoch' and 'batches' "
                f"(as saved from TrainingProgress.state). Received: {state!r}"
            )
        return cls(epoch=state["epoch"], batches=state["batches"])
