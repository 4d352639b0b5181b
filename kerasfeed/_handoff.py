"""Values a process hands to its own worker processes in memory, beside the pickled source, never in it.

NOTE [ Secrets travel to workers in memory, never with the source ]
A source is pickled to reach worker processes and Ray actors, and a pickle
can end up in a log, a crash dump or Ray's object store (which spills to
disk). What must not (a remote store's credentials: ``hdf5/remote/urls.py``)
is put in this process's table instead, under a random token that the
source keeps. A kerasfeed worker process gets the table's entries with its
first message, over its private socket (``protocol.Init``'s ``handoff``),
and puts them in its own table before it unpickles the source: the copy
finds its values by the token. Ray actors get none (Ray keeps actors'
arguments in its object store): they find credentials the way the store's
own library does (environment, profile files, a metadata service).
"""

from __future__ import annotations

import secrets
import threading
from typing import Any, Optional

_TABLE: dict = {}
_LOCK = threading.Lock()


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


def entries() -> dict:
    """Every value kept here, for a worker process's first message."""
    with _LOCK:
        return dict(_TABLE)


def receive(given: Optional[dict]) -> None:
    """A worker process: keeps the values its owner handed over."""
    if given:
        with _LOCK:
            _TABLE.update(given)


def drop(token: Optional[str]) -> None:
    """Forgets the value under ``token`` (its last holder is gone). Takes no lock: a dict's pop is
    atomic, and a finalizer may run while a thread that is collecting garbage holds the lock."""
    _TABLE.pop(token, None)


__all__ = ["drop", "entries", "get", "put", "receive"]
