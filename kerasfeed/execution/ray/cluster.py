"""Which Ray cluster the actors run on, and letting go of it (connection and lifetime).

The user's own connection (``ray.init(...)``) is used and never ended;
``address=`` (or ``RAY_ADDRESS``) connects first, and kerasfeed disconnects
when the last executor that needed it closes; otherwise Ray is started here on
127.0.0.1 (never joining a cluster another program left behind:
``address="local"``) and stopped likewise (docs/ray.md). An address is tried
with a TCP connection first (``CONNECT_TIMEOUT_S``): a ``ConnectionError`` at
once, not Ray's minute of retries.

NOTE [ Ray started by kerasfeed listens on 127.0.0.1 only ]
===========================================================

Ray's processes (GCS, raylet, core workers, agents) bind their gRPC servers
to 127.0.0.1 only when the node's IP is 127.0.0.1, else to every interface.
But ``ray.init`` rewrites a loopback address (``_node_ip_address="127.0.0.1"``
and ``address="127.0.0.1:port"`` alike) into the machine's "reachable" IP
(``services.resolve_ip_for_localhost``), except where multi-node clusters are
off (``ray_constants.ENABLE_RAY_CLUSTER``, False on Windows and macOS): with
Ray 2.60 here, ``ray.init(_node_ip_address="127.0.0.1")`` listened on ``*``
and talked to the eth0 address. So around the ``ray.init`` that starts Ray
(and one that connects at a loopback address) ``ENABLE_RAY_CLUSTER`` is False,
and restored after: every server binds 127.0.0.1 (checked with ``ss -ltnp``),
and a local start is checked after the fact (a GCS address that is not
loopback stops Ray again and fails the start). A Ray 2.60 local start also
turns on token authentication (``RAY_AUTH_MODE=token``, a token in
``~/.ray/auth_token``), which keeps other users of the machine out.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import random
import socket
import threading
import time
import weakref
from typing import Any, Iterator, Optional

logger = logging.getLogger("kerasfeed")

CONNECT_TIMEOUT_S = 5.0
# How long the placement check waits for resources being freed (a killed actor gives its CPU back a moment later).
PLACEMENT_WAIT_S = 10.0
_lock = threading.RLock()


class _Connection:
    users = 0  # leases not released
    owned: Optional[str] = None  # "started" or "connected" by kerasfeed; None: the user's (or none)
    exit_hook = False
    guard: Any = None  # reaper.Guard (NOTE [ Ray started by kerasfeed ends with its owner ])


_conn = _Connection()
_pools: "weakref.WeakSet[Any]" = weakref.WeakSet()  # pools to close at exit


def import_ray() -> Any:
    """``import ray``, or a ``ModuleNotFoundError`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ModuleNotFoundError(
            "kerasfeed: executor='ray' (RayExecutor) runs the source on Ray actors and needs Ray: "
            f"pip install 'kerasfeed[ray]' (or pip install ray). Received: {type(e).__name__}: {e}",
            name="ray",
        ) from e
    return ray


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``ray://host:port``; None for ``auto`` and the like."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _probe(address: str) -> None:
    """Raises ``ConnectionError`` at once if nothing accepts a TCP connection at ``address``."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConnectionError(
            f"kerasfeed: no Ray cluster answers at {address} ({type(e).__name__}: {e}; waited at most "
            f"{CONNECT_TIMEOUT_S:g} s). Start one there (`ray start --head` on that host), check the host and port "
            f"(the head's GCS port, 6379 by default), or pass address=None to start Ray on this machine. "
            f"Received: address={address!r}"
        ) from e


@contextlib.contextmanager
def _loopback_stays_loopback() -> Iterator[None]:
    # NOTE [ Ray started by kerasfeed listens on 127.0.0.1 only ]
    try:
        import ray._private.ray_constants as constants
    except ImportError:  # pragma: no cover - another Ray layout: the check after the start decides
        yield
        return
    old = getattr(constants, "ENABLE_RAY_CLUSTER", True)
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = old


def current_address(ray: Any) -> Optional[str]:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - informative only
        return None


@contextlib.contextmanager
def _users_random_kept() -> Iterator[None]:
    """Python's global ``random`` as the user left it: ``ray.init`` draws from it, so a model built after
    ``executor="ray"`` got other initial weights (``keras.utils.set_random_seed`` seeds that generator too)."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _start_local(ray: Any) -> None:
    from kerasfeed.execution.ray.reaper import Guard, descendants

    before = descendants()
    try:
        with _loopback_stays_loopback(), _users_random_kept():
            ray.init(
                address="local",
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
    except BaseException:  # Ctrl-C or an error inside ray.init: what it started already must not outlive us
        guard = Guard(before)
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - half started: the guard kills what is left
            pass
        guard.close()
        raise
    _conn.guard = Guard(before)
    address = current_address(ray) or ""
    hp = _host_port(address)
    if hp is None or not _is_loopback(hp[0]):
        _shutdown("started")
        raise RuntimeError(
            "kerasfeed: the Ray instance started for executor='ray' did not stay on 127.0.0.1 (this Ray version "
            "rewrote the node address), so it was stopped again: it would have listened on the network. Start Ray "
            "yourself on a private network (`ray start --head --node-ip-address=...`) and pass its address. "
            f"Received: address={address!r}"
        )


def _connect(ray: Any, address: str) -> None:
    _probe(address)
    hp = _host_port(address)
    local = hp is not None and _is_loopback(hp[0])
    try:
        with _loopback_stays_loopback() if local else contextlib.nullcontext(), _users_random_kept():
            kwargs = {"_node_ip_address": "127.0.0.1"} if local else {}
            ray.init(address=address, logging_level=logging.WARNING, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConnectionError(
            f"kerasfeed: could not connect to the Ray cluster at {address}: {type(e).__name__}: {e}. "
            f"Received: address={address!r}"
        ) from e


class Lease:
    """One executor's use of the Ray connection; ``release`` once (idempotent). ``address``: the cluster's
    GCS address; ``owner``: ``"started"`` (Ray started here), ``"connected"`` (by kerasfeed) or ``"user"``."""

    def __init__(self, address: Optional[str], owner: str):
        self.address = address
        self.owner = owner
        self._released = False

    def release(self) -> None:
        with _lock:
            if self._released:
                return
            self._released = True
            _conn.users = max(0, _conn.users - 1)
            if _conn.users or _conn.owned is None:
                return
            owned, _conn.owned = _conn.owned, None
        _shutdown(owned)

    def __repr__(self) -> str:
        return f"<Lease address={self.address!r} owner={self.owner!r}>"


def _shutdown(owned: str) -> None:
    ray = import_ray()
    try:
        ray.shutdown()  # stops the processes Ray started here; a connection only disconnects
    except Exception as e:  # noqa: BLE001 - at exit or after the user's own shutdown
        logger.debug("kerasfeed: ray.shutdown() after the last RayExecutor (%s) failed: %s", owned, e)
    _close_guard()


def _close_guard() -> None:
    """Ends the guard of the Ray kerasfeed started, if any (its processes are gone or going)."""
    guard, _conn.guard = _conn.guard, None
    if guard is not None:
        guard.close()


def acquire(address: Optional[str]) -> Lease:
    """The cluster to run on (see the module docstring); ``release`` the lease when done.

    Raises:
        ConnectionError: nobody answers at ``address``, or Ray refused it.
        ValueError: this process is connected to another cluster than ``address``.
        ModuleNotFoundError: Ray is not installed.
    """
    ray = import_ray()
    with _lock:
        if ray.is_initialized():
            current = current_address(ray)
            if address is not None and address not in ("auto",) and not _same(address, current):
                raise ValueError(
                    f"kerasfeed: this process is connected to the Ray cluster at {current} already, and Ray serves one "
                    f"cluster per process: use that one (address=None) or call ray.shutdown() first. "
                    f"Received: address={address!r}"
                )
            _conn.users += 1
            owner = _conn.owned or "user"
            return Lease(current, owner)
        if _conn.owned is not None:  # someone called ray.shutdown() under kerasfeed's executors
            _conn.owned, _conn.users = None, 0
            _close_guard()
        target = address if address is not None else (os.environ.get("RAY_ADDRESS") or None)
        if target is None:
            _start_local(ray)
            _conn.owned = "started"
        else:
            _connect(ray, target)
            _conn.owned = "connected"
        _conn.users = 1
        if not _conn.exit_hook:
            atexit.register(_at_exit)  # after ray.init's own exit hook, so it runs before it
            _conn.exit_hook = True
        return Lease(current_address(ray), _conn.owned)


def _same(given: str, current: Optional[str]) -> bool:
    if current is None:
        return True
    a, b = _host_port(given), _host_port(current)
    if a is None or b is None:
        return True
    if a[1] != b[1]:
        return False
    return a[0] == b[0] or (_is_loopback(a[0]) and _is_loopback(b[0])) or _resolves_to(a[0], b[0])


def _resolves_to(host: str, ip: str) -> bool:
    try:
        return ip in {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False


def room(ray: Any, options: Any, items: Optional[int], address: Optional[str], name: str) -> dict:
    """The cluster's available resources, once they hold the workers (a short wait while a closed
    executor's actors give theirs back); WorkerError if not within ``PLACEMENT_WAIT_S`` (or ``start_timeout``).
    """
    from kerasfeed.errors import WorkerError
    from kerasfeed.execution.ray.options import workers_for

    per = options.resources
    deadline = time.monotonic() + min(PLACEMENT_WAIT_S, options.start_timeout)
    while True:
        available = dict(ray.available_resources())
        workers = workers_for(options, available, items)
        short = {k: v * workers for k, v in per.items() if v > 0 and available.get(k, 0.0) + 1e-9 < v * workers}
        if not short:
            return available
        if time.monotonic() > deadline:
            total = dict(ray.cluster_resources())
            none = "CPU" in short and available.get("CPU", 0.0) < per["CPU"]
            what = "no CPU for the workers" if none else "no room for the workers"
            raise WorkerError(
                f"kerasfeed: the Ray cluster at {address} has {what}: {workers} worker(s) of {name} ask for "
                f"{dict(per)} each, {short} in all, but only { {k: available.get(k, 0.0) for k in short} } is "
                f"available (of { {k: total.get(k, 0.0) for k in short} } in the cluster; other executors and jobs "
                "hold the rest). Use fewer `workers` (a second executor in this process, e.g. for validation, needs "
                "its own), smaller `resources`, or add nodes with `ray start --address=...`. "
                f"Received: workers={options.workers!r}, resources={dict(per)}"
            )
        time.sleep(0.2)


def register_pool(pool: Any) -> None:
    """``pool.close()`` runs at interpreter exit if it has not yet (its actors are killed)."""
    _pools.add(pool)


def _at_exit() -> None:
    for pool in list(_pools):
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


__all__ = ["Lease", "acquire", "current_address", "import_ray", "register_pool", "room"]
