"""Each begin of a pass as a ticket, and what is kept per ticket (TF-free).

NOTE [ A pass begun again ]
Under ``model.fit`` a pass is the fit's epoch (NOTE [ The pass follows Keras' epoch ]), so a pass may
begin again while an iterator of its earlier begin still calls in: a model build's throwaway iterator
(JAX, torch), or the iterator of a fit that an exception ended, which the traceback a notebook keeps
holds alive and whose tf.data prefetch goes on taking items. Had both begins one number, the older
calls would use up the newer begin's count and items: a lost batch, or ``KeyError``. Each begin
therefore hands out a *ticket*, which the front ends pass back with every call: the pass's number the
first time, then that plus a multiple of ``2**TICKET_BITS`` (``pass_of`` gives the pass back). What
the pipeline and the front ends keep per pass is kept per ticket; the executor's plan and the items'
numbers stay per pass. A begin again waits for the older begin's takes already under way (they read
its plan; ``SETTLE_S`` at most), and refuses the older begin's later calls: an abandoned iterator
never reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

logger = logging.getLogger("kerasfeed")

TICKET_BITS = 40
# Seconds a begin again waits for the older begin's takes under way, then goes on (with a warning).
SETTLE_S = 10.0


def pass_of(ticket: Any) -> int:
    """The pass that a ticket (``PassPipeline.begin``) is a begin of."""
    return int(ticket) & ((1 << TICKET_BITS) - 1)


class Begins:
    """The passes begun, one ticket each (NOTE [ A pass begun again ]): per ticket, the pass's order
    (a lazy view; the last ``kept`` passes), its items not loaded yet and its takes under way.

    Args:
        kept: passes whose order stays available; older ones are iterators given up.
    """

    def __init__(self, kept: int):
        self._kept = kept
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an older begin's last take under way returned
        self._tickets: dict[int, int] = {}  # pass -> the ticket of its newest begin
        self._remaining: dict[int, int] = {}
        self._views: dict[int, Any] = {}
        self._in_flight: dict[int, int] = {}

    def issue(self, epoch: int, indices: Any) -> int:
        """The ticket of pass ``epoch`` begun now with the order ``indices``, once the takes under way
        of its older begin, if any, returned."""
        with self._lock:
            older = self._tickets.get(epoch)
            ticket = epoch if older is None else older + (1 << TICKET_BITS)
            self._tickets[epoch] = ticket
            self._remaining[ticket], self._views[ticket] = len(indices), indices
            for gone in [t for t in self._views if pass_of(t) <= epoch - self._kept or t == older]:
                self._views.pop(gone, None)  # a view is small: a window of indices
                self._remaining.pop(gone, None)
            for gone in [e for e in self._tickets if e <= epoch - self._kept]:
                del self._tickets[gone]
            deadline = time.monotonic() + SETTLE_S
            while older is not None and self._in_flight.get(older):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("kerasfeed: pass %d begins again while %d item(s) of its earlier begin are still "
                                   "loading after %.0f s; going on.", epoch, self._in_flight[older], SETTLE_S)
                    break
                self._settled.wait(left)
        return ticket

    def view(self, ticket: int) -> Optional[Any]:
        """The order of begin ``ticket`` (None: no longer kept)."""
        with self._lock:
            self._check_current(ticket)
            return self._views.get(ticket)

    def progress(self, ticket: int) -> tuple[Optional[Any], int]:
        """``(order, items not loaded yet)`` of begin ``ticket`` (None: no longer kept)."""
        with self._lock:
            return self._views.get(ticket), self._remaining.get(ticket, 0)

    def enter(self, ticket: int) -> None:
        """A take of begin ``ticket`` starts (refused for an older begin of a pass begun again)."""
        with self._lock:
            self._check_current(ticket)
            self._in_flight[ticket] = self._in_flight.get(ticket, 0) + 1

    def leave(self, ticket: int, loaded: bool) -> bool:
        """A take of begin ``ticket`` returned, ``loaded`` (else it raised): whether it was the last
        item of its pass to load (False for an older begin whose pass began again meanwhile)."""
        with self._lock:
            count = self._in_flight[ticket] - 1
            if count:
                self._in_flight[ticket] = count
            else:
                del self._in_flight[ticket]
                if not self._current(ticket):  # a begin again may be waiting for it
                    self._settled.notify_all()
            left = self._remaining.get(ticket) if loaded else None
            if left is None:
                return False
            if left > 1:
                self._remaining[ticket] = left - 1
                return False
            del self._remaining[ticket]
            return True

    def read_whole(self, ticket: int) -> bool:
        """Begin ``ticket``'s items were all read at once: whether it is the pass's newest begin."""
        with self._lock:
            if not self._current(ticket):
                return False
            self._remaining.pop(ticket, None)
            return True

    def _current(self, ticket: int) -> bool:
        """Under ``_lock``: whether ``ticket`` is its pass's newest begin (or one no longer kept)."""
        return self._tickets.get(pass_of(ticket), ticket) == ticket

    def _check_current(self, ticket: int) -> None:
        if not self._current(ticket):
            epoch = pass_of(ticket)
            raise RuntimeError(
                f"kerasfeed: pass {epoch} began again for a newer iterator (a new `fit`'s epoch {epoch}, the "
                f"fit's first epoch after a model build, or a read of this same dataset or loader from inside the "
                f"fit that reads it: a callback's predict, evaluate or iter() of the data fit trains on), so this "
                f"older iterator of it is no longer read; iterate the newest iterator, and give a callback that "
                f"reads the training data a dataset or loader of its own (made once, beside the fit's). "
                f"Received: a call for pass {epoch} from the older iterator"
            )


__all__ = ["Begins", "SETTLE_S", "TICKET_BITS", "pass_of"]
