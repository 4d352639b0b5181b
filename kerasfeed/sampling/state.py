"""Where a pipeline stands: a small JSON-able state for exact resume."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from kerasfeed import _validation as _v

_KEYS = {"epoch", "batches"}


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """The next element to deliver: batch ``batches`` of pass ``epoch``.

    Pass orders are pure functions of ``(seed, epoch)`` (``IndexOrder``,
    ``BalancedOrder``, ``WeightedOrder``), so this pair, the order and the
    source are all it takes to continue a run exactly where it stopped.
    ``order`` is the fingerprint of the order the state was saved with
    (``kerasfeed.sampling.protocol.order_fingerprint``): resuming with a
    different order is refused. States saved without one resume with any
    order. ``to_dict()`` is plain JSON.

    Args:
        epoch: the pass to resume in (equal to Keras' epoch number).
        batches: elements of that pass already consumed.
        order: fingerprint of the saved run's order, or None.
    """

    epoch: int = 0
    batches: int = 0
    order: Optional[str] = None

    def __post_init__(self):
        for name in ("epoch", "batches"):
            object.__setattr__(self, name, _v.non_negative_int(name, getattr(self, name), owner="ResumeState"))
        if self.order is not None and not isinstance(self.order, str):
            raise ValueError(f"ResumeState.order must be a fingerprint string or None. Received: order={self.order!r}")

    def to_dict(self) -> dict:
        out = {"epoch": self.epoch, "batches": self.batches}
        if self.order is not None:
            out["order"] = self.order
        return out

    @classmethod
    def from_dict(cls, state: Any) -> "ResumeState":
        if isinstance(state, ResumeState):
            return state
        if not isinstance(state, Mapping) or not _KEYS <= set(state) or not set(state) <= _KEYS | {"order"}:
            raise ValueError(
                "A resume state is a dict with exactly the keys 'epoch' and 'batches' (and 'order', the "
                "order's fingerprint, when it was saved with one) as saved from TrainingProgress.state. "
                f"Received: {state!r}"
            )
        return cls(epoch=state["epoch"], batches=state["batches"], order=state.get("order"))
