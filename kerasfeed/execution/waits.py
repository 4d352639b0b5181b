"""Blocking pick-ups that end when their consumer is gone, or on Ctrl-C.

Without a ``timeout`` an executor waits for an item as long as its worker
lives. A wait in progress also ends, from outside the waiting thread, when the
last iterator over the executor is deleted (``kerasfeed.tfdata.consumers``
tells its ``WaitScope`` before TensorFlow joins the iterator's threads) and on
Ctrl-C (the SIGINTs ``interrupts.sigints`` read between slices); why tf.data
needs both: docs/reliability.md, *A stuck item without a timeout*. A wait
remembers both states when it starts, so a later load waits as usual (but for
a SIGINT the main thread has not handled yet: NOTE [ A Ctrl-C between two
waits ] in ``interrupts.py``).

Some waits nobody can end from here (TensorFlow resetting an input inside
``next()`` at the end of ``take(3)``, iterators made inside a
``tf.function``), so a wait longer than the *stuck-wait notice* interval (60
s; ``KERASFEED_STUCK_NOTICE_S``) logs one warning on the ``kerasfeed`` logger
naming what it waits for and the remedies.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable, Optional, Union

from kerasfeed.execution.interrupts import sigints

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


class WaitScope:
    """The waits of one executor, and the live consumers (iterators) over it."""

    def __init__(self, timeout: Optional[float] = None):
        self._lock = threading.Lock()
        self._gen = 0
        self._consumers = 0
        self.notice_s = stuck_notice_s()  # a bad value fails where the dataset is made
        self.timeout = timeout  # the executor's ``timeout=``, named by the notice

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
        """Call when a load starts to block (not on the fast path). ``interrupts``: Ctrl-C ends the wait
        (False in threads no one joins, e.g. stream producers: a KeyboardInterrupt there would only print
        a traceback); ``notice``: it logs the stuck-wait notice (False when another wait of the item does)."""
        return Wait(self, interrupts, notice)


What = Union[str, Callable[[], str]]


class Wait:
    """One blocking wait; ``check`` between slices raises when it must end."""

    __slots__ = ("_scope", "_gen", "_sigints", "_t0", "_notice_at")

    def __init__(self, scope: WaitScope, interrupts: bool = True, notice: bool = True):
        self._scope = scope
        self._gen = scope._gen
        # SIGINTs the main thread handled before this wait do not count.
        self._sigints = sigints.poll() if interrupts else None
        self._t0 = time.monotonic()
        self._notice_at = self._t0 + getattr(scope, "notice_s", DEFAULT_NOTICE_S) if notice else math.inf

    def check(self, what: What) -> None:
        """Raises ``KeyboardInterrupt`` (Ctrl-C since the wait began) or ``WaitAbandoned`` (its consumer
        was deleted), or logs the stuck-wait notice once; ``what`` names the item (or a callable does)."""
        if self._sigints is not None and sigints.ends(self._sigints):
            raise KeyboardInterrupt(f"kerasfeed: interrupted (Ctrl-C) while waiting for {_name(what)}")
        if self._scope._gen != self._gen:
            name = _name(what)
            raise WaitAbandoned(
                f"kerasfeed: the iterator waiting for {name} was deleted; the wait was abandoned. Received: {name}"
            )
        now = time.monotonic()
        if now >= self._notice_at:
            self._notice_at = math.inf
            timeout = getattr(self._scope, "timeout", None)
            remedy = (
                " (no `timeout=` was given); it looks stuck. Pass `timeout=` (seconds) to fail with an error "
                "instead of waiting"
                if timeout is None
                else f"; it looks stuck. It fails with an error once an item takes timeout={timeout:g} s"
            )
            logger.warning(
                "kerasfeed: waiting for %s for %.0f s%s; Ctrl-C stops the wait. "
                "(This notice comes once per wait, after %s=%g s.)",
                _name(what),
                now - self._t0,
                remedy,
                NOTICE_ENV,
                self._scope.notice_s,
            )


def _name(what: What) -> str:
    return what() if callable(what) else what


__all__ = ["Wait", "WaitAbandoned", "WaitScope", "stuck_notice_s"]
