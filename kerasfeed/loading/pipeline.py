"""The Python side of one kerasfeed pipeline, shared by every front end (TF-free).

``PassPipeline`` owns the pass bookkeeping (which pass runs next, the resumed
first pass, the epoch hooks, handing each pass's order to the executor) and
item loading through the executor; its bases follow a running ``fit``
(``FollowsFit``, ``fit_follow.py``) and leave items out under ``max_skipped``
(``LeavesOut``, ``left_out.py``). ``to_dataset`` drives it from
``tf.numpy_function`` calls, ``to_loader`` from plain Python.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional

import numpy as np

from kerasfeed.errors import ItemError, WorkerError
from kerasfeed.execution.base import Executor
from kerasfeed.execution.fpenv import default_fp_env
from kerasfeed.execution.waits import WaitAbandoned
from kerasfeed.loading.begins import Begins, pass_of
from kerasfeed.loading.fit_follow import FollowsFit
from kerasfeed.loading.left_out import LeavesOut
from kerasfeed.loading.skips import SkipBudget, skippable
from kerasfeed.observe.stats import new_collector
from kerasfeed.sampling.views import IndexView, pass_view
from kerasfeed.sources.base import has_own_epoch_hooks, set_epoch

logger = logging.getLogger("kerasfeed")


def _length(source: Any) -> Optional[int]:
    try:
        return int(len(source))
    except Exception:  # noqa: BLE001 - no __len__ (num_batches, an endless source): nothing to compare
        return None

# Indices handed to tf.data per ``window`` call (one Python call per this many items).
INDEX_WINDOW = 4096
# Passes whose order stays available to ``window`` (iterators of older passes are abandoned ones).
KEPT_PASSES = 8
# The mark of a loaded item beside its arrays (``load_marked``): kept, or left out (max_skipped).
_KEPT, _LEFT_OUT = np.bool_(True), np.bool_(False)


class PassPipeline(LeavesOut, FollowsFit):
    """The Python side of one dataset: pass bookkeeping and item loading.

    TensorFlow keeps every ``numpy_function`` callable alive for the life of
    the process, so those callables hold this object only weakly; the
    dataset owns it (and iterators keep their dataset alive). Dropping the
    dataset therefore releases the source and stops worker processes.
    """

    def __init__(self, source: Any, order: Any, executor: Executor, checker: Any, start_epoch: int, skip: int,
                 follow_keras: bool = False):
        self._source, self._order, self.executor, self._checker = source, order, executor, checker
        self._lock = threading.Lock()
        self._next = start_epoch
        self._skip = skip  # items already consumed in the first (resumed) pass
        # Without an initial_state, a pass begun under model.fit is the fit's
        # epoch (NOTE [ The pass follows Keras' epoch ] in kerasfeed/_keras_fit.py), and
        # a pass pinned by kerasfeed.BackupAndRestore starts where the backup stopped.
        self._follow = follow_keras
        self._pins: dict[int, int] = {}  # pass -> items of it already trained on
        # (the fit's epoch iterator, weakly; its epoch): what a kerasfeed callback's on_epoch_begin said
        self._expected: Optional[tuple] = None
        self._resumed_pass = start_epoch if skip else None  # a first pass shorter than the others
        self.items_per_batch, self.batches_per_pass = 1, None  # set by the feed
        self._begins = Begins(KEPT_PASSES)  # each begin's ticket, order and count (NOTE [ A pass begun again ])
        self._hooked: Optional[int] = None  # the pass whose begin hooks ran and whose end hook has not
        self._build: Optional[int] = None  # the ticket a model build began (NOTE [ A model build's pass ends later ])
        self._deferred_end: Optional[int] = None  # that ticket, once its pass ended: its end hook waits
        # NOTE [ An evaluation's model build ] (kerasfeed/_keras_build.py): the next begin is its; then its pass
        self._build_next, self._again = False, None  # (pass, skip), which the evaluation's loop begins again
        # NOTE [ Epoch hooks and items that view the source ]: TensorFlow may keep a numpy_function's
        # arrays without copying them, for as long as the consumer holds the element. A user's hook
        # that overwrites in place what earlier items viewed (``self.x[a:b]``, then an in-place
        # reshuffle in ``on_epoch_end``) would change elements still in flight, so with such hooks,
        # views the source lends this process are copied. Groups copy anyway (the stack) and run
        # the hook after it (``end_pass``).
        self._copy_views = executor.lends_source_arrays and has_own_epoch_hooks(source)
        self.stats = new_collector("pipeline")  # None when switched off
        if self.stats is not None:
            executor.attach_stats(self.stats)
        # max_skipped: failed items left out, up to a budget (None: every failure ends the pass),
        # and what a front end that marks items hands over in a left-out item's place.
        self.skips: Optional[SkipBudget] = None
        self.placeholder: Optional[list] = None
        self._short: Optional[tuple[int, int]] = None  # (pass, items left out): the last pass, complete but short
        self._length: Optional[int] = _length(source)  # what every pass's order was made for

    def begin(self) -> tuple[IndexView, np.int64]:
        """Starts the next pass: ``(indices, ticket)``, its order as a lazy view
        (``indices.window(start, stop)``; never the whole pass in memory) and the begin's ticket, which
        the calls for its items pass back (``pass_of(ticket)`` is the pass: NOTE [ A pass begun again ])."""
        epoch, skip, build = self._upcoming()
        indices = pass_view(self._order, epoch)[skip:]
        ticket = self._begins.issue(epoch, indices)
        with self._lock:
            deferred, self._deferred_end = self._deferred_end, None
            self._build = ticket if build else None
        if deferred is not None and pass_of(deferred) != epoch:
            self._run_end_hook(pass_of(deferred))  # the build's pass is not begun again: it ended
        if self.stats is not None:
            self.stats.pass_begin(epoch)
        if self.skips is not None:
            self.skips.begin(epoch, skip)
        if self._resumed_pass is not None and epoch == self._resumed_pass + 1:
            self._check_keras_length()
        # A pass begun again whose earlier begin ran the begin hooks, and not yet the end hook (a model build's
        # iterator; a fit an exception ended): the source is in that pass already, its hooks run once.
        if ticket == epoch or self._hooked != epoch:
            self._run_begin_hooks(epoch)
        self._hooked = epoch
        # After the hooks: an executor in this process makes items from now on. Worker processes may
        # also go on with the next pass's first items when this one is all requested (its order is seeded).
        upcoming = (epoch + 1, pass_view(self._order, epoch + 1)) if self.executor.plans_next_pass else None
        self.executor.plan(epoch, indices, upcoming)
        return indices, np.int64(ticket)

    def _upcoming(self) -> tuple[int, int, bool]:
        """``(pass, items skipped, begun by a model build)`` of the pass that begins now, marked begun (the
        next one follows it)."""
        target = self.fit_target()
        with self._lock:
            epoch, skip, build = self._next, self._skip, False
            again, self._again = self._again, None
            if target is not None and target.epoch is not None:
                epoch, skip, build = target
                build = build or self._build_next  # TensorFlow's fit under a strategy (``_keras_build``)
            elif self._build_next or target is not None:
                # An evaluation's build, or a fit's whose passes are counted (steps_per_epoch): the loop begins
                # this pass again; a build that failed before its loop began its pass leaves it to this one.
                epoch, skip = again or (epoch, skip)
                build, self._again = True, (epoch, skip)
            elif again is not None:
                epoch, skip = again
            self._build_next = False
            self._next, self._skip = epoch + 1, 0
            self._pins.pop(epoch, None)
        return epoch, skip, build

    def next_skip(self) -> int:
        """Items already read of the pass begun next, a fit's frame aside: a resumed first pass's skip until
        it begins (a loader under TensorFlow tells Keras that pass's length from it)."""
        with self._lock:
            return (self._again or (self._next, self._skip))[1]

    def model_build_iterator(self) -> None:
        """An iterator made now is an evaluation's model build's (NOTE [ An evaluation's model build ])."""
        with self._lock:
            self._build_next = True

    def takes_over(self, epoch: int, skip: int) -> bool:
        taken = super().takes_over(epoch, skip)
        if not taken:
            return False
        with self._lock:  # the fit reads the build's pass on: its end, come or to come, is the pass's own
            if self._again == (epoch, skip):  # handed over: not begun again (counted passes: ``_upcoming``)
                self._again = None
            ended = self._deferred_end is not None and pass_of(self._deferred_end) == epoch
            if ended:
                self._deferred_end = None
            if self._build is not None and pass_of(self._build) == epoch:
                self._build = None
        if ended:
            self._run_end_hook(epoch)
        return True

    def begin_count(self) -> tuple[np.int64, np.int64]:
        """``begin`` for tf.data: ``(items in the pass, ticket)``; the indices
        follow by ``window`` calls."""
        indices, ticket = self.begin()
        return np.int64(len(indices)), ticket

    def window(self, ticket: Any, start: Any) -> np.ndarray:
        """Positions ``start`` to ``start + INDEX_WINDOW`` of the order of begin ``ticket`` (int64)."""
        ticket = int(ticket)
        indices = self._begins.view(ticket)
        if indices is None:
            raise RuntimeError(
                f"kerasfeed: pass {pass_of(ticket)} is no longer read: an iterator of it went on after {KEPT_PASSES} "
                f"newer passes began. Iterate the newest iterator. Received: epoch={pass_of(ticket)}"
            )
        start = int(start)
        return indices.window(start, start + INDEX_WINDOW)

    def _run_begin_hooks(self, epoch: int) -> None:
        # The executor hears when each hook is about to run: one whose items run on a copy of the source
        # (worker processes) tells from that what the hooks changed and carries it over
        # (execution/state_sync.py). Hooks run with the default floating-point environment, as items do
        # (NOTE [ Threads that run the source start with the default floating-point environment ]).
        with default_fp_env():
            self.executor.before_hook("set_epoch")
            try:
                set_epoch(self._source, epoch)
                self.executor.before_hook("on_epoch_begin")
                hook = getattr(self._source, "on_epoch_begin", None)
                if callable(hook):
                    hook()
            finally:
                self.executor.after_hook("on_epoch_begin")

    def _pick(self, index: int, epoch: int) -> Any:
        stats = self.stats
        if stats is None:
            return self.executor.load(index, epoch)
        t0 = time.perf_counter()  # how long the pick-up blocked
        try:
            item = self.executor.load(index, epoch)
        except WaitAbandoned:
            raise  # the consumer left (not an item's error), as Ctrl-C
        except Exception:
            stats.error()
            raise
        t1 = time.perf_counter()
        stats.picked(epoch, t1 - t0, t1)
        return item

    def _arrays(self, index: int, ticket: int) -> Optional[list]:
        """Item ``index`` of the pass begun as ``ticket`` (an endless pass's: its number), checked and
        flattened; None: it failed and was left out (``max_skipped``). A failure that ends the
        pass is told to the executor (NOTE [ Parking after a failed pass ])."""
        epoch, picked = pass_of(ticket), False
        try:
            item, picked = self._pick(index, epoch), True
            return self._checker.flat_arrays(index, item)
        except WaitAbandoned:
            raise  # the consumer left on purpose
        except Exception as e:
            if picked and self.stats is not None:
                self.stats.error()  # it came, not as the signature says (_pick counts the executor's errors)
            # An error got over (left out, or its worker's death) drops the frames it gathered here: the executor
            # may keep it (a thread task's error), and through this frame it held the pipeline, its executor and
            # workers until the garbage collector ran.
            if self.skips is not None and skippable(e, index):
                error = self._leave_out(index, ticket, e)
                if error is None:
                    e.with_traceback(None)
                    return None
            elif self.skips is not None and isinstance(e, WorkerError) and e.index is not None:
                e.with_traceback(None)
                return self._after_death(index, ticket, e)
            else:
                error = e
            self.executor.pass_failed(epoch)
            if isinstance(error, ItemError):
                # The executor's own frames say nothing to the user (TensorFlow
                # prints them under the original traceback): start from here.
                raise error.with_traceback(None) from error.__cause__
            if error is not e:
                raise error from e.__cause__
            raise

    def ready(self, i, ticket) -> bool:
        """Whether ``load(i, ticket)`` would not wait (see ``Executor.ready``)."""
        return self.executor.ready(int(i), pass_of(ticket))

    def take(self, i, ticket) -> tuple:
        """``(arrays, last)``: item ``i`` of the pass begun as ``ticket``, and whether it was the pass's
        last item to load. After ``last`` the caller runs ``end_pass`` once nothing it hands out views
        the item any more (the group loaders: after stacking the group)."""
        index, ticket = int(i), int(ticket)
        self._begins.enter(ticket)
        try:
            arrays = self._arrays(index, ticket)
        except BaseException:
            self._begins.leave(ticket, loaded=False)
            raise
        last = self._begins.leave(ticket, loaded=True)
        if last and self.skips is not None and self.skips.batch_size is None:
            epoch = pass_of(ticket)
            left = self.skips.count(epoch)
            with self._lock:
                self._short = (epoch, left) if left else None
        return arrays, last

    # NOTE [ A model build's pass ends later ]
    # Keras' JAX and torch trainers build the model from a batch of a throwaway iterator before the
    # loop (``FitView.builds``). Its read-ahead may load the pass whole (a pass of a few batches): its end
    # hook then ran, and the loop's begin of the same pass ran the begin and end hooks again. So the end of
    # a pass a model build began waits (``_deferred_end``): the loop's begin of that pass drops it (the hooks
    # of the pass run once, the end at that begin's end), the loader's hand-over of it (``takes_over``) or
    # the begin of another pass runs it then.

    def end_pass(self, ticket: int) -> None:
        """Every item of the pass begun as ``ticket`` is loaded (in whatever order): the pass is over
        for the source, without waiting for a consumer that may never ask past the last element."""
        with self._lock:
            if ticket == self._build:  # NOTE [ A model build's pass ends later ]
                self._deferred_end = ticket
                return
        self._run_end_hook(pass_of(ticket))

    def _run_end_hook(self, epoch: int) -> None:
        if self._hooked == epoch:
            self._hooked = None
        hook = getattr(self._source, "on_epoch_end", None)
        self.executor.before_hook("on_epoch_end")  # with cache=: what the pass's items left, before the hook
        try:
            if callable(hook):
                with default_fp_env():  # as items (execution/fpenv.py)
                    hook()
        except BaseException:  # as a failed load: the pool parks once the pass is left, even while
            self.executor.pass_failed(epoch)  # a notebook or Keras keeps this error (and the pipeline)
            raise
        finally:
            self.executor.after_hook("on_epoch_end")
        if callable(hook):
            now = _length(self._source) if self._length is not None else None
            if now is not None and now != self._length:  # said once: later passes read the first length
                logger.warning(
                    "kerasfeed: %s's length changed from %d to %d in on_epoch_end; every pass reads %d items (its "
                    "order was made for that length). Make a new dataset or loader to read the new length.",
                    type(self._source).__name__, self._length, now, self._length)
                self._length = None

    def read_whole(self, ticket: int, count: int, first: float, last: float) -> None:
        """The pass begun as ``ticket`` was read without ``load`` (its ``count`` items all stored, read
        in the graph between ``first`` and ``last``: NOTE [ A stored pass runs in the graph ]): it is
        over for the source, as after its last ``take``. Nothing for an older begin of a pass begun again."""
        ticket = int(ticket)
        if not self._begins.read_whole(ticket):
            return
        if self.stats is not None:
            self.stats.picked_many(pass_of(ticket), count, first, last)
        self.end_pass(ticket)

    def load(self, i, ticket):
        """Item ``i`` of the pass begun as ``ticket``: its arrays, or None when it was left out
        (``max_skipped``)."""
        arrays, last = self.take(i, ticket)
        # The hook may change in place what items view: hand over copies
        # (NOTE [ Epoch hooks and items that view the source ]); the last item's arrays always, as the
        # hook runs before this call returns.
        if (last or self._copy_views) and arrays is not None:
            arrays = [a.copy() if isinstance(a, np.ndarray) and (last or a.base is not None) else a for a in arrays]
        if last:
            self.end_pass(ticket)
        return arrays

    def load_marked(self, i, ticket) -> list:
        """``load`` for tf.data with ``max_skipped``: the arrays and a True mark, or for an item left
        out ``placeholder`` and a False mark (the tail drops it: NOTE [ A skipped item and its batch ])."""
        arrays = self.load(i, ticket)
        return self.placeholder + [_LEFT_OUT] if arrays is None else arrays + [_KEPT]

    def take_marked(self, i, ticket) -> tuple:
        """``take`` with the mark of ``load_marked`` (for the group loaders)."""
        arrays, last = self.take(i, ticket)
        return (self.placeholder + [_LEFT_OUT] if arrays is None else arrays + [_KEPT]), last


def weak_method(obj: Any, name: str) -> Callable:
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is None:
            raise RuntimeError("kerasfeed: the dataset that owned this pipeline was released; iterate a live dataset.")
        return getattr(target, name)(*args)

    return call


def probe_indices(n: int, probe: int) -> list[int]:
    return sorted(set(list(range(min(probe, n))) + [n - 1]))


__all__ = ["INDEX_WINDOW", "PassPipeline", "probe_indices", "weak_method"]
