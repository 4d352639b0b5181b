"""The worker process: runs ``source[index]`` (or a streaming task) and writes
the result into shared memory.

A worker is a fresh interpreter started by the pool (``WorkerProcess.launch``:
fork + immediate exec, safe while TensorFlow's threads run in the parent). It
imports only numpy, cloudpickle and the light parts of kerasfeed;
``KERASFEED_LIGHT_WORKER=1`` lets ``SceneSequence`` subclasses unpickle without
Keras or TensorFlow. Requests come from the parent's ``Dispatcher``, streams
from its ``StreamSessions``, as the types of ``protocol.py``. How a worker
leaves, and how its death is seen: NOTE [ Worker process shutdown ] in ``process.py``.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import pickle
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Optional

_T0 = time.perf_counter()

import numpy as np  # noqa: E402

from kerasfeed import _handoff  # noqa: E402
from kerasfeed.errors import ItemError  # noqa: E402
from kerasfeed.execution import worker_info  # noqa: E402
from kerasfeed.execution.cached_items import ItemCache  # noqa: E402
from kerasfeed.execution.processes import frameworks, light_modules, protocol, shm  # noqa: E402
from kerasfeed.execution.processes.channel import Channel  # noqa: E402
from kerasfeed.execution.processes.worker_threads import ThreadedLoads, worker_threads  # noqa: E402
from kerasfeed.execution.source_calls import call_source  # noqa: E402
from kerasfeed.execution.state_sync import apply_state  # noqa: E402
from kerasfeed.sources import item_random  # noqa: E402
from kerasfeed.sources.base import GeneratorsSeen, close_quietly, keep_epoch, source_name  # noqa: E402

_PARENT_POLL_S = 0.5


class _Exit(Exception):
    """The parent asked us to leave, or went away."""


def _own_resident(statm: bytes) -> int:
    """Pages resident and not shared (``/proc/self/statm``'s resident minus shared: anonymous memory, what a
    leaking source grows), not the shared memory this worker writes items into, nor mapped files and libraries:
    with those counted, a worker carrying 50 MB items passed a 256 MB limit without any leak."""
    fields = statm.split()
    return int(fields[1]) - int(fields[2])


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return _own_resident(f.read()) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _RssProbe:
    """This process's own resident bytes (``_own_resident``), read after every item (``worker_max_rss``):
    ``/proc/self/statm`` opened once and re-read with ``pread`` (~2 us; opening it each time costs ~20 us), else
    ``_rss_bytes``."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._fd: Optional[int] = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def __call__(self) -> int:
        if self._fd is None:
            return _rss_bytes()
        return _own_resident(os.pread(self._fd, 128, 0)) * self._page


def _die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (Linux; unlike a watching
    thread, works inside a C call that holds the GIL, or stopped). The parent may have died
    before the request took effect: checked right after, and then the worker leaves at once."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    # A busy worker does not read its socket, so it would not see the parent's
    # death (EOF) until the item is done; this thread makes it leave promptly.
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


class WorkerLoop:
    """The worker's side of one pool worker: set-up, then answers requests until told to leave.

    Args:
        chan: the worker's end of its socket.
        init: the ``protocol.Init`` config.
        fds: the fds that came with it (the item store's, with cache=).
    """

    def __init__(self, chan: Channel, init: dict, fds: Optional[list] = None):
        self.chan = chan
        self.init = init
        self._init_fds = list(fds or ())
        self.cache: Optional[ItemCache] = None  # cache=: set up in ``setup`` (NOTE [ An item with cache= ])
        self.id = init["worker_id"]
        self.pid = os.getpid()
        self.slots: dict[int, shm.Segment] = {}
        self.source: Any = None
        self.name = "source"
        self.epoch: Any = None
        self.state_error: Optional[BaseException] = None  # a SetState that failed here
        self._generators = GeneratorsSeen()  # a stream task's generator is read only once
        self.seeds: Optional[item_random.ItemSeeds] = None  # set up in ``setup``
        # worker_max_rss: checked after each item; past it, ``Retire`` is sent once.
        self.max_rss: Optional[int] = init.get("max_rss")
        self.rss = _RssProbe() if self.max_rss is not None else None
        self.retiring = False
        self._retire_lock = threading.Lock()
        self.threaded = False  # loads on several threads (worker_threads.py): the globals are not reseeded

    # ------------------------------------------------------------ start-up
    def setup(self) -> None:
        init = self.init
        if init.get("nice"):  # PoolOptions.worker_nice: under contention the consumer's threads run first
            try:
                os.nice(init["nice"])
            except OSError:
                pass  # not allowed here: run at the owner's priority
        # The parent's import path first, so the source's modules resolve the same way (as spawn does).
        sys.path[:] = list(init["sys_path"]) + [p for p in sys.path if p not in init["sys_path"]]
        info = worker_info.WorkerInfo(self.id, init["num_workers"], init["seed"])
        worker_info._set_worker_info(info)
        # For worker_init and unseeded pools; a seeded pool's items reseed them (``load``), as
        # NOTE [ Random augmentation is a function of (seed, pass, index) ] says.
        self.seeds = item_random.ItemSeeds(init["base_seed"], given=init["seed_given"])
        random.seed(info.seed)
        np.random.seed(info.seed % 2**32)
        fds, self._init_fds = self._init_fds, []
        try:
            self.cache = ItemCache.in_worker(init.get("cache"), fds)  # takes the store's fds
        finally:
            if self.cache is None:  # no cache=, or it failed
                for fd in fds:
                    os.close(fd)
        _handoff.receive(init.get("handoff"))  # before the source: its copy finds them by token
        source, worker_init = light_modules.loads(init["payload"])  # light Keras/TF stand-ins meanwhile
        if worker_init is not None:
            with frameworks.starting():
                worker_init()
        self.source = source
        if source is not None:
            self.name = source_name(source)

    def run(self) -> int:
        # _Exit (the parent closed the channel, e.g. a pool closed while its workers start)
        # ends the worker quietly wherever it is raised.
        loads = None
        try:
            try:
                self.setup()
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                self._send(protocol.InitError(type(e).__name__, str(e), tb))
                return 1
            info = {"pid": self.pid, "startup_s": time.perf_counter() - _T0, "rss_bytes": _rss_bytes()}
            info.update(tensorflow_imported="tensorflow" in sys.modules, keras_imported="keras" in sys.modules)
            self._send(protocol.Ready(info))
            threads = worker_threads(self.source)  # NOTE [ A worker that makes several items at once ]
            self.threaded = threads > 1
            loads = ThreadedLoads(threads, self.load) if self.threaded else None
            while True:
                msg = self._recv()
                if isinstance(msg, protocol.Load):
                    if loads is None:
                        self.load(msg)
                    else:
                        loads.submit(msg)
                    continue
                if loads is not None:
                    loads.drain()  # a state or a stream comes after the loads before it
                if isinstance(msg, protocol.SetState):
                    self.set_state(msg)
                elif isinstance(msg, protocol.StartStream):
                    self.stream(msg)
                # else: a late Credit/Cancel for a finished stream.
        except _Exit:
            if loads is not None:
                loads.close()  # no load thread left to be cut off by the interpreter's exit (worker_threads.py)
            return 0

    # ------------------------------------------------------------ transport
    def _send(self, message: protocol.ToParent, fds: tuple = ()) -> None:
        try:
            self.chan.send(protocol.encode(message), fds)
        except OSError as e:  # the parent closed the channel or died
            raise _Exit() from e
        finally:
            for fd in fds:
                os.close(fd)

    def _recv(self) -> protocol.ToWorker:
        try:
            raw, fds = self.chan.recv()
        except (EOFError, OSError) as e:
            raise _Exit() from e
        for fd in fds:  # the parent never sends fds
            os.close(fd)
        msg = protocol.decode(raw)
        if isinstance(msg, protocol.Exit):
            raise _Exit()
        return msg

    def _write(self, slot: int, item: Any) -> tuple[bytes, tuple, Any, int]:
        """Writes the item's arrays into the slot's segment, growing it if needed (or making it anew, smaller,
        after an outlier item grew it: ``shm.oversized``). Returns the
        pickled spec, the fds and size of a new segment (or ``()``, None), and the bytes used."""
        spec, arrays, nbytes = shm.encode(item)
        spec_bytes = shm.dumps_spec(spec)
        fds: tuple = ()
        size = None
        if nbytes:
            seg = self.slots.get(slot)
            if seg is None or seg.size < nbytes or shm.oversized(seg.size, nbytes):
                if seg is not None:
                    seg.close()
                    del self.slots[slot]
                size = shm.grown_size(nbytes)
                seg, send_fd = shm.new_segment(size, f"w{self.id}s{slot}")
                self.slots[slot] = seg
                fds = (send_fd,)
            shm.write(seg, arrays)
        return spec_bytes, fds, size, nbytes

    # ------------------------------------------------------------ tasks
    def set_state(self, msg: protocol.SetState) -> None:
        try:
            _handoff.receive(msg.handoff)
            self.source = apply_state(self.source, msg.payload, light_modules.loads)
            self.state_error = None
        except BaseException as e:  # noqa: BLE001 - every later item fails with it (SystemExit too)
            self.state_error = e
        self.epoch = msg.epoch  # the state carries the consumer's set_epoch(epoch)
        # But not a SceneSequence's epoch (each process keeps its own), and this copy's may be a pass made
        # ahead: a pass begun again read it (NOTE [ A pass begun again keeps what was made ]).
        keep_epoch(self.source, msg.epoch)

    def load(self, request: protocol.Load) -> None:
        index, epoch, slot = request.index, request.epoch, request.slot
        try:
            item, make_s = call_source(self, index, epoch)
            t1 = time.perf_counter()
            if self.cache is not None and self.cache.handed_over_stored(index):
                spec, fds, size, nbytes = protocol.IN_STORE, (), None, 0  # NOTE [ An item with cache= ]
            else:
                spec, fds, size, nbytes = self._write(slot, item)
            t2 = time.perf_counter()
        except _Exit:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            # KeyboardInterrupt, SystemExit too: SIGINT is ignored here, so they
            # come from the source itself; an item error, not a worker death.
            err = ItemError.from_exception(index, e, worker_id=self.id, pid=self.pid, source_name=self.name)
            self._send(protocol.ItemFailed(request.request_id, err))
            return
        self._send(protocol.ItemDone(request.request_id, slot, spec, size, nbytes, make_s, t2 - t1), fds)
        if self.rss is not None and not self.retiring:
            rss = self.rss()
            with self._retire_lock:  # loads may run on several threads (worker_threads.py)
                retire, self.retiring = rss > self.max_rss and not self.retiring, self.retiring or rss > self.max_rss
            if retire:
                self._send(protocol.Retire(rss))

    def _take_messages(self, stream_id: int, free: collections.deque, block: bool) -> bool:
        """Reads credits for stream ``stream_id``; returns True if it was cancelled."""
        while block or select.select([self.chan.sock], [], [], 0)[0]:
            msg = self._recv()
            if getattr(msg, "stream_id", None) != stream_id:
                continue
            if isinstance(msg, protocol.Credit):
                free.append(msg.slot)
            elif isinstance(msg, protocol.Cancel):
                return True
            block = False
        return False

    def stream(self, request: protocol.StartStream) -> None:
        """Counterpart of the parent's ``StreamSessions`` (``stream_sessions.py``)."""
        stream_id, name = request.stream_id, request.name
        free = collections.deque(request.slots)
        n = 0
        gen = None
        try:
            _handoff.receive(request.handoff)
            fn, arg = pickle.loads(request.payload)
            self._send(protocol.StreamStarted(stream_id))
            t0 = time.perf_counter()  # the first item's make time includes the task's call
            gen = self._generators.check(iter(fn(arg)))
            while True:
                if self._take_messages(stream_id, free, block=False):
                    break
                if n:
                    t0 = time.perf_counter()
                try:
                    item = next(gen)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                cancelled = False
                while not free and not cancelled:
                    cancelled = self._take_messages(stream_id, free, block=True)
                if cancelled:
                    break
                slot = free.popleft()
                t2 = time.perf_counter()
                spec, fds, size, _ = self._write(slot, item)
                t3 = time.perf_counter()
                self._send(protocol.StreamItem(stream_id, n, slot, spec, size, t1 - t0, t3 - t2), fds)
                n += 1
        except _Exit:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer (as in ``load``)
            err = ItemError.from_exception(n, e, worker_id=self.id, pid=self.pid, source_name=name)
            self._send(protocol.StreamFailed(stream_id, err))
            return
        finally:
            close_quietly(gen)
        self._send(protocol.StreamEnd(stream_id, n))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    sock_fd, crash_fd = int(argv[1]), int(argv[2])
    parent_pid = int(argv[3]) if len(argv) > 3 else os.getppid()
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group (terminal, Jupyter); the parent
    # decides what stops, so a worker never dies half-way through an item.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked from launch (process._without_sigint)
    # A native crash dumps the Python stacks into a pipe the parent reads to
    # explain the death; non-blocking so a full pipe cannot hang a dying worker.
    os.set_blocking(crash_fd, False)
    crash_file = os.fdopen(crash_fd, "w")
    faulthandler.enable(crash_file, all_threads=False)
    chan = Channel(socket.socket(fileno=sock_fd))
    # Also where the kernel signal exists: it cannot tell a re-parenting to a
    # subreaper from a death, but a changed parent pid can.
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="kerasfeed-parent-watch", daemon=True).start()
    try:
        raw, fds = chan.recv()
    except (EOFError, OSError):
        return 0
    init = protocol.decode(raw)
    if not isinstance(init, protocol.Init):
        return 0
    return WorkerLoop(chan, init.config, fds).run()


if __name__ == "__main__":
    sys.exit(main())
