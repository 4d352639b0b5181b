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
    """One pass of a stream, checked against ``expected`` items (``take``/``close`` as the wrapped pass)."""

    def __init__(self, inner: Any, expected: int, api: str, number: int):
        self._inner, self._expected, self._api, self._number = inner, expected, api, number
        self._n = 0
        self._held: Any = None
        self._done = False

    def take(self, timeout: Optional[float] = None) -> Any:
        """Returns ``(item, origin)``, ``NOT_READY`` or ``END`` (raises on a count mismatch)."""
        if self._done:
            return END
        while True:
            r = self._inner.take(timeout)
            if r is NOT_READY:
                return r
            if self._held is not None:  # the declared items are all here: only END may follow
                if r is not END:
                    raise self._error("more than")
                held, self._held, self._done = self._held, None, True
                return held
            if r is END:
                raise self._error("fewer than")
            self._n += 1
            if self._n < self._expected:
                return r
            self._held = r  # the last one: wait for the end of the pass

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


def counted_passes(open_pass: Callable[[], Any], expected: Optional[int], api: str) -> Callable[[], Any]:
    """``open_pass`` whose passes are checked against ``expected`` items (unchanged when None)."""
    if expected is None:
        return open_pass
    number = iter(range(2**62))

    def open_counted() -> CountedPass:
        return CountedPass(open_pass(), expected, api, next(number))

    return open_counted


__all__ = ["EpochLengthError", "CountedPass", "counted_passes"]
