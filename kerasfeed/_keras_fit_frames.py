"""Where a running Keras ``fit``'s frame is found (TF-free, Keras-free): on the calling thread, kept from
the fit's own thread, or in the other threads' stacks (NOTE [ Another thread's frames ]). Part of NOTE [ Keras'
private structure ] in ``kerasfeed/_keras_fit.py`` (item 1), which reads what a frame found here holds: each
``fit`` frame is handed to the caller's ``look`` (``_keras_fit.find_fit``: the frame's view where its ``fit``
reads the caller's pipeline, else None).
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any, Callable, Optional

Look = Callable[[Any], Any]  # a ``fit`` frame -> what it says, or None where it is not the one looked for


def is_fit(frame: Any) -> bool:
    """Whether ``frame`` runs a Keras ``fit`` (the training loop of any backend)."""
    return frame.f_code.co_name == "fit" and frame.f_globals.get("__name__", "").startswith("keras.")


def current_frames() -> dict:
    """``sys._current_frames()`` with the garbage collector held off.

    NOTE [ sys._current_frames and the garbage collector ]: in CPython up to
    3.11, ``sys._current_frames()`` holds the runtime's thread-list lock while
    it makes frame objects; an allocation there may start a collection, and a
    collected object whose deallocation takes that lock again (a
    ``threading.local``, a thread state) deadlocks the process inside C, where
    no signal handler runs (cpython#106883, fixed in 3.12 by the same means:
    no collection during the call). Found in a fresh-clone run of this suite
    on the 2-core machine: a pass begun while a thread pool's threads came and
    went hung there for good. The collector is switched back on only if it was on.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def on_this_thread(frame: Any, look: Look) -> Optional[Any]:
    """``look`` of the first ``fit`` frame from ``frame`` down the calling thread's stack that answers; each
    ``fit`` frame passed is kept (none on the stack: one kept for this thread has returned, and is dropped)."""
    me, seen = threading.get_ident(), False
    try:
        while frame is not None:
            if is_fit(frame):
                if _sweep not in gc.callbacks:
                    gc.callbacks.append(_sweep)
                _SEEN[me], seen = frame, True
                view = look(frame)
                if view is not None:
                    return view
            frame = frame.f_back
        if not seen and me in _SEEN:
            _drop(me, _SEEN[me])
        return None
    finally:
        del frame  # frames hold their locals (batches among them): none is kept past this call


# NOTE [ Another thread's frames ]: tf.data begins a pass on one of its own threads while ``fit``
# waits on another, so the ``fit`` frame is often not on the calling thread's stack. Walking another
# running thread's stack (``sys._current_frames()``, then ``f_back``) can crash CPython 3.11 when that
# thread pops frames meanwhile (cpython#111363, sentry-python#2386 and #6119: a segfault in
# ``PyFrame_GetBack``; seen once in this suite under load). So a ``fit`` frame is taken where Keras calls
# kerasfeed on the fit's own thread (a dataset's ``cardinality``, a data adapter's hooks, a sequence's
# ``on_epoch_begin``, a kerasfeed callback: ``_keras_fit.remember_fit``) and kept, one per thread, while it
# runs: another thread reads its locals, never its ``f_back``. A kept frame is cleared once its ``fit`` returned,
# at the next look or garbage collection (``_sweep``; nothing else reads it; its locals are freed), which
# is also how a running one is told apart (``frame.clear()`` refuses an executing frame). Only where
# none is kept (a dataset derived from kerasfeed's, which Keras reads without calling kerasfeed) are the
# other threads walked, with the garbage collector off and the GIL's switch interval long: no other
# thread runs during the walk unless it was about to take the GIL anyway.
_SEEN: dict = {}  # thread ident -> the ``fit`` frame last seen on that thread's stack


def _sweep(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` hook: drops the kept frames whose ``fit`` returned. Without it the last ``fit`` of a
    thread kept its model, optimizer and data alive (nothing looked again after it), also past
    ``clear_session()``; a collection runs soon after any Python work, and ``gc.collect()`` frees them.
    Not at the youngest generation's collections, the most frequent (a kept frame that still runs costs a
    RuntimeError to tell apart)."""
    if phase == "start" and info.get("generation", 2) >= 1:
        for ident, frame in list(_SEEN.items()):
            _drop(ident, frame)


def seen_elsewhere() -> list:
    """The kept ``fit`` frames of other threads that still run; those that returned are dropped."""
    me, running = threading.get_ident(), []
    for ident, frame in list(_SEEN.items()):
        if ident == me:
            continue
        if not _drop(ident, frame):
            running.append(frame)
    return running


def _drop(ident: int, frame: Any) -> bool:
    """Drops (and clears) the kept frame of a ``fit`` that returned; False while it runs."""
    try:
        frame.clear()  # a returned fit: its locals freed (NOTE above)
    except RuntimeError:  # "cannot clear an executing frame"
        return False
    if _SEEN.get(ident) is frame:
        _SEEN.pop(ident, None)
    return True


def walk_other_threads(look: Look) -> Optional[Any]:
    """``look`` of the first ``fit`` frame in another thread's stack that answers (NOTE above)."""
    enabled, interval = gc.isenabled(), sys.getswitchinterval()
    gc.disable()
    sys.setswitchinterval(max(interval, 0.5))
    try:
        frames = current_frames()
        frames.pop(threading.get_ident(), None)  # this very frame: a reference cycle with `frames` otherwise
        tops = list(frames.values())
        frames.clear()
        for frame in tops:
            while frame is not None:
                if is_fit(frame):
                    view = look(frame)
                    if view is not None:
                        return view
                frame = frame.f_back
        return None
    finally:
        if sys.getswitchinterval() == max(interval, 0.5):
            sys.setswitchinterval(interval)
        if enabled:
            gc.enable()
        tops = frame = None


__all__ = ["current_frames", "is_fit", "on_this_thread", "seen_elsewhere", "walk_other_threads"]
