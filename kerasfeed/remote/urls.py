"""Object-store URLs and ``storage_options``: which paths are remote, messages without secrets, credentials kept home.

NOTE [ Credentials stay in the process that was given them ]
============================================================

``storage_options`` may hold credentials (``key``/``secret``/``token`` for
s3fs, a token dict for gcsfs, HTTP headers: any may be an API key). A
source travels to worker processes and Ray actors by pickling, and a pickle
can end up in a log, a crash dump or Ray's object store. So ``Credentials``
splits the options once, at construction: the public part (endpoint, region,
``anon``, a profile *name*, timeouts) travels; the secret part stays in the
building process's hand-off table under a random token (NOTE [ Secrets
travel to workers in memory, never with the source ] in
``kerasfeed/_handoff.py``). A copy unpickled in that process finds its
secrets by the token, and so does one in a kerasfeed worker process, which
gets the table in memory with its first message. The entry goes when the
last ``Credentials`` of this process holding it does (a reader built and
dropped leaves nothing behind), and the per-process caches of filesystems
name secret options by a digest of them, never by the token, so readers
given the same options share one filesystem and its connections. A Ray actor does not: its
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

import hashlib
import re
import threading
import weakref
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from kerasfeed import _handoff
from kerasfeed._urls import PROTOCOLS, is_url, options_per_scheme, protocol, redact, redact_text

# Parts of an option's name that make it a credential (compared lower-case).
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "passphrase", "auth", "credential", "cookie",
                 "signature", "session")
# Option names that are credentials without such a word (s3fs' aliases of `key`: `username`, `user`).
_SECRET_NAMES = {"user", "username", "login", "creds", "sas"}
# Option names that contain such a word but name no secret.
_PUBLIC_NAMES = {"anon", "endpoint_url", "profile", "signature_version", "use_listings_cache", "skip_instance_cache"}
# gcsfs `token=` values that name a way of finding credentials, not a credential.
_PUBLIC_TOKENS = {"anon", "google_default", "cache", "cloud", "browser"}


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def has_scheme(path: Any) -> bool:
    """Whether ``path`` is written as a URL (``scheme://``), of a store kerasfeed reads or not."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


def check_url(url: str, owner: str) -> str:
    """Refuses a URL of a scheme kerasfeed does not read, one it cannot parse, one with credentials in it,
    or one that names no object; returns it unchanged."""
    if not is_url(url):  # an fsspec URL of another store (az://, file://): it would be looked up as a local file
        scheme = _SCHEME.match(url).group(1)
        local = "; for a file:// URL pass the local path itself" if scheme.lower() == "file" else ""
        raise ValueError(f"{owner}: '{scheme}://' paths are not read: kerasfeed reads local paths and s3://, gs:// "
                         f"and http(s):// URLs{local}. Received: path='{redact_text(url)}'")
    try:
        parts = urlsplit(url)
        parts.port  # raises on a port that is not a number
    except ValueError as e:
        raise ValueError(f"{owner}: the URL cannot be read ({e}). Received: path='{redact_text(url)}'") from None
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{owner}: a URL may not carry credentials (they would travel to every worker with the source): "
            f"pass them in `storage_options` or the environment. Received: path='{redact(url)}' with user info"
        )
    if not parts.netloc or parts.path in ("", "/"):
        raise ValueError(
            f"{owner}: the URL names no object (a bucket or host and a path). Received: path='{redact(url)}'"
        )
    if PROTOCOLS.get(parts.scheme.lower()) in ("s3", "gcs") and parts.path.endswith("/"):
        raise IsADirectoryError(folder_message(owner, redact(url)))
    return url


def folder_message(owner: str, url: str) -> str:
    """The error for a URL that names a folder (a prefix of objects) instead of one HDF5 object."""
    return (f"{owner}: '{url}' is a folder (a prefix other objects share), not an HDF5 object: name the files in it "
            f"(a reader takes a list of paths; fsspec's `glob` lists them). Received: path='{url}'")


def _is_secret(name: Any, value: Any) -> bool:
    low = str(name).lower()
    if low == "headers":  # any header may be a credential, under a name of the server's own (X-JFrog-Art-Api)
        return True
    if isinstance(value, str) and "://" in value and "@" in _netloc(value):
        return True  # a URL with a user and password, whatever its name: endpoint_url, proxy, proxies.https
    if low == "endpoint_url":
        return False
    if low in _PUBLIC_NAMES:
        return False
    if low == "token" and isinstance(value, str) and value in _PUBLIC_TOKENS:
        return False
    return low in _SECRET_NAMES or any(word in low for word in _SECRET_WORDS)


def _netloc(url: str) -> str:
    try:
        return urlsplit(url).netloc
    except ValueError:
        return url  # unparsable: judged by its text


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


def _canonical(value: Any) -> Any:
    """``value`` with its mappings sorted by key, so that equal options give equal digests."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return value


# Tokens this process put in the hand-off table -> how many Credentials here hold each (built or unpickled):
# the entry goes with the last (a worker's entries, handed over by its owner, stay for its life).
_HELD: dict = {}
_HELD_LOCK = threading.RLock()  # re-entrant: a finalizer may run inside a held section, on collection


def _hold(credentials: "Credentials", only_if_held: bool = False) -> None:
    with _HELD_LOCK:
        count = _HELD.get(credentials.token, 0)
        if only_if_held and not count:
            return
        _HELD[credentials.token] = count + 1
    weakref.finalize(credentials, _release, credentials.token).atexit = False


def _release(token: str) -> None:
    with _HELD_LOCK:
        count = _HELD.pop(token, 0) - 1
        if count > 0:
            _HELD[token] = count
            return
    _handoff.drop(token)


class Credentials:
    """The ``storage_options`` of a source: public ones travel, secret ones stay (NOTE above).

    Args:
        options: the user's ``storage_options`` (None: none).
    """

    __slots__ = ("public", "token", "has_secrets", "_key", "__weakref__")

    def __init__(self, options: Optional[Mapping] = None, *, _token: Optional[str] = None):
        public, secret = split_options(dict(options or {}))
        self.public = public
        self.has_secrets = bool(secret)
        self.token = _token
        self._key: Optional[tuple] = None
        if secret:
            self.token = _handoff.put(secret)
            _hold(self)

    @classmethod
    def _restore(cls, public: dict, token: Optional[str], has_secrets: bool) -> "Credentials":
        out = cls.__new__(cls)
        out.public, out.token, out.has_secrets, out._key = public, token, has_secrets, None
        if token is not None:
            _hold(out, only_if_held=True)  # a copy in the process that put the entry keeps it too
        return out

    def __reduce__(self):
        _handoff.mention(self.token)  # its pool's workers get this entry (NOTE [ Secrets travel ... ])
        return (Credentials._restore, (self.public, self.token, self.has_secrets))

    def for_cache(self) -> "Credentials":
        """A copy for this process's caches (``fetch._Stores``): it finds the secrets while a reader's own
        ``Credentials`` lives, and keeps none alive."""
        out = Credentials.__new__(Credentials)
        out.public, out.token, out.has_secrets, out._key = self.public, self.token, self.has_secrets, self.key()
        return out

    def secrets_here(self) -> bool:
        """Whether this process holds the secret options given at construction."""
        return _handoff.get(self.token) is not None

    def options(self) -> dict:
        """The options for fsspec in this process: the public ones, plus the secret ones where they are."""
        secret = _handoff.get(self.token)
        return _merge(self.public, secret) if secret else dict(self.public)

    def key(self) -> tuple:
        """A hashable name of these options, for per-process tables: the public values and a digest of the
        secret ones found here (kept in memory, never pickled): equal options, equal keys."""
        key = self._key
        if key is None:
            secret = _handoff.get(self.token)
            digest = hashlib.sha256(repr(_canonical(secret)).encode()).hexdigest() if secret else None
            key = self._key = (repr(sorted(self.public.items(), key=lambda kv: str(kv[0]))), digest, self.has_secrets)
        return key

    def __repr__(self) -> str:
        names = sorted(self.public)
        return f"<storage_options {names}{' + secret options kept in this process' if self.has_secrets else ''}>"


__all__ = [
    "PROTOCOLS", "Credentials", "check_url", "folder_message", "has_scheme", "is_url", "options_per_scheme",
    "protocol", "redact", "redact_text", "split_options",
]
