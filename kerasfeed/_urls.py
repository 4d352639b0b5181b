"""The URL schemes kerasfeed reads remotely, for every layer that meets a path (the HDF5 readers,
``BalancedOrder.from_hdf5``): one table and one reading of `storage_options`, so what one accepts the
other accepts too."""

from __future__ import annotations

import re
from typing import Mapping, Optional
from urllib.parse import urlsplit, urlunsplit

# URL scheme -> fsspec protocol of the filesystems that read it.
PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "https"}


def is_url(path: object) -> bool:
    """Whether ``path`` names an object in a store kerasfeed reads remotely (s3, gs, http(s))."""
    if not isinstance(path, str):
        return False
    head, sep, _ = path.partition("://")
    return bool(sep) and head.lower() in PROTOCOLS


def protocol(url: str) -> str:
    """fsspec's protocol for ``url`` (``s3``, ``gcs``, ``http``, ``https``)."""
    return PROTOCOLS[url.partition("://")[0].lower()]


def redact(url: str) -> str:
    """``url`` fit for a message: no user info, and for http(s) no query string (a presigned URL's
    signature). An ``s3://`` or ``gs://`` URL keeps the rest: '?' and '#' are part of an object's key there
    (``runs#8/part-0.h5``), not a query or a fragment."""
    scheme, sep, rest = url.partition("://")
    if sep and PROTOCOLS.get(scheme.lower()) in ("s3", "gcs"):
        bucket, slash, key = rest.partition("/")
        return f"{scheme}://{bucket.rpartition('@')[2]}{slash}{key}"
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


# A URL inside a library's message (aiohttp's "url='http://...?X-Amz-Signature=...'"), and a query string
# left without its URL ("GET /a.h5?X-Amz-Signature=...").
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_QUERY_IN_TEXT = re.compile(r"\?[^\s'\"<>=&?/]+=[^\s'\"<>]*")


def _redact_found(match: re.Match) -> str:
    try:
        return redact(match.group())
    except ValueError:  # not a URL urlsplit reads (a bad port, a bracket): no query, no user info
        return re.sub(r"//[^/?#]*@", "//", match.group().split("?")[0])


def redact_text(text: str) -> str:
    """``text`` (another library's error, say) fit for a message: every URL in it redacted, no query string."""
    return _QUERY_IN_TEXT.sub("?…", _URL_IN_TEXT.sub(_redact_found, text))


def keyed_by_scheme(options: dict) -> bool:
    """Whether ``storage_options`` is fsspec's per-filesystem form (``{"s3": {...}, "https": {...}}``)."""
    return bool(options) and all(isinstance(k, str) and k.lower() in PROTOCOLS for k in options)


def options_per_scheme(options: Optional[Mapping], protocols: set, owner: str) -> dict:
    """``{protocol: storage options}`` for the protocols of a reader's URLs.

    ``storage_options`` is either one dict for every URL, or, keyed by
    scheme (``{"s3": {...}, "gs": {...}, "https": {...}}``, fsspec's form for
    several filesystems), one per kind of URL.
    """
    options = dict(options or {})
    if not keyed_by_scheme(options):
        return {p: options for p in protocols}
    out = {p: {} for p in protocols}
    for scheme, value in options.items():
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{owner}: `storage_options` keyed by scheme needs a dict per scheme. "
                f"Received: storage_options[{scheme!r}] of type {type(value).__name__}"
            )
        if PROTOCOLS[scheme.lower()] in out:
            out[PROTOCOLS[scheme.lower()]] = dict(value)
    return out


__all__ = ["PROTOCOLS", "is_url", "keyed_by_scheme", "options_per_scheme", "protocol", "redact", "redact_text"]
