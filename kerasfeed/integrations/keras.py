"""Keras callbacks: record where the input pipeline stands for exact resume."""

from __future__ import annotations

import json
import os
import sys
import weakref
from typing import Any, Mapping, Optional, Union

import keras

from kerasfeed import _validation as _v
from kerasfeed._keras_callback import callback_model
from kerasfeed._keras_fit import batch_end_offset
from kerasfeed._keras_fit_frames import is_fit
from kerasfeed.integrations.steps import step_offset
from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged
from kerasfeed.sampling.protocol import check_resume_order, order_fingerprint
from kerasfeed.sampling.state import ResumeState


def fingerprint_of(obj: Any) -> str:
    """The fingerprint of an order, or of the order behind a kerasfeed dataset or loader."""
    return order_fingerprint(order_of(obj))


def order_of(obj: Any) -> Any:
    """An order, or the order behind a kerasfeed dataset or loader.

    Raises:
        TypeError: ``obj`` is neither an order nor a dataset made by a
            kerasfeed front end.
    """
    if callable(getattr(obj, "indices", None)) and hasattr(obj, "shard_length"):
        return obj
    pipeline = find_tagged(obj, PIPELINE_ATTR)
    order = getattr(pipeline, "_order", None)  # PassPipeline keeps the order it reads in
    if order is None:
        raise TypeError(
            "`order` must be an order object (IndexOrder, BalancedOrder, WeightedOrder, ...) or a dataset "
            f"made by kerasfeed.to_dataset. Received: order={obj!r} of type {type(obj).__name__}"
        )
    return order


class TrainingProgress(keras.callbacks.Callback):
    """Tracks the pass and batch that training has consumed: the data half of a checkpoint.

    With ``model.fit``, use ``kerasfeed.BackupAndRestore``: it saves this
    position with the model and the optimizer in one atomic commit, and the
    same ``fit`` call started again resumes inside the interrupted epoch.
    ``TrainingProgress`` is for custom loops, or for weights you save
    yourself: a state is right only with the weights of the same batch.
    Paired with ``keras.callbacks.BackupAndRestore`` it is wrong: that
    callback restores weights of another moment (an epoch's end at
    ``save_freq="epoch"``), and a state at batch ``k`` then skips the ``k``
    batches those weights never trained.

    A state ``{"epoch": e, "batches": b}`` given as ``initial_state=`` to
    ``to_dataset``/``to_loader`` starts at batch ``b`` of pass ``e``. Dataset
    passes and Keras epochs are counted alike: a run that starts at
    ``initial_epoch=e`` reads pass ``e``.

    Args:
        initial_state: the state the dataset was resumed from, if any.
        path: if given, the JSON file the state is written to (atomically)
            every ``save_every`` batches and at the end of every epoch;
            a directory, or a path under a file, is refused here. Only
            right beside weights saved at those same batches; else save
            the state with your weights yourself (``save``).
        save_every: batches between writes to ``path``.
        order: the order being trained on (an ``IndexOrder``,
            ``BalancedOrder``, ... or, best, the dataset or loader being
            fitted): its fingerprint is saved in the state, and the front
            ends then refuse to resume from that state with a different
            order. Given the dataset or loader, the state also records the
            items its batches held (resuming with another ``batch_size`` is
            refused), and a ``fit`` whose epochs are not whole passes
            (``steps_per_epoch`` shorter than a pass) is refused at its start:
            the saved position would point elsewhere. Without ``order``, the
            fingerprint of ``initial_state`` (if any) is kept.

    Raises:
        ValueError: ``order`` differs from the order ``initial_state`` was
            saved with, or bad arguments.

    Example: a custom loop. ``checkpoint(model, progress)`` writes the
    weights (``model.save_weights``: model and optimizer) and
    ``progress.save(...)`` of the same moment and makes both current with
    one atomic rename; ``restore(model)`` loads both back and returns the
    state, or None on a first run (both in ``docs/resume.md``):

    ```python
    state = restore(model)
    loader = kerasfeed.to_loader(seq, shuffle=True, seed=0, initial_state=state)
    progress = kerasfeed.TrainingProgress(state, order=loader)
    progress.set_model(model)
    model.stop_training = False
    for epoch in range(progress.state()["epoch"], 10):
        progress.on_epoch_begin(epoch)
        for step, (x, y) in enumerate(loader):  # a resumed pass starts at its next batch
            model.train_on_batch(x, y)
            progress.on_train_batch_end(step)
            if progress.state()["batches"] % 100 == 0:  # and at each pass's end
                checkpoint(model, progress)
        progress.on_epoch_end(epoch)
    ```

    Under ``model.fit`` with weights you save at the batch of the state, the
    interrupted epoch gets a ``fit`` call of its own (``docs/resume.md``): one
    call going on past it trains every batch too (the resumed dataset's
    ``cardinality()`` is a whole pass), but Keras warns "Your input ran out of
    data" at the end of the resumed epoch, and a resumed ``to_loader`` refuses it.
    """

    def __init__(self, initial_state: Optional[Mapping[str, int]] = None,
                 path: Optional[Union[str, os.PathLike]] = None, save_every: int = 1, *, order: Any = None):
        super().__init__()
        save_every = _v.positive_int("save_every", save_every)
        start = ResumeState.from_dict({"epoch": 0, "batches": 0} if initial_state is None else initial_state)
        self._resume = start
        self._order = start.order
        # Items per batch and batches per pass of the front end given as `order` (None: not known).
        pipeline = None if order is None else find_tagged(order, PIPELINE_ATTR)
        # Held weakly: the items it left out (max_skipped) go into every state; it must not keep the data alive.
        self._pipeline = (lambda: None) if pipeline is None else weakref.ref(pipeline)
        self._per_batch = getattr(pipeline, "items_per_batch", None)
        self._per_pass = getattr(pipeline, "batches_per_pass", None)
        if self._per_batch is None and start.items is not None and start.batches:
            self._per_batch = start.items // start.batches  # keeps recording what the state recorded
        if order is not None:
            order = order_of(order)
            check_resume_order(start, order)
            self._order = order_fingerprint(order)
            if pipeline is not None:
                start.check_batching(self._per_batch, owner="TrainingProgress: ")
        self._epoch, self._batches = start.epoch, start.batches
        self.path = None if path is None else _state_path(path, owner="TrainingProgress")
        self.save_every = save_every
        self._step_end = 1  # on_train_batch_end's batch + this = the epoch's batches trained (a fit sets it)

    def state(self) -> dict:
        """``{"epoch": e, "batches": b}``: the next batch is batch b of pass e.

        With an order fingerprint (see ``order``) the dict also has ``"order"``,
        and given the dataset or loader as ``order``, ``"items"``.
        """
        epoch, batches = self._epoch, self._batches
        skipped = self._skipped(epoch, batches)
        if skipped and self._per_batch == 1 and self._per_pass and batches + len(skipped) >= self._per_pass:
            # Items that are batches, left out up to the pass's end: the next position is the next pass.
            epoch, batches, skipped = epoch + 1, 0, []
        items = None if self._per_batch is None else batches * self._per_batch
        return ResumeState(epoch, batches, self._order, items, skipped or None).to_dict()

    def _skipped(self, epoch: int, batches: int) -> list:
        # What the pipeline left out of the pass before this position (max_skipped); without a
        # live pipeline, what the state it resumed from says of that pass.
        pipeline = self._pipeline()
        if pipeline is not None and pipeline.skips is not None:
            return pipeline.skipped_before(epoch, batches)
        return [[epoch, i] for i in self._resume.skipped_in(epoch)]

    def on_train_begin(self, logs: Any = None) -> None:
        params = self.params or {}
        steps, start = params.get("steps"), self._resume
        if self._per_pass is None or steps is None:
            return  # nothing known
        if start.batches and params.get("epochs") == start.epoch + 1:
            return  # the resumed epoch's own call: its pass is shorter
        if steps != self._per_pass:
            raise ValueError(
                f"TrainingProgress counts one Keras epoch as one pass of the data, but this fit's epochs have "
                f"{steps} steps and a pass has {self._per_pass} batches: Keras would go on reading a pass across "
                "epochs, and a saved position would point elsewhere. Drop `steps_per_epoch` (or make it a pass), "
                "or fit the resumed epoch in a call of its own. "
                f"Received: steps_per_epoch={steps}, batches per pass={self._per_pass}"
            )

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        # Keras < 3.11's fit under steps_per_execution gives the execution's first step (keras#21422); a custom
        # loop (a CallbackList's too) gives the step it trained.
        in_fit = _in_fit(sys._getframe(1))
        self._step_end = batch_end_offset(callback_model(self)) if in_fit else 1
        self._first_end = in_fit  # its first on_train_batch_end says which step Keras gives (step_offset)
        self._epoch = epoch
        self._batches = self._resume.batches if epoch == self._resume.epoch else 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        skip = self._resume.batches if self._epoch == self._resume.epoch else 0
        steps = (self.params or {}).get("steps")
        if getattr(self, "_first_end", False):  # the fit numbers this epoch's steps from 0 (its data's pass)
            self._first_end = False
            self._step_end = step_offset(callback_model(self), 0, batch, steps, self._step_end)
        self._batches = skip + batch + self._step_end  # `batch` is a step index in this epoch
        done = batch + self._step_end  # of this fit's steps
        if (steps is not None and done >= steps) or (self._per_pass and self._batches >= self._per_pass):
            # The pass is over before validation and on_epoch_end run: a crash
            # there resumes at the next pass (a position at the pass's end is
            # refused by the front ends, and leaves no steps to fit).
            self._epoch, self._batches = self._epoch + 1, 0
        if self.path is not None and self._batches % self.save_every == 0:
            self._write(self.path)  # checked when the callback was made

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        # Keras ends an epoch early (and still calls this) when a callback
        # sets `stop_training` mid-epoch; then the position stays as it is.
        steps = (self.params or {}).get("steps")
        skip = self._resume.batches if epoch == self._resume.epoch else 0
        # A custom loop may call the hooks without set_model: no model, nothing that stopped the epoch early.
        stopped = bool(getattr(callback_model(self), "stop_training", False))
        complete = (steps is not None and self._batches - skip >= steps) or not stopped
        if steps is None and self._per_pass:  # the pass's length is known: its last batch moved on already, and
            complete = False  # a loop that broke off inside it (a time limit) stays where it stopped
        if complete:
            self._epoch, self._batches = epoch + 1, 0
        if self.path is not None:
            self._write(self.path)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Writes ``state()`` as JSON, atomically (parent directories are created)."""
        self._write(_state_path(path, owner="TrainingProgress.save"))

    def _write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"  # processes sharing the path never share the temporary
        try:
            with open(tmp, "w") as f:
                json.dump(self.state(), f)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @staticmethod
    def load(path: Union[str, os.PathLike], missing_ok: bool = True) -> dict:
        """Reads a state written by ``save``.

        Args:
            path: the JSON file ``TrainingProgress(path=...)`` writes.
            missing_ok: when the file does not exist (a first run), return
                the start state ``{"epoch": 0, "batches": 0}``; with False,
                raise ``FileNotFoundError`` instead.

        Returns:
            ``{"epoch": int, "batches": int}``.
        """
        path = _state_path(path, owner="TrainingProgress.load")
        if missing_ok and not os.path.exists(path):
            return ResumeState(0, 0).to_dict()
        with open(path) as f:
            text = f.read()
        try:
            state = json.loads(text)
        except ValueError as e:
            raise ValueError(
                f"TrainingProgress.load: {path!r} is not a resume state written by TrainingProgress.save: not "
                f"JSON ({e}); a machine that crashed while it was written can leave it empty. Pass the state "
                f"yourself, or delete the file to start over. Received: {text[:80]!r}"
            ) from None
        try:
            return ResumeState.from_dict(state).to_dict()
        except ValueError as e:
            raise ValueError(f"TrainingProgress.load: {path!r}: {e}") from None


def _state_path(path: Any, *, owner: str) -> str:
    """``path`` as a str once it can name the JSON file of a resume state; else a clear error."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes) or not os.fspath(path):
        raise TypeError(f"{owner}: `path` must be a non-empty str path of a JSON file. Received: path={path!r}")
    path = os.fspath(path)
    if path.endswith((os.sep, "/")) or os.path.isdir(path):
        raise ValueError(
            f"{owner}: `path` names the JSON file the resume state is written to, not a directory; e.g. "
            f"{os.path.join(path, 'data_state.json')!r}. Received: path={path!r}"
        )
    parent = _v.nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(parent):
        raise ValueError(
            f"{owner}: `path` is under {parent!r}, which is a file, not a directory. Received: path={path!r}"
        )
    return path


def _in_fit(frame: Any, depth: int = 12) -> bool:
    """Whether a Keras ``fit`` calls (through its callback list) the hook running above ``frame``."""
    for _ in range(depth):
        if frame is None:
            return False
        if is_fit(frame):
            return True
        frame = frame.f_back
    return False
