"""Remote access over fsspec: filesystems with timeouts, error translation, retry, bounded fetches.

Everything that touches a remote goes through this module so that three rules hold everywhere:

* every remote call has a timeout (invariant 6: no silent hangs);
* library exceptions (fsspec, botocore, aiohttp, OSError) become ours at this edge, with the URL in
  the message and the original chained (``raise ... from exc``)::

      TimeoutError, asyncio/FSTimeout, botocore Read/ConnectTimeout   -> RemoteTimeout     (transient)
      HTTP 503 (S3 SlowDown), 429, throttling error codes             -> Throttled         (a rate)
      PermissionError, HTTP 401/403, a region (301, 400 naming it),
      a scheme the client refuses                                     -> SourceRefused (every key)
      FileNotFoundError, HTTP 404, a key the client cannot name       -> PermanentRemoteError
      connection errors, other HTTP 5xx, other OSError                -> SourceUnavailable (transient)

* only transient errors are retried, by `retry`, with exponential backoff, full jitter, bounded
  attempts and an overall deadline. Filesystems are built so that s3fs and botocore do not retry
  underneath us (``total_max_attempts=1``, ``fs.retries=1``): one owner of retrying keeps the timing
  honest (and the count of requests true).

Credentials in ``storage_options`` never reach a log line: use
`epochcache.redact.redact_options` whenever options could be printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

from ..errors import (
    PermanentRemoteError,
    RemoteTimeout,
    SourceError,
    SourceRefused,
    SourceUnavailable,
    Throttled,
)
from ..redact import redact_url, scrub_urls
from .concurrency import FixedConcurrency, Outcome
from .requests import RequestGate, backoff_delays, throttle_delay

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
    own retry loop is disabled, because `retry` owns retrying.

    Raises:
        SourceUnavailable: the protocol is unknown or its package is not installed.
    """
    options = dict(storage_options or {})
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        config_kwargs = dict(options.pop("config_kwargs", None) or {})
        config_kwargs.setdefault("connect_timeout", connect_timeout_s)
        config_kwargs.setdefault("read_timeout", timeout_s)
        # total_max_attempts counts the first request; max_attempts counts retries (1 was one
        # retry under us: a 503 asked twice, the second never counted or backed off by us)
        config_kwargs.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config_kwargs
        # s3fs >= 2024 sends a HEAD before every whole-object GET when max_concurrency > 1 (to
        # split big objects into ranged reads): two round trips per sample. Samples are small
        # and many; fetch_many already runs `concurrency` objects at once.
        options.setdefault("max_concurrency", 1)
    elif protocol in ("http", "https") and "client_kwargs" not in options:
        # aiohttp's default total timeout is five minutes. Ours is on silence (sock_read), not
        # on a whole body: a shard slower than timeout_s still completes (`bodies`); whole
        # objects are bounded by timeout_s in fetch_many besides.
        import aiohttp

        options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)}
    try:
        if protocol in ("gs", "gcs") and (options.get("endpoint_url")
                                          or os.environ.get("STORAGE_EMULATOR_HOST")):
            # gcsfs's default class asks a gRPC control plane for each bucket's type (retried
            # for a minute, again on every call while it fails); an endpoint of one's own (an
            # emulator, a private endpoint) serves the JSON API, which the plain class reads.
            from gcsfs.core import GCSFileSystem

            fs, path = GCSFileSystem(**options), GCSFileSystem._strip_protocol(url)
        else:
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


#: Error codes of throttling answers (S3, botocore's, GCS/Azure through their clients).
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled",
                            "TooManyRequests", "RequestLimitExceeded", "ServerBusy",
                            "TooManyRequestsException", "ProvisionedThroughputExceededException"})
#: The status in a message that carries no attribute for it (obstore's errors: "Server
#: returned non-2xx status code: 503 Service Unavailable").
_STATUS_IN_MESSAGE = re.compile(r"status(?: code)?:? (\d{3})\b")


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
    if type(exc).__module__.split(".")[0] == "obstore":
        match = _STATUS_IN_MESSAGE.search(str(exc))
        if match:
            return int(match.group(1))
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from (s3fs raises an OSError from botocore's)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


def _status(exc: BaseException) -> int | None:
    return next((s for e in _causes(exc) if (s := _http_status(e)) is not None), None)


def _is_throttle(exc: BaseException) -> bool:
    for error in _causes(exc):
        if _http_status(error) in (429, 503):
            return True
        response = getattr(error, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") in \
                THROTTLE_CODES:
            return True
    return False


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
    if _is_throttle(exc):
        return Throttled(
            f"{url}: throttled by the remote ({detail}); samplers slow down and ask again "
            "(sampler.max_requests_per_s keeps them below a known limit)", url
        )
    status = _status(exc)
    refused = _refusal(exc, status, url, detail)
    if refused is not None:
        return refused
    if isinstance(exc, FileNotFoundError) or status == 404 or type(exc).__name__ == "NotFoundError":
        return PermanentRemoteError(f"{url}: not found ({detail})", url)
    if isinstance(exc, PermissionError):
        return PermanentRemoteError(f"{url}: permission denied ({detail})", url)
    if isinstance(exc, ValueError) and str(exc).startswith("Could not parse path"):
        return PermanentRemoteError(f"{url}: the client cannot name this key ({detail}); "
                                    "source.client: s3fs reads it", url)
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return PermanentRemoteError(f"{url}: request rejected with HTTP {status} ({detail})", url)
    return SourceUnavailable(
        f"{url}: remote unavailable ({detail}); check the endpoint, network and URL", url
    )


#: Error codes of a request signed for another region than the bucket's.
_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed",
                           "IllegalLocationConstraintException"})


def _refusal(exc: BaseException, status: int | None, url: str,
             detail: str) -> SourceRefused | None:
    """The error as a `SourceRefused` when every key of the source would meet it."""
    codes = {str((getattr(e, "response", None) or {}).get("Error", {}).get("Code", ""))
             for e in _causes(exc) if isinstance(getattr(e, "response", None), dict)}
    # obstore (object_store) reports S3's 301 as a redirect without a Location: BareRedirect
    if status == 301 or codes & _REGION_CODES or "BareRedirect" in str(exc):
        return SourceRefused(
            f"{url}: the bucket is in another region than the requests are signed for "
            f"({detail}); set storage_options.client_kwargs.region_name (or AWS_DEFAULT_REGION,"
            " the profile's region) to the bucket's region, or leave it out so that the bucket"
            " is asked", url)
    if any("scheme is not allowed" in str(e) for e in _causes(exc)):
        return SourceRefused(
            f"{url}: the client refuses the endpoint's scheme ({detail}); check the endpoint "
            "(storage_options.endpoint_url, AWS_ENDPOINT_URL, the profile), or use client: "
            "s3fs", url)
    # (a local file's PermissionError carries no status: that file only, quarantined below)
    if status in (401, 403) or type(exc).__name__ in ("PermissionDeniedError",
                                                        "UnauthenticatedError"):
        return SourceRefused(
            f"{url}: access denied ({detail}); check the credentials (storage_options key and "
            "secret, or AWS_ACCESS_KEY_ID, AWS_PROFILE, the credentials file) and the bucket's"
            " policy", url)
    return None


#: Errors of a request that never left the process: no connection was made (refused, no
#: route, a name that does not resolve, a connect timeout), or the client would not build it.
_UNSENT = frozenset({"ConnectionRefusedError", "ClientConnectorError", "ClientConnectorDNSError",
                     "ClientConnectorCertificateError", "ClientConnectorSSLError",
                     "ConnectionTimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
                     "NoCredentialsError", "ParamValidationError", "InvalidURL"})
#: obstore's errors say so in their text (reqwest's "builder error", hyper's connect error).
_OBSTORE_UNSENT = re.compile(r"HTTP error: builder error|\bkind: Connect\b")


def reached_remote(value: object) -> bool:
    """Whether a request whose result is ``value`` (its bytes, or the error it raised,
    translated or not) reached the remote: what the remote bills and counts is what it received,
    so a request that never left the process is not counted (`requests`)."""
    seen: set[int] = set()
    stack = [value] if isinstance(value, BaseException) else []
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if type(error).__name__ in _UNSENT:
            return False
        if type(error).__module__.split(".")[0] == "obstore" and \
                _OBSTORE_UNSENT.search(str(error)):
            return False
        stack.extend(e for e in (error.__cause__, error.__context__) if e is not None)
    return True


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
        if module in {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs",
                      "obstore"}:
            raise translate_error(exc, url) from exc
        raise


# ------------------------------------------------------------------------------------------- retry


def retry(
    fn: Callable[[], T],
    *,
    url: str = "",
    attempts: int = 5,
    deadline_s: float | None = None,
    base_s: float = 0.2,
    max_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors with backoff and full jitter.

    Library exceptions are translated (`translate_errors`) before they are classified, so
    ``fn`` may call fsspec directly. Permanent errors are raised at once.

    Args:
        fn: the call, without arguments.
        url: named in translated errors and log lines.
        attempts: total calls at most (1 = no retry).
        deadline_s: overall budget in seconds across all attempts and sleeps; the last error is
            raised when the next sleep would cross it.
        base_s: first backoff cap; it doubles per attempt up to ``max_s``.
        max_s: largest backoff.
        sleep: injected for tests.
        rng: injected for tests.

    Raises:
        SourceError: the last translated error once attempts or the deadline run out.
    """
    if attempts < 1:
        raise ValueError(f"retry attempts: must be at least 1, got {attempts}")
    delays = backoff_delays(attempts, base_s=base_s, max_s=max_s, deadline_s=deadline_s, rng=rng)
    attempt = 0
    while True:
        attempt += 1
        try:
            with translate_errors(url):
                return fn()
        except TRANSIENT_ERRORS as exc:
            delay = next(delays, None)
            if delay is None:
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
    gate: RequestGate | None = None,
    throttled_for_s: float = 0.0,
) -> list[bytes | SourceError]:
    """Read whole objects concurrently; return each one's bytes or error, in input order.

    ``limits`` bounds what is read of each object: with a limit ``n`` at most ``n`` bytes are
    downloaded (a ranged read), so a caller that asks for one byte more than it accepts can
    tell an object that is too large without holding all of it.

    Every request passes through ``gate`` (`requests.RequestGate`: the requests in flight,
    shared with the other calls using it, the pace and budget, the counting); without one, at
    most ``concurrency`` are in flight. A throttled request (503 SlowDown, 429) is asked again for
    the same object after a backoff, for up to ``throttled_for_s`` seconds (0: not at all).

    Async filesystems (s3fs, http, gcs) run one coroutine per path on fsspec's IO loop, each
    request bounded by ``timeout_s`` (measured faster than a thread pool of ``cat_file``; see
    the report in remote's tests). Other filesystems use a thread pool. Errors are translated
    per object and never raised: one bad object must not fail its batch.
    """
    url_of = url_of or (lambda p: redact_url(fs.unstrip_protocol(p)))
    if not paths:
        return []
    if gate is None:
        gate = RequestGate(FixedConcurrency(max(1, concurrency)))
    ends = list(limits) if limits is not None else [None] * len(paths)
    fetch = _Fetch(fs, gate, timeout_s, throttled_for_s, url_of)
    if isinstance(fs, AsyncFileSystem) and getattr(fs, "asynchronous", False) is False:
        return fetch.run_async(paths, ends)
    return fetch.run_threads(paths, ends)


def _unsatisfiable(value: BaseException) -> bool:
    """A ranged read from byte 0 answered 416: the object is empty (no range of it exists)."""
    return any(_http_status(error) == 416 for error in _causes(value))


def _range(end: int | None) -> dict[str, int]:
    return {} if end is None else {"start": 0, "end": end}


def outcome_of(error: SourceError) -> Outcome:
    """How a failed request counts for the concurrency control."""
    if isinstance(error, Throttled):
        return Outcome.THROTTLED
    if isinstance(error, RemoteTimeout):
        return Outcome.TIMEOUT
    return Outcome.ERROR


class _Fetch:
    """One `fetch_many` call: each object through the gate, retried while throttled."""

    def __init__(self, fs: fsspec.AbstractFileSystem, gate: RequestGate, timeout_s: float,
                 throttled_for_s: float, url_of: Callable[[str], str]) -> None:
        self.fs, self.gate, self.timeout_s = fs, gate, timeout_s
        self.throttled_for_s, self.url_of = throttled_for_s, url_of

    def _result(self, path: str, end: int | None, value: Any) -> bytes | SourceError:
        if isinstance(value, BaseException):
            if end is not None and _unsatisfiable(value):
                return b""
            return translate_error(value, self.url_of(path))
        return bytes(value)

    def _answered(self, leave: Callable[..., None], started: float, path: str, end: int | None,
                  value: Any, first: float, attempt: int
                  ) -> tuple[bytes | SourceError, float | None]:
        """One request's result, counted at the gate (``leave``), and the backoff before
        asking again for a throttled object (None: do not)."""
        result = self._result(path, end, value)
        outcome, nbytes = ((Outcome.OK, len(result)) if isinstance(result, bytes)
                           else (outcome_of(result), 0))
        leave(started, outcome, nbytes, sent=reached_remote(value), retry=attempt > 0)
        if not isinstance(result, Throttled) or not self.throttled_for_s:
            return result, None
        delay = throttle_delay(attempt)
        return result, None if time.monotonic() + delay - first > self.throttled_for_s else delay

    def run_async(self, paths: Sequence[str], ends: Sequence[int | None]
                  ) -> list[bytes | SourceError]:
        fs, gate, timeout_s = self.fs, self.gate, self.timeout_s

        async def one(path: str, end: int | None) -> bytes | SourceError:
            first = time.monotonic()
            attempt = 0
            while True:
                started = await gate.enter(retry=attempt > 0)
                try:
                    value: Any = await asyncio.wait_for(fs._cat_file(path, **_range(end)),
                                                        timeout_s)
                except Exception as exc:  # noqa: BLE001 - returned per object
                    value = exc
                result, delay = self._answered(gate.leave, started, path, end, value, first,
                                               attempt)
                if delay is None:
                    return result
                attempt += 1
                await asyncio.sleep(delay)

        async def gather() -> list[bytes | SourceError]:
            return list(await asyncio.gather(*(one(p, e) for p, e in zip(paths, ends))))

        # A safety net only: every request has its own timeout above. The gate is shared with
        # the source's other batches, and throttled objects are asked again for a while.
        waves = 2 * -(-len(paths) // max(1, gate.slots))
        limit = timeout_s * (waves + 1) + self.throttled_for_s
        result: list[bytes | SourceError] = sync(fs.loop, gather, timeout=limit)
        return result

    def run_threads(self, paths: Sequence[str], ends: Sequence[int | None]
                    ) -> list[bytes | SourceError]:
        gate, fs = self.gate, self.fs
        results: list[bytes | SourceError] = []
        workers = max(1, min(gate.slots, len(paths)))
        pool = ThreadPoolExecutor(max_workers=workers)

        def one(path: str, end: int | None) -> bytes | SourceError:
            first = time.monotonic()
            attempt = 0
            while True:
                started = gate.enter_sync(retry=attempt > 0)
                try:
                    value: Any = fs.cat_file(path, **_range(end))
                except Exception as exc:  # noqa: BLE001 - returned per object
                    value = exc
                result, delay = self._answered(gate.leave_sync, started, path, end, value,
                                               first, attempt)
                if delay is None:
                    return result
                attempt += 1
                time.sleep(delay)

        try:
            futures = [pool.submit(one, p, e) for p, e in zip(paths, ends)]
            # A thread cannot be interrupted, so bound the whole call: every wave of `workers`
            # objects gets timeout_s. An object still running at the deadline is reported as
            # timed out.
            waves = -(-len(paths) // workers)
            deadline = time.monotonic() + self.timeout_s * waves + self.throttled_for_s
            for path, future in zip(paths, futures):
                try:
                    results.append(future.result(max(0.0, deadline - time.monotonic())))
                except BaseException as exc:  # noqa: BLE001 - returned per object
                    results.append(translate_error(exc, self.url_of(path)))
        finally:
            # Do not wait for a hung thread: its result is already reported as a timeout.
            pool.shutdown(wait=False, cancel_futures=True)
        return results
