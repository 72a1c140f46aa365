"""A TCP proxy on 127.0.0.1 in front of the S3-compatible server, which fails or slows on command.

``pass``: bytes flow both ways. ``fail``: every open connection is reset and every new one is
reset on arrival (the AWS SDK in pyarrow retries a few times, then the request fails: an upload
or a download breaks mid-way). ``slow``: every chunk is held ``delay`` seconds each way. It works
below HTTP, as a flaky network or an overloaded store does, so it needs nothing of the server.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.mode, self.delay = "pass", 0.0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str, delay: float = 0.0) -> None:
        """``pass``, ``fail`` (resets every connection now and until set otherwise) or ``slow``
        (``delay`` seconds per chunk)."""
        with self._lock:
            self.mode, self.delay = mode, delay
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
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
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
