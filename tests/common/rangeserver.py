"""A static file server on 127.0.0.1 that answers ``Range`` requests, as web servers and CDNs do.

Python's ``http.server`` ignores ``Range`` (it answers 200 with the whole file), so a client
that resumes a body from a byte would be given the first bytes again: this one answers ``206
Partial Content`` with ``Content-Range`` for ``bytes=A-`` and ``bytes=A-B``, ``416`` past the
end, and a directory with a page of links (fsspec lists HTTP "directories" so).
"""

from __future__ import annotations

import re
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _Server(ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that gave up mid-body (a timeout a test provokes)
        super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def range_server(root: Path) -> Iterator[str]:
    """Serve ``root`` for the block; yields ``http://127.0.0.1:<port>``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers

        def _answer(self, body: bool) -> None:
            rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
            path = root / rel
            if ".." in rel.split("/") or not path.exists():
                self._send(404, b"", {})
                return
            if path.is_dir():
                names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
                page = "".join(f'<a href="{urllib.parse.quote(n)}">{n}</a>\n' for n in names)
                self._send(200, page.encode() if body else b"", {"Content-Type": "text/html"},
                           len(page.encode()))
                return
            data = path.read_bytes()
            match = _RANGE.match(self.headers.get("Range", ""))
            if match is None:
                self._send(200, data if body else b"", {}, len(data))
                return
            start = int(match.group(1))
            end = min(int(match.group(2)) + 1 if match.group(2) else len(data), len(data))
            if start >= len(data):
                self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            self._send(206, data[start:end] if body else b"",
                       {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}, end - start)

        def _send(self, status: int, data: bytes, headers: dict[str, str],
                  length: int | None = None) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout it was testing)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def log_message(self, *args: object) -> None:
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
