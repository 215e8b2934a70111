"""An object store with real manners: a reverse proxy on 127.0.0.1 that puts first-byte latency,
a per-connection bandwidth cap and a request-rate limit in front of a loopback server.

The servers the suite uses (moto's S3 server, the HTTP file servers) answer in microseconds and
never refuse; a real bucket answers a GET in 10-50 ms, serves each connection at 50-100 MB/s
and answers ``503 SlowDown`` above a request rate. This proxy gives the loopback servers those
manners, so that tests and benchmarks see them:

* **latency**: every request waits ``latency_s`` before it is passed on (first-byte latency);
* **bandwidth**: each connection's response bodies are paced at ``bandwidth_bytes_per_s``;
* **throttling**: requests above ``rate_per_s`` (a token bucket holding ``burst`` requests)
  are answered at once, never passed on: S3's ``503 Slow Down`` with its XML error
  (``style="s3"``), or ``429 Too Many Requests`` (``style="http"``; ``throttle_status`` picks
  another). Only object reads are throttled by default (``GET``/``HEAD`` of a key, not bucket
  listings), as S3's limits are per prefix and per kind of request.

It speaks just enough HTTP/1.1 for that (keep-alive, Content-Length and chunked bodies, HEAD),
one upstream connection per client connection. It imports nothing from epochcache or the
tests, so the benchmarks start it as a process by path, and tests import it
(``common.remoteproxy``) to run it in a thread of their own::

    python tests/common/remoteproxy.py --target 127.0.0.1:PORT --latency-ms 20 \\
        --bandwidth 100MB --rate 500 [--burst 50] [--style s3|http]   # prints "PORT <n>"

* **a stall**: the next ``stall_count`` object bodies stop after ``stall_after_bytes`` bytes for
  ``stall_s`` seconds (a remote that hangs mid-body), then go on.

Counters (``stats()``; ``GET /__proxy__/stats`` as JSON in script mode): requests passed and
throttled, requests received by kind (``GET``, ``HEAD``, ``LIST``, ...: what a bucket would bill),
bytes sent, requests in flight and the most seen at once, and each object request's path and
``Range`` (``seen``). ``POST
/__proxy__/config?rate=...&latency_ms=...&bandwidth=...`` changes the manners while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

_CHUNK = 64 * 1024
_REASONS = {429: "Too Many Requests", 503: "Slow Down"}


@dataclass
class Manners:
    """How the proxied store behaves (mutable while it runs).

    Attributes:
        latency_s: added before each request is passed on.
        bandwidth_bytes_per_s: each connection's response bodies at most this fast (None: no cap).
        rate_per_s: object requests per second passed on (None: no limit).
        burst: requests the token bucket holds (default: a tenth of a second's, at least 1).
        style: ``s3`` (503 with S3's SlowDown XML) or ``http`` (429).
        throttle_status: the status of a throttled answer (default by style).
        throttle_lists: throttle bucket-level requests (listings) too.
    """

    latency_s: float = 0.02
    bandwidth_bytes_per_s: float | None = None
    rate_per_s: float | None = None
    burst: float | None = None
    style: str = "s3"
    throttle_status: int | None = None
    throttle_lists: bool = False
    stall_after_bytes: int | None = None
    stall_s: float = 0.0
    stall_count: int = 1

    @property
    def status(self) -> int:
        return self.throttle_status or (503 if self.style == "s3" else 429)


@dataclass
class ProxyStats:
    """What the proxy saw."""

    requests: int = 0  # passed on to the server
    throttled: int = 0  # answered with a throttle status
    bytes_sent: int = 0  # response body bytes relayed to clients
    in_flight: int = 0
    max_in_flight: int = 0
    connections: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    #: requests received (passed on or throttled) by kind: GET and HEAD of an object, LIST
    #: (a GET of a bucket or a directory), or the method
    by_kind: dict[str, int] = field(default_factory=dict)
    #: ``(kind, path, Range header)`` of every request received, in order
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    stalled: int = 0  # bodies stalled
    #: when each object request arrived (time.monotonic()), passed on or throttled
    arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()
                if k not in ("arrivals", "seen")}


class _Bucket:
    """A token bucket (GCRA form: one 'theoretical arrival time')."""

    def __init__(self) -> None:
        self._tat = 0.0

    def allow(self, rate: float, burst: float) -> bool:
        now = time.monotonic()
        interval = 1.0 / rate
        tat = max(self._tat, now)
        if tat - now > burst * interval - interval:  # the bucket is empty
            return False
        self._tat = tat + interval
        return True


class RemoteProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` with :class:`Manners`.

    In-process use runs its event loop in a thread (:meth:`start`, :meth:`close`, or ``with``).
    """

    def __init__(self, target_host: str, target_port: int, manners: Manners | None = None,
                 **kwargs: Any) -> None:
        self.target = (target_host, target_port)
        self.manners = manners or Manners(**kwargs)
        self.stats = ProxyStats()
        self.port = 0
        self._bucket = _Bucket()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- running ----------------------------------------------------------------------------

    async def serve(self, port: int = 0) -> asyncio.base_events.Server:
        """Listen (in the running loop); returns the server."""
        self._server = await asyncio.start_server(self._client, "127.0.0.1", port, backlog=1024,
                                                  limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self._server

    def start(self) -> RemoteProxy:
        """Serve from a thread of this process."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            loop.run_until_complete(self.serve())
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="remote-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the proxy did not start")
        return self

    def close(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None:
            return

        async def stop() -> None:
            server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> RemoteProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one client connection --------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                method, target, headers = _parse_head(head)
                body = await _read_body(reader, headers)
                if target.startswith("/__proxy__/"):
                    self._control(method, target, writer)
                    await writer.drain()
                    continue
                if method in ("GET", "HEAD") and not self._is_list(target):
                    self.stats.arrivals.append(time.monotonic())
                kind = self._kind(method, target)
                self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
                self.stats.seen.append((kind, urlsplit(target).path, headers.get("range", "")))
                if self._throttle(method, target):
                    self.stats.throttled += 1
                    writer.write(self._throttle_answer(method))
                    await writer.drain()
                    continue
                self.stats.requests += 1
                self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
                self.stats.in_flight += 1
                self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
                try:
                    if self.manners.latency_s > 0:
                        await asyncio.sleep(self.manners.latency_s)
                    if upstream is None:
                        upstream = await asyncio.open_connection(*self.target, limit=1 << 20)
                    upstream[1].write(head + body)
                    keep, html = await self._relay_response(method, upstream[0], writer,
                                                            stall=kind == "GET")
                finally:
                    self.stats.in_flight -= 1
                if html and kind == "GET" and self.manners.style == "http":
                    self._relabel(kind, "LIST")  # an index page: a directory's listing
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.CancelledError):
            return  # the client went away, or the proxy is closing
        finally:
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    w.close()

    def _throttle(self, method: str, target: str) -> bool:
        manners = self.manners
        if not manners.rate_per_s:
            return False
        if method not in ("GET", "HEAD"):
            return False
        if self._is_list(target) and not manners.throttle_lists:
            return False
        burst = manners.burst if manners.burst else max(1.0, manners.rate_per_s / 10)
        return not self._bucket.allow(manners.rate_per_s, burst)

    def _relabel(self, kind: str, new: str) -> None:
        by_kind = self.stats.by_kind
        by_kind[kind] -= 1
        by_kind[new] = by_kind.get(new, 0) + 1
        last = self.stats.seen[-1]
        self.stats.seen[-1] = (new, last[1], last[2])

    def _kind(self, method: str, target: str) -> str:
        if method == "GET" and self._is_list(target):
            return "LIST"
        return method

    def _is_list(self, target: str) -> bool:
        """A listing: of a bucket (s3: no key in the path), of a directory (http: ends in /;
        a directory named without it is known by its answer, an HTML page: see _client)."""
        path = urlsplit(target).path
        return "/" not in path.strip("/") if self.manners.style == "s3" else path.endswith("/")

    def _throttle_answer(self, method: str) -> bytes:
        status = self.manners.status
        body = b""
        if self.manners.style == "s3" and status == 503:
            request_id = uuid.uuid4().hex[:16].upper()
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
                    "<Message>Please reduce your request rate.</Message>"
                    f"<RequestId>{request_id}</RequestId><HostId>proxy</HostId></Error>").encode()
        reason = _REASONS.get(status, "Throttled")
        extra = "Retry-After: 1\r\n" if status == 429 else ""
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: keep-alive\r\n\r\n")
        return head.encode() + (b"" if method == "HEAD" else body)

    async def _relay_response(self, method: str, upstream: asyncio.StreamReader,
                              writer: asyncio.StreamWriter, stall: bool = False
                              ) -> tuple[bool, bool]:
        """Pass one response on, its body paced (``stall``: an object's body, which may
        stall); ``(keep the connection, the answer was an HTML page)``."""
        head = await upstream.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        _, _, headers = _parse_head(head, response=True)
        html = headers.get("content-type", "").startswith("text/html")
        writer.write(head)
        pace = _Pace(self.manners.bandwidth_bytes_per_s)
        manners = self.manners
        if stall and not html and manners.stall_after_bytes is not None and manners.stall_count > 0 \
                and status in (200, 206):
            manners.stall_count -= 1
            pace.stall_at, pace.stall_s = manners.stall_after_bytes, manners.stall_s
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            await writer.drain()
            return True, html
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await upstream.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                chunk = await upstream.readexactly(size + 2) if size else b""
                writer.write(size_line + chunk)
                await self._paced(writer, pace, size)
                if not size:
                    writer.write(await upstream.readuntil(b"\r\n"))
                    await writer.drain()
                    return True, html
        length = headers.get("content-length")
        if length is None:  # until the server closes
            while chunk := await upstream.read(_CHUNK):
                writer.write(chunk)
                await self._paced(writer, pace, len(chunk))
            return False, html
        left = int(length)
        while left:
            chunk = await upstream.read(min(left, _CHUNK))
            if not chunk:
                return False, html
            left -= len(chunk)
            writer.write(chunk)
            await self._paced(writer, pace, len(chunk))
        await writer.drain()
        return headers.get("connection", "").lower() != "close", html

    async def _paced(self, writer: asyncio.StreamWriter, pace: _Pace, nbytes: int) -> None:
        self.stats.bytes_sent += nbytes
        await writer.drain()
        wait = pace.sent(nbytes)
        if pace.stall_at is not None and pace.total >= pace.stall_at:
            pace.stall_at = None
            self.stats.stalled += 1
            wait += pace.stall_s
        if wait > 0:
            await asyncio.sleep(wait)

    def _control(self, method: str, target: str, writer: asyncio.StreamWriter) -> None:
        url = urlsplit(target)
        if url.path == "/__proxy__/config" and method == "POST":
            for name, value in parse_qsl(url.query):
                if name == "rate":
                    self.manners.rate_per_s = float(value) or None
                elif name == "burst":
                    self.manners.burst = float(value) or None
                elif name == "latency_ms":
                    self.manners.latency_s = float(value) / 1000
                elif name == "bandwidth":
                    self.manners.bandwidth_bytes_per_s = parse_size(value) or None
        body = json.dumps({"stats": self.stats.as_dict(),
                           "manners": dict(self.manners.__dict__)}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Pace:
    """Paces one response body at a byte rate: the seconds to wait after each chunk."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self.start = time.monotonic()
        self.total = 0
        self.stall_at: int | None = None  # stall once this many bytes were sent
        self.stall_s = 0.0

    def sent(self, nbytes: int) -> float:
        self.total += nbytes
        if not self.rate:
            return 0.0
        return self.start + self.total / self.rate - time.monotonic()


def _parse_head(head: bytes, response: bool = False) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if response:
        return "", "", headers
    return first[0], first[1] if len(first) > 1 else "/", headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            parts.append(size_line + await reader.readexactly(size + 2))
            if not size:
                break
        return b"".join(parts)
    length = int(headers.get("content-length", "0") or 0)
    return await reader.readexactly(length) if length else b""


def parse_size(text: str) -> float:
    """``100MB``, ``64MiB``, ``1e8`` -> bytes."""
    text = text.strip()
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1e3, "mb": 1e6, "gb": 1e9}
    for unit, scale in units.items():
        if text.lower().endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="host:port of the server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth", default="", help="per connection, e.g. 100MB (/s)")
    parser.add_argument("--rate", type=float, default=0.0, help="object requests/s (0: none)")
    parser.add_argument("--burst", type=float, default=0.0)
    parser.add_argument("--style", choices=("s3", "http"), default="s3")
    parser.add_argument("--status", type=int, default=0, help="throttle status (429, 503)")
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    manners = Manners(latency_s=args.latency_ms / 1000,
                      bandwidth_bytes_per_s=parse_size(args.bandwidth) if args.bandwidth else None,
                      rate_per_s=args.rate or None, burst=args.burst or None, style=args.style,
                      throttle_status=args.status or None)
    proxy = RemoteProxy(host, int(port), manners)

    async def run() -> None:
        await proxy.serve(args.port)
        print(f"PORT {proxy.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
