"""Which tf.data iterators consume a kerasfeed dataset, and when they go.

Deleting a tf.data iterator (``break``, ``take(3)``, the end of ``fit``)
cancels its threads and joins them. A thread inside a kerasfeed load that
waits for an item never sees that cancellation (TensorFlow's
Python-function op does not listen for it), so the join used to wait as
long as the item took: forever for a stuck one. Python, though, sees the
iterator object die *before* TensorFlow joins: its weak references are
called first, its attributes (the iterator resource) released after.

So kerasfeed wraps ``OwnedIterator._create_iterator`` (the one place every
eager iterator is made, over any dataset derived from a kerasfeed one:
``iter(ds.take(3))``, Keras' ``fit``) and, for an iterator over a kerasfeed
dataset, counts it on the ``WaitScope`` of what feeds it (a pipeline's
executor; a stream, ``from_generators``/``from_files``, or a feed,
``from_queue``: its own or its worker pool's) and registers a
``weakref.finalize`` that uncounts it. When the last one goes, the waits in
progress end (``execution/waits.py``), and TensorFlow's join returns at once.
The same hook lets waits see Ctrl-C (``install_interrupts``) and gives the
exit guard the live iterators without scanning the heap. A ``tf.distribute``
strategy's iterators are multi-device iterators: the eager ones (made over a
dataset) are watched by a wrapper of ``OwnedMultiDeviceIterator.__init__``,
so their waits end as they go too, and a model build's peek through one is
told apart (NOTE [ An evaluation's model build ]). Iterators made another
way (inside a ``tf.function``, ``Dataset.reduce``) are not counted: their
waits end only as before (``timeout=``, the executor closed, interpreter exit).

NOTE [ A model build's pass over a stream ]: Keras' JAX and torch trainers build a model not built yet
from a batch of a throwaway iterator, then read the epoch from another (NOTE [ An evaluation's model
build ], ``kerasfeed/_keras_build.py``). A stream has no index to begin again at: the build's iterator,
told apart here where it is made, begins a pass that does not count. ``from_generators``/``from_files``
read that pass again (generators made anew, the same shard order); ``from_queue`` hands the entries the
build took back to the queue's front, so the fit's first epoch reads the producer's first epoch whole.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import warnings
import weakref
from typing import Any

from kerasfeed._keras_build import evaluation_builds
from kerasfeed.execution.interrupts import install_interrupts
from kerasfeed.observe.lookup import find_all_tagged

logger = logging.getLogger("kerasfeed")

_lock = threading.Lock()
_installed = False
# Live iterators over any kerasfeed dataset (pipelines, streams, feeds).
live_iterators: "weakref.WeakSet" = weakref.WeakSet()
_TAGS = ("_kerasfeed_pipeline", "_kerasfeed_stream", "_kerasfeed_feed")


def install() -> None:
    """Wraps ``OwnedIterator._create_iterator`` and ``OwnedMultiDeviceIterator.__init__`` once per process."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from tensorflow.python.data.ops import iterator_ops

        original = getattr(getattr(iterator_ops, "OwnedIterator", None), "_create_iterator", None)
        if original is None:  # another TensorFlow: iterators go unwatched (a bare AttributeError before)
            _unwatched("tensorflow.python.data.ops.iterator_ops.OwnedIterator._create_iterator",
                       "iterators of kerasfeed datasets are not counted")
        elif not getattr(original, "_kerasfeed_hook", False):

            @functools.wraps(original)
            def _create_iterator(self, dataset):
                original(self, dataset)
                try:
                    _watch(self, dataset)
                except Exception:  # never break iterator creation
                    logger.debug("kerasfeed: watching an iterator failed", exc_info=True)

            _create_iterator._kerasfeed_hook = True
            iterator_ops.OwnedIterator._create_iterator = _create_iterator
        _watch_multi_device_iterators()
        _installed = True


def _watch_multi_device_iterators() -> None:
    # With the lock held. A TensorFlow without this class: a strategy's iterators stay uncounted, as before.
    try:
        from tensorflow.python.data.ops import multi_device_iterator_ops
    except ImportError:
        return
    cls = getattr(multi_device_iterator_ops, "OwnedMultiDeviceIterator", None)
    original = getattr(cls, "__init__", None)
    if cls is None:
        _unwatched("tensorflow.python.data.ops.multi_device_iterator_ops.OwnedMultiDeviceIterator",
                   "a tf.distribute strategy's iterators of kerasfeed datasets are not counted")
    if original is None or getattr(original, "_kerasfeed_hook", False):
        return

    @functools.wraps(original)
    def __init__(self, dataset=None, *args, **kwargs):
        original(self, dataset, *args, **kwargs)
        if dataset is not None:  # None: rebuilt from its components (tracing), not a new iterator
            try:
                _watch(self, dataset)
            except Exception:  # never break iterator creation
                logger.debug("kerasfeed: watching a multi-device iterator failed", exc_info=True)

    __init__._kerasfeed_hook = True
    cls.__init__ = __init__


def _unwatched(what: str, then: str) -> None:
    """One warning: TensorFlow's private structure kerasfeed wraps (the module NOTE) is not there."""
    import tensorflow as tf

    warnings.warn(
        f"kerasfeed: this TensorFlow has no {what}, which kerasfeed wraps to watch the iterators of its datasets: "
        f"{then}, so an iterator dropped mid-pass does not end the waits of what feeds it at once (they end with "
        "timeout=, the pipeline closed or the interpreter's exit), and Ctrl-C inside them is seen later. The "
        f"batches are the same. Please report it with this TensorFlow version. Received: tensorflow {tf.__version__}",
        RuntimeWarning, stacklevel=4)


def _watch(iterator: Any, dataset: Any) -> None:
    pipelines = find_all_tagged(dataset, _TAGS[0])  # each of a zip's
    owners = pipelines + [owner for tag in _TAGS[1:] for owner in find_all_tagged(dataset, tag)]
    if not owners:
        return
    live_iterators.add(iterator)
    install_interrupts()  # a no-op off the main thread, or once done
    for pipeline in pipelines:  # NOTE [ An evaluation's model build ]
        if evaluation_builds(sys._getframe(2), fit=not pipeline.follows_keras):
            pipeline.model_build_iterator()
    streams = [owner for owner in owners[len(pipelines):] if hasattr(owner, "model_build_iterator")]
    if streams and evaluation_builds(sys._getframe(2), fit=True):  # NOTE [ A model build's pass over a stream ]
        for stream in streams:
            stream.model_build_iterator()
    for scope in _scopes(owners):
        scope.consumer_started()
        # Holds the scope (small), never the executor or the iterator.
        weakref.finalize(iterator, scope.consumer_gone)


def _scopes(owners: list) -> list:
    """The ``WaitScope`` of each kerasfeed source behind a dataset, once each."""
    found = []
    for owner in owners:
        scope = getattr(owner, "waits", None) or getattr(getattr(owner, "executor", None), "waits", None)
        if scope is not None and all(scope is not s for s in found):
            found.append(scope)
    return found


__all__ = ["install", "live_iterators"]
