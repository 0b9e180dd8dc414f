"""A loopback TCP proxy in front of a real redis-server that delays chosen traffic on purpose.

``DelayProxy(upstream_host, upstream_port)`` listens on a free 127.0.0.1 port and forwards every
connection byte for byte. ``delay_reply_to(marker, seconds)`` holds the server's answer to the
next request whose bytes contain ``marker`` (Redis answers in order on a connection, so the
next server bytes after that request are its reply): the command runs on the server at once,
the client hears of it late (a fork, an fsync, a network blip). ``delay_request(marker,
seconds)`` holds the request itself: the server runs it only after the delay, after the client
gave up. Each arming applies once. Used by the slow-store tests; threads only, no fakes of
Redis itself.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class _Arm:
    marker: bytes
    seconds: float
    request: bool  # hold the request (True) or the reply to it (False)


class DelayProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._arms: list[_Arm] = []
        self.delayed = 0  # how many times a delay was applied
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._start(self._accept)

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def delay_reply_to(self, marker: bytes, seconds: float) -> None:
        with self._lock:
            self._arms.append(_Arm(marker, seconds, request=False))

    def delay_request(self, marker: bytes, seconds: float) -> None:
        with self._lock:
            self._arms.append(_Arm(marker, seconds, request=True))

    def _take(self, data: bytes) -> _Arm | None:
        with self._lock:
            for arm in self._arms:
                if arm.marker in data:
                    self._arms.remove(arm)
                    self.delayed += 1
                    return arm
        return None

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            hold = _Hold()
            self._start(self._pump_requests, client, server, hold)
            self._start(self._pump_replies, server, client, hold)

    def _pump_requests(self, src: socket.socket, dst: socket.socket, hold: _Hold) -> None:
        try:
            while data := src.recv(65536):
                arm = self._take(data)
                if arm is not None and arm.request:
                    time.sleep(arm.seconds)
                elif arm is not None:
                    hold.until = time.monotonic() + arm.seconds
                dst.sendall(data)
        except OSError:
            pass
        # The client is gone: let the server read (and run) what was forwarded, then close.
        time.sleep(0.2)
        _close(dst)

    def _pump_replies(self, src: socket.socket, dst: socket.socket, hold: _Hold) -> None:
        try:
            while data := src.recv(65536):
                wait = hold.until - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                hold.until = 0.0
                dst.sendall(data)
        except OSError:
            pass
        _close(dst)

    def close(self) -> None:
        self._closed.set()
        _close(self._listener)
        for sock in self._sockets:
            _close(sock)


class _Hold:
    """When the replies of one connection may flow again (monotonic seconds)."""

    until = 0.0


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
