"""Object stores on 127.0.0.1 for the remote HDF5 tests and benchmarks: an HTTP server with byte ranges, and moto's S3.

``RangeServer`` is a stdlib HTTP/1.1 server for files on disk with what the
remote readers rely on: ``Range`` requests (206, ``Content-Range``), an
``ETag`` per file version and ``If-Match`` (412 when it changed), or, as
some servers do, a weak ETag, no ETag, no ``Last-Modified``, preconditions
ignored (``RangeServer``'s ``etag``, ``last_modified``, ``if_match``), plus what
the tests need to see and to break: a fixed delay per request (the latency
of a far store), faults injected into the next requests (503, 429, a
dropped connection, a stall), an optional bearer token (403 without it),
and counts of requests and bytes. The same server answers the two calls of
Google Cloud Storage's JSON API that gcsfs makes to read an object (its
metadata, and ranged media downloads pinned to a generation), so ``gs://``
URLs are read through gcsfs with ``endpoint_url`` pointing here. With
``forward=``, it stands in front of another server (moto's S3) instead: the
same faults, everything else passed on as it came.

``MotoS3`` runs moto's S3 server (``python -m moto.server``) in a process
of its own, with IAM authentication on: an access key made through moto's
own IAM is accepted, any other is refused (403), as on AWS.

Run as a script (``python tests/remote_servers.py --root DIR --delay 0.02``)
the HTTP server serves DIR from a process of its own and prints its port
(the benchmarks use it so that the server does not share the reader's GIL).
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connections, as with a real store
    # Headers, then the body by sendfile: with Nagle's algorithm on, the body's last short segment
    # waits for the client's delayed ACK, and 14 of 64 answers took 42-45 ms instead of ~1 (a real
    # store shows no such stall).
    disable_nagle_algorithm = True
    server: "RangeServer"

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _reply(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self, head: bool) -> None:
        srv = self.server
        if self.path == "/__counts__":  # for a server in another process: requests and bytes so far
            requests, sent = srv.counts()
            self._reply(200, json.dumps({"requests": requests, "bytes": sent}).encode())
            return
        fault = srv._take_fault()
        if srv.delay:
            time.sleep(srv.delay)
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "stall":
            time.sleep(srv.stall_s)
        if fault in ("503", "429"):
            self._reply(int(fault), _SLOW_DOWN if srv.forward else b"slow down", {"Retry-After": "0"})
            return
        self._shift = 64 if fault == "shift" else 0  # an honest Content-Range of another part of that length
        if srv.forward:
            self._forward()
            return
        if srv.token is not None and self.headers.get("Authorization") != f"Bearer {srv.token}":
            self._reply(403, b"forbidden")
            return
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = url.path.split("/")
        # gcsfs: /storage/v1/b/<bucket>/o/<key> (metadata), /download/storage/v1/b/<bucket>/o/<key>?alt=media
        if url.path.startswith("/storage/v1/b/") and len(parts) >= 7:
            self._gcs_metadata(parts[4], urllib.parse.unquote("/".join(parts[6:])))
            return
        if url.path.startswith("/download/storage/v1/b/") and len(parts) >= 8:
            name = urllib.parse.unquote(f"{parts[5]}/" + "/".join(parts[7:]))
            self._bytes(name, head, generation=(query.get("generation") or [None])[0])
            return
        self._bytes(urllib.parse.unquote(url.path.lstrip("/")), head)

    def _forward(self) -> None:
        """The request as it came (headers and all: a signature covers ``Host``), to ``server.forward``."""
        target = urllib.parse.urlsplit(self.server.forward)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() == "if-match" and not self.server.if_match:
                    continue  # a store that ignores If-Match
                conn.putheader(k, v)
            conn.endheaders()
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        self.server._count(len(body), (self.path, self.command, r.status))  # before the answer (see _bytes)
        self.send_response(r.status, r.reason)
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                self.send_header(k, v)
        # A HEAD's length is the object's, as the server said it.
        self.send_header("Content-Length", r.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _stat(self, name: str):
        path = self.server.files.get(name)
        try:
            return path, os.stat(path) if path else None
        except FileNotFoundError:
            return path, None

    def _gcs_metadata(self, bucket: str, key: str) -> None:
        _, st = self._stat(f"{bucket}/{key}")
        if st is None:
            self._reply(404, json.dumps({"error": {"code": 404, "message": "No such object"}}).encode())
            return
        meta = {"kind": "storage#object", "name": key, "bucket": bucket, "size": str(st.st_size),
                "generation": str(st.st_mtime_ns), "metageneration": "1", "etag": _etag(st).strip('"'),
                "updated": "2026-01-01T00:00:00.000Z", "contentType": "application/x-hdf5"}
        self._reply(200, json.dumps(meta).encode(), {"Content-Type": "application/json"})

    def _bytes(self, name: str, head: bool, generation: str | None = None) -> None:
        srv = self.server
        path, st = self._stat(name)
        if st is None or (generation is not None and generation != str(st.st_mtime_ns)):
            self._reply(404, b"not found")
            return
        etag = _etag(st)
        if srv.if_match and self._precondition_failed(etag, st):
            self._reply(412, b"precondition failed")
            return
        size, start, end, status = st.st_size, 0, st.st_size, 200
        rng = self.headers.get("Range") if self.server.ranges else None
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a), min(int(b) + 1 if b else size, size)
            status = 206
            move = min(getattr(self, "_shift", 0), size - end)
            start, end = start + move, end + move
        headers = {"Accept-Ranges": "bytes"}
        if srv.etag:
            headers["ETag"] = "W/" + etag if srv.etag == "weak" else etag
        if srv.last_modified:
            headers["Last-Modified"] = email.utils.formatdate(st.st_mtime, usegmt=True)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        # Logged before anything goes out: once a client holds the headers (a size probe reads no more) or the
        # bytes, the log shows them. A test reads the log right after; logged later, the entry could come after.
        if not (head or self.command == "HEAD"):
            srv._count(end - start, (name, start, end))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if head or self.command == "HEAD":
            return
        with open(path, "rb") as f:
            self.connection.sendfile(f, start, end - start)

    def _precondition_failed(self, etag: str, st) -> bool:
        """RFC 7232: If-Match by strong comparison (a weak ETag never matches), else If-Unmodified-Since."""
        srv, match = self.server, self.headers.get("If-Match")
        if match is not None:
            return srv.etag != "strong" or match != etag
        since = self.headers.get("If-Unmodified-Since")
        if since is not None and srv.last_modified:
            return int(st.st_mtime) > email.utils.parsedate_to_datetime(since).timestamp()
        return False


_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
              b'request rate.</Message><RequestId>0</RequestId></Error>')


def _etag(st) -> str:
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'


class RangeServer(ThreadingHTTPServer):
    """An HTTP object store on 127.0.0.1 (see the module docstring).

    Args:
        files: ``{url path: file on disk}`` (``"data/a.h5"`` is served at
            ``/data/a.h5`` and, for gcsfs, as object ``a.h5`` of bucket ``data``).
        delay: seconds added to every request.
        token: when set, requests need ``Authorization: Bearer <token>``.
        forward: a server's URL (moto's S3): every request not failed by an
            injected fault goes there as it came, and its answer back (a 503
            then has S3's ``SlowDown`` body).
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # a reader opens many connections at once (the default backlog is 5)

    def handle_error(self, request, client_address) -> None:
        # A client that closes its connections (a loader closed while it read ahead) is not an error of
        # the server: socketserver would print a traceback for each one, hiding a benchmark's output.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)

    def __init__(self, files: dict | None = None, delay: float = 0.0, token: str | None = None,
                 forward: str | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.forward = dict(files or {}), forward
        self.delay, self.token, self.stall_s = delay, token, 5.0
        # False: ignore If-Match and If-Unmodified-Since, as some servers do (the reader then checks the answers;
        # with ``forward``, If-Match is dropped on the way)
        self.if_match = True
        self.etag = "strong"  # "weak": W/"..." (If-Match never matches, as in nginx and Go); None: no ETag
        self.last_modified = True  # False: no Last-Modified header
        self.ranges = True  # False: Range ignored, every answer the whole object (200)
        self._lock = threading.Lock()
        self._faults: collections.deque = collections.deque()
        self.requests = self.bytes_sent = 0
        # (name, start, end) of every byte range served; with ``forward``: (path, method, status) of each answer
        self.log: list = []
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def inject(self, fault: str, count: int = 1) -> None:
        """The next ``count`` requests fail with ``fault``: ``"503"``, ``"429"``, ``"drop"``, ``"stall"`` or
        ``"shift"`` (a range answered 64 bytes later than asked, as its ``Content-Range`` says)."""
        with self._lock:
            self._faults.extend([fault] * count)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def faults_left(self) -> int:
        with self._lock:
            return len(self._faults)

    def _take_fault(self):
        with self._lock:
            return self._faults.popleft() if self._faults else None

    def _count(self, nbytes: int, what: tuple) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_sent += nbytes
            self.log.append(what)

    def counts(self) -> tuple:
        with self._lock:
            return self.requests, self.bytes_sent

    def start(self) -> "RangeServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout} s")


# Environment for anything that talks to moto: no real AWS configuration, never the metadata service.
AWS_ISOLATION = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_DEFAULT_REGION": "us-east-1",
}
# gcsfs' experimental file system asks a gRPC service for the bucket's type (60 s, then it falls back):
# not a JSON-API server's job.
GCS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class MotoS3:
    """moto's S3 (and IAM) server on 127.0.0.1 in a process of its own, authentication on.

    ``key``/``secret`` are a valid access key (made through moto's IAM, with
    a policy allowing S3); ``bucket`` exists. ``stop()`` ends the process.
    ``auth=False``: no signature is checked (a proxy in front may then drop
    a signed header).
    """

    bucket = "kerasfeed-data"

    def __init__(self, auth: bool = True):
        self.port = free_port()
        # The first 4 calls (making the user, its key and policy, the bucket) need no signature.
        env = dict(os.environ, **AWS_ISOLATION)
        env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(self.port, self.proc)
            self._setup()
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _client(self, service: str, key: str = "bootstrap", secret: str = "bootstrap"):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def _setup(self) -> None:
        iam = self._client("iam")
        iam.create_user(UserName="reader")
        made = iam.create_access_key(UserName="reader")["AccessKey"]
        self.key, self.secret = made["AccessKeyId"], made["SecretAccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(policy))
        self.s3 = self._client("s3", self.key, self.secret)
        self.s3.create_bucket(Bucket=self.bucket)

    def upload(self, path: str, key: str) -> str:
        """Puts a local file as ``key``; returns its ``s3://`` URL."""
        with open(path, "rb") as f:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=f.read())
        return f"s3://{self.bucket}/{key}"

    def options(self, **extra) -> dict:
        """``storage_options`` for s3fs: this endpoint and the valid key."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret, **extra}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def http_server(files: dict | None = None, **kwargs):
    """A started ``RangeServer`` (in a thread of this process), stopped at the end."""
    srv = RangeServer(files, **kwargs).start()
    try:
        yield srv
    finally:
        srv.stop()


def _main(argv: list) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Serve the files of a directory with ranges and a fixed delay.")
    p.add_argument("--root", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--procs", type=int, default=1,
                   help="processes accepting on the one listening socket (each counts only its own requests); "
                        "the caller stops them all by their process group")
    args = p.parse_args(argv)
    files = {}
    for dirpath, _, names in os.walk(args.root):
        for n in names:
            full = os.path.join(dirpath, n)
            files[os.path.relpath(full, args.root)] = full
    srv = RangeServer(files, delay=args.delay)
    # Forked before any thread starts: a store of many processes does not serve every request under one GIL,
    # as a many-core reader would otherwise measure this server, not itself (benchmarks/remote.py --store-procs).
    for _ in range(args.procs - 1):
        if os.fork() == 0:
            try:
                srv.serve_forever(poll_interval=0.05)
            finally:
                os._exit(0)
    print(srv.server_address[1], flush=True)
    try:
        srv.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    _main(sys.argv[1:])
