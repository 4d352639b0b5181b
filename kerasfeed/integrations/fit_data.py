"""The kerasfeed data a running ``model.fit`` reads (``FitData.of``, through ``kerasfeed/_keras_fit.py``), and
its position in a backup: ``position`` saves it, ``restore`` resumes from it (NOTE [ Resuming inside an epoch ])."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from kerasfeed._keras_epoch_iterator import start_epoch_at
from kerasfeed._keras_fit import FitView, find_fit, refuse, restore_epoch
from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged
from kerasfeed.sampling.protocol import order_summary, pass_fingerprint


@dataclasses.dataclass
class FitData:
    """A running fit and the kerasfeed pipelines its ``x`` reads (none: other data).

    Attributes:
        view: the fit call (epoch iterator, steps_per_epoch).
        pipelines: the ``PassPipeline``s that read ``x``'s passes.
    """

    view: Optional[FitView]
    pipelines: list
    # The saved position ``check`` accepted last: ``resume`` restores its items left out (max_skipped).
    accepted: Optional[dict] = None
    restored: Optional[int] = None  # the epoch ``restore`` made the fit start at, until it starts

    @classmethod
    def of(cls, model: Any) -> "FitData":
        """The data of ``model``'s running ``fit`` (call from ``on_train_begin``)."""
        found: list = []

        def holds(x: Any) -> bool:
            for candidate in (x, getattr(x, "_tf_dataset", None)):
                pipeline = None if candidate is None else find_tagged(candidate, PIPELINE_ATTR)
                if pipeline is not None and hasattr(pipeline, "pin") and pipeline not in found:
                    found.append(pipeline)
            return True

        view = find_fit(holds, model=model)
        data = cls(view, found if view is not None else [])
        data.epoch_begins(None)  # what an earlier fit's callback said (one that raised) no longer holds
        return data

    def epoch_begins(self, epoch: Optional[int], *, owner: str = "kerasfeed.BackupAndRestore") -> None:
        """A kerasfeed callback's ``on_epoch_begin(epoch)`` (None: the fit ends): the first epoch
        must be the restored one, and the pipelines read pass ``epoch`` (``PassPipeline.expect``).

        Raises:
            KerasStructureError: the fit started at another epoch than the one restored.
        """
        restored, self.restored = self.restored, None
        if epoch is not None and restored is not None and epoch != restored:
            raise refuse(f"its fit started at epoch {epoch} after {owner} set model._initial_epoch={restored}",
                         "The backup's epoch was not restored: refused rather than train other passes.")
        for pipeline in self.pipelines:
            pipeline.expect(self.view, epoch)

    @property
    def known(self) -> bool:
        """Whether ``fit`` reads kerasfeed data whose position can be kept."""
        return bool(self.pipelines)

    @property
    def main(self) -> Any:
        return self.pipelines[0]

    def check_fit(self, steps: Optional[int] = None, *, owner: str = "kerasfeed.BackupAndRestore") -> None:
        """Refuses what a backup cannot resume exactly (``owner``: the callback, for the messages).

        Args:
            steps: the steps of an epoch, as Keras tells its callbacks (``params["steps"]``;
                None: not known, the data's length is).

        Raises:
            ValueError: an ``initial_state`` numbers the passes, or the fit's
                epochs are not passes (``steps_per_epoch``).
        """
        p = self.main
        if not p.follows_keras:
            raise ValueError(
                f"{owner}: the data was made with `initial_state=`, which numbers its passes "
                "itself; the backup keeps the data position with the weights and restores both. Make the dataset "
                "or loader without initial_state (a fit that starts at initial_epoch=e reads pass e). "
                "Received: a dataset or loader made with initial_state"
            )
        steps = steps or self.view.steps_per_epoch
        if steps and steps != p.batches_per_pass:
            raise ValueError(
                f"{owner} counts one Keras epoch as one pass of the data, but this fit's epochs have "
                f"steps_per_epoch={steps} steps and a pass has {p.batches_per_pass} batches: Keras reads a pass across "
                "epochs, and a backup's batch of an epoch would not say where in which pass the data stands. Drop "
                "steps_per_epoch (or make it a whole pass), or make the pass shorter with "
                "kerasfeed.IndexOrder/shards. "
                f"Received: steps_per_epoch={steps}, batches per pass={p.batches_per_pass}"
            )

    @functools.cached_property
    def _fingerprint(self) -> str:
        return pass_fingerprint(self.main._order)  # the same for the whole fit: hashed once

    def record(self, epoch: int, batch: int) -> dict:
        """The data position after ``batch`` batches of epoch ``epoch`` (its pass);
        with ``max_skipped``, ``"skipped"``: the items left out of the pass before it."""
        p = self.main
        # The pipeline that reads the items keeps them (a loader under TensorFlow reads through its dataset's).
        skipped = max((q.skipped_before(epoch, batch) for q in self.pipelines if getattr(q, "skips", None)),
                      key=len, default=[])
        out = {
            "pass": epoch,
            "batches": batch,
            "items": batch * p.items_per_batch,
            "order": self._fingerprint,
            "order_summary": order_summary(self.main._order),  # to name what changed (not compared itself)
            "items_per_batch": p.items_per_batch,
            "batches_per_pass": p.batches_per_pass,
            # A step's items over every process reading its own shard (each
            # shard is every num_shards-th entry of the pass order, so a global
            # batch is the same items whatever the number of processes).
            "shards": p.num_shards,
            "global_batch": p.items_per_batch * p.num_shards,
        }
        if skipped:
            out["skipped"] = skipped
        return out

    def check(self, saved: dict, where: str, *, owner: str = "kerasfeed.BackupAndRestore") -> None:
        """Refuses a saved position that this run's data cannot continue exactly.

        Raises:
            ValueError: the order (seed, shuffle, order, data), the batch size
                or the pass length differ from the saved run's.
        """
        now = self.record(saved["pass"], saved["batches"])
        names = {
            "order": "the order of the items (seed, shuffle, order=, or the number of items)",
            "global_batch": "the items per step (batch_size x processes reading their own shards)",
            "batches_per_pass": "the batches per pass (the number of items, batch_size or drop_remainder)",
        }
        if "global_batch" not in saved:  # written before processes were counted
            saved = dict(saved, global_batch=saved.get("items_per_batch"))
        changed = [k for k in names if saved.get(k) != now[k]]
        self.accepted = None if changed else saved
        if changed:
            what = "; ".join(_changed_order(saved, now) if k == "order" else
                             f"{names[k]}: saved {_shown(saved, k)}, now {_shown(now, k)}" for k in changed)
            raise ValueError(
                f"{owner}: the backup in {where!r} was taken with other data than this run's, so "
                f"its position (pass {saved['pass']}, batch {saved['batches']}) would point at other items. Changed: "
                f"{what}. Make the data as the saved run did (the executor, the worker count and, with the same "
                f"items per step, the number of processes may change), or delete the backup to start over. "
                f"Received: {now}"
            )

    def position(self, epoch: int, batch: int, steps: Optional[int]) -> dict:
        """What a backup after ``batch`` batches of epoch ``epoch`` saves: ``{"epoch", "batch"}``, and
        ``"data"`` (``record``) for kerasfeed data. An epoch whose ``steps`` batches are all trained is
        saved as the next one's start: a crash before its end (validation, ``on_epoch_end``) resumes at
        the next epoch, as Keras' own callback would."""
        if steps is not None and batch >= steps:
            epoch, batch = epoch + 1, 0
        out = {"epoch": epoch, "batch": batch}
        if self.known:
            out["data"] = self.record(epoch, batch)
        return out

    def restore(self, model: Any, saved: dict, where: str, *, owner: str = "kerasfeed.BackupAndRestore") -> bool:
        """Makes ``model``'s fit start at the saved epoch, and inside it at the saved batch.

        Args:
            saved: what ``position`` made, read back from the backup.
            where: the backup, for the messages.

        Returns:
            Whether the data position was restored; False (data that is
            not kerasfeed's, or a backup without a position): the epoch
            starts again from its first batch.

        Raises:
            ValueError: the saved position is another data's (``check``).
        """
        epoch, batch = int(saved["epoch"]), int(saved["batch"])
        data = saved.get("data")
        exact = self.known and data is not None
        if exact:
            self.check(data, where, owner=owner)
            self.resume(epoch, batch, owner=owner)
        restore_epoch(model, epoch, owner=owner)  # Keras' trainer starts at it (as its BackupAndRestore does)
        self.restored = epoch  # checked when the first epoch begins (epoch_begins)
        return exact

    def resume(self, epoch: int, batch: int, *, owner: str = "kerasfeed.BackupAndRestore") -> None:
        """Makes epoch ``epoch`` of this fit start at its batch ``batch``.

        NOTE [ Resuming inside an epoch ]: the pass of epoch ``epoch`` begins
        after the items of its first ``batch`` batches (``PassPipeline.pin``),
        and Keras' epoch iterator numbers that epoch's steps from ``batch``
        and stops at the epoch's usual end, so the progress bar, the
        callbacks' batch numbers and ``on_train_batch_end`` logs read as in
        the interrupted run, and Keras never runs out of data. Later epochs
        are whole passes. Items the saved run left out (``max_skipped``, the
        ``"skipped"`` of the position ``check`` accepted) count against the
        resumed pass's budget and, where items are batches, are passed over.
        ``_keras_epoch_iterator.start_epoch_at`` does Keras' part (refusing a
        Keras whose epoch iterator differs, before any batch).
        """
        if batch:  # its checks first: nothing pinned if it refuses
            checked = any(getattr(p, "length_checked", False) for p in self.pipelines)
            start_epoch_at(self.view, batch, owner=owner, length_checked=checked)
        saved = self.accepted if self.accepted is not None and self.accepted.get("pass") == epoch else {}
        left_out = [i for e, i in saved.get("skipped", ()) if e == epoch]
        for pipeline in self.pipelines:
            extra = pipeline.resume_skipped(epoch, left_out) if hasattr(pipeline, "resume_skipped") else 0
            pipeline.pin(epoch, batch * pipeline.items_per_batch + extra)


def _changed_order(saved: dict, now: dict) -> str:
    """The order's change in words: which of its kind and arguments differ where the backup kept them (written
    since 2026-11-28), else its fingerprints."""
    was, new = saved.get("order_summary"), now["order_summary"]
    keys = sorted(was.keys() | new.keys()) if isinstance(was, dict) else []
    differ = [k for k in keys if was.get(k) != new.get(k)]
    if not differ:
        return (f"the order of the items (seed, shuffle, order=, or the number of items): saved "
                f"{saved.get('order')!r}, now {now['order']!r}")
    return "the order of the items: " + ", ".join(f"{k} saved {was.get(k)!r}, now {new.get(k)!r}" for k in differ)


def _shown(record: dict, key: str) -> str:
    """A record's value for a refusal; the items per step with what they are made of (a run on 2 processes
    resumed on 1 names both counts)."""
    value = record.get(key)
    shards, per_batch = record.get("shards"), record.get("items_per_batch")
    if key == "global_batch" and shards is not None and per_batch is not None:
        return f"{value!r} ({per_batch} x {shards} process{'es' if shards != 1 else ''})"
    return repr(value)


__all__ = ["FitData"]
