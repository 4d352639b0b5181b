"""Values a process hands to its own worker processes in memory, beside the pickled source, never in it.

NOTE [ Secrets travel to workers in memory, never with the source ]
A source is pickled to reach worker processes and Ray actors, and a pickle
can end up in a log, a crash dump or Ray's object store (which spills to
disk). What must not (a remote store's credentials: ``remote/urls.py``)
is put in this process's table instead, under a random token that the
source keeps. A kerasfeed worker process gets the table's entries with its
first message, over its private socket (``protocol.Init``'s ``handoff``),
and puts them in its own table before it unpickles the source: the copy
finds its values by the token. Only the entries the pickled source names
travel (``mentioned``): a pool for one reader never receives the secrets of
another reader living in the same process. Ray actors get none (Ray keeps actors'
arguments in its object store): they find credentials the way the store's
own library does (environment, profile files, a metadata service).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from typing import Any, Iterator, Optional

_TABLE: dict = {}
_LOCK = threading.Lock()
_PICKLING = threading.local()  # .tokens: the set that ``mention`` fills while ``mentioned`` runs


def put(value: Any) -> str:
    """Keeps ``value`` in this process; returns its token."""
    token = secrets.token_hex(16)
    with _LOCK:
        _TABLE[token] = value
    return token


def get(token: Optional[str]) -> Any:
    """The value kept under ``token`` in this process, or None."""
    if token is None:
        return None
    with _LOCK:
        return _TABLE.get(token)


def entries(tokens: Optional[frozenset] = None) -> dict:
    """The values kept here under ``tokens`` (None: all of them), for a worker process's first message."""
    with _LOCK:
        if tokens is None:
            return dict(_TABLE)
        return {token: _TABLE[token] for token in tokens if token in _TABLE}


@contextlib.contextmanager
def mentioned() -> Iterator[set]:
    """Yields the set of the tokens that values pickled in this block (on this thread) named."""
    outer = getattr(_PICKLING, "tokens", None)
    _PICKLING.tokens = tokens = set()
    try:
        yield tokens
    finally:
        _PICKLING.tokens = outer
        if outer is not None:
            outer |= tokens


def mention(token: Optional[str]) -> None:
    """A holder being pickled names its token (kept only inside ``mentioned``)."""
    tokens = getattr(_PICKLING, "tokens", None)
    if tokens is not None and token is not None:
        tokens.add(token)


def receive(given: Optional[dict]) -> None:
    """A worker process: keeps the values its owner handed over."""
    if given:
        with _LOCK:
            _TABLE.update(given)


def drop(token: Optional[str]) -> None:
    """Forgets the value under ``token`` (its last holder is gone). Takes no lock: a dict's pop is
    atomic, and a finalizer may run while a thread that is collecting garbage holds the lock."""
    _TABLE.pop(token, None)


__all__ = ["drop", "entries", "get", "mention", "mentioned", "put", "receive"]
