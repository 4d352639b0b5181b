"""Training steps from ``on_train_batch_end`` calls: one call per execution of ``steps_per_execution`` steps."""

from __future__ import annotations

from typing import Any, Optional

from kerasfeed._keras_fit import batch_end_offset, keras_version, report


class StepCount:
    """Steps trained, in all and in the current epoch, as a callback's ``on_train_batch_end`` calls tell them.

    Under ``compile(steps_per_execution=n)`` Keras calls ``on_train_batch_end`` once per ``n`` steps, with the
    ``batch`` of the execution's last step (Keras >= 3.11; its first before: ``batch_end_offset``), so a count of
    calls is a count of executions. Each call adds the steps since the previous one of the epoch; the first adds
    at most one execution (an epoch resumed inside it numbers its batches from where it stopped), and every call
    at least one (a custom loop that passes no step numbers).
    """

    def __init__(self):
        self.total = 0  # steps trained by this callback's fits
        self.epoch = 0  # steps trained in the current epoch (by this run)
        self._done: Optional[int] = None  # the epoch's steps done at the last call (Keras' numbering)

    def epoch_begins(self) -> None:
        self.epoch, self._done = 0, None

    def batch_ends(self, model: Any, batch: Any, params: Optional[dict]) -> int:
        """Counts the call ``on_train_batch_end(batch)``; returns the steps it adds."""
        batch = batch if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 0 else 0
        done = batch + batch_end_offset(model)
        steps = (params or {}).get("steps")
        if isinstance(steps, int) and steps > 0:
            done = min(done, steps)  # Keras < 3.11: an epoch's last, shorter execution
        if self._done is None:
            per_call = getattr(model, "steps_per_execution", 1)
            per_call = per_call if isinstance(per_call, int) and per_call > 0 else 1
            added = max(1, min(done, per_call))
        else:
            added = max(1, done - self._done)
        self._done = done
        self.epoch += added
        self.total += added
        return added

    def crossed(self, added: int, every: int) -> bool:
        """Whether the last ``added`` steps passed a multiple of ``every``."""
        return self.total // every > (self.total - added) // every


def step_offset(model: Any, start: int, batch: Any, steps: Any, guess: int) -> int:
    """What to add to ``on_train_batch_end``'s ``batch`` for the batches trained, read from an epoch's first call:
    under ``steps_per_execution=n`` (> 1) Keras gives an execution's last step (``start + n - 1``, 1 to add) or its
    first (``start``, ``n`` to add; Keras 3.7 to 3.10, keras#21422). ``guess`` is ``batch_end_offset``'s, from
    the Keras version; where the call says the other, that one is used and reported (once): a backup saved by
    the guess would point a batch before or after what was trained.

    Args:
        start: the batches of the epoch trained before this fit's first step of it (a resumed epoch's).
        steps: the epoch's steps (Keras' ``params``), or None.
    """
    spe = getattr(model, "steps_per_execution", 1)
    if not isinstance(spe, int) or spe <= 1 or not isinstance(batch, int):
        return guess
    last = (min(start + spe, steps) if isinstance(steps, int) and steps > start else start + spe) - 1
    seen = 1 if batch == last else spe if batch == start else None
    if last == start or seen is None or seen == guess:
        return guess  # one step (both agree), or a numbering neither says (checked elsewhere)
    report(f"its fit gives on_train_batch_end an execution's {'last' if seen == 1 else 'first'} step (batch "
           f"{batch} after {start} with steps_per_execution={spe}), not its {'first' if seen == 1 else 'last'} as "
           f"kerasfeed expects of Keras {keras_version()} (keras#21422)",
           "kerasfeed counts the batches trained by what the call says; the data trained is the same.")
    return seen


__all__ = ["StepCount", "step_offset"]
