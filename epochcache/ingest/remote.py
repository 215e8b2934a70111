"""Remote access over fsspec: filesystems with timeouts, error translation, retry, bounded fetches.

Everything that touches a remote goes through this module so that three rules hold everywhere:

* every remote call has a timeout (invariant 6: no silent hangs);
* library exceptions (fsspec, botocore, aiohttp, OSError) become ours at this edge, with the URL in
  the message and the original chained (``raise ... from exc``)::

      TimeoutError, asyncio/FSTimeout, botocore Read/ConnectTimeout   -> RemoteTimeout     (transient)
      FileNotFoundError, PermissionError, HTTP 401/403/404            -> PermanentRemoteError
      connection errors, HTTP 5xx/429, other OSError                  -> SourceUnavailable (transient)

* only transient errors are retried, by :func:`retry`, with exponential backoff, full jitter, bounded
  attempts and an overall deadline. Filesystems are built so that s3fs and botocore do not retry
  underneath us (``max_attempts=1``, ``fs.retries=1``): one owner of retrying keeps the timing honest.

Credentials in ``storage_options`` never reach a log line: use
:func:`epochcache.redact.redact_options` whenever options could be printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

from ..errors import PermanentRemoteError, RemoteTimeout, SourceError, SourceUnavailable
from ..redact import redact_url, scrub_urls

log = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (SourceUnavailable, RemoteTimeout)


# --------------------------------------------------------------------------------------- filesystems


def open_fs(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 5.0,
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Build the filesystem for ``url`` and return it with the path inside it.

    For ``s3://`` the botocore client gets our connect/read timeouts and a single attempt, and s3fs's
    own retry loop is disabled, because :func:`retry` owns retrying.

    Raises:
        SourceUnavailable: the protocol is unknown or its package is not installed.
    """
    options = dict(storage_options or {})
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        config_kwargs = dict(options.pop("config_kwargs", None) or {})
        config_kwargs.setdefault("connect_timeout", connect_timeout_s)
        config_kwargs.setdefault("read_timeout", timeout_s)
        config_kwargs.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config_kwargs
        # s3fs >= 2024 sends a HEAD before every whole-object GET when max_concurrency > 1 (to
        # split big objects into ranged reads): two round trips per sample. Samples are small
        # and many; fetch_many already runs `concurrency` objects at once.
        options.setdefault("max_concurrency", 1)
    elif protocol in ("http", "https") and "client_kwargs" not in options:
        # aiohttp's default total timeout is five minutes; bound every request by ours.
        import aiohttp

        options["client_kwargs"] = {
            "timeout": aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        }
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        shown = redact_url(url)
        raise SourceUnavailable(
            f"{shown}: cannot open this URL ({scrub_urls(str(exc))}); check the protocol and that "
            "its fsspec package (s3fs, gcsfs, adlfs, aiohttp) is installed",
            shown,
        ) from exc
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs retries 5 times with its own sleeps unless told otherwise
    return fs, path


def call(
    fs: fsspec.AbstractFileSystem, method: str, *args: Any, timeout_s: float, **kwargs: Any
) -> Any:
    """Call ``fs.<method>(*args, **kwargs)`` bounded by ``timeout_s`` where the filesystem allows.

    Async filesystems run the coroutine ``_<method>`` on their loop with a hard timeout (it is
    cancelled when it expires; ``FSTimeoutError`` translates to RemoteTimeout). Synchronous ones
    (local, memory) are called directly: they rely on the OS for timeouts.
    """
    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous and hasattr(fs, "_" + method):
        return sync(fs.loop, getattr(fs, "_" + method), *args, timeout=timeout_s, **kwargs)
    return getattr(fs, method)(*args, **kwargs)


def join_url(root: str, relative: str) -> str:
    """Join a root path or URL and a relative key with exactly one slash."""
    if not relative:
        return root
    return root.rstrip("/") + "/" + relative.lstrip("/")


# ------------------------------------------------------------------------------- error translation


def _http_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        value = meta.get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, FutureTimeout)):
        return True
    name = type(exc).__name__
    return name in {
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ServerTimeoutError",
        "FSTimeoutError",
    }


def translate_error(exc: BaseException, url: str) -> SourceError:
    """Map a library exception raised while accessing ``url`` to an epochcache error.

    The result is not raised; callers write ``raise translate_error(exc, url) from exc``.
    """
    if isinstance(exc, SourceError):
        return exc
    url = redact_url(url)
    # Library messages repeat the URL they fetched, credentials and all.
    detail = scrub_urls(f"{type(exc).__name__}: {exc}") if str(exc) else type(exc).__name__
    if _is_timeout(exc):
        return RemoteTimeout(
            f"{url}: timed out ({detail}); check the endpoint or raise timeout_s", url
        )
    status = _http_status(exc)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return PermanentRemoteError(f"{url}: not found ({detail})", url)
    if isinstance(exc, PermissionError) or status in (401, 403):
        return PermanentRemoteError(
            f"{url}: access denied ({detail}); check the credentials in storage_options", url
        )
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return PermanentRemoteError(f"{url}: request rejected with HTTP {status} ({detail})", url)
    return SourceUnavailable(
        f"{url}: remote unavailable ({detail}); check the endpoint, network and URL", url
    )


@contextlib.contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Translate any library exception raised inside the block into our errors (URL in the message)."""
    try:
        yield
    except SourceError:
        raise
    except (OSError, asyncio.TimeoutError, FutureTimeout) as exc:
        raise translate_error(exc, url) from exc
    except Exception as exc:
        # botocore/aiohttp errors do not share a base class with OSError; anything else raised by a
        # remote library is treated like a connection problem (transient) rather than a crash.
        module = type(exc).__module__.split(".")[0]
        if module in {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs"}:
            raise translate_error(exc, url) from exc
        raise


# ------------------------------------------------------------------------------------------- retry


def backoff_delays(
    attempts: int, *, base_s: float = 0.2, max_s: float = 10.0, rng: random.Random | None = None
) -> Iterator[float]:
    """Yield ``attempts - 1`` full-jitter delays: uniform(0, min(max_s, base_s * 2**i))."""
    rng = rng or random.Random()
    for i in range(max(0, attempts - 1)):
        yield rng.uniform(0.0, min(max_s, base_s * (2**i)))


def retry(
    fn: Callable[[], T],
    *,
    url: str = "",
    attempts: int = 5,
    deadline_s: float | None = None,
    base_s: float = 0.2,
    max_s: float = 10.0,
    retry_on: tuple[type[BaseException], ...] = TRANSIENT_ERRORS,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors with backoff and full jitter.

    Library exceptions are translated (:func:`translate_errors`) before they are classified, so
    ``fn`` may call fsspec directly. Permanent errors are raised at once.

    Args:
        fn: the call, without arguments.
        url: named in translated errors and log lines.
        attempts: total calls at most (1 = no retry).
        deadline_s: overall budget in seconds across all attempts and sleeps; the last error is
            raised when the next sleep would cross it.
        base_s: first backoff cap; it doubles per attempt up to ``max_s``.
        max_s: largest backoff.
        retry_on: the (translated) error classes worth retrying.
        sleep: injected for tests.
        rng: injected for tests.

    Raises:
        SourceError: the last translated error once attempts or the deadline run out.
    """
    if attempts < 1:
        raise ValueError(f"retry attempts: must be at least 1, got {attempts}")
    start = time.monotonic()
    delays = backoff_delays(attempts, base_s=base_s, max_s=max_s, rng=rng)
    attempt = 0
    while True:
        attempt += 1
        try:
            with translate_errors(url):
                return fn()
        except retry_on as exc:
            delay = next(delays, None)
            remaining = None if deadline_s is None else deadline_s - (time.monotonic() - start)
            if delay is None or (remaining is not None and remaining <= delay):
                log.debug("%s: giving up after %d attempt(s): %s", url, attempt, exc)
                raise
            log.info("%s: attempt %d failed (%s); retrying in %.2fs", url, attempt, exc, delay)
            sleep(delay)


# ------------------------------------------------------------------------------------ bulk fetches

def fetch_many(
    fs: fsspec.AbstractFileSystem,
    paths: Sequence[str],
    *,
    concurrency: int = 16,
    timeout_s: float = 30.0,
    url_of: Callable[[str], str] | None = None,
    limits: Sequence[int | None] | None = None,
) -> list[bytes | SourceError]:
    """Read whole objects concurrently; return each one's bytes or error, in input order.

    ``limits`` bounds what is read of each object: with a limit ``n`` at most ``n`` bytes are
    downloaded (a ranged read), so a caller that asks for one byte more than it accepts can
    tell an object that is too large without holding all of it.

    Async filesystems (s3fs, http, gcs) run one coroutine per path on fsspec's IO loop, at most
    ``concurrency`` in flight, each bounded by ``timeout_s`` (measured faster than a thread pool of
    ``cat_file``; see the report in remote's tests). Other filesystems use a thread pool. Errors are
    translated per object and never raised: one bad object must not fail its batch.
    """
    url_of = url_of or (lambda p: redact_url(fs.unstrip_protocol(p)))
    if not paths:
        return []
    ends = list(limits) if limits is not None else [None] * len(paths)
    if isinstance(fs, AsyncFileSystem) and getattr(fs, "asynchronous", False) is False:
        raw = _fetch_async(fs, paths, concurrency, timeout_s, ends)
    else:
        raw = _fetch_threads(fs, paths, concurrency, timeout_s, ends)
    raw = [b"" if end is not None and _unsatisfiable(value) else value
           for value, end in zip(raw, ends)]
    return [
        translate_error(value, url_of(path)) if isinstance(value, BaseException) else value
        for path, value in zip(paths, raw)
    ]


def _unsatisfiable(value: bytes | BaseException) -> bool:
    """A ranged read from byte 0 answered 416: the object is empty (no range of it exists)."""
    while isinstance(value, BaseException):
        if _http_status(value) == 416:
            return True
        value = value.__cause__  # type: ignore[assignment]
    return False


def _range(end: int | None) -> dict[str, int]:
    return {} if end is None else {"start": 0, "end": end}


def _fetch_async(
    fs: AsyncFileSystem, paths: Sequence[str], concurrency: int, timeout_s: float,
    ends: Sequence[int | None],
) -> list[bytes | BaseException]:
    async def one(semaphore: asyncio.Semaphore, path: str, end: int | None) -> bytes | BaseException:
        async with semaphore:
            try:
                return bytes(await asyncio.wait_for(fs._cat_file(path, **_range(end)), timeout_s))
            except Exception as exc:  # noqa: BLE001 - returned per object, translated by the caller
                return exc

    async def gather() -> list[bytes | BaseException]:
        semaphore = asyncio.Semaphore(max(1, concurrency))
        return list(await asyncio.gather(*(one(semaphore, p, e) for p, e in zip(paths, ends))))

    # The outer timeout is a safety net only: every object has its own wait_for above.
    waves = -(-len(paths) // max(1, concurrency))
    result: list[bytes | BaseException] = sync(fs.loop, gather, timeout=timeout_s * (waves + 1))
    return result


def _fetch_threads(
    fs: fsspec.AbstractFileSystem, paths: Sequence[str], concurrency: int, timeout_s: float,
    ends: Sequence[int | None],
) -> list[bytes | BaseException]:
    results: list[bytes | BaseException] = []
    workers = max(1, min(concurrency, len(paths)))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(fs.cat_file, p, **_range(e)) for p, e in zip(paths, ends)]
        # A thread cannot be interrupted, so bound the whole call: every wave of `workers` objects
        # gets timeout_s. An object still running at the deadline is reported as timed out.
        waves = -(-len(paths) // workers)
        deadline = time.monotonic() + timeout_s * waves
        for future in futures:
            try:
                results.append(bytes(future.result(max(0.0, deadline - time.monotonic()))))
            except BaseException as exc:  # noqa: BLE001 - returned per object, translated by caller
                results.append(exc)
    finally:
        # Do not wait for a hung thread: its result is already reported as a timeout.
        pool.shutdown(wait=False, cancel_futures=True)
    return results


# ---------------------------------------------------------------------------------- bandwidth limit


class BandwidthLimiter:
    """Token bucket shared by the threads of one process: ``consume(n)`` sleeps to keep the average
    rate at ``bytes_per_s``.

    The bucket holds at most ``burst_s`` seconds of tokens. Sizes are known only after a fetch, so
    the bucket may go into debt, and the next caller waits it off; the long-run rate still holds.

    Args:
        bytes_per_s: the average rate to keep; must be positive.
        burst_s: seconds of traffic that may pass at full speed after an idle period.
    """

    def __init__(self, bytes_per_s: float, *, burst_s: float = 1.0) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth limit: must be positive bytes/s, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self._capacity = self.bytes_per_s * burst_s
        self._tokens = self._capacity
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def consume(self, num_bytes: int, *, sleep: Callable[[float], None] = time.sleep) -> float:
        """Take ``num_bytes`` from the bucket, sleeping while it is in debt; return the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= num_bytes
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            sleep(wait)
        return wait

    def __repr__(self) -> str:
        return f"BandwidthLimiter(bytes_per_s={self.bytes_per_s:.0f})"
