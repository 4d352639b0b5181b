"""Argument checks shared by every entry point (TF-free).

One function per kind of argument, so the same bad value gets the same
message from ``to_dataset``, the stream functions, the executors and the
HDF5 readers, up front. Each returns the normalized value (numpy integers
become ``int``), and every message ends with what was received.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Optional

import numpy as np

# tf.data.AUTOTUNE, without importing TensorFlow.
AUTOTUNE = -1

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function: the first frame outside kerasfeed."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _where(owner: Optional[str]) -> str:
    return f"{owner}: " if owner else ""


def _int(name: str, value: Any, least: int, what: str, allow_none: bool, allow_autotune: bool,
         owner: Optional[str]) -> Optional[int]:
    if value is None and allow_none:
        return None
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if allow_autotune and is_int and value == AUTOTUNE:
        return AUTOTUNE
    if not is_int or value < least:
        extra = " or tf.data.AUTOTUNE" if allow_autotune else ""
        raise ValueError(f"{_where(owner)}`{name}` must be a {what} int{extra}. Received: {name}={value!r}")
    return int(value)


def positive_int(
    name: str, value: Any, *, allow_none: bool = False, allow_autotune: bool = False, owner: Optional[str] = None
) -> Optional[int]:
    """A positive int (numpy integers accepted), or None/AUTOTUNE when allowed."""
    return _int(name, value, 1, "positive", allow_none, allow_autotune, owner)


def non_negative_int(name: str, value: Any, *, allow_none: bool = False, owner: Optional[str] = None) -> Optional[int]:
    """An int >= 0 (numpy integers accepted), or None when allowed."""
    return _int(name, value, 0, "non-negative", allow_none, False, owner)


def flag(name: str, value: Any, *, owner: Optional[str] = None) -> bool:
    """True or False (numpy bools accepted)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{_where(owner)}`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


def batching_needs_batch_size(batch_size: Optional[int], *, owner: Optional[str] = None, **given: Any) -> None:
    """Refuses batching arguments (``given``: ``drop_remainder``, ``ragged``, ``padding_values``; False or
    None: not given) without ``batch_size``: items are batches already, so they would do nothing."""
    if batch_size is not None:
        return
    for name, value in given.items():
        if value is not None and value is not False:
            raise ValueError(
                f"{_where(owner)}`{name}` needs `batch_size`; items are already batches when batch_size=None, "
                f"so kerasfeed does not batch them. Received: {name}={value!r}, batch_size=None"
            )


def seed(name: str, value: Any, *, owner: Optional[str] = None) -> Optional[int]:
    """None or an int that numpy's generators accept (0 <= seed < 2**64); TypeError for a
    value that is not an int, ValueError for one out of range."""
    if value is None:
        return None
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if wrong_type or not 0 <= int(value) < 2**64:
        error = TypeError if wrong_type else ValueError
        raise error(f"{_where(owner)}`{name}` must be None or an int in [0, 2**64). Received: {name}={value!r}")
    return int(value)


def seconds(name: str, value: Any, *, allow_none: bool = True, owner: Optional[str] = None) -> Optional[float]:
    """A positive, finite number of seconds, or None when allowed."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        none = " (or None)" if allow_none else ""
        raise ValueError(
            f"{_where(owner)}`{name}` must be a positive number of seconds{none}. Received: {name}={value!r}"
        )
    return float(value)


def positive_float(name: str, value: Any, *, owner: Optional[str] = None) -> float:
    """A positive, finite number."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{_where(owner)}`{name}` must be a positive number. Received: {name}={value!r}")


def prefetch(value: Any) -> Optional[int]:
    """None, AUTOTUNE or an int >= 0."""
    return _int("prefetch", value, 0, "non-negative", True, True, None)


def device(value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"`device` must be a device name such as '/gpu:0'. Received: device={value!r}")
    return value


def summarize(value: Any, limit: int = 8) -> str:
    """A short repr of a possibly huge array or sequence, for ``Received:`` parts."""
    if isinstance(value, np.ndarray) or (isinstance(value, (list, tuple)) and len(value) > limit):
        a = np.asarray(value)
        if a.size > limit:
            head = ", ".join(repr(x) for x in a.ravel()[:limit].tolist())
            return f"array of {a.size} ({a.dtype}): [{head}, ...]"
        return f"array({a.tolist()!r})"
    return repr(value)


def weights(name: str, values: Any, *, owner: Optional[str] = None) -> np.ndarray:
    """A non-empty 1-D float64 array of finite, non-negative numbers, not all zero.

    The array is the caller's own read-only copy, never ``values`` itself: an
    order keeps it, and later edits of the caller's array must not change it.
    """
    where = _where(owner)
    try:
        if np.asarray(values).dtype.kind in "SUc":  # numpy would read "2" as 2.0, and drop 1j with a warning
            raise TypeError("strings or complex numbers")
        a = np.array(values, dtype=np.float64)  # a copy, also of a float64 array
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}`{name}` must be numbers. Received: {name}={summarize(values)}") from e
    if a.ndim != 1 or a.size == 0:
        raise ValueError(
            f"{where}`{name}` must be a non-empty 1-D sequence of numbers. Received: {name} of shape {a.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(a) | (a < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{where}`{name}` must be finite and non-negative; {name}[{i}] is {float(a[i])!r} ({bad.size} bad "
            f"entr{'y' if bad.size == 1 else 'ies'}). Received: {name}={summarize(values)}"
        )
    if not a.any():
        raise ValueError(
            f"{where}`{name}` are all zero: nothing could ever be drawn. Received: {name}={summarize(values)}"
        )
    with np.errstate(over="ignore"):
        total = a.sum()
    # The same proportions, rescaled only where the sum leaves the normal range (so that other weights
    # keep their exact draws): a sum that overflows, or a subnormal one, whose few steps made u * sum
    # (inverse CDF) land past the last cumulative weight, on an item of weight 0. An overflow is divided
    # by a power of two >= the count (exact; the sum then fits): dividing by the largest weight turned
    # a positive weight under 2**-1074 of it into 0.
    if total == np.inf:
        a = a / 2.0 ** int(a.size - 1).bit_length()
    elif total < np.finfo(np.float64).tiny:
        a = a / a.max()
    a.setflags(write=False)
    return a


def sequence_index(index: Any, length: int, owner: str, out_of_range: Callable[[], str]) -> int:
    """``index`` of a sequence of ``length`` (a Python or numpy int; negative counts from the end) as an
    int in ``[0, length)``; TypeError for another type (a bool, 1.0 and '3' included), naming ``owner``;
    IndexError with ``out_of_range()``'s message."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{owner} indices must be integers. Received: index={index!r}")
    i = int(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(out_of_range())
    return i


def optional_callable(name: str, value: Any, *, owner: Optional[str] = None) -> Any:
    """None or a callable."""
    if value is not None and not callable(value):
        raise TypeError(f"{_where(owner)}`{name}` must be a callable or None. Received: {name}={value!r}")
    return value


def path(name: str, value: Any, *, owner: Optional[str] = None) -> str:
    """A non-empty str path (a str or an ``os.PathLike`` that gives one), as a str."""
    try:
        p = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    except TypeError:  # an __fspath__ that returns neither str nor bytes
        p = None
    if not isinstance(p, str) or not p:
        raise TypeError(
            f"{_where(owner)}`{name}` must be a non-empty path (a str or os.PathLike). "
            f"Received: {name}={value!r} of type {type(value).__name__}"
        )
    return p


def nearest_existing(path: str) -> str:
    """``path`` (made absolute) or the nearest directory above it that exists:
    where a file in the way of a path to be made shows up."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe
