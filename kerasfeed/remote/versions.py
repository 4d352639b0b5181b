"""The version of an object a reader pins (``ObjectStat``), and whether a store's answer is of it.

A store that has replaced the object refuses a request's precondition
(``If-Match``, or ``If-Unmodified-Since`` where the ETag is weak or absent:
412). Some stores and proxies ignore preconditions, so each answer's own
version is compared too: its ETag as a tag (``W/`` dropped: the weakness
mark may differ between answers), else its Last-Modified, and the object's
size it states. A server that sends neither ETag nor Last-Modified leaves
only the size (``fetch.Store`` warns once).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional
from urllib.parse import urlsplit


@dataclasses.dataclass(frozen=True)
class ObjectStat:
    """An object's size and version, as the store reports them."""

    size: int
    etag: Optional[str] = None
    generation: Optional[str] = None
    version: Optional[str] = None
    last_modified: Optional[str] = None

    def identity(self) -> str:
        """The version and size as one string (``kerasfeed_identity``)."""
        parts = [f"{name}={value}" for name, value in (
            ("etag", self.etag), ("generation", self.generation), ("version", self.version),
            ("last_modified", None if self.etag or self.generation else self.last_modified),
        ) if value]
        return ",".join([*parts, f"size={self.size}"])

    def keyed_identity(self, url: str) -> str:
        """``identity()`` for a cache's key, with ``,query=<digest>`` for an http(s) URL with a query whose
        store gives no strong version (no ETag or generation): keyed without its query, two objects of one
        download endpoint (``?f=a.h5``, ``?f=b.h5``) of one size and second would have one identity across
        runs. A digest, never the query (a presigned URL's signature); with an ETag the query stays out, so
        a signature renewed every run keeps the cache."""
        query = urlsplit(url).query if url.lower().startswith(("http://", "https://")) else ""
        if not query or self.etag or self.generation or self.version:
            return self.identity()
        return f"{self.identity()},query={hashlib.sha256(query.encode()).hexdigest()[:16]}"

    def same_version(self, other: ObjectStat) -> bool:
        """Whether ``other`` (a later stat) is this version: GCS' etag changes with metadata alone, so a
        generation is compared instead; a weak ETag compares as its tag."""
        if self.size != other.size:
            return False
        if self.generation or self.version:
            return (self.generation, self.version) == (other.generation, other.version)
        if self.etag:
            return _tag(self.etag) == _tag(other.etag)
        return self.last_modified == other.last_modified


def _tag(etag: Optional[str]) -> Optional[str]:
    return etag[2:] if etag and etag.startswith("W/") else etag


def http_precondition(pin: ObjectStat) -> dict:
    """The header that pins an HTTP request to ``pin``. A weak ETag never matches ``If-Match`` (RFC 7232
    3.1: strong comparison; nginx and Go answer 412): the date is sent instead, as without an ETag."""
    if pin.etag and not pin.etag.startswith("W/"):
        return {"If-Match": pin.etag}
    return {"If-Unmodified-Since": pin.last_modified} if pin.last_modified else {}


def total_size(content_range: Optional[str]) -> Optional[int]:
    """The object's size in a ``Content-Range`` header (``bytes 0-9/1234``); None when absent or ``*``."""
    total = (content_range or "").rpartition("/")[2]
    return int(total) if total.isdigit() else None


def range_moved(content_range: Optional[str], start: int, end: int) -> Optional[str]:
    """Why an answer's ``Content-Range`` (``bytes a-b/size``) is not the range ``[start, end)`` asked
    for (a proxy or CDN serving another part of the right length); None if it is, or says nothing."""
    first, _, last = (content_range or "").removeprefix("bytes ").partition("/")[0].partition("-")
    if not (first.strip().isdigit() and last.strip().isdigit()):
        return None
    if (int(first), int(last) + 1) != (start, end):
        return (f"the answer holds another part (Content-Range: bytes {int(first)}-{int(last)}; "
                f"asked: bytes={start}-{end - 1})")
    return None


def answer_changed(pin: ObjectStat, etag: Optional[str], last_modified: Optional[str],
                   total: Optional[int]) -> Optional[str]:
    """Why an answer (its ETag, Last-Modified and the object size it states) is not of ``pin``; None if it is."""
    if total is not None and total != pin.size:
        return f"the answer is of an object of {total} bytes, the source read {pin.size}"
    if pin.etag:
        if etag and _tag(etag) != _tag(pin.etag):
            return f"the store answered ETag {etag}, the source read {pin.etag}"
    elif pin.last_modified and last_modified and last_modified != pin.last_modified:
        return f"the server answered Last-Modified {last_modified}, the source read {pin.last_modified}"
    return None


__all__ = ["ObjectStat", "answer_changed", "http_precondition", "total_size"]
