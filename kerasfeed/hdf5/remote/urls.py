"""Object-store URLs and ``storage_options``: which paths are remote, messages without secrets, credentials kept home.

NOTE [ Credentials stay in the process that was given them ]
============================================================

``storage_options`` may hold credentials (``key``/``secret``/``token`` for
s3fs, a token dict for gcsfs, an ``Authorization`` header for HTTP). A
source travels to worker processes and Ray actors by pickling, and a pickle
can end up in a log, a crash dump or Ray's object store. So ``Credentials``
splits the options once, at construction: the public part (endpoint, region,
``anon``, a profile *name*, timeouts) travels; the secret part stays in the
building process's hand-off table under a random token (NOTE [ Secrets
travel to workers in memory, never with the source ] in
``kerasfeed/_handoff.py``). A copy unpickled in that process finds its
secrets by the token, and so does one in a kerasfeed worker process, which
gets the table in memory with its first message. A Ray actor does not: its
filesystem is built from the public options alone, so fsspec looks for
credentials the way it does by itself: environment variables
(``AWS_ACCESS_KEY_ID``...), a profile or credentials file,
``GOOGLE_APPLICATION_CREDENTIALS``, the instance's metadata service. An
actor that finds none fails its first read with a message that says so. Credentials written into a URL
(``https://user:pass@host/...``) are refused; a query string (a presigned
URL's signature) is part of the address, travels with it, and is left out
of every message.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional
from urllib.parse import urlsplit, urlunsplit

from kerasfeed import _handoff

# URL scheme -> fsspec protocol of the filesystems that read it.
PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "https"}

# Parts of an option's name that make it a credential (compared lower-case).
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "auth", "credential", "cookie", "signature",
                 "session")
# Option names that contain such a word but name no secret.
_PUBLIC_NAMES = {"anon", "endpoint_url", "profile", "signature_version", "use_listings_cache", "skip_instance_cache"}
# gcsfs `token=` values that name a way of finding credentials, not a credential.
_PUBLIC_TOKENS = {"anon", "google_default", "cache", "cloud", "browser"}


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in a store kerasfeed reads remotely (s3, gs, http(s))."""
    head, sep, _ = path.partition("://")
    return bool(sep) and head.lower() in PROTOCOLS


def protocol(url: str) -> str:
    """fsspec's protocol for ``url`` (``s3``, ``gcs``, ``http``, ``https``)."""
    return PROTOCOLS[url.partition("://")[0].lower()]


def redact(url: str) -> str:
    """``url`` fit for a message: no user info, no query string (a presigned URL's signature)."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def check_url(url: str, owner: str) -> str:
    """Refuses a URL with credentials in it, or one that names no object; returns it unchanged."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{owner}: a URL may not carry credentials (they would travel to every worker with the source): "
            f"pass them in `storage_options` or the environment. Received: path='{redact(url)}' with user info"
        )
    if not parts.netloc or parts.path in ("", "/"):
        raise ValueError(
            f"{owner}: the URL names no object (a bucket or host and a path). Received: path='{redact(url)}'"
        )
    return url


def options_per_scheme(options: Optional[Mapping], protocols: set, owner: str) -> dict:
    """``{protocol: storage options}`` for the protocols of a reader's URLs.

    ``storage_options`` is either one dict for every URL, or, keyed by
    scheme (``{"s3": {...}, "gs": {...}, "https": {...}}``, fsspec's form for
    several filesystems), one per kind of URL.
    """
    options = dict(options or {})
    if not options or not all(isinstance(k, str) and k.lower() in PROTOCOLS for k in options):
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


def _is_secret(name: Any, value: Any) -> bool:
    low = str(name).lower()
    if low in _PUBLIC_NAMES:
        return False
    if low == "token" and isinstance(value, str) and value in _PUBLIC_TOKENS:
        return False
    return any(word in low for word in _SECRET_WORDS)


def split_options(options: Mapping, where: str = "") -> tuple:
    """``(public, secret)``: nested dicts of ``options``, split by each name (see the NOTE)."""
    public: dict = {}
    secret: dict = {}
    for name, value in options.items():
        if _is_secret(name, value):
            secret[name] = value
        elif isinstance(value, Mapping):
            pub, sec = split_options(value, f"{where}{name}.")
            public[name] = pub
            if sec:
                secret[name] = sec
        else:
            public[name] = value
    return public, secret


def _merge(public: Mapping, secret: Mapping) -> dict:
    out = dict(public)
    for name, value in secret.items():
        if isinstance(value, Mapping) and isinstance(out.get(name), Mapping):
            out[name] = _merge(out[name], value)
        else:
            out[name] = value
    return out


class Credentials:
    """The ``storage_options`` of a source: public ones travel, secret ones stay (NOTE above).

    Args:
        options: the user's ``storage_options`` (None: none).
    """

    __slots__ = ("public", "token", "has_secrets")

    def __init__(self, options: Optional[Mapping] = None, *, _token: Optional[str] = None):
        public, secret = split_options(dict(options or {}))
        self.public = public
        self.has_secrets = bool(secret)
        self.token = _token
        if secret:
            self.token = _handoff.put(secret)

    @classmethod
    def _restore(cls, public: dict, token: Optional[str], has_secrets: bool) -> "Credentials":
        out = cls.__new__(cls)
        out.public, out.token, out.has_secrets = public, token, has_secrets
        return out

    def __reduce__(self):
        return (Credentials._restore, (self.public, self.token, self.has_secrets))

    def secrets_here(self) -> bool:
        """Whether this process holds the secret options given at construction."""
        return _handoff.get(self.token) is not None

    def options(self) -> dict:
        """The options for fsspec in this process: the public ones, plus the secret ones where they are."""
        secret = _handoff.get(self.token)
        return _merge(self.public, secret) if secret else dict(self.public)

    def key(self) -> tuple:
        """A hashable name of these options (public values and the token), for per-process tables."""
        return (repr(sorted(self.public.items(), key=lambda kv: str(kv[0]))), self.token)

    def __repr__(self) -> str:
        names = sorted(self.public)
        return f"<storage_options {names}{' + secret options kept in this process' if self.has_secrets else ''}>"


__all__ = [
    "PROTOCOLS", "Credentials", "check_url", "is_url", "options_per_scheme", "protocol", "redact", "split_options",
]
