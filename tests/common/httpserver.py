"""A small HTTP server on 127.0.0.1 whose URLs carry credentials, as real ones do.

``/data/...`` serves files under a directory to requests with HTTP basic auth (the userinfo of
``https://user:token@host/...`` URLs); ``/signed/...`` serves them to requests whose query has
the expected presigned-URL parameters (``X-Amz-Credential``, ``X-Amz-Signature``). Anything else
is refused, so a test passes only if the credentials are really used. A directory is answered
with an HTML page of links, as web servers index them (fsspec lists HTTP "directories" so).
"""

from __future__ import annotations

import base64
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class CredentialServer:
    """Where the server runs and the credentials it wants."""

    root: Path
    port: int
    user: str
    token: str
    signature: str
    credential: str

    def data_url(self, path: str = "") -> str:
        """A URL under ``/data/`` with the credentials as userinfo."""
        return f"http://{self.user}:{self.token}@127.0.0.1:{self.port}/data/{path}"

    def signed_url(self, path: str) -> str:
        """A presigned-style URL under ``/signed/``."""
        query = urllib.parse.urlencode({
            "X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": self.credential,
            "X-Amz-Date": "20260101T000000Z", "X-Amz-Expires": "3600",
            "X-Amz-Signature": self.signature,
        })
        return f"http://127.0.0.1:{self.port}/signed/{path}?{query}"


@contextmanager
def credential_server(root: Path, *, user: str, token: str, signature: str,
                      credential: str) -> Iterator[CredentialServer]:
    """Run the server for the block (a thread of this process)."""
    expected_auth = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _file(self) -> Path | None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.lstrip("/").split("/", 1)
            if len(parts) != 2 or ".." in parts[1].split("/"):
                return None
            kind, rest = parts
            if kind == "data" and self.headers.get("Authorization") == expected_auth:
                return root / urllib.parse.unquote(rest)
            query = dict(urllib.parse.parse_qsl(url.query))
            if (kind == "signed" and query.get("X-Amz-Signature") == signature
                    and query.get("X-Amz-Credential") == credential):
                return root / urllib.parse.unquote(rest)
            return None

        def _answer(self, body: bool) -> None:
            path = self._file()
            if path is None:
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if path.is_dir():
                names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
                page = "".join(f'<a href="{urllib.parse.quote(n)}">{n}</a>\n' for n in names)
                self._send(page.encode(), "text/html", body)
                return
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._send(path.read_bytes(), "application/octet-stream", body)

        def _send(self, data: bytes, kind: str, body: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def log_message(self, *args: object) -> None:
            pass  # quiet: the test process's stderr is not the place

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield CredentialServer(root, server.server_address[1], user, token, signature, credential)
    finally:
        server.shutdown()
        server.server_close()
