"""Ctrl-C for a main thread that may be blocked inside TensorFlow: the wakeup pipe the waits read,
kerasfeed's SIGINT handler, and a Ctrl-C that Python would drop raised again.

A main thread blocked inside TensorFlow (``next(it)``, a ``fit`` step) never
runs Python's signal handlers, but Python's C-level handler also writes the
signal number to the *wakeup fd* (``signal.set_wakeup_fd``): kerasfeed points
it at a pipe of its own (only when nobody else uses it) that the waits
(``waits.py``) read between slices (``sigints``); the whole path:
docs/reliability.md, *A stuck item without a timeout*.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional

from kerasfeed._keras_fit import fit_calls
from kerasfeed._keras_fit_frames import is_fit

logger = logging.getLogger("kerasfeed")


class _Interrupts:
    """SIGINTs seen through Python's wakeup fd (a pipe kerasfeed owns)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None
        self.count = 0  # SIGINTs read from the pipe so far
        self.handled = 0  # of those, the ones read when kerasfeed's SIGINT handler last ran in the main thread
        self.raised = 0  # KeyboardInterrupts that handler raised (or put off) in the main thread

    def install(self) -> bool:
        """Points the wakeup fd at our pipe (main thread, once, if the fd is free); whether ours is in place."""
        if self._read_fd is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False  # set_wakeup_fd works in the main thread only
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)  # the C handler must never block
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old != -1:  # someone else's (asyncio) or not allowed: leave it alone
            if old is not None:
                signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return False
        self._read_fd, self._write_fd = r, w
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
        return True

    def poll(self) -> int:
        """Reads what the pipe holds; returns the SIGINT count."""
        fd = self._read_fd
        if fd is None:
            return self.count
        try:
            data = os.read(fd, 512)
        except OSError:  # empty (BlockingIOError), interrupted, closed
            return self.count
        hits = data.count(signal.SIGINT)
        # Only when Ctrl-C means KeyboardInterrupt: a handler of the user's (a graceful stop) keeps its pipeline.
        if hits and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint):
            with self._lock:
                self.count += hits
        return self.count

    def ends(self, begun: int) -> bool:
        """Whether a wait begun at count ``begun`` must end: a SIGINT came since, or one before it that the
        main thread has not handled yet (blocked in C: NOTE [ A Ctrl-C between two waits ])."""
        count = self.poll()
        if count == begun and signal.getsignal(signal.SIGINT) is _on_sigint:
            return count > self.handled
        return count != begun


# NOTE [ A Ctrl-C between two waits ]
# ===================================
#
# A wait that began before a SIGINT ends on it. One that begins after it must
# not end on a SIGINT the main thread has already turned into a
# KeyboardInterrupt (caught, the script went on: its next pass waits as
# usual). But a SIGINT that came while no wait was in progress (a tf.data
# thread between two items), with the main thread blocked inside TensorFlow,
# is not handled until ``next()`` returns, and the next wait, for an item that
# never comes, was its only way out. So under kerasfeed's handler (which
# counts what the main thread handled) a wait also ends on an unhandled SIGINT
# that came before it; under another handler only on those after it.


sigints = _Interrupts()
# Where TensorFlow makes the exception its C++ raises: eager/core.py (``next(it)``), or the error class's own
# ``__init__`` in framework/errors_impl.py, which pybind11 calls under a ``fit`` step (``execute.quick_execute``).
_TF_EXCEPTION_MODULES = (os.path.join("tensorflow", "python", "eager", "core.py"),
                         os.path.join("tensorflow", "python", "framework", "errors_impl.py"))


def _on_sigint(signum, frame):
    """Python's default SIGINT behaviour (KeyboardInterrupt), but never raised
    inside TensorFlow's exception constructor: when a wait gives up on Ctrl-C,
    the pending SIGINT is handled in the first bytecodes of the exception
    TensorFlow makes for the main thread, and a KeyboardInterrupt raised there
    comes out as pybind11's ``RuntimeError: ... MISMATCH of original and
    normalized active exception types``; it is raised again at the next
    Python call outside it (the caller's ``except`` clause) instead. It also
    notes what the main thread has handled (NOTE [ A Ctrl-C between two waits ]),
    and watches a ``fit`` it interrupts (NOTE [ A Ctrl-C taken inside fit ]).
    """
    global _held
    count = sigints.poll()
    if _holding and not _held:
        sigints.handled = count
        _held = True  # raised when the block ends (interrupts_held)
        return
    if _inside_op_attributes(frame):  # TensorFlow's C++ would clear it: NOTE [ A Ctrl-C inside an op's attributes ]
        _interrupt_at_next_call(_inside_op_attributes)  # not handled yet: a wait that begins now still ends on it
        return
    if _inside_tf_scope_change(frame):  # NOTE [ A Ctrl-C inside a TensorFlow scope's enter or exit ]
        _interrupt_at_next_call(_inside_tf_scope_change)
        return
    sigints.handled = count  # the main thread runs Python: it handles what came so far
    sigints.raised += 1
    _FitWatch.start(frame)
    if _inside_tf_exception(frame):
        _interrupt_at_next_call(_inside_tf_exception)
        return
    signal.default_int_handler(signum, frame)


# NOTE [ A Ctrl-C inside an op's attributes ]
# ============================================
#
# An op's generated wrapper (``gen_*_ops.py``, e.g. ``iterator_get_next``
# under ``next(it)`` of a tf.data iterator) hands its attributes to
# TensorFlow's C++ fast path, which calls Python methods of them: the
# ``TensorShape.__len__`` of ``output_shapes``, then clears any error that
# call raised (``TensorShapeNumDims``: ``__len__`` raises for an unknown
# rank). A Ctrl-C whose handler runs in that call (it checks for signals as
# it starts) raised a KeyboardInterrupt that was cleared there: the loop went
# on, and the script read an endless dataset until killed (CI, once; 1 in 26
# SIGINTs to ``endless_streams.py`` beside a busy test run). So a Ctrl-C
# handled in a TensorShape or DType method that an op wrapper's C++ called
# (the Python frame below it is the wrapper's) is put off to the next Python
# call outside such methods, which comes as soon as the op returns; it is
# not counted as handled, so a wait for an item that never comes, begun after
# it, still ends on it (NOTE [ A Ctrl-C between two waits ]).


def _inside_op_attributes(frame) -> bool:
    while frame is not None:
        back = frame.f_back
        if (
            back is not None
            and frame.f_code.co_filename.endswith(_OP_ATTRIBUTE_MODULES)
            and os.path.basename(back.f_code.co_filename).startswith("gen_")
        ):
            return True
        frame = back
    return False


_OP_ATTRIBUTE_MODULES = tuple(
    os.path.join("tensorflow", "python", "framework", name) for name in ("tensor_shape.py", "dtypes.py")
)


# NOTE [ A Ctrl-C inside a TensorFlow scope's enter or exit ]
# ===========================================================
#
# TensorFlow's scopes (``tf.device``'s ``_EagerDeviceContext``, name scopes) change the context's state,
# then record it on their own stack, in two steps. A KeyboardInterrupt between them (a Ctrl-C handled in
# an inner ``__enter__``) left the state changed and unrecorded: the outer scope's ``__exit__`` then raised
# ``RuntimeError: Exiting device scope without proper scope nesting`` in its place, and Keras' traceback
# filter hid the interrupt (1 of 116 SIGINTs mid-``fit`` of ``benchmarks/ctrl_c.py``'s script). Handled
# inside such a method, it is raised as the next Python call outside one starts.


def _inside_tf_scope_change(frame) -> bool:
    for _ in range(_SCOPE_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name in ("__enter__", "__exit__") and _TF_PYTHON in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


_TF_PYTHON = os.path.join("tensorflow", "python", "")
_SCOPE_DEPTH = 6  # the scope method and the few calls it makes (the device's parsing, the context's setters)


def _inside_tf_exception(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(_TF_EXCEPTION_MODULES):
            return True
        frame = frame.f_back
    return False


def _interrupt_at_next_call(skip: Optional[Callable[[Any], bool]] = None, *, calls_only: bool = True) -> None:
    """Raises KeyboardInterrupt in this (the main) thread as the next Python function starts
    (``calls_only``; else at the next call or return of any function, Python or C) whose frame
    ``skip`` does not reject, outside this module's frames. Call it last: every call of this
    thread is looked at until then."""
    global _armed
    previous = sys.getprofile()

    def again(frame, event, arg):
        global _armed
        if (calls_only and event != "call") or frame.f_code in _OWN_CODES or (skip is not None and skip(frame)):
            return
        sys.setprofile(previous)
        _armed = None
        _thread.interrupt_main()  # handled at the next bytecode boundary: as this call starts, or right after it

    again.previous = previous  # type: ignore[attr-defined]
    _armed = again
    sys.setprofile(again)


_armed: Optional[Callable[..., None]] = None  # the profile function of an interrupt put off, until it fires


# NOTE [ A Ctrl-C that Python swallows ]
# ======================================
#
# Python runs the SIGINT handler between bytecodes of whatever main-thread
# code runs, also where it ignores exceptions (a ``gc.callbacks`` function such
# as JAX's, a ``__del__``, a ``weakref.finalize``): the KeyboardInterrupt is
# printed as "Exception ignored in ..." and dropped (docs/reliability.md, *A
# Ctrl-C that Python drops*). Measured with ``benchmarks/ctrl_c.py`` (SIGINT
# to the process group of a script on its way into ``fit``, beside a CPU
# burner on 2 cores): 5 of 90 SIGINTs were lost, all in JAX's gc callback
# during ``import tensorflow``.
#
# So kerasfeed wraps ``sys.unraisablehook`` (``keep_interrupts``: on the first
# use of the public API, before it imports TensorFlow, and again whenever an
# iterator is made, in case someone replaced it). A KeyboardInterrupt dropped
# in the main thread while Ctrl-C means KeyboardInterrupt (Python's handler or
# kerasfeed's ``_on_sigint``) is raised again at the next call or return of
# a function (Python or C) in that thread, and again until it lands in
# ordinary code. It also reaches the waits in progress:
# ``_thread.interrupt_main`` writes to the wakeup fd as a real SIGINT does.
# Every other unraisable exception goes to the previous hook.


# NOTE [ A Ctrl-C taken inside fit ]
# ==================================
#
# C code that calls Python and clears the error that call raised can take the
# KeyboardInterrupt without a report: once in 200 runs of ``make soak-ctrl-c``
# the SIGINT came while TensorFlow's graph optimiser made the next epoch's
# iterator, and ``fit`` trained on. A propagating KeyboardInterrupt never lets
# ``fit`` begin another batch or epoch, so when kerasfeed's handler raises one
# while a Keras ``fit`` runs in the main thread, it watches that ``fit`` with
# a profile function (set only where none is, until that ``fit`` returns, at
# most ``_WATCH_S``): ``fit`` calling ``on_train_batch_begin`` or
# ``on_epoch_begin`` after the Ctrl-C means the interrupt was taken inside it,
# and it is raised again there (with a warning). A trainer whose ``fit`` names
# neither is reported once (``_keras_fit.fit_calls``, NOTE [ Keras' private
# structure ], item 5). Nothing is watched before a Ctrl-C; after one, a
# Python call per function call of the main thread until ``fit`` unwound. One
# that the user's code inside ``fit`` (a callback) takes on purpose is raised
# again too: a graceful stop installs a SIGINT handler of its own instead.


class _FitWatch:
    """The main thread's profile function while a ``fit`` that a Ctrl-C interrupted unwinds."""

    def __init__(self, fit: Any, resumes: tuple):
        self.fit, self.resumes, self.until = fit, resumes, time.monotonic() + _WATCH_S

    @classmethod
    def start(cls, frame: Any) -> None:
        while frame is not None and not is_fit(frame):
            frame = frame.f_back  # this thread's own stack (the handler runs in it)
        if frame is None or sys.getprofile() is not None:  # someone's profiler, or an interrupt put off
            return
        resumes = fit_calls(frame)  # what that fit calls as it trains on (NOTE [ Keras' private structure ])
        if resumes:
            sys.setprofile(cls(frame, resumes))

    def stop(self) -> None:
        self.fit = None  # its frame (and the model and data it holds) is not kept
        if sys.getprofile() is self:
            sys.setprofile(None)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame is self.fit or time.monotonic() > self.until:
            self.stop()  # unwound (or returned), or watched long enough
        elif event == "call" and frame.f_back is self.fit and frame.f_code.co_name in self.resumes:
            self.stop()
            logger.warning("kerasfeed: model.fit went on after Ctrl-C (the KeyboardInterrupt was taken inside "
                           "it, by C code or an except clause); raising it again")
            _thread.interrupt_main()  # handled as this call starts: the handler raises it in fit


_WATCH_S = 120.0  # a fit that neither unwinds nor trains for this long is not watched further


# NOTE [ Ctrl-C while TensorFlow is imported ]
# ============================================
#
# ``import tensorflow`` (2-4 s on a busy 2-core machine; the public API's lazy
# imports run it, ``kerasfeed.to_dataset`` first) is where a Ctrl-C at the
# start of a script most often lands, and does most harm: measured with
# ``benchmarks/ctrl_c.py`` (SIGINT 2.3-3.7 s after the start, one burner, 50
# runs before any change), 10 were dropped in JAX's gc callback, 1 was taken
# by a bare ``except:`` (TensorFlow's generated TFLite schema modules hold 32
# ``try: from typing import List / except: pass``; no "Exception ignored"
# line), and 2 crashed the process (SIGSEGV while jaxlib's extension module
# initialised, ``jaxlib/xla_client.py``). So those imports run under
# ``interrupts_held``: kerasfeed's handler (in place of Python's default one
# from the first use of the API) only notes a first Ctrl-C during the import
# and raises it once the import ends (a second one raises at once, for an
# import that hangs); one raised in it and taken by a bare ``except:`` is
# raised again when it ends.


def _redeliver_dropped_interrupts(unraisable: Any, previous: Callable[[Any], None]) -> None:
    if (
        isinstance(unraisable.exc_value, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint)
        and not sys.is_finalizing()  # nothing left to interrupt
        # Nor once the interpreter's exit began (threading's shutdown stopped the main thread; atexit callbacks
        # run): raised again, it would reach no handler ("Signal 2 ignored due to race condition").
        and threading.main_thread().is_alive()
    ):
        logger.debug("kerasfeed: a KeyboardInterrupt raised where Python ignores it (%r) is raised again",
                     unraisable.object)
        _interrupt_at_next_call(calls_only=False)
        return
    previous(unraisable)


# The frames of the two functions above see their own returns after arming.
_OWN_CODES = (_interrupt_at_next_call.__code__, _redeliver_dropped_interrupts.__code__)
_hook_lock = threading.Lock()


def keep_interrupts() -> None:
    """Makes sure a Ctrl-C that Python would drop is raised again (NOTE [ A Ctrl-C
    that Python swallows ]), and, in the main thread, puts kerasfeed's SIGINT
    handler in place of Python's default one (the same, counted, and held
    during ``interrupts_held``). Idempotent; cheap when in place."""
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _on_sigint)
    if getattr(sys.unraisablehook, "_kerasfeed_keeps_interrupts", False):
        return
    with _hook_lock:
        previous = sys.unraisablehook
        if getattr(previous, "_kerasfeed_keeps_interrupts", False):
            return
        hook = functools.partial(_redeliver_dropped_interrupts, previous=previous)
        hook._kerasfeed_keeps_interrupts = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Holds a Ctrl-C that comes during the block, in the main thread, and raises it as ``KeyboardInterrupt``
    once the block ends; a second Ctrl-C raises at once (NOTE [ Ctrl-C while TensorFlow is imported ]).
    Also raises one that was raised in the block and taken there (a bare ``except:``)."""
    global _holding, _held
    if _holding or threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not _on_sigint
    ):
        yield
        return
    _holding, _held = True, False
    before = sigints.raised
    try:
        yield
    except BaseException as e:
        if _held and not isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(_HELD_MESSAGE) from e
        raise
    finally:
        _holding = False
    if _held or sigints.raised != before:
        armed = _armed
        if armed is not None and sys.getprofile() is armed:  # this one instead of one put off
            sys.setprofile(armed.previous)  # type: ignore[attr-defined]
        raise KeyboardInterrupt(_HELD_MESSAGE)


# Said of every lazy import of kerasfeed's (TensorFlow's among them, where installed).
_HELD_MESSAGE = "kerasfeed: Ctrl-C while kerasfeed imported its modules, raised once the import ended"
_holding = False  # an ``interrupts_held`` block runs (main thread)
_held = False  # a Ctrl-C came during it


def install_interrupts() -> bool:
    """Lets waits see Ctrl-C (module docstring); keeps a Ctrl-C Python would drop (``keep_interrupts``). Idempotent."""
    keep_interrupts()
    return sigints.install()


__all__ = ["install_interrupts", "interrupts_held", "keep_interrupts", "sigints"]
