"""Framed pickle messages, with optional file descriptors, over a Unix socket.

One socket pair per worker carries small control messages both ways (requests,
item specs, errors). Array bytes travel in shared memory, whose segments are
passed as fds (``SCM_RIGHTS``) attached to the message that first uses them.
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("<QI")  # payload length, number of fds
_MAX_FDS = 4


class Channel:
    """Sends and receives ``(message, fds)`` over a connected Unix socket.

    ``send`` is thread-safe; ``recv`` must be called by one thread at a time.

    Args:
        sock: a connected ``AF_UNIX`` stream socket.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any, fds: tuple[int, ...] = (), nowait: bool = False) -> bool:
        """Sends one message; returns False only if ``nowait`` and another
        send was under way (used by finalizers, which must not block)."""
        payload = pickle.dumps(message, protocol=5)
        header = _HEADER.pack(len(payload), len(fds))
        if not self._send_lock.acquire(blocking=not nowait):
            return False
        try:
            if fds:
                # The fds travel with the header bytes; the kernel delivers them
                # with the first recvmsg that reads those bytes.
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self.sock.sendmsg([header], anc)
                if sent < len(header):
                    self.sock.sendall(header[sent:])
                self.sock.sendall(payload)
            else:
                self.sock.sendall(header + payload)
        finally:
            self._send_lock.release()
        return True

    def recv(self) -> tuple[Any, list[int]]:
        """Receives one message and the fds sent with it.

        Raises:
            EOFError: the peer closed its end (or died).
        """
        fds: list[int] = []
        header = self._recv_exact(_HEADER.size, fds)
        length, _ = _HEADER.unpack(header)
        payload = self._recv_exact(length, fds)
        return pickle.loads(payload), fds

    def _recv_exact(self, n: int, fds: list[int]) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        anc_size = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
        while got < n:
            data, anc, _flags, _addr = self.sock.recvmsg(min(n - got, 1 << 20), anc_size)
            if not data:
                for fd in fds:  # do not leak fds of a message cut short
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                raise EOFError("kerasfeed: the peer process closed the channel")
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(cdata[: len(cdata) - (len(cdata) % a.itemsize)])
                    fds.extend(a)
            view[got : got + len(data)] = data
            got += len(data)
        return buf

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
