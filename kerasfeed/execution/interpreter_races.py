"""Known interpreter races that a retry of the same item gets past.

NOTE [ AST race on Python 3.11.0-3.11.7 and 3.12.0-3.12.1 ]
CPython kept the AST constructor's recursion depth in interpreter-wide state
(python/cpython#106905, fixed in 3.11.8 and 3.12.2): when two threads build
ASTs at once and a garbage collection switches threads in between, one fails
with ``SystemError: AST constructor recursion depth mismatch``. ``np.load``
builds one (``ast.literal_eval`` of the ``.npy`` header), so a source loading
``.npy`` files on the threads executor, beside Keras or TensorFlow parsing
code in the main thread, fails an item now and then. The item is made again
(up to ``AST_RACE_RETRIES`` times) and a warning once per process says to
upgrade Python. Only the threads executor and ``export``'s writer threads
retry (worker processes call items on one thread).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

AST_RACE_MESSAGE = "AST constructor recursion depth mismatch"
AST_RACE_RETRIES = 3

_warned = threading.Event()


def get_item(source: Any, index: int, name: str, cache: Any = None) -> Any:
    """``source[index]`` (through ``cache.make`` with cache=), made again when it failed only by the AST race."""
    for attempt in range(AST_RACE_RETRIES + 1):
        try:
            return source[index] if cache is None else cache.make(source, index)
        except SystemError as e:
            if attempt == AST_RACE_RETRIES or AST_RACE_MESSAGE not in str(e):  # not the AST race
                raise
            if not _warned.is_set():
                _warned.set()
                warnings.warn(
                    f"kerasfeed: {name}[{index}] failed with CPython's AST race ({e}); "
                    "the item was made again. Python 3.11.8 and 3.12.2 fix it "
                    "(python/cpython#106905).",
                    RuntimeWarning,
                    stacklevel=2,
                )
    raise AssertionError("unreachable")  # the loop returns or raises
