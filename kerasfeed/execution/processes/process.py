"""The parent's handle on one worker process: launch, send, diagnose an exit, stop.

Counterpart of the worker loop (``worker.py``: ``WorkerLoop``), which runs in
the child at the other end of the handle's socket.

NOTE [ Worker process shutdown ]
================================

How a pool notices that a worker died, and how everything stops.

- **One reader thread per worker** (``readers.read_loop``) blocks on the
  worker's socket. A worker that dies, however (SIGKILL, segfault,
  ``os._exit``), closes its end: the reader sees EOF at once. A grandchild
  that inherited the socket would keep it open, so the reader also polls
  the process every second as a backstop.
- **Explaining the death** (``WorkerProcess.explain_exit``): the exit code
  or signal (with the usual cause of SIGKILL, SIGSEGV, SIGBUS, SIGABRT), the
  ``InitError`` traceback if set-up failed, and the Python stacks that
  ``faulthandler`` wrote into the worker's crash pipe if native code crashed.
- **Failure propagation** (``readers._worker_gone``): the first failure
  (a death, or a timeout that made the consumer kill a worker) is kept; the
  item the worker died on (its oldest pending request) is named; every
  pending request of every worker fails with a fresh copy of that error (one
  exception object raised in many threads would collect all their
  tracebacks), a stream on that worker gets ``WorkerDied``, and every later
  call raises it too. Workers are never restarted: a crash in native code
  usually repeats, and a loud stop beats a pass that silently loses items.
  The pool is closed at once, not when it is collected: a kept traceback or
  a failed iterator that Keras holds would put that off for ever.
- **Shutdown** (``Dispatcher.close``; run by ``ProcessExecutor.close``, by
  garbage collection and at interpreter exit through ``weakref.finalize``):
  under the lock, mark closed, drop the plans and fail what is pending;
  then, without the lock, shut every socket down (idle workers see EOF and
  leave at once), give busy ones ``GRACE_S`` to finish their item, then
  SIGTERM, then SIGKILL, and reap them all (no zombies); join the readers;
  unmap the segments (a lent one stays mapped until its last view is gone).
  A forked copy of the owner never closes (the sockets are the owner's).
- **The other direction**: a worker leaves when its socket reaches EOF, and
  the kernel SIGKILLs it when its parent dies (Linux ``PR_SET_PDEATHSIG``:
  works even inside a C call that holds the GIL, or while stopped). The
  kernel sends it when the *thread* that started the worker ends, so workers
  are started from the main thread or one long-lived launcher thread.
  Elsewhere a thread of the worker's own watches its parent. Workers ignore
  SIGINT: Ctrl-C interrupts the consumer, which decides what stops.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from kerasfeed.errors import WorkerError
from kerasfeed.execution.processes import light_modules, protocol
from kerasfeed.execution.processes.channel import Channel

logger = logging.getLogger("kerasfeed")

_BOOT = "from kerasfeed.execution.processes.worker import main; main()"
GRACE_S = 1.0
NO_RESTART = (
    "Without retries=, kerasfeed does not replace a dead or stopped worker within a pass (a crash in native code "
    "usually repeats): this pass fails, and the next pass starts new workers. Pass retries=1 (or more) to make the "
    "item again on a new worker, or use executor='threads' to debug the source in the main process."
)
# Streams take no retries= (a generator cannot be resumed on another worker).
STREAM_NO_RESTART = (
    "A stream does not replace a dead or stopped worker within a pass: this pass fails, and the next pass starts "
    "new workers. Use executor='threads' to debug the generators in the main process."
)


def describe_exit(code: Optional[int]) -> str:
    """Why a worker ended, from its exit code (negative: the signal)."""
    if code is None:
        return "stopped answering (its channel closed while it kept running) and was killed"
    if code < 0:
        sig = -code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        why = {
            signal.SIGKILL: " (SIGKILL: `kill -9` or the kernel's out-of-memory killer)",
            signal.SIGSEGV: " (a crash in native code, e.g. a C extension)",
            signal.SIGBUS: " (a crash in native code, or shared memory exhausted)",
            signal.SIGABRT: " (aborted by native code)",
        }.get(sig, "")
        return f"was killed by signal {name} ({sig}){why}"
    return f"exited unexpectedly with exit code {code}"


def fresh_error(err: WorkerError) -> WorkerError:
    """A copy of ``err`` to raise (see NOTE [ Worker process shutdown ]: failure propagation)."""
    return WorkerError(str(err), err.worker_id, err.pid, err.exitcode, err.index, err.attempts, err.causes)


_launcher: Optional["queue.SimpleQueue"] = None
_launcher_lock = threading.Lock()


def _launcher_loop(jobs: "queue.SimpleQueue") -> None:
    while True:
        fn, box, done = jobs.get()
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            box.append((False, e))
        done.set()
        del fn, box, done


def _without_sigint(fn: Callable[[], Any]) -> Any:
    """``fn`` (a launch) with SIGINT blocked on this thread: the worker is born with it blocked, so a
    Ctrl-C sent to the process group while its interpreter starts (before ``main`` ignores it) does
    not end it with "Fatal Python error: init_import_site". Here, a Ctrl-C meanwhile waits until after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return fn()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _from_a_lasting_thread(fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` (a process launch) on a thread that lives as long as the process: a worker
    started from a short-lived thread (tf.data's, a user's) would get the parent-death signal
    when that thread ends (NOTE [ Worker process shutdown ])."""
    global _launcher
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _launcher_lock:
        if _launcher is None:
            _launcher = queue.SimpleQueue()
            threading.Thread(target=_launcher_loop, args=(_launcher,), name="kerasfeed-launcher", daemon=True).start()
        jobs = _launcher
    box: list = []
    done = threading.Event()
    jobs.put((fn, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class WorkerProcess:
    """The parent's handle on one worker process (see NOTE [ Worker process shutdown ]).

    Never takes the pool's lock: its state is written by its reader thread
    (``info``, ``init_error``, ``reader_cpu_s``) or once at launch.

    Args:
        worker_id: the worker's number in its pool.
        proc: the started process.
        chan: the parent's end of the worker's socket.
        crash_fd: the read end of the worker's crash pipe (non-blocking).
    """

    def __init__(self, worker_id: int, proc: subprocess.Popen, chan: Channel, crash_fd: int):
        self.id = worker_id
        self.proc = proc
        self.pid = proc.pid
        self.chan = chan
        self.crash_fd = crash_fd
        self.launched = time.perf_counter()
        self.ready = threading.Event()
        self.ready_at: Optional[float] = None  # time.monotonic() when it said ready
        self.info: dict = {}
        self.init_error: Optional[protocol.InitError] = None
        self.reader: Optional[threading.Thread] = None
        self.reader_cpu_s = 0.0
        self._poller: Optional[select.poll] = None

    # ------------------------------------------------------------ launch
    @classmethod
    def launch(cls, worker_id: int) -> "WorkerProcess":
        """Starts a fresh interpreter running the worker loop (fork + exec:
        safe while TensorFlow's threads run; ``__main__`` is never re-imported)."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        crash_r, crash_w = os.pipe()
        env = dict(os.environ, **light_modules.worker_environment())
        env["PYTHONUNBUFFERED"] = "1"  # a worker's prints show up before it dies
        # kerasfeed must import in the child even when the parent found it
        # through a sys.path tweak rather than an install.
        root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["kerasfeed"].__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        try:
            proc = _from_a_lasting_thread(
                lambda: _without_sigint(lambda: subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(child_sock.fileno()), str(crash_w), str(os.getpid())],
                    pass_fds=(child_sock.fileno(), crash_w),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    close_fds=True,
                ))
            )
        except BaseException:
            parent_sock.close()
            os.close(crash_r)
            raise
        finally:
            child_sock.close()
            os.close(crash_w)
        os.set_blocking(crash_r, False)
        return cls(worker_id, proc, Channel(parent_sock), crash_r)

    def deadline(self, since: float, timeout: Optional[float]) -> Optional[float]:
        """When a request waited on since ``since`` times out: ``timeout`` s after the later of ``since``
        and the worker's ready (start-up and ``worker_init`` do not count); None if not ready or no timeout."""
        ready_at = self.ready_at
        if timeout is None or ready_at is None:
            return None
        return max(since, ready_at) + timeout

    # ------------------------------------------------------------ messages
    def send(self, message: protocol.ToWorker, fds: tuple = ()) -> None:
        """Sends one message (thread-safe), with ``fds`` (kept open here).

        Raises:
            OSError: the worker is gone.
        """
        self.chan.send(protocol.encode(message), fds)

    def send_quietly(self, message: protocol.ToWorker, nowait: bool = False) -> bool:
        """``send`` unless the worker is gone; False only as ``Channel.send`` with ``nowait``."""
        try:
            return self.chan.send(protocol.encode(message), nowait=nowait)
        except OSError:
            return True

    def wait_readable(self, timeout_s: float) -> bool:
        """True once a message (or EOF) is there to read; reader thread only."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.chan.sock, select.POLLIN)
        return bool(self._poller.poll(int(timeout_s * 1000)))

    def recv(self) -> tuple[protocol.ToParent, list[int]]:
        """The next message and the fds sent with it; reader thread only.

        Raises:
            EOFError: the worker closed its end (or died).
        """
        raw, fds = self.chan.recv()
        return protocol.decode(raw), fds

    def start_reader(self, target: Callable[[Any], None], arg: Any) -> None:
        """Starts the thread that reads this worker's messages (``target(arg)``)."""
        name = f"kerasfeed-worker-{self.id}-reader"
        self.reader = threading.Thread(target=target, args=(arg,), name=name, daemon=True)
        self.reader.start()

    def mark_ready(self, info: dict, pool_name: str) -> None:
        """Records the worker's ``Ready`` info (its reader thread)."""
        self.info = dict(info, launch_to_ready_s=time.perf_counter() - self.launched)
        self.ready_at = time.monotonic()
        self.ready.set()
        if self.info.get("tensorflow_imported") and self.id == 0:
            logger.warning(
                "kerasfeed: worker processes of %s loaded TensorFlow while starting (start-up %.1f s): worker 0's "
                "warning above names the use that pulled it in, its cost and what to do (docs/your_sequence.md).",
                pool_name,
                self.info["launch_to_ready_s"],
            )

    # ------------------------------------------------------------ exit
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()

    def reap(self) -> Optional[int]:
        """The exit code of a worker whose channel closed; None if it kept running (killed then)."""
        return None if self.kill_after(5) else self.proc.returncode

    def explain_exit(self, code: Optional[int]) -> tuple[str, str]:
        """``(head, details)``: what happened, and the traceback or crash stacks (may be empty)."""
        details = ""
        if self.init_error is not None:
            head = f"failed to start: {self.init_error.type_name}: {self.init_error.message}"
            details = f"Worker traceback:\n{self.init_error.traceback}"
        elif not self.ready.is_set() and code == 0:
            head = "exited before it was ready"
        else:
            head = describe_exit(code)
        try:
            crash = os.read(self.crash_fd, 1 << 16).decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            crash = ""
        if crash:
            details = f"Python stacks of the worker when it crashed:\n{crash}"
        return head, details

    # ------------------------------------------------------------ stop (in this order, over all workers)
    def ask_to_stop(self) -> None:
        """EOF on its socket: an idle worker leaves at once."""
        try:
            self.chan.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def terminate_after(self, deadline: float) -> None:
        """SIGTERM if still running at ``deadline`` (``time.monotonic``)."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.terminate()

    def kill_after(self, grace_s: float) -> bool:
        """SIGKILL if still running after ``grace_s`` (then True); reaps it either way."""
        try:
            self.proc.wait(timeout=grace_s)
            return False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return True

    def release(self) -> None:
        """Joins the reader (unless called from it) and closes the fds."""
        me = threading.current_thread()
        if self.reader is not None and self.reader is not me and self.reader.is_alive():
            self.reader.join(timeout=2)
        self.chan.sock.close()
        try:
            os.close(self.crash_fd)
        except OSError:
            pass
        self.crash_fd = -1
