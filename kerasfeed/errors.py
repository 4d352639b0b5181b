"""Exceptions raised by kerasfeed.

They are plain Python exceptions (no TensorFlow import) so that worker
processes can build and pickle them.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any, Optional


def _traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _where(worker_id, pid) -> str:
    return "" if worker_id is None else f" in worker {worker_id} (pid {pid})"


# One cause of a failed attempt, as ``causes`` lists it: short, one line.
CAUSE_CHARS = 160


def short_repr(obj: object, limit: int = 80) -> str:
    """``repr(obj)`` cut to ``limit`` characters, for ``Received:`` (a stand-in if ``repr`` raises)."""
    try:
        r = repr(obj)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the error being reported
        r = f"<{type(obj).__name__} object>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def held_objects(array: Any) -> Optional[str]:
    """What an object array holds, by its first element: ``"strings (b'oops'...)"`` (a str or bytes leaf
    becomes one), else ``"object: dict {...}"``; None for any other array, or an empty one."""
    if getattr(getattr(array, "dtype", None), "kind", "") != "O" or not array.size:
        return None
    first = array.flat[0]
    if isinstance(first, (str, bytes)):
        return f"strings ({short_repr(first)}...)"
    return f"object: {type(first).__name__} {short_repr(first)}"


def short_cause(text: str) -> str:
    """``text``'s first line, at most ``CAUSE_CHARS`` characters (an attempt's cause)."""
    line = (text.strip().splitlines() or [""])[0].strip()
    if line.startswith("kerasfeed: "):
        line = line[len("kerasfeed: ") :]
    return line if len(line) <= CAUSE_CHARS else line[: CAUSE_CHARS - 3] + "..."


def attempts_text(causes: list) -> str:
    """`` [3 attempts: 1) ...; 2) ...; 3) ...]``: what a final error adds to its message
    (nothing for a single attempt, so that messages without retries are unchanged)."""
    if len(causes) <= 1:
        return ""
    return f" [{len(causes)} attempts: " + "; ".join(f"{k}) {c}" for k, c in enumerate(causes, 1)) + "]"


class ItemTraceback(Exception):
    """The original traceback of a failed item or stream, as text: every ``ItemError``'s ``__cause__``, so
    that the error's own message stays one line (TensorFlow repeats that message)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class ItemError(RuntimeError):
    """``source[index]`` raised; carries the index and the original error.

    Its message is one line (index, worker, original type and message); the
    original traceback is its ``__cause__`` (an ``ItemTraceback``), which
    Python prints once, just before it. Inside a ``tf.data`` pipeline
    TensorFlow re-raises it as ``tf.errors.UnknownError`` whose text holds
    that line and the original traceback once. ``full_message`` gives both.

    Attributes:
        index: the item index that failed.
        exc_type: name of the original exception type (e.g. ``"ValueError"``).
        exc_message: ``str()`` of the original exception.
        traceback_text: the formatted original traceback.
        worker_id: id of the worker process that ran the item, or None.
        pid: process id where the item ran.
        attempts: how many times the item was tried (1 without ``retries``).
        causes: one short line per attempt, why it failed (the last one is
            this error's own); the message lists them when there were several.
    """

    def __init__(self, index: int, exc_type: str, exc_message: str, traceback_text: str,
                 worker_id: Optional[int] = None, pid: Optional[int] = None, source_name: str = "source",
                 attempts: int = 1, causes: Optional[list] = None):
        self.index = index
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback_text = traceback_text
        self.worker_id = worker_id
        self.pid = pid
        self.source_name = source_name
        self.causes = list(causes) if causes else [short_cause(f"{exc_type}: {exc_message}")]
        self.attempts = attempts if causes else 1
        where = _where(worker_id, pid)
        super().__init__(self._message(where))
        self.__cause__ = ItemTraceback(f"Original traceback{where}:\n{traceback_text.rstrip()}")

    def _message(self, where: str) -> str:
        return f"kerasfeed: {self._subject()}{where}: {self.exc_message}" + attempts_text(self.causes)

    def with_attempts(self, causes: list) -> "ItemError":
        """A copy of this error after ``len(causes)`` attempts (``causes``: one
        line each, this error's own last), its message listing them."""
        new = copy.copy(self)  # through __reduce__: a fresh object with its own cause
        new.causes, new.attempts = list(causes), max(1, len(causes))
        new.args = (new._message(_where(new.worker_id, new.pid)),)
        return new

    @property
    def full_message(self) -> str:
        """The one-line message followed by the original traceback."""
        return f"{self}\n\n{self.__cause__}" if self.__cause__ is not None else str(self)

    def _subject(self) -> str:
        return f"{self.source_name}[{self.index}] raised {self.exc_type}"

    def __reduce__(self):
        return (ItemError, (self.index, self.exc_type, self.exc_message, self.traceback_text, self.worker_id,
                            self.pid, self.source_name, self.attempts, self.causes))

    @classmethod
    def from_exception(cls, index: int, exc: BaseException, *, worker_id: Optional[int] = None,
                       pid: Optional[int] = None, source_name: str = "source") -> "ItemError":
        return cls(index, type(exc).__name__, str(exc), _traceback_text(exc), worker_id=worker_id, pid=pid,
                   source_name=source_name)


class SignatureError(ValueError):
    """An item does not match the dataset's element signature.

    The message names the index, the field (``x``, ``y['mask']``, ...) and
    the expected versus received structure, shape or dtype.
    """


class WorkerError(RuntimeError):
    """A worker process died, failed to start, or stopped answering.

    Raised by the process executor for the items that were pending on the
    worker and, without ``retries``, for every later item of that pass: such
    a pool does not replace workers within a pass (a crash in native code
    usually repeats), so the pass stops with this error instead of hanging;
    the next pass starts new workers. With ``retries`` the worker is
    replaced and the item tried again; this error then comes only when the
    item's last attempt failed so.

    Attributes:
        worker_id: id of the worker (0 .. workers-1).
        pid: the worker's process id.
        exitcode: the exit code, or ``-signal`` when a signal killed it,
            or None when it is unknown.
        index: the item index that was pending on the worker, if any (the
            item it died on: another load's item may fail with it too).
        attempts: how many times the item was tried (1 without ``retries``).
        causes: one short line per attempt (this error's own last).
    """

    def __init__(self, message: str, worker_id: Optional[int] = None, pid: Optional[int] = None,
                 exitcode: Optional[int] = None, index: Optional[int] = None, attempts: int = 1,
                 causes: Optional[list] = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.index = index
        self.causes = list(causes) if causes else [short_cause(message)]
        self.attempts = attempts if causes else 1

    def with_attempts(self, causes: list) -> "WorkerError":
        """A copy after ``len(causes)`` attempts, the list at the end of its first line."""
        head, sep, rest = str(self).partition("\n")
        message = head + attempts_text(list(causes)) + sep + rest
        return WorkerError(message, self.worker_id, self.pid, self.exitcode, self.index, max(1, len(causes)), causes)

    def __reduce__(self):
        return WorkerError, (str(self), self.worker_id, self.pid, self.exitcode, self.index, self.attempts, self.causes)


class ItemTimeout(ItemError, TimeoutError):
    """``source[index]`` ran past ``timeout=`` on the threads executor.

    A ``TimeoutError`` (what it always was) and an ``ItemError`` (with
    ``index``, ``attempts`` and ``causes``), so that what handles an item's
    failure handles this one too. The call itself runs on in its thread
    (Python cannot stop a thread). Worker processes raise ``WorkerError``
    instead: their stuck worker is stopped.
    """

    def __init__(self, index: int, message: str, source_name: str = "source", attempts: int = 1,
                 causes: Optional[list] = None):
        causes = causes or [short_cause(message)]
        super().__init__(index, "TimeoutError", message, "", None, None, source_name, attempts, causes)
        self.__cause__ = None  # nothing ran to the end: no traceback to show

    def _message(self, where: str) -> str:
        # The attempts go before the closing "Received: ...".
        head, sep, received = self.exc_message.rpartition(" Received: ")
        if not sep:
            return self.exc_message + attempts_text(self.causes)
        return f"{head}{attempts_text(self.causes)}{sep}{received}"

    def __reduce__(self):
        return (ItemTimeout, (self.index, self.exc_message, self.source_name, self.attempts, self.causes))


class StreamError(ItemError):
    """A generator shard, a file's ``read_fn`` or a queue producer raised.

    Used by ``from_generators``, ``from_files`` and ``from_queue``. Like
    ``ItemError`` (a subclass), TensorFlow re-raises it inside a pipeline as a
    ``tf.errors.OpError`` whose message is this exception's message.

    Attributes (besides ``ItemError``'s):
        what: the failing stream, e.g. ``"make_gen(3) (generator shard 3 of 100)"``.
        items_before: how many items that stream had produced before it raised.
        index: the shard or file number, or None (a queue producer).
    """

    def __init__(self, what: str, exc_type: str, exc_message: str, traceback_text: str, index: Optional[int] = None,
                 items_before: int = 0, worker_id: Optional[int] = None, pid: Optional[int] = None):
        self.what = what
        self.items_before = items_before
        super().__init__(index, exc_type, exc_message, traceback_text, worker_id, pid, source_name=what)

    def _subject(self) -> str:
        plural = "" if self.items_before == 1 else "s"
        return f"{self.what} raised {self.exc_type} after {self.items_before} item{plural}"

    def __reduce__(self):
        return (StreamError, (self.what, self.exc_type, self.exc_message, self.traceback_text, self.index,
                              self.items_before, self.worker_id, self.pid))

    @classmethod
    def from_exception(  # type: ignore[override]
        cls, what: str, exc: BaseException, *, index: Optional[int] = None, items_before: int = 0,
        worker_id: Optional[int] = None, pid: Optional[int] = None,
    ) -> "StreamError":
        return cls(what, type(exc).__name__, str(exc), _traceback_text(exc), index, items_before, worker_id, pid)


class FileChangedError(OSError):
    """A file changed on disk since it was opened or described: replaced (renamed over its path) or
    shortened in place. Raised by the HDF5 sequences and by h5py handles a source sends to worker
    processes (``execution/h5_handles.py``)."""


class KerasStructureError(RuntimeError):
    """This Keras differs from the private structure kerasfeed reads where Keras has no public
    route (its ``fit``'s locals, its epoch iterator), and reading on would train other passes
    than the run it continues (a ``fit`` from a later epoch, a restored backup, a resume inside
    an epoch). The message names the Keras version and what is missing
    (NOTE [ Keras' private structure ] in ``kerasfeed/_keras_fit.py``)."""


class KerasStructureWarning(UserWarning):
    """This Keras differs from the private structure kerasfeed reads, where the data trained stays
    right (once per difference; ``KerasStructureError`` where it would not)."""
