"""Byte ranges of one object over fsspec: stat, ranged GETs pinned to the object's version, retries, timeouts.

NOTE [ One wave of requests per batch, on fsspec's event loop ]
===============================================================

s3fs, gcsfs and fsspec's HTTP filesystem are asynchronous: their requests
run as coroutines on one event-loop thread per process (``fsspec.asyn``).
A batch's byte ranges, over every file and key it reads, are sent as one
``asyncio.gather`` from the thread that makes the batch, which waits for
them with the GIL released (``run``): one round trip per batch, and the
threads executor's 64 calls in flight are 64 waves in flight, not 64 calls
queued behind h5py's lock. Every request is pinned to the version the
source saw: ``If-Match: <ETag>`` on S3 and HTTP (a store that has replaced
the object answers 412; ``If-Unmodified-Since`` for a weak ETag or none),
the generation on GCS (a replaced object's old generation is gone: 404),
and the response's own ETag (else Last-Modified) and object size are
checked, so a replaced object is a ``FileChangedError``, never bytes of the
new object decoded with the old layout. ``RemoteOptions`` says which
failures are tried again and how long each try may take.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import threading
import weakref
from typing import Any, Awaitable, Callable, Optional

from kerasfeed.errors import FileChangedError
from kerasfeed.remote.options import RemoteOptions
from kerasfeed.remote.urls import Credentials, folder_message, protocol, redact, redact_text
from kerasfeed.remote.versions import ObjectStat, answer_changed, http_precondition, range_moved, total_size

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11
logger = logging.getLogger("kerasfeed")

# HTTP statuses worth another try: timeout, throttling, server errors.
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# Exception classes (by name, anywhere in the class's MRO) that mean the connection failed or stalled.
_TRANSIENT = {"ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError", "ServerTimeoutError",
              "HTTPClientError", "ConnectionError", "TimeoutError", "ReadTimeoutError", "IncompleteRead",
              "ResponseStreamingError"}


class RequestStats:
    """Requests this process sent to object stores (for tests and benchmarks).

    ``rounds``: waits of a calling thread on the network (one per batch on
    the fast path, one per block h5py reads itself); ``requests``/``bytes``:
    GETs sent and bytes received; ``retries``: tries made again.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.rounds = self.requests = self.bytes = self.retries = self.stats = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in ("rounds", "requests", "bytes", "retries", "stats")}


STATS = RequestStats()


def run(fn: Callable[..., Awaitable], *args: Any) -> Any:
    """Runs ``fn(*args)`` on fsspec's event loop; the calling thread waits (GIL released): one round."""
    import fsspec.asyn
    from fsspec.exceptions import FSTimeoutError

    STATS.add(rounds=1)
    try:
        return fsspec.asyn.sync(fsspec.asyn.get_loop(), fn, *args)
    except FSTimeoutError as e:  # fsspec's stand-in for any TimeoutError: ours carries the message
        if isinstance(e.__cause__, TimeoutError):
            raise e.__cause__ from None
        raise


class _Fail(Exception):
    """One failed try: ``kind`` is ``retry``, ``changed``, ``missing``, ``denied`` or ``other`` (not retried)."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind


def _status_of(err: BaseException) -> Optional[int]:
    """The HTTP status an error of aiohttp, botocore (under s3fs' translation) or gcsfs carries."""
    for e in (err, err.__cause__, err.__context__):
        if e is None:
            continue
        status = getattr(e, "status", None) or getattr(e, "code", None)
        if isinstance(status, int) and status >= 100:
            return status
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code:
                return int(code)
    return None


def _classify(err: BaseException) -> _Fail:
    """What one failed try means (see ``_RETRY_STATUS`` and ``_TRANSIENT``)."""
    if isinstance(err, _Fail):
        return err
    # aiohttp names the URL it followed, query string (a presigned URL's signature) and all.
    why = redact_text(f"{type(err).__name__}: {err}".strip().rstrip(":"))
    names = {c.__name__ for c in type(err).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return _Fail("denied", f"no credentials found ({why})")
    status = _status_of(err)
    if status == 412:
        return _Fail("changed", "the store refused the pinned version (HTTP 412)")
    if isinstance(err, IsADirectoryError):
        return _Fail("folder", why)
    if isinstance(err, FileNotFoundError) or status in (404, 410):
        return _Fail("missing", why)
    if isinstance(err, PermissionError) or status in (401, 403) or str(err).startswith("Forbidden"):
        return _Fail("denied", why)
    if status in _RETRY_STATUS or names & _TRANSIENT or isinstance(err, asyncio.TimeoutError):
        return _Fail("retry", why)
    if isinstance(err, OSError) and err.errno in (errno.EBUSY, errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT):
        return _Fail("retry", why)  # s3fs' translation of SlowDown / ServiceUnavailable
    return _Fail("other", why)


def _not_a_folder(info: dict) -> None:
    # s3fs and gcsfs describe a prefix that holds objects (no object of that name) as a directory of size 0.
    if info.get("type") == "directory":
        raise IsADirectoryError("the store lists it as a folder of other objects")


class Store:
    """One object in one process: its filesystem, and requests with retries (``RemoteOptions``).

    Args:
        url: the object's URL.
        credentials: its ``storage_options`` (see ``urls.Credentials``).
        options: timeouts and retries.
        owner: the public class, for messages.
    """

    def __init__(self, url: str, credentials: Credentials, options: RemoteOptions, owner: str):
        self.url, self.credentials, self.options, self.owner = url, credentials, options, owner
        self.protocol = protocol(url)
        self._fs = None
        self._lock = threading.Lock()
        self._warned = False  # that the server sends no version (ETag, Last-Modified): once
        self._warned_range = False  # that it ignores Range: once

    @property
    def fs(self):
        with self._lock:
            if self._fs is None:
                self._fs = STORES.filesystem(self.protocol, self.credentials)
            return self._fs

    # ---- requests, each with its tries -------------------------------------

    async def _tries(self, what: str, attempt: Callable[[], Awaitable]) -> Any:
        opts, causes = self.options, []
        try:  # made before the first try's clock starts: a process's first (aiohttp's import: ~0.3 s) is no request
            self.fs
        except Exception:  # noqa: BLE001 - the try raises it again, sorted by _classify
            pass
        for k in range(opts.attempts):
            try:
                if _timeout is None:  # Python 3.10
                    return await asyncio.wait_for(attempt(), opts.timeout)
                async with _timeout(opts.timeout):  # no task of its own, unlike wait_for
                    return await attempt()
            except asyncio.TimeoutError:
                fail = _Fail("retry", f"no answer within timeout={opts.timeout:g} s")
            except Exception as e:  # noqa: BLE001 - sorted by _classify; anything else is raised
                fail = _classify(e)
            if fail.kind == "other":
                hint = ""
                if "unexpected keyword argument" in str(fail):  # another store's options, as one flat dict
                    hint = (f" (`storage_options` reach fsspec's {self.protocol} filesystem as given: key those "
                            f"of another store by its scheme, storage_options={{'s3': {{...}}, 'http': {{...}}}})")
                raise OSError(f"{self.owner}: {what} of '{redact(self.url)}' failed: {fail}{hint}") from None
            if fail.kind != "retry":
                raise self._error(fail, what) from None
            causes.append(str(fail))
            if k + 1 < opts.attempts:
                STATS.add(retries=1)
                await asyncio.sleep(opts.wait(k, random.random()))
        timed_out = all(c.startswith("no answer") for c in causes)
        # gcsfs tries a failing request again itself (6 tries, waits of 1-32 s), inside each of ours.
        inside = " (gcsfs tries each request up to 6 times itself: a throttling store shows as this)" if (
            timed_out and self.protocol == "gcs") else ""
        raise (TimeoutError if timed_out else OSError)(
            f"{self.owner}: {what} of '{redact(self.url)}' failed {len(causes)} times (attempts="
            f"{opts.attempts}, waits from {opts.backoff:g} s to {opts.max_backoff:g} s, timeout={opts.timeout:g} s "
            f"each; `remote_options` sets these, `retries=` of to_dataset/to_loader retries the batch): "
            + "; ".join(dict.fromkeys(causes)) + inside
        )

    def _error(self, fail: _Fail, what: str) -> OSError:
        url = redact(self.url)
        if fail.kind == "changed":
            return FileChangedError(
                f"{self.owner}: the object '{url}' was replaced after the source read its layout ({what}: {fail}). "
                "Build a new source to read the new object."
            )
        if fail.kind == "missing":
            return FileNotFoundError(f"{self.owner}: HDF5 object not found: '{url}' ({fail}). Received: path='{url}'")
        if fail.kind == "folder":
            return IsADirectoryError(folder_message(self.owner, url))
        home = "" if self.credentials.secrets_here() or not self.credentials.has_secrets else (
            " The credentials given in `storage_options` reach kerasfeed's worker processes in memory but never "
            "travel to Ray actors (nor with the pickled source), and a copy unpickled in the process that built "
            "the reader finds them only while a reader holding them is alive there; give actors and such copies "
            "credentials the way fsspec finds them: environment variables (AWS_ACCESS_KEY_ID, ...), a profile, or "
            "GOOGLE_APPLICATION_CREDENTIALS."
        )
        return PermissionError(
            f"{self.owner}: access to '{url}' was refused ({fail}): wrong or missing credentials, or no "
            f"permission to read it.{home} Received: path='{url}'"
        )

    async def stat(self) -> ObjectStat:
        """The object's size and version now (a fresh request, no listing cache)."""
        STATS.add(stats=1)
        return await self._tries("reading the size and version", self._stat_once)

    async def get(self, start: int, end: int, pin: ObjectStat) -> bytes:
        """Bytes ``[start, end)`` of the version ``pin``; ``FileChangedError`` if it is gone."""
        try:
            data = await self._tries(f"reading bytes {start}-{end}", lambda: self._get_once(start, end, pin))
        except FileNotFoundError as e:  # it was there when the source read its layout
            raise FileChangedError(
                f"{self.owner}: the object '{redact(self.url)}' was deleted after the source read its layout "
                "(HTTP 404 for a range of it). Build a new source once it is back."
            ) from e
        STATS.add(requests=1, bytes=len(data))
        return data

    # ---- one try, per protocol ---------------------------------------------

    async def _stat_once(self) -> ObjectStat:
        fs = self.fs
        if self.protocol == "s3":
            info = await fs._info(self.url, refresh=True)
            _not_a_folder(info)
            return ObjectStat(int(info["size"]), etag=info.get("ETag"), version=info.get("VersionId"))
        if self.protocol == "gcs":
            fs.invalidate_cache(self.url)
            info = await fs._info(self.url)
            _not_a_folder(info)
            generation = info.get("generation")
            return ObjectStat(int(info["size"]), etag=info.get("etag"),
                              generation=str(generation) if generation else None)
        # HTTP: a one-byte GET (a presigned URL answers GET only, and some servers refuse HEAD).
        async with await self._http_get({"Range": "bytes=0-0"}) as r:
            self._http_status(r, {})
            if r.status == 206:
                size = total_size(r.headers.get("Content-Range"))
            else:
                length = r.headers.get("Content-Length", "")
                size = int(length) if length.isdigit() else None
            if size is None:
                raise OSError(f"the server gave no size (Content-Range {r.headers.get('Content-Range')!r}, "
                              f"Content-Length {r.headers.get('Content-Length')!r}; status {r.status})")
            stat = ObjectStat(size, etag=r.headers.get("ETag"), last_modified=r.headers.get("Last-Modified"))
        if not (stat.etag or stat.last_modified) and not self._warned:
            self._warned = True  # once per object and process: at creation, or a later identity check
            logger.warning(
                "%s: the server of '%s' sends neither ETag nor Last-Modified: an object replaced during the run "
                "is detected only when its size changes (otherwise its new bytes would be decoded with the old "
                "layout). Serve it with an ETag, or read it from a local copy.", self.owner, redact(self.url))
        return stat

    async def _get_once(self, start: int, end: int, pin: ObjectStat) -> bytes:
        fs, url = self.fs, self.url
        if self.protocol == "s3":
            bucket, key, _ = fs.split_path(url)
            kw = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
            if pin.etag:
                kw["IfMatch"] = pin.etag
            if pin.version:
                kw["VersionId"] = pin.version
            resp = await fs._call_s3("get_object", **kw)
            try:  # a store or proxy may ignore IfMatch: the answer's own version is checked too
                changed = answer_changed(pin, resp.get("ETag"), None, total_size(resp.get("ContentRange")))
                if changed:
                    raise _Fail("changed", changed)
                moved = range_moved(resp.get("ContentRange"), start, end)
                if moved:
                    raise _Fail("retry", moved)
                data = await resp["Body"].read()
            finally:
                resp["Body"].close()
        elif self.protocol == "gcs":
            try:
                data = await fs._cat_file(url, start=start, end=end, generation=pin.generation)
            except FileNotFoundError:
                raise _Fail("changed", f"generation {pin.generation} is gone (HTTP 404)") from None
        else:
            headers = {"Range": f"bytes={start}-{end - 1}", **http_precondition(pin)}
            async with await self._http_get(headers) as r:
                self._http_status(r, headers)
                h = r.headers
                length = h.get("Content-Length", "")
                total = total_size(h.get("Content-Range")) if r.status == 206 else (
                    int(length) if length.isdigit() else None)
                changed = answer_changed(pin, h.get("ETag"), h.get("Last-Modified"), total)
                if changed:  # a server that ignores the precondition
                    raise _Fail("changed", changed)
                moved = range_moved(h.get("Content-Range"), start, end) if r.status == 206 else None
                if moved:  # the right length of another part: decoded, it would be another chunk's bytes
                    raise _Fail("retry", moved)
                data = await r.read()
                if r.status == 200 and len(data) == pin.size:  # the server ignored Range
                    self._whole_object(end - start, pin.size)
                    data = data[start:end]
        if len(data) != end - start:
            raise _Fail("retry", f"{len(data)} bytes received of {end - start}")
        return data

    def _whole_object(self, wanted: int, size: int) -> None:
        if self._warned_range or wanted >= size:
            return
        self._warned_range = True  # once per object and process
        logger.warning(
            "%s: the server of '%s' ignores Range requests: every read downloads the whole object (%d bytes) to use "
            "a part of it. Serve it from a store that answers byte ranges (S3, GCS, nginx...), or read a local "
            "copy.", self.owner, redact(self.url), size)

    async def _http_get(self, headers: dict):
        fs = self.fs
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        merged = dict(kw.pop("headers", None) or {})
        merged.update(headers)
        merged["Accept-Encoding"] = "identity"  # byte offsets of the stored object, not of a compressed one
        return session.get(fs.encode_url(self.url), headers=merged, **kw)

    @staticmethod
    def _http_status(r, headers) -> None:
        if r.status in (200, 206):
            return
        if r.status == 412:
            sent = "If-Match" if "If-Match" in headers else "If-Unmodified-Since"
            raise _Fail("changed", f"the server answered 412 to {sent}")
        if r.status in (404, 410):
            raise _Fail("missing", f"HTTP {r.status}")
        if r.status in (401, 403):
            raise _Fail("denied", f"HTTP {r.status}")
        if r.status in _RETRY_STATUS:
            raise _Fail("retry", f"HTTP {r.status}")
        raise OSError(f"HTTP {r.status} {r.reason}")


def _make_filesystem(protocol: str, credentials: Credentials):
    """A filesystem of kerasfeed's own (not fsspec's cached instance, which the user's code may share):
    on S3 one try per request, so that ``RemoteOptions`` is the whole budget (s3fs would otherwise try a
    throttled request 5 times and botocore each of those again, waiting past ``timeout``)."""
    import fsspec  # only for URLs: local files never import it

    opts = {**credentials.options(), "skip_instance_cache": True}
    if protocol == "s3":
        config = dict(opts.get("config_kwargs") or {})
        # A batch's ranges go out at once: more than botocore's 10 pooled connections.
        config.setdefault("max_pool_connections", 64)
        config.setdefault("retries", {"total_max_attempts": 1})
        opts["config_kwargs"] = config
    fs = fsspec.filesystem(protocol, **opts)
    if protocol == "s3":
        fs.retries = 1  # s3fs' own loop (a class attribute; set on this instance only)
    return fs


class _Stores:
    """This process's ``Store`` per (URL, options, reader class), and its filesystem per (protocol, options): one
    connection pool for the objects read with the same options (``Credentials.key``: secrets by digest).
    A ``Store`` holds a ``Credentials.for_cache`` copy: no reader's secrets kept alive. Both tables hold
    their entries weakly: a store lives while a reader's ``RemoteFile`` holds it, a filesystem while a
    store does; then both go, and with the filesystem its connections and the options it was made with
    (secrets included: with rotating credentials, one per reader would pile up for the process's life)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._stores: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._filesystems: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def _forked(self) -> None:
        if self._pid != os.getpid():  # forked: fsspec makes new loops and sessions in a child
            self._stores, self._filesystems = weakref.WeakValueDictionary(), weakref.WeakValueDictionary()
            self._pid = os.getpid()

    def get(self, url: str, credentials: Credentials, options: RemoteOptions, owner: str) -> Store:
        key = (url, credentials.key(), options, owner)  # a store's messages name its reader's class
        with self._lock:
            self._forked()
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = Store(url, credentials.for_cache(), options, owner)
            elif store.credentials.token != credentials.token and not store.credentials.secrets_here():
                store.credentials = credentials.for_cache()  # the reader that made it is gone: this one's
            return store

    def filesystem(self, protocol: str, credentials: Credentials):
        key = (protocol, credentials.key())
        with self._lock:
            self._forked()
            fs = self._filesystems.get(key)
            if fs is None:
                fs = self._filesystems[key] = _make_filesystem(protocol, credentials)
            return fs


STORES = _Stores()


async def gather_ranges(requests: list) -> list:
    """``[(store, start, end, pin), ...]`` fetched concurrently; bytes in the same order."""
    if len(requests) == 1:  # no task to make
        store, s, e, pin = requests[0]
        return [await store.get(s, e, pin)]
    return list(await asyncio.gather(*(store.get(s, e, pin) for store, s, e, pin in requests)))


async def gather_settled(calls: list) -> list:
    """``[(coroutine function, args), ...]`` run concurrently; each one's result, or its exception in its place."""
    return list(await asyncio.gather(*(fn(*args) for fn, args in calls), return_exceptions=True))


__all__ = ["ObjectStat", "RequestStats", "STATS", "STORES", "Store", "gather_ranges", "gather_settled", "run"]
