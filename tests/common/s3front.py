"""A front for a loopback S3 server with two of AWS's manners the test servers lack: TLS with a
certificate of its own (a private CA, as on-premises object stores have) and buckets that live
in a region.

* **TLS**: given an ``ssl.SSLContext`` (the tests make one with ``trustme``), the front speaks
  HTTPS, so a client reaches the bucket only if it trusts that CA (``AWS_CA_BUNDLE``, a
  profile's ``ca_bundle``, ``client_kwargs.verify``).
* **regions**: ``regions={bucket: region}``. A request signed for another region (the
  ``Credential=.../<region>/s3/aws4_request`` of its Authorization header) is answered as AWS
  answers it: ``301 PermanentRedirect`` with ``x-amz-bucket-region``; every answer about such
  a bucket carries that header, as AWS's HEAD of a bucket does. moto and s3rver accept any
  region.

Everything else is passed to the server as it came (one upstream connection per request),
and the answer back as it came. It imports nothing from epochcache or the tests.
"""

from __future__ import annotations

import http.client
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

_SIGNED_REGION = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-connection"}


class S3Front:
    """Start with `start`, stop with `close`; ``endpoint`` is ``http(s)://localhost:<port>``.

    Args:
        upstream: the server's ``http://host:port``.
        context: a server-side TLS context (None: plain HTTP).
        regions: the region of each bucket that has one.
    """

    def __init__(self, upstream: str, *, context: ssl.SSLContext | None = None,
                 regions: dict[str, str] | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.regions = dict(regions or {})
        self.redirected = 0  # requests answered 301 for their region
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _bucket(self) -> str:
                host = (self.headers.get("Host") or "").split(":")[0]
                if host.count(".") and not host.replace(".", "").isdigit() and \
                        host.split(".", 1)[1] in ("localhost",):
                    return host.split(".", 1)[0]  # virtual-hosted: <bucket>.localhost
                return unquote(urlsplit(self.path).path.lstrip("/").split("/", 1)[0])

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                bucket = self._bucket()
                region = front.regions.get(bucket)
                signed = _SIGNED_REGION.search(self.headers.get("Authorization") or "")
                if region and signed and signed.group(1) != region:
                    front.redirected += 1
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
                               b"PermanentRedirect</Code><Message>The bucket you are attempting"
                               b" to access must be addressed using the specified endpoint."
                               b"</Message><Bucket>" + bucket.encode() + b"</Bucket></Error>")
                    self.send_response(301)
                    self.send_header("x-amz-bucket-region", region)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(0 if self.command == "HEAD"
                                                           else len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(*front.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    upstream.request(self.command, self.path, body=body or None,
                                     headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for name, value in response.getheaders():
                        if name.lower() not in _HOP and name.lower() != "content-length":
                            self.send_header(name, value)
                    if region:
                        self.send_header("x-amz-bucket-region", region)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if context is not None:
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if context is not None else "http"
        self.endpoint = f"{scheme}://localhost:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> S3Front:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
