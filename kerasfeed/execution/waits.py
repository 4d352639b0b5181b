"""Blocking pick-ups that end when their consumer is gone, or on Ctrl-C.

Without a ``timeout`` an executor waits for an item as long as its worker
lives. Two things must still end such a wait, from outside the waiting
thread:

- **The consumer went away.** Deleting a tf.data iterator (``break``,
  ``take(3)``, the end of ``fit``) cancels its threads and joins them; a
  thread inside a kerasfeed ``numpy_function`` never sees that cancellation
  (TensorFlow's Python-function op does not listen for it), so the join
  waited for the stuck item. ``kerasfeed.tfdata.consumers`` tells the
  executor's ``WaitScope`` when the last iterator over it is deleted (before
  TensorFlow joins), and the waits in progress give up.
- **Ctrl-C.** Python runs signal handlers in the main thread only, between
  bytecodes; a main thread blocked inside TensorFlow (``next(it)``, a
  ``fit`` step) waiting for that item never gets there. Python's C-level
  handler also writes the signal number to the *wakeup fd*
  (``signal.set_wakeup_fd``); kerasfeed points it at a pipe of its own
  (only when nobody else uses it, e.g. not under asyncio), and the waits
  read that pipe between slices. A wait that sees SIGINT (while Python's
  default handler is in place) raises ``KeyboardInterrupt``: TensorFlow
  hands the main thread an error, the main thread returns to Python, and
  the pending handler raises ``KeyboardInterrupt`` there as usual.

Only waits in progress are ended: a wait remembers the state of both when
it starts, and a later load waits as usual.

Some waits nobody can end from here (TensorFlow resetting an input inside
``next()`` at the end of ``take(3)``, iterators made inside a
``tf.function``). So a wait that goes on for longer than the *stuck-wait
notice* interval (60 s; ``KERASFEED_STUCK_NOTICE_S`` sets it) logs one
warning on the ``kerasfeed`` logger naming what it waits for and the
remedies.
"""

from __future__ import annotations

import _thread
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, Union

logger = logging.getLogger("kerasfeed")

NOTICE_ENV = "KERASFEED_STUCK_NOTICE_S"
DEFAULT_NOTICE_S = 60.0


def stuck_notice_s() -> float:
    """Seconds a wait goes on before its one warning (``KERASFEED_STUCK_NOTICE_S``).

    Raises:
        ValueError: the variable is set but is not a positive number.
    """
    raw = os.environ.get(NOTICE_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_NOTICE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"The environment variable {NOTICE_ENV} must be a positive number of seconds (how long a wait "
            f"goes on before kerasfeed warns that it looks stuck). Received: {NOTICE_ENV}={raw!r}"
        )
    return value


class WaitAbandoned(RuntimeError):
    """A load gave up because the iterator waiting for it was deleted."""


class _Interrupts:
    """SIGINTs seen through Python's wakeup fd (a pipe kerasfeed owns)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None
        self.count = 0  # SIGINTs read from the pipe so far

    def install(self) -> bool:
        """Points the wakeup fd at our pipe; main thread only, once, and only
        if the wakeup fd is free. Returns whether ours is in place."""
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
        except (BlockingIOError, InterruptedError):
            return self.count
        except OSError:
            return self.count
        hits = data.count(signal.SIGINT)
        # Only when Ctrl-C means KeyboardInterrupt: a handler of the user's own
        # (a graceful stop) must not have its pipeline broken.
        if hits and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint):
            with self._lock:
                self.count += hits
        return self.count


_interrupts = _Interrupts()
_TF_EXCEPTION_MODULE = os.path.join("tensorflow", "python", "eager", "core.py")


def _on_sigint(signum, frame):
    """Python's default SIGINT behaviour (KeyboardInterrupt), but never raised
    inside TensorFlow's exception constructor.

    When a wait gives up on Ctrl-C, TensorFlow turns the error into an
    exception object for the main thread; the pending SIGINT is handled in
    that constructor's first bytecodes, and a KeyboardInterrupt raised there
    comes out as pybind11's ``RuntimeError: ... MISMATCH of original and
    normalized active exception types``. So there, the SIGINT is raised
    again at the next Python call outside it (the caller's ``except``
    clause): a plain KeyboardInterrupt.
    """
    if _inside_tf_exception(frame):
        previous = sys.getprofile()

        def again(f, event, arg):
            if event == "call" and not _inside_tf_exception(f):
                sys.setprofile(previous)
                _thread.interrupt_main()  # handled as this call starts

        sys.setprofile(again)
        return
    signal.default_int_handler(signum, frame)


def _inside_tf_exception(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(_TF_EXCEPTION_MODULE):
            return True
        frame = frame.f_back
    return False


def install_interrupts() -> bool:
    """Lets waits see Ctrl-C (see the module docstring). Idempotent."""
    return _interrupts.install()


class WaitScope:
    """The waits of one executor, and the live consumers (iterators) over it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._gen = 0
        self._consumers = 0
        self.notice_s = stuck_notice_s()  # a bad value fails where the dataset is made

    def consumer_started(self) -> None:
        with self._lock:
            self._consumers += 1

    def consumer_gone(self) -> None:
        """One consumer is deleted; the last one ends the waits in progress."""
        with self._lock:
            self._consumers = max(0, self._consumers - 1)
            if self._consumers == 0:
                self._gen += 1

    def cancel(self) -> None:
        """Ends every wait in progress (later ones wait as usual)."""
        with self._lock:
            self._gen += 1

    def begin(self, *, interrupts: bool = True, notice: bool = True) -> "Wait":
        """Call when a load starts to block (not on the fast path).

        Args:
            interrupts: Ctrl-C ends the wait (False in threads that no one
                joins, e.g. stream producers: a KeyboardInterrupt there would
                only print a traceback).
            notice: this wait logs the stuck-wait notice (False when another
                wait of the same item already does).
        """
        return Wait(self, interrupts, notice)


What = Union[str, Callable[[], str]]


class Wait:
    """One blocking wait; ``check`` between slices raises when it must end."""

    __slots__ = ("_scope", "_gen", "_sigints", "_t0", "_notice_at")

    def __init__(self, scope: WaitScope, interrupts: bool = True, notice: bool = True):
        self._scope = scope
        self._gen = scope._gen
        # SIGINTs from before this wait do not count.
        self._sigints = _interrupts.poll() if interrupts else None
        self._t0 = time.monotonic()
        self._notice_at = self._t0 + getattr(scope, "notice_s", DEFAULT_NOTICE_S) if notice else math.inf

    def check(self, what: What) -> None:
        """Raises ``KeyboardInterrupt`` (Ctrl-C since the wait began) or
        ``WaitAbandoned`` (its consumer was deleted); ``what`` names the item
        (or returns its name: called only when needed). Logs the stuck-wait
        notice once, when the wait has gone on for the notice interval."""
        if self._sigints is not None and _interrupts.poll() != self._sigints:
            raise KeyboardInterrupt(f"kerasfeed: interrupted (Ctrl-C) while waiting for {_name(what)}")
        if self._scope._gen != self._gen:
            name = _name(what)
            raise WaitAbandoned(
                f"kerasfeed: the iterator waiting for {name} was deleted; the wait was abandoned. Received: {name}"
            )
        now = time.monotonic()
        if now >= self._notice_at:
            self._notice_at = math.inf
            logger.warning(
                "kerasfeed: waiting for %s for %.0f s (no `timeout=` was given); it looks stuck. Pass "
                "`timeout=` (seconds) to fail with an error instead of waiting; Ctrl-C stops the wait. "
                "(This notice comes once per wait, after %s=%g s.)",
                _name(what),
                now - self._t0,
                NOTICE_ENV,
                self._scope.notice_s,
            )


def _name(what: What) -> str:
    return what() if callable(what) else what


__all__ = ["Wait", "WaitAbandoned", "WaitScope", "install_interrupts", "stuck_notice_s"]
