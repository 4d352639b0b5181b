"""The executor seam: how one item is produced, wherever it runs.

``to_dataset`` maps the index stream through ``tf.numpy_function``, each call
asking the executor for one item: an executor only has to be thread-safe and
blocking, and tf.data's parallel, order-preserving map provides the
concurrency. One that ``prefetches`` instead gets each pass's order up front
(``plan``) and makes items ahead itself; the map then calls it sequentially,
saving the main process tf.data's per-call thread hops.
"""

from __future__ import annotations

import abc
import operator
from typing import Any, Optional, Sequence

# The ``epoch`` of ``Executor.item_skipped`` for a call outside the passes (a probe).
OUTSIDE_PASSES = -1


class Executor(abc.ABC):
    """Produces ``source[index]`` for the consumer.

    Attributes:
        name: ``"threads"`` or ``"processes"``.
        reason: why this executor was chosen (set by ``executor="auto"``).
    """

    name: str = "?"
    reason: str = ""
    prefetches: bool = False
    # True: ``plan`` may start the next pass's first items once every item of the current one is started, so
    # workers do not idle while a new iterator is built (~10 ms a pass). Only for executors whose items cannot
    # observe the main process's ``on_epoch_begin`` hook anyway (processes).
    plans_next_pass: bool = False
    # True: items are what ``source[index]`` returned in this process: they may view arrays the source keeps
    # (and its epoch hooks may overwrite).
    lends_source_arrays: bool = False
    # The waits of its loads (``execution/waits.py``), ended when the last iterator over it is deleted.
    waits: Optional[Any] = None
    # The seed of ``kerasfeed.item_rng()`` the user gave it (None: drawn when it was made, or none used).
    item_seed: Optional[int] = None
    seed_warned: bool = False  # told once that a pipeline's seed is not its item seed (factory.py)

    @abc.abstractmethod
    def load(self, index: int, epoch: int) -> Any:
        """Returns item ``index`` of pass ``epoch`` as nested numpy data; called concurrently from many
        threads. Raises ``kerasfeed.ItemError`` when ``source[index]`` raises."""

    def plan(self, epoch: int, indices: Sequence[int], next_pass: Optional[tuple[int, Sequence[int]]] = None) -> None:
        """Called when pass ``epoch`` starts, with the order its items will be
        asked in: a lazy ``kerasfeed.sampling.views.IndexView`` (read a window
        at a time; a pass is never held whole) or any sequence of indices.
        Executors that ``prefetch`` start making them. ``next_pass``:
        ``(epoch, indices)`` of the pass likely to follow, given only to
        executors that ``plans_next_pass``."""

    def attach_stats(self, collector: Any) -> None:
        """Gives the executor a ``kerasfeed.observe.stats.StatsCollector``: it reports each item's make
        time there (``made``) and its instant figures through ``gauges``."""
        collector.executor = self.name
        collector.add_gauges(self.gauges)

    def gauges(self) -> dict:
        """Figures of this instant, whichever the executor knows: ``ahead`` (made, not taken yet),
        ``in_flight`` (being made), ``shm_bytes``, ``workers`` (per-worker dicts with ``id``), and the
        counts of retries and replacements (``execution/retries.py``: ``RetryCounts``)."""
        return {}

    def before_hook(self, name: str) -> None:
        """Called in the consumer just before a pass runs the source's hook ``name`` (``"on_epoch_end"`` at a
        pass's end; ``"set_epoch"``, then ``"on_epoch_begin"`` at the next one's start, ``plan`` follows):
        executors whose items run on a copy of the source use it to tell what each hook changed."""

    def after_hook(self, name: str) -> None:
        """Called in the consumer just after a pass ran the source's hook ``name`` (``"on_epoch_end"``, or
        ``"on_epoch_begin"``, which ends the hooks ``"set_epoch"`` began): with ``before_hook``, it tells what
        the hooks set from what code between them set (NOTE [ State each process makes for itself ])."""

    def ready(self, index: int, epoch: int) -> bool:
        """Whether ``load(index, epoch)`` would return (or raise) now: the
        item was made ahead for the current plan, or failed. Never blocks (a
        few microseconds). Grouped hand-over asks it for every item after a
        group's first and ends the group at the first one not ready, so that
        no item waits for a later one. False (the default) is always safe:
        groups then hold one item."""
        return False

    def pass_failed(self, epoch: int) -> None:
        """Called by the pipeline when a load of pass ``epoch`` raised (the item's
        error, a signature mismatch, a worker failure): an executor that owns
        threads or processes parks them once the pass is left
        (NOTE [ Parking after a failed pass ] in ``execution/parking.py``)."""

    def item_skipped(self, index: int, epoch: int) -> None:
        """Called by the pipeline *instead of* ``pass_failed`` when it leaves
        out item ``index`` of pass ``epoch`` after its load raised its final
        ``ItemError`` or ``WorkerError`` (a skip budget): the pass goes on and
        nothing parks. An executor that closed on that failure (``retries=0``:
        a dead worker's pool, a timed-out thread pool) starts again and plans
        the rest of the pass (the items of its plan not taken yet). ``epoch``
        ``OUTSIDE_PASSES``: a call outside the passes (a probe) failed; the
        executor only starts again, and every pass still makes ``index``."""

    def activity(self) -> tuple[int, int]:
        """``(loads started so far, loads in progress)``; cheap, any thread."""
        return (0, 0)

    def park(self, activity: Optional[tuple[int, int]] = None) -> bool:
        """Stops the executor's threads or worker processes until the next
        ``plan`` or ``load`` starts them again; with ``activity``, only if
        ``activity()`` still returns it (checked atomically with the loads).

        Returns:
            Whether it parked (or was parked already)."""
        return False

    def parallel_calls(self) -> int:
        """How many ``load`` calls tf.data should keep in flight by default."""
        return 1

    def caller_augment_seeds(self) -> Optional[Any]:
        """The items' seeds (``ItemSeeds``) when a cache front may run a cheap ``augment`` in the thread that
        asks for a stored item instead of here (NOTE [ A cheap augment runs where its item is asked for ],
        ``cache_front.py``); None: it may not (worker processes and actors make their items apart)."""
        return None

    def close(self) -> None:
        """Releases threads, processes and memory. Idempotent."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"<{type(self).__name__} name={self.name!r}{why}>"

def item_position(owner: str, name: str, value: Any) -> int:
    """``index`` or ``epoch`` of a ``load`` call, as a plain int >= 0 (``int()``
    would take ``'1'`` and ``2.7`` (2): a worker would make another item than
    the one asked for; a negative one would reach ``source[-1]``).

    Raises:
        TypeError: not an int (a bool neither).
        ValueError: negative.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{owner}.load: `{name}` must be an int. Received: {name}={value!r}") from None
    if value < 0:
        raise ValueError(f"{owner}.load: `{name}` must be >= 0. Received: {name}={value}")
    return value
