"""Where a pipeline stands: a small JSON-able state for exact resume."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from kerasfeed import _validation as _v

_KEYS = {"epoch", "batches"}
_OPTIONAL = {"order", "items", "skipped"}


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """The next element to deliver: batch ``batches`` of pass ``epoch``.

    Pass orders are pure functions of ``(seed, epoch)`` (``IndexOrder``, ``BalancedOrder``,
    ``WeightedOrder``), so this pair, the order and the source are all it takes to continue a run exactly
    where it stopped. ``order`` is the fingerprint of the order the state was saved with
    (``kerasfeed.sampling.protocol.order_fingerprint``): resuming with a different order is refused.
    States saved without one resume with any order. ``to_dict()`` is plain JSON.

    ``items`` is how many items of the pass those batches held, when the state was saved knowing the
    batching (``TrainingProgress(order=<the dataset or loader>)``): resuming with another ``batch_size``
    is refused, as ``batches`` would then skip another number of items.

    ``skipped`` lists the items the saved run left out of pass ``epoch`` before its position
    (``max_skipped=``), as ``[pass, index]`` pairs: the resumed run counts them against its budget, and
    with ``batch_size=None`` (each item a batch) its position counts them too (each was a batch Keras
    never saw). At most the budget of one pass.

    Args:
        epoch: the pass to resume in (equal to Keras' epoch number).
        batches: elements of that pass already consumed.
        order: fingerprint of the saved run's order, or None.
        items: items of the pass in those batches, or None (not known).
        skipped: ``[[pass, index], ...]`` left out before the position, or None (none, or not known).

    Example:

    ```python
    state = kerasfeed.ResumeState.from_dict({"epoch": 2, "batches": 5})
    state.to_dict()   # {'epoch': 2, 'batches': 5}: what initial_state= takes
    ```
    """

    epoch: int = 0
    batches: int = 0
    order: Optional[str] = None
    items: Optional[int] = None
    skipped: Optional[tuple] = None

    def __post_init__(self):
        for name in ("epoch", "batches"):
            object.__setattr__(self, name, _v.non_negative_int(name, getattr(self, name), owner="ResumeState"))
        if self.order is not None and not isinstance(self.order, str):
            raise ValueError(f"ResumeState.order must be a fingerprint string or None. Received: order={self.order!r}")
        items = _v.non_negative_int("items", self.items, allow_none=True, owner="ResumeState")
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "skipped", _skipped_pairs(self.skipped))

    def to_dict(self) -> dict:
        out = {"epoch": self.epoch, "batches": self.batches}
        if self.order is not None:
            out["order"] = self.order
        if self.items is not None:
            out["items"] = self.items
        if self.skipped:
            out["skipped"] = [list(pair) for pair in self.skipped]
        return out

    def skipped_in(self, epoch: int) -> list:
        """The indices ``skipped`` lists for pass ``epoch``."""
        return [i for e, i in self.skipped or () if e == epoch]

    def check_batching(self, batch_size: Optional[int], *, owner: str = "") -> None:
        """Refuses to resume with batches of another size than the state was saved with.

        Raises:
            ValueError: the saved ``items`` are not ``batches`` batches of ``batch_size``.
        """
        per_batch = batch_size or 1
        if self.items is None or self.items == self.batches * per_batch:
            return
        saved = f"{self.items // self.batches} items" if self.batches and self.items % self.batches == 0 else "items"
        raise ValueError(
            f"{owner}`initial_state` was saved after {self.batches} batches holding {self.items} items of pass "
            f"{self.epoch} (batches of {saved}), but this pipeline's batches hold {per_batch}: resuming would skip "
            f"{self.batches * per_batch} items, repeating or losing some. Resume with the batch_size the state was "
            f"saved with, or from the next pass: initial_state={{'epoch': {self.epoch + 1}, 'batches': 0}}. "
            f"Received: initial_state={self.to_dict()}, batch_size={batch_size}"
        )

    @classmethod
    def from_dict(cls, state: Any) -> "ResumeState":
        if isinstance(state, ResumeState):
            return state
        if not isinstance(state, Mapping) or not _KEYS <= set(state) or not set(state) <= _KEYS | _OPTIONAL:
            raise ValueError(
                "A resume state is a dict with exactly the keys 'epoch' and 'batches' (and 'order', the "
                "order's fingerprint, 'items' and 'skipped', when it was saved with them) as saved from "
                f"TrainingProgress.state. Received: {state!r}"
            )
        return cls(epoch=state["epoch"], batches=state["batches"], order=state.get("order"), items=state.get("items"),
                   skipped=state.get("skipped"))


def _skipped_pairs(value: Any) -> Optional[tuple]:
    """``skipped`` as a tuple of ``(pass, index)`` int pairs (None when empty)."""
    if value is None:
        return None
    pairs = []
    ok = isinstance(value, (list, tuple))
    for pair in value if ok else ():
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            ok = False
            break
        try:
            pairs.append(tuple(_v.non_negative_int("skipped", v) for v in pair))
        except ValueError:
            ok = False
            break
    if not ok:
        raise ValueError(
            "ResumeState: `skipped` must be a list of [pass, index] pairs of non-negative ints (the items a run "
            f"left out before its position, as TrainingProgress.state saves them). Received: skipped={value!r}"
        )
    return tuple(pairs) or None
