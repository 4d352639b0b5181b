"""The messages between the pool (parent) and its worker processes.

One small type per message. On the wire each is a plain tuple ``(kind, *fields)``
pickled by ``Channel``: ``encode`` and ``decode`` convert at the two ends, so the
bytes do not change and the worker needs nothing but this module to read them.

Parent -> worker (in ``process.py``: ``WorkerProcess.send``):
    ``Init`` once, first; then ``Load``, ``SetState``, ``StartStream``,
    ``Credit``, ``Cancel``; ``Exit`` (EOF on the socket means the same).
Worker -> parent (in ``worker.py``: ``WorkerLoop``):
    ``Ready`` or ``InitError`` once; then ``ItemDone`` / ``ItemFailed`` per
    ``Load`` (and once ``Retire`` after an item that left it past
    ``worker_max_rss``), and ``StreamItem`` ... ``StreamEnd`` /
    ``StreamFailed`` per ``StartStream``.
Consumer only (never on the wire): ``WorkerDied``, put on a stream session's
queue by the reader thread that saw its worker die.

A message with a ``new_size`` (``ItemDone``, ``StreamItem``) has the new
shared-memory segment's fd attached (``SCM_RIGHTS``, see ``channel.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union, get_args

# --------------------------------------------------------------- parent -> worker


class Init(NamedTuple):
    """Parent -> worker, first message: who the worker is and what it runs.

    ``config``: ``Dispatcher.init_config``. ``seed`` is this worker's, ``base_seed`` the pool's (the
    items' random numbers); with ``seed_given`` (the user's) the worker reseeds ``random`` and
    ``numpy.random`` before each item; ``payload``: cloudpickled source and ``worker_init``;
    ``max_rss``: ``worker_max_rss`` or None (may be absent).
    """

    config: dict
    kind = "init"


class Load(NamedTuple):
    """Parent -> worker: write ``source[index]`` (after ``set_epoch(epoch)``) into ``slot``; answered
    by ``ItemDone`` or ``ItemFailed`` with the same ``request_id``. ``epoch`` (the pass) and ``index``
    also seed the item's random numbers (``sources/item_random.py``)."""

    request_id: int
    index: int
    epoch: int
    slot: int
    kind = "load"


class SetState(NamedTuple):
    """Parent -> worker, before any ``Load`` of pass ``epoch``: what the consumer's epoch hooks
    changed in the source (``state_sync.StateTracker.check``, applied with ``apply_state``). It
    includes the consumer's ``set_epoch(epoch)``: the worker does not call it again for that pass.
    ``handoff``: the ``_handoff`` entries the payload names, kept before it is unpickled."""

    epoch: int
    payload: bytes
    handoff: dict = {}
    kind = "state"


class StartStream(NamedTuple):
    """Parent -> worker: iterate ``fn(arg)`` (cloudpickled in ``payload``), each item into a free
    one of ``slots``; ``name`` is for error messages; ``handoff`` as ``SetState``'s."""

    stream_id: int
    payload: bytes
    slots: list
    name: str
    handoff: dict = {}
    kind = "stream"


class Credit(NamedTuple):
    """Parent -> worker: the consumer is done with stream ``stream_id``'s item in ``slot``."""

    stream_id: int
    slot: int
    kind = "credit"


class Cancel(NamedTuple):
    """Parent -> worker: stop stream ``stream_id`` (no more items)."""

    stream_id: int
    kind = "cancel"


class Exit(NamedTuple):
    """Parent -> worker: leave now."""

    kind = "exit"


# --------------------------------------------------------------- worker -> parent


class Ready(NamedTuple):
    """Worker -> parent, once: set up done. ``info``: ``pid``, ``startup_s``, ``rss_bytes``,
    ``tensorflow_imported``, ``keras_imported``."""

    info: dict
    kind = "ready"


class InitError(NamedTuple):
    """Worker -> parent, once: unpickling the source or ``worker_init`` raised; the worker exits."""

    type_name: str
    message: str
    traceback: str
    kind = "init_error"


# ``ItemDone.spec`` of an item the worker put in the item store (cache=): the parent reads it there.
IN_STORE = b""


class ItemDone(NamedTuple):
    """Worker -> parent: the item of ``Load`` ``request_id`` is in ``slot``.

    ``spec``: the pickled structure (``shm.dumps_spec``), or ``IN_STORE`` when the item is in the
    item store and the slot was not written (cache=, no ``augment``); ``new_size``: the size of a
    new segment for the slot (its fd attached), or None; ``nbytes``: the bytes of the segment the
    item uses; ``make_s``, ``write_s``: the worker's own time for ``source[index]`` and for writing
    the item into shared memory (for ``kerasfeed.stats``).
    """

    request_id: int
    slot: int
    spec: bytes
    new_size: Optional[int]
    nbytes: int
    make_s: float = 0.0
    write_s: float = 0.0
    kind = "item"


class ItemFailed(NamedTuple):
    """Worker -> parent: ``Load`` ``request_id``'s item raised ``error`` (a ``kerasfeed.ItemError``)."""

    request_id: int
    error: BaseException
    kind = "error"


class Retire(NamedTuple):
    """Worker -> parent, once, right after an item's answer: its resident memory (``rss`` bytes)
    passed ``worker_max_rss``. The parent sends it no more requests, starts a successor, and sends
    ``Exit`` once those sent are answered (NOTE [ Replacing a worker ] in ``replacement.py``)."""

    rss: int
    kind = "retire"


class StreamStarted(NamedTuple):
    """Worker -> parent: stream ``stream_id``'s task is unpickled (its module imported); its
    ``timeout`` counts from here, as a load's from ``Ready`` (start-up is not the task's time)."""

    stream_id: int
    kind = "stream_started"


class StreamItem(NamedTuple):
    """Worker -> parent: item ``n`` of stream ``stream_id`` is in ``slot`` (``spec``, ``new_size``,
    ``write_s`` as in ``ItemDone``); ``make_s``: the worker's time for ``next`` (and, for the first
    item, the task's call)."""

    stream_id: int
    n: int
    slot: int
    spec: bytes
    new_size: Optional[int]
    make_s: float = 0.0
    write_s: float = 0.0
    kind = "stream_item"


class StreamEnd(NamedTuple):
    """Worker -> parent: stream ``stream_id`` ended (or was cancelled) after ``n`` items."""

    stream_id: int
    n: int
    kind = "stream_end"


class StreamFailed(NamedTuple):
    """Worker -> parent: stream ``stream_id``'s task raised ``error`` (a ``kerasfeed.ItemError``
    whose index is the number of items made)."""

    stream_id: int
    error: BaseException
    kind = "stream_error"


# --------------------------------------------------------------- consumer only


class WorkerDied(NamedTuple):
    """Reader thread -> stream consumer (a queue, never the wire): the stream's worker died or the
    pool closed; ``error`` is the ``kerasfeed.WorkerError`` to raise."""

    error: BaseException
    kind = "dead"


ToWorker = Union[Init, Load, SetState, StartStream, Credit, Cancel, Exit]
ToParent = Union[Ready, InitError, ItemDone, ItemFailed, Retire, StreamStarted, StreamItem, StreamEnd, StreamFailed]

_BY_KIND: dict[str, Any] = {cls.kind: cls for cls in (*get_args(ToWorker), *get_args(ToParent))}


def encode(message: Union[ToWorker, ToParent]) -> tuple:
    """The wire form of ``message``: ``(kind, *fields)``."""
    return (message.kind, *message)


def decode(raw: tuple) -> Union[ToWorker, ToParent]:
    """The typed message of a wire tuple.

    Raises:
        ValueError: an unknown kind or a wrong number of fields.
    """
    try:
        cls = _BY_KIND[raw[0]]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"kerasfeed: unknown worker message. Received: {raw!r:.200}") from None
    if len(raw) - 1 != len(cls._fields):
        raise ValueError(
            f"kerasfeed: message {raw[0]!r} needs {len(cls._fields)} fields {cls._fields}. Received: {len(raw) - 1}"
        )
    return tuple.__new__(cls, raw[1:])
