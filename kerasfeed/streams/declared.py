"""Streams of a declared length: the ``items_per_epoch`` of the stream functions.

A stream (generators, files, a queue) has no length tf.data can see, so
``model.fit`` learns the number of steps from the first epoch and warns that
the input "ran out of data" (Keras 3.15 on TensorFlow warns at the end of
every epoch: it counts the step that found no data). A declared number of
items per pass becomes the dataset's cardinality (Keras then knows its steps
and stays quiet), and every pass is checked here: one that ends early or has
more items fails with a ``StreamError`` naming both counts, instead of Keras
silently cutting or shortening the epoch. The last declared item is held back
until the pass's end is confirmed: a consumer that stops after the declared
number of batches (``fit`` does) would otherwise never see the surplus.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kerasfeed.streams.options import END, NOT_READY, NothingRaised


class EpochLengthError(NothingRaised):
    """A pass of a stream with ``items_per_epoch`` had a different number of items."""

    def _subject(self) -> str:
        return f"{self.what} {self.exc_type}"


class CountedPass:
    """One pass of a stream, checked against ``expected`` items (``take``/``close`` as the wrapped pass).

    ``needed``: the items a consumer reads before it stops (``expected``; with ``drop_remainder``, those of
    the whole batches). That last one is held back until the pass's end is confirmed; the items after it
    (the dropped remainder, fewer than a batch) are read and counted meanwhile, then handed out behind it
    (a shuffle before the batch may still pick them)."""

    def __init__(self, inner: Any, expected: int, api: str, number: int, needed: Optional[int] = None):
        self._inner, self._expected, self._api, self._number = inner, expected, api, number
        self._needed = expected if needed is None else needed
        self._n = 0
        self._held: list = []  # the last needed item, then the rest up to the end
        self._done = False

    def take(self, timeout: Optional[float] = None) -> Any:
        """Returns ``(item, origin)``, ``NOT_READY`` or ``END`` (raises on a count mismatch)."""
        if self._done:
            return self._held.pop(0) if self._held else END
        while True:
            r = self._inner.take(timeout)
            if r is NOT_READY:
                return r
            if r is END:
                if self._n != self._expected:
                    raise self._error("fewer than")
                if not self._held:
                    return END
                self._done = True
                return self._held.pop(0)
            self._n += 1
            if self._n > self._expected:
                raise self._error("more than")
            if self._n < self._needed:
                return r
            self._held.append(r)  # the last needed one and those after it: until the pass's end

    def _error(self, how: str) -> EpochLengthError:
        what = f"{self._api} (pass {self._number})"
        more = how == "more than"
        got = f"at least {self._expected + 1} items arrived" if more else f"it ended after {self._n} items"
        return EpochLengthError(
            what, f"had {how} {self._expected} items",
            f"{got}, but `items_per_epoch={self._expected}` declared the length of every pass "
            "(the dataset's cardinality). Declare the right count, or drop `items_per_epoch` for a stream "
            f"whose length varies. Received: items_per_epoch={self._expected}",
            "", None, self._n,
        )

    def close(self) -> None:
        self._inner.close()


def counted_passes(open_pass: Callable[[], Any], expected: Optional[int], api: str,
                   needed: Optional[int] = None) -> Callable[[], Any]:
    """``open_pass`` whose passes are checked against ``expected`` items (unchanged when None); ``needed``:
    the items a consumer reads (fewer with ``drop_remainder``: ``CountedPass``)."""
    if expected is None:
        return open_pass
    number = iter(range(2**62))

    def open_counted() -> CountedPass:
        return CountedPass(open_pass(), expected, api, next(number), needed)

    return open_counted


__all__ = ["EpochLengthError", "CountedPass", "counted_passes"]
