"""Interpreter exit with kerasfeed iterators still alive.

A script that stops iterating without closing its iterator (``it =
iter(ds)``, a few ``next(it)``, the end of the script) leaves the iterator to
Python's finalization, which destroys it while clearing module globals, after
Python has stopped handing the GIL to other threads: a thread that asks for
it from then on is ended on the spot (3.11: ``PyThread_exit_thread``). The
iterator's destructor cancels its prefetch thread and waits for it; inside a
kerasfeed Python call (a ``numpy_function`` load waiting for an item, a
generator chunk) that thread can never return, so the process hangs at exit
("sometimes, under load": on a busy machine it is more often mid-call then).

The fix destroys those iterators while Python still runs every thread: an
``atexit`` hook (registered when the first kerasfeed dataset is built, so it
runs before TensorFlow's own exit hooks) finds every live tf.data iterator
over a kerasfeed dataset, stops the Python side of its pipeline (a load
waiting for a stuck item returns at once), and points the iterator at an
empty dataset, which destroys its old state, threads joined, right there.
Then the threads executor's pool threads (and kerasfeed's other daemon
threads: stream producers, device prefetch) are stopped and joined, a few
seconds at most in all, before the heap freeze (NOTE [ Pool threads at exit ]
in ``execution/thread_tasks.py``).

Keras' own ``model.fit(seq)`` iterators: ``kerasfeed/_keras_iterators_at_exit.py``.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
from typing import Any, Callable

from kerasfeed._keras_iterators_at_exit import retire_iterator
from kerasfeed.execution import thread_tasks
from kerasfeed.observe.lookup import find_tagged

logger = logging.getLogger("kerasfeed")

# Attributes by which a front end tags the dataset it returns, and how to
# stop the Python side they name.
_OWNERS = (
    ("_kerasfeed_pipeline", lambda p: p.executor.close()),
    ("_kerasfeed_stream", lambda s: s.close()),
    ("_kerasfeed_feed", lambda f: f.close()),
)

_lock = threading.Lock()
_installed = False
_exiting = False


def exiting() -> bool:
    """Whether the exit hook has begun stopping kerasfeed's pipelines: what fails after that is the stop
    itself (a stream's pool closed under a generator chunk still being read), not the data's."""
    return _exiting


def quiet_at_exit(fn: Any, fallback: Callable[[], list]) -> Any:
    """``fn`` for a ``numpy_function``; once the exit hook stops the pipelines, an error gives ``fallback()``
    instead (an element dropped with its iterator): TensorFlow logged each load the stop failed as a
    failure, after the KeyboardInterrupt that began the exit. Made then, not kept: TensorFlow keeps the
    function for the life of the process (an item-sized placeholder a dataset, before)."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            if not _exiting:
                raise
            return fallback()

    return call


def install() -> None:
    """Registers the exit hook once (called for every dataset kerasfeed builds)."""
    global _installed
    if _installed:
        return
    with _lock:
        if not _installed:
            # Registered first, the pools' own hook runs after this one (it then finds them joined already).
            thread_tasks.install_exit_join()
            atexit.register(retire_live_iterators)
            _installed = True


def _owners(dataset: Any) -> list:
    found = [(find_tagged(dataset, attr), stop) for attr, stop in _OWNERS]
    return [(owner, stop) for owner, stop in found if owner is not None]


def retire_live_iterators() -> int:
    """Destroys the state of every live iterator over a kerasfeed dataset.

    The iterator objects stay valid (a later ``next`` ends the iteration);
    their threads are joined here. Returns how many were retired. Never
    raises: it runs at exit.
    """
    global _exiting
    _exiting = True
    try:
        from tensorflow.python.data.ops import iterator_ops
        from tensorflow.python.ops import gen_dataset_ops
    except Exception:  # noqa: BLE001 - TensorFlow half torn down, or absent
        return 0
    from kerasfeed.tfdata.consumers import live_iterators

    ours = []
    # Tracked as they are made (tfdata/consumers.py): scanning the heap
    # instead (gc.get_objects, ~0.5 M objects with TensorFlow and Keras) took
    # about a second of the exit on a busy machine.
    for obj in list(live_iterators):
        if isinstance(obj, iterator_ops.OwnedIterator):
            ds = getattr(obj, "_dataset", None)
            owners = _owners(ds) if ds is not None else []
            if owners:
                ours.append((obj, owners))
    # The Python side first: a load waiting on a stuck item gives up, so the
    # joins below wait at most for calls already returning.
    for _, owners in ours:
        for owner, stop in owners:
            try:
                stop(owner)
            except Exception:
                logger.debug("kerasfeed: stopping %r at exit failed", owner, exc_info=True)
    retired = sum(retire_iterator(it, gen_dataset_ops) for it, _ in ours)
    thread_tasks.join_threads_at_exit()  # the loads that fed them have returned: the threads end now
    _freeze_heap()
    return retired


def _freeze_heap() -> None:
    # NOTE [ Exit time ]: after this hook, Python finalizes: it clears every
    # module and runs full cyclic collections over the whole heap (several
    # hundred thousand objects once TensorFlow and Keras are imported), which
    # was most of a kerasfeed script's exit on a busy machine (sampled with
    # py-spy: the main thread in gc_collect_main for most of it). Moving what
    # lives now to the permanent generation (gc.freeze) takes those objects
    # out of every later collection; they are freed by reference counting as
    # modules are cleared, as before. What the freeze gives up: finalizers of
    # objects in reference cycles that are still alive at exit (Python does
    # not promise to run those) and cycles made garbage only at exit.
    if os.environ.get("KERASFEED_EXIT_GC", "") != "1":
        gc.freeze()


__all__ = ["exiting", "install", "quiet_at_exit", "retire_live_iterators"]
