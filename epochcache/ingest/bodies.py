"""A remote object's body read as it arrives (a tar shard, whatever its size): each request
through the source's request gate, a deadline on silence rather than on the body's length,
and a start at any byte.

* Every request passes the gate (its slot, the pace after throttling, the daemon's request
  budget) before it is sent, and is counted there when the remote received it (`requests`): a
  shard is as many GETs as the remote answered, no HEAD first.
* A request fails when no byte of its body arrives for ``timeout_s`` (`RemoteTimeout`),
  whatever the body's length: a shard on a slow link completes while bytes keep coming, a
  stalled one fails within ``timeout_s``. The first byte (the answer's head) has the same
  deadline.
* ``offset``: the body from that byte (``Range: bytes=<offset>-``), so that a shard whose read
  failed is resumed after its last whole piece (`layouts.tar`) instead of read again; with
  ``end``, only up to that byte (``Range: bytes=<offset>-<end - 1>``): `read_span`, what
  `Source.read_range` reads a remote range with (a Parquet row group).

Each client has its own body (`open_body`):

* s3fs: one ``GetObject``, its body read as it arrives;
* obstore: one ``get`` with an offset range, its chunks as they arrive (at least
  `OBSTORE_CHUNK_BYTES` each: "silence" there is that long without a chunk), from a store
  whose client has no deadline of its own on the whole request (ours is on silence);
* HTTP: one ``GET`` with ``Range``, through the filesystem's aiohttp session;
* any other asynchronous filesystem (gcsfs, adlfs): ranged reads of `BLOCK_BYTES`, each a
  request that must complete within ``timeout_s`` (they give no body to read as it arrives).

Synchronous filesystems (``memory://``, local files) are read as files by the caller.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

from ..errors import RemoteTimeout, SourceError, SourceUnavailable, Throttled
from .concurrency import Outcome
from .remote import outcome_of, reached_remote, translate_error
from .requests import RequestGate, throttle_delay

#: What one read hands over at most (the memory of a stream beyond its client's buffers).
READ_AHEAD_BYTES = 1024 * 1024
#: The block of filesystems read by ranged requests (fsspec's default block for S3).
BLOCK_BYTES = 8 * 1024 * 1024
#: obstore's chunks are at least this long: a short one costs a call into the loop each.
OBSTORE_CHUNK_BYTES = 64 * 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class ObjectChanged(SourceUnavailable):
    """An object read from an offset is not the size it was when its read began: its bytes
    there are not the ones that followed (read it from its start)."""


class Body(Protocol):
    """One answer's body: ``read`` gives the next bytes as they arrive (b"" at its end)."""

    #: the whole object's size, when the answer said it
    total: int | None
    #: after its end: whether the object goes on past it (a ranged block)
    more: bool

    async def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


#: The body of one object from a byte offset up to an end (None: the object's end), one request.
Opener = Callable[[int, "int | None"], Awaitable[Body]]


def _total(content_range: str | None, length: int | None, offset: int) -> int | None:
    match = _CONTENT_RANGE.match(content_range or "")
    if match and match.group(3) != "*":
        return int(match.group(3))
    if content_range is None and length is not None and offset == 0:
        return length
    return None


class _S3fsBody:
    more = False

    def __init__(self, response: dict[str, Any], offset: int) -> None:
        self._body = response["Body"]
        self.total = _total(response.get("ContentRange"), response.get("ContentLength"), offset)

    async def read(self, size: int) -> bytes:
        data: bytes = await self._body.read(size)
        return data

    def close(self) -> None:
        self._body.close()


class _ObstoreBody:
    more = False

    def __init__(self, result: Any) -> None:
        self.total: int | None = int(result.meta["size"])
        self._chunks = result.stream(min_chunk_size=OBSTORE_CHUNK_BYTES).__aiter__()

    async def read(self, size: int) -> bytes:
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            return b""
        return bytes(chunk)

    def close(self) -> None:
        pass  # the stream is dropped with this body


class _HttpBody:
    more = False

    def __init__(self, response: Any, offset: int) -> None:
        self._response = response
        ranged = response.status == 206
        length = response.headers.get("Content-Length")
        self.total = _total(response.headers.get("Content-Range") if ranged else None,
                            int(length) if length and length.isdigit() else None, 0)
        # A server that ignores Range answers 200 with the whole body: skip what we have.
        self._skip = 0 if ranged else offset

    async def read(self, size: int) -> bytes:
        while self._skip:
            skipped = await self._response.content.read(min(self._skip, READ_AHEAD_BYTES))
            if not skipped:
                return b""
            self._skip -= len(skipped)
        data: bytes = await self._response.content.read(size)
        return data

    def close(self) -> None:
        self._response.close()


class _BlockBody:
    def __init__(self, data: bytes, asked: int = BLOCK_BYTES) -> None:
        self.total: int | None = None
        self._data: bytes | None = data
        self.more = len(data) == asked

    async def read(self, size: int) -> bytes:
        data, self._data = self._data or b"", None
        return data

    def close(self) -> None:
        self._data = None


def open_body(fs: fsspec.AbstractFileSystem, path: str,
              obstore_store: Any = None) -> Opener | None:
    """How to open ``path``'s body from a byte with ``fs`` (or with ``obstore_store``, an
    obstore store of the path's bucket); None for a synchronous filesystem."""
    if obstore_store is not None:
        key = path.split("/", 1)[1] if "/" in path else path

        async def obstore_open(offset: int, end: int | None = None) -> Body:
            import obstore

            options: Any = ({"range": (offset, end)} if end is not None else
                            {"range": {"offset": offset}} if offset else None)
            return _ObstoreBody(await obstore.get_async(obstore_store, key, options=options))

        return obstore_open
    if not isinstance(fs, AsyncFileSystem):
        return None
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if {"s3", "s3a"} & set(protocols) and hasattr(fs, "_call_s3"):
        bucket, key, version = fs.split_path(path)

        async def s3fs_open(offset: int, end: int | None = None) -> Body:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if version:
                kwargs["VersionId"] = version
            if offset or end is not None:
                kwargs["Range"] = _range(offset, end)
            response = await fs._call_s3("get_object", **kwargs)
            return _S3fsBody(response, offset)

        return s3fs_open
    if {"http", "https"} & set(protocols):

        async def http_open(offset: int, end: int | None = None) -> Body:
            session = await fs.set_session()
            kwargs = dict(fs.kwargs)
            headers = dict(kwargs.pop("headers", None) or {})
            if offset or end is not None:
                headers["Range"] = _range(offset, end)
            response = await session.get(fs.encode_url(path),
                                         headers=headers, **kwargs)
            if response.status >= 400:
                response.release()
                if response.status == 404:
                    raise FileNotFoundError(path)
                response.raise_for_status()
            return _HttpBody(response, offset)

        return http_open

    async def block_open(offset: int, end: int | None = None) -> Body:
        stop = offset + BLOCK_BYTES if end is None else min(end, offset + BLOCK_BYTES)
        try:
            data = await fs._cat_file(path, start=offset, end=stop)
        except Exception as exc:
            if offset and _status_416(exc):  # past the end of an object of whole blocks
                return _BlockBody(b"")
            raise
        return _BlockBody(bytes(data), stop - offset)

    return block_open


def _range(offset: int, end: int | None) -> str:
    """The ``Range`` header of the bytes ``[offset, end)`` (HTTP's last byte is inclusive)."""
    return f"bytes={offset}-" if end is None else f"bytes={offset}-{end - 1}"


def _status_416(exc: BaseException) -> bool:
    error: BaseException | None = exc
    while error is not None:
        status = getattr(error, "status", None) or getattr(error, "code", None)
        if status == 416 or "416" in str(error)[:200]:
            return True
        error = error.__cause__
    return False


class RawReader(io.RawIOBase):
    """A readable raw stream whose subclass gives `read`: `readinto` (what
    ``io.BufferedReader`` and tarfile call) copies that read into the caller's buffer."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)


class BodyReader(RawReader):
    """An object's *body* (its bytes as the remote sends them) from ``offset``, read in a
    thread (tarfile's) while its requests run on fsspec's IO loop (see the module docstring).

    Args:
        opener: the body from a byte (`open_body`).
        gate: the source's request gate.
        loop: fsspec's IO loop, where the requests run.
        url: named in errors.
        timeout_s: the longest silence of a request (and its wait for the answer).
        offset: the first byte.
        end: the byte after the last one to read (None: the object's end).
        expect_size: the size the object must have (raises `ObjectChanged` if the first
            answer says another).
        throttled_for_s: how long a throttled request is asked again before it fails.

    Attributes:
        size: the object's size, once an answer said it.
    """

    def __init__(self, opener: Opener, gate: RequestGate, loop: asyncio.AbstractEventLoop, *,
                 url: str, timeout_s: float, offset: int = 0, end: int | None = None,
                 expect_size: int | None = None, throttled_for_s: float = 0.0) -> None:
        super().__init__()
        self._opener, self.gate, self._loop = opener, gate, loop
        self.url, self.timeout_s = url, timeout_s
        self.position = offset
        self.end = end
        self.size: int | None = None
        self.expect_size = expect_size
        self.throttled_for_s = throttled_for_s
        self.requests = 0
        self._body: Body | None = None
        self._started = 0.0
        self._received = 0  # by the request open now
        self._ended = False
        self._buffer = b""
        self._at = 0

    def read(self, size: int | None = -1) -> bytes:
        if self._at >= len(self._buffer):
            if self._ended:
                return b""
            # No deadline on the call: it may wait for a slot of the gate, which other shards
            # hold while they are read; every request within it has its own.
            self._buffer = sync(self._loop, self._fill, timeout=None)
            self._at = 0
        end = len(self._buffer) if size is None or size < 0 else self._at + size
        data = self._buffer[self._at : end]
        self._at += len(data)
        return data

    def close(self) -> None:
        """Close the request still open (its body not read to the end: the archive ended
        before it), on the loop, where the gate wakes the requests waiting for its slot."""
        if self._body is not None and not self.closed:
            self._loop.call_soon_threadsafe(self._end, None)
        super().close()

    # -- on the IO loop ------------------------------------------------------------------------

    async def _fill(self) -> bytes:
        """The next bytes (up to `READ_AHEAD_BYTES`; b"" at the object's end)."""
        chunks: list[bytes] = []
        got = 0
        while got < READ_AHEAD_BYTES and not self._ended:
            if self._body is None:
                if self._at_end():
                    self._ended = True
                    break
                await self._open()
                assert self._body is not None
            body = self._body
            try:
                chunk = await asyncio.wait_for(body.read(READ_AHEAD_BYTES - got), self.timeout_s)
            except BaseException as exc:
                self._end(exc)
                raise self._error(exc) from exc
            if not chunk:
                if self.size is None and body.total is not None:
                    self.size = body.total
                more = (body.more or self.size is not None) and not self._at_end()
                self._end(None)
                self._ended = not more
                continue
            if self.end is not None and self.position + len(chunk) > self.end:
                chunk = chunk[: self.end - self.position]  # a server that ignored the range
            self.position += len(chunk)
            self._received += len(chunk)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    async def _open(self) -> None:
        first = time.monotonic()
        attempt = 0
        while True:
            self._started = await self.gate.enter(retry=self.requests > 0)
            self.requests += 1
            self._received = 0
            try:
                self._body = await asyncio.wait_for(self._opener(self.position, self.end),
                                                    self.timeout_s)
            except BaseException as exc:
                error = self._error(exc)
                self.gate.leave(self._started, outcome_of(error), sent=reached_remote(exc),
                                 retry=self.requests > 1)
                delay = throttle_delay(attempt) if isinstance(error, Throttled) else None
                if delay is None or time.monotonic() + delay - first > self.throttled_for_s:
                    raise error from exc
                attempt += 1
                await asyncio.sleep(delay)
                continue
            total = self._body.total
            if self.expect_size is not None and total is not None and total != self.expect_size:
                self._end(None)
                raise ObjectChanged(f"{self.url}: {total:,} bytes, {self.expect_size:,} when its "
                                    "read began: read again from its start", self.url)
            if self.size is None and total is not None:
                self.size = total
            return

    def _at_end(self) -> bool:
        """Whether every byte asked for has arrived (the object's, or up to ``end``)."""
        return ((self.size is not None and self.position >= self.size)
                or (self.end is not None and self.position >= self.end))

    def _end(self, exc: BaseException | None) -> None:
        """The request open now ended (its body read, or failed with ``exc``)."""
        body, self._body = self._body, None
        if body is None:
            return
        body.close()
        outcome = Outcome.OK if exc is None else outcome_of(self._error(exc))
        self.gate.leave(self._started, outcome, self._received, streamed=True,
                         retry=self.requests > 1)

    def _error(self, exc: BaseException) -> SourceError:
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not isinstance(
                exc, SourceError):
            return RemoteTimeout(
                f"{self.url}: no byte arrived for {self.timeout_s:g}s (at byte "
                f"{self.position:,}); check the endpoint or raise source.timeout_s", self.url)
        return translate_error(exc, self.url)


def read_span(body: BodyReader) -> bytearray:
    """Everything ``body`` (opened with an ``end``) gives, in one buffer filled in place (a
    range is not held twice); its bytes are counted as received by its gate."""
    assert body.end is not None
    buffer = bytearray(body.end - body.position)
    view = memoryview(buffer)
    got = 0
    with body:
        while got < len(buffer):
            count = body.readinto(view[got:])
            if not count:
                break
            got += count
    view.release()
    body.gate.received(got)
    del buffer[got:]
    return buffer
