"""The random-access source protocol and helpers shared by every executor."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RandomAccessSource(Protocol):
    """What ``to_dataset`` needs: a length and items by integer index.

    Optional hooks, used when present:
      - ``set_epoch(epoch)``: called in every process that runs items before
        it runs items of pass ``epoch`` (so worker copies see the epoch too).
      - ``on_epoch_begin()`` / ``on_epoch_end()``: called once per pass in the
        consumer process, as Keras does for a ``PyDataset``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def source_length(source: Any) -> int:
    """Returns ``len(source)`` after checking that ``source`` is indexable.

    Raises:
        TypeError: ``source`` lacks ``__len__``/``__getitem__``.
        ValueError: the length is not a positive integer.
    """
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            "kerasfeed needs an indexable source: an object with `__len__` and "
            "`__getitem__` (e.g. a kerasfeed.SceneSequence or keras.utils.PyDataset). "
            f"Received: {source!r} of type {type(source).__name__}"
        )
    try:
        n = len(source)
    except Exception as e:  # a PyDataset without __len__, say
        raise TypeError(
            f"len(source) failed for {type(source).__name__}: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"len(source) must return an int. Received: {n!r}")
    if n <= 0:
        raise ValueError(
            f"The source is empty: len({type(source).__name__}) is {n}; "
            "it must hold at least one item."
        )
    return n


def source_name(source: Any) -> str:
    return type(source).__name__


def set_epoch(source: Any, epoch: int) -> None:
    """Tells ``source`` which pass is running, if it wants to know."""
    hook = getattr(source, "set_epoch", None)
    if callable(hook):
        hook(epoch)


def close_quietly(iterator: Any) -> None:
    """Closes a generator (or any iterator with ``close``) whose stream is over
    either way: an exception from its clean-up must not hide the real outcome."""
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001
            pass
