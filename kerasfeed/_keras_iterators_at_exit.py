"""Keras' own ``model.fit(seq)`` under TensorFlow: its tf.data iterator retired at exit (TF-free, Keras-free;
``retire_iterator`` is also the exit guard's, ``tfdata/exit_guard.py``, for kerasfeed's own datasets).

NOTE [ Keras' own iterators at exit ]: Keras' own ``model.fit(seq)`` under
TensorFlow reads a ``SceneSequence`` (a ``PyDataset``) through
``tf.data.Dataset.from_generator(...).prefetch(AUTOTUNE)`` (``workers=1``,
the default): tf.data's prefetch thread runs Keras' generator, which calls
``seq[i]``. After an exception out of ``fit`` (Ctrl-C, any error) the
iterator stays alive with the traceback's frames and with the cycle between
Keras' ``EpochIterator`` and its epoch generator, so Python destroys it only
in the collection of its finalization: the hang the docstring of
``tfdata/exit_guard.py`` describes (the
Python-function op's thread ended as it asked for the GIL, the prefetch
thread's function never returns, the iterator's destructor waits for it:
3 of 19 interrupted runs, every run with the thread held in ``seq[i]``,
2026-11-29). A ``SceneSequence``'s ``on_epoch_begin`` hands
Keras' epoch iterator that calls it to ``watch_keras_epoch_iterator``; a hook
of its own (no heap freeze: nothing else of the exit changes) retires that
iterator's current tf.data iterator at exit, as that module does its own.
Keras' dataset keeps tf.data's autotuning on: destroying its iterator also
waits for the autotuning thread, which sleeps through its period (up to 60 s;
20-37 s in 4 of 10 interrupted runs here, 2026-11-29) before it sees the
cancel. So the destruction runs on a daemon thread that the exit waits for
at most ``RETIRE_WAIT_S``: past it, the process ends while that thread still
holds the iterator (never destroyed in finalization: no hang either). Keras' generator is
not stopped: the join waits for the ``seq[i]`` in progress.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any

logger = logging.getLogger("kerasfeed")

_lock = threading.Lock()
# Keras' epoch iterators that read a SceneSequence (the NOTE above).
_keras_epoch_iterators: "weakref.WeakSet" = weakref.WeakSet()
_keras_installed = False
# How long the exit waits for a Keras iterator's destruction (the NOTE): its item in progress, at most.
RETIRE_WAIT_S = 5.0


def retire_iterator(it: Any, gen_dataset_ops: Any) -> bool:
    """Points ``it`` at an empty dataset: its old state is destroyed, its threads joined, now."""
    try:
        empty = it._dataset.take(0)  # same element spec, no input iterator
        gen_dataset_ops.make_iterator(empty._variant_tensor, it._iterator_resource)
        return True
    except Exception:
        logger.debug("kerasfeed: retiring an iterator at exit failed", exc_info=True)
        return False


def watch_keras_epoch_iterator(epoch_iterator: Any) -> None:
    """Keeps (weakly) Keras' ``EpochIterator`` reading a ``SceneSequence``, whose tf.data iterator the exit
    retires (NOTE [ Keras' own iterators at exit ]); registers that exit hook once."""
    global _keras_installed
    try:
        _keras_epoch_iterators.add(epoch_iterator)
    except TypeError:  # not weakly referenceable: left as before
        return
    if not _keras_installed:
        with _lock:
            if not _keras_installed:
                atexit.register(retire_keras_iterators)
                _keras_installed = True


def retire_keras_iterators(wait: float = RETIRE_WAIT_S) -> int:
    """Retires the tf.data iterator each live Keras epoch iterator kept by ``watch_keras_epoch_iterator``
    reads (its ``_current_iterator``), on a daemon thread waited for at most ``wait`` seconds (the NOTE:
    TensorFlow's autotuning thread). Returns how many were retired by then; never raises, never imports
    TensorFlow."""
    iterator_ops = sys.modules.get("tensorflow.python.data.ops.iterator_ops")
    gen_dataset_ops = sys.modules.get("tensorflow.python.ops.gen_dataset_ops")
    if iterator_ops is None or gen_dataset_ops is None:  # no tf.data iterator was ever made
        return 0
    owned = getattr(iterator_ops, "OwnedIterator", ())
    ours = []
    for epoch_iterator in list(_keras_epoch_iterators):
        try:
            it = getattr(epoch_iterator, "_current_iterator", None)
        except Exception:  # noqa: BLE001 - it runs at exit: an iterator it cannot read is left as before
            continue
        if isinstance(it, owned):  # a strategy's distributed iterator, a JAX or torch one: not ours to retire
            ours.append(it)
    if not ours:
        return 0
    retired = []

    def retire() -> None:
        for it in ours:
            retired.append(retire_iterator(it, gen_dataset_ops))

    # The thread holds the iterators it has not retired yet: the exit's collection never destroys them.
    thread = threading.Thread(target=retire, name="kerasfeed-retire-keras-iterators", daemon=True)
    thread.start()
    thread.join(wait)
    return sum(retired)


__all__ = ["retire_iterator", "retire_keras_iterators", "watch_keras_epoch_iterator"]
