"""A TCP proxy on 127.0.0.1 that makes S3 listing requests slow, or holds them, on purpose.

A real network element between s3fs and moto's server: every request whose first line asks
for a bucket listing (``list-type=2``) is delayed by ``list_delay_s`` before it is passed on,
and waits while ``hold`` is set past the first ``hold_after`` listing requests. Other requests
(object reads) pass at once. The first line of each listing request is kept in
``list_lines``, so a test can see what was asked (``start-after=...``).

HTTP keep-alive is fine: a chunk from the client that starts with a method name starts a new
request (requests here are small and come in one chunk).
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import unquote

_METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ")


class SlowListProxy:
    """Forwards 127.0.0.1:<port> to ``target`` (``host:port``)."""

    def __init__(self, target_host: str, target_port: int, *, list_delay_s: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.list_delay_s = list_delay_s
        self.hold_after: int | None = None  # listing requests let through before holding
        self.released = threading.Event()
        self.released.set()
        self.list_lines: list[str] = []
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, after: int) -> None:
        """Let ``after`` more listing requests through, then hold the next until :meth:`release`."""
        with self._lock:
            self.hold_after = len(self.list_lines) + after
            self.released.clear()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self._closed = True
        self.released.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                if from_client and chunk.startswith(_METHODS):
                    self._on_request(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def _on_request(self, chunk: bytes) -> None:
        line = chunk.split(b"\r\n", 1)[0].decode("latin-1")
        if "list-type=2" not in line:
            return
        with self._lock:
            self.list_lines.append(unquote(line))
            held = self.hold_after is not None and len(self.list_lines) > self.hold_after
        if held:
            self.released.wait()
        if self.list_delay_s:
            time.sleep(self.list_delay_s)
