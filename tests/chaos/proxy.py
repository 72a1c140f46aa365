"""A TCP proxy on 127.0.0.1 in front of the S3-compatible server, which fails or slows on command.

``pass``: bytes flow both ways. ``fail``: every open connection is reset and every new one is
reset on arrival (the AWS SDK in pyarrow retries a few times, then the request fails: an upload
or a download breaks mid-way). ``slow``: every chunk is held ``delay`` seconds each way.
``hold``: a request whose first bytes match ``pattern`` (an upload's request line, ``PUT
/bucket/.../__1_0.distcp``) is held where it is, and its request line kept in ``held``; every
other one flows; when the mode changes the held connections are reset, so that upload never
completes. It works below HTTP, as a
flaky network or an overloaded store does, so it needs nothing of the server.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.mode, self.delay = "pass", 0.0
        self.pattern: re.Pattern[bytes] | None = None
        self.held: list[bytes] = []  # the request lines held in this hold
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str, delay: float = 0.0, pattern: bytes | None = None) -> None:
        """``pass``, ``fail`` (resets every connection now and until set otherwise), ``slow``
        (``delay`` seconds per chunk) or ``hold`` (the requests ``pattern`` matches)."""
        with self._lock:
            self.mode, self.delay = mode, delay
            self.pattern = re.compile(pattern) if pattern is not None else None
            if mode == "hold":
                self.held = []
            if mode == "fail":
                for sock in list(self._open):
                    _reset(sock)
                self._open.clear()

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                failing = self.mode == "fail"
            if failing:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, sink, outbound in ((client, upstream, True),
                                           (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, outbound),
                                 daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, outbound: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if outbound and self.mode == "hold" and self.pattern is not None and \
                        self.pattern.search(data[:1024]):
                    with self._lock:
                        self.held.append(data.split(b"\r\n", 1)[0])
                    while self.mode == "hold":  # held here; then the connection is reset
                        time.sleep(0.05)
                    break
                delay = self.delay if self.mode == "slow" else 0.0
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped connection arrives at a client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
