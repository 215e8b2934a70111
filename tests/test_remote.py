"""Remote access: error translation, retry with backoff against real flaky servers, timeouts."""

from __future__ import annotations

import http.server
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from epochcache.errors import PermanentRemoteError, RemoteTimeout, SourceUnavailable
from epochcache.ingest.remote import (
    call,
    fetch_many,
    open_fs,
    retry,
    translate_error,
    translate_errors,
)
from epochcache.ingest.requests import BandwidthLimiter
from epochcache.redact import redact_options

if TYPE_CHECKING:
    from .conftest import S3Env


class FlakyHandler(http.server.BaseHTTPRequestHandler):
    """``/flaky-N/x`` fails with 500 N times, ``/busy-N/x`` answers 429 (Too Many Requests) N
    times, ``/slow`` sleeps 3 s, ``/missing`` 404, ``/forbidden`` 403."""

    hits: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        self.hits[self.path] += 1
        count = self.hits[self.path]
        if self.path.startswith("/flaky-"):
            failures = int(self.path.split("-")[1].split("/")[0])
            status = 500 if count <= failures else 200
        elif self.path.startswith("/busy-"):
            failures = int(self.path.split("-")[1].split("/")[0])
            status = 429 if count <= failures else 200
        elif self.path == "/slow":
            time.sleep(3)
            status = 200
        else:
            status = {"/missing": 404, "/forbidden": 403}.get(self.path, 200)
        body = b"payload:" + self.path.encode() if status == 200 else b"nope"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:
            pass  # the client gave up on /slow after its timeout: expected

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # the default listen backlog of 5 drops concurrent connects
    daemon_threads = True


@pytest.fixture
def http_server() -> Iterator[str]:
    FlakyHandler.hits = Counter()
    server = _Server(("127.0.0.1", 0), FlakyHandler)  # port 0: the OS picks a free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_retry_recovers_from_transient_http_errors(http_server: str) -> None:
    url = f"{http_server}/flaky-2/a"
    fs, _ = open_fs(url, timeout_s=5)
    data = retry(lambda: call(fs, "cat_file", url, timeout_s=5), url=url, attempts=5, base_s=0.01)
    assert data == b"payload:/flaky-2/a"
    assert FlakyHandler.hits["/flaky-2/a"] == 3


def test_retry_gives_up_after_attempts_with_url(http_server: str) -> None:
    url = f"{http_server}/flaky-99/b"
    fs, _ = open_fs(url, timeout_s=5)
    with pytest.raises(SourceUnavailable) as info:
        retry(lambda: call(fs, "cat_file", url, timeout_s=5), url=url, attempts=3, base_s=0.01)
    assert url in str(info.value) and info.value.url == url
    assert FlakyHandler.hits["/flaky-99/b"] == 3


@pytest.mark.parametrize("path", ["/missing", "/forbidden"])
def test_permanent_errors_are_not_retried(http_server: str, path: str) -> None:
    url = f"{http_server}{path}"
    fs, _ = open_fs(url, timeout_s=5)
    with pytest.raises(PermanentRemoteError, match=path):
        retry(lambda: call(fs, "cat_file", url, timeout_s=5), url=url, attempts=5, base_s=0.01)
    assert FlakyHandler.hits[path] == 1


def test_timeout_raises_remote_timeout_with_url(http_server: str) -> None:
    url = f"{http_server}/slow"
    fs, _ = open_fs(url, timeout_s=5)
    start = time.monotonic()
    with pytest.raises(RemoteTimeout) as info, translate_errors(url):
        call(fs, "cat_file", url, timeout_s=0.5)
    assert time.monotonic() - start < 2.5
    assert url in str(info.value) and isinstance(info.value, TimeoutError)


def test_fetch_many_returns_per_object_results(http_server: str) -> None:
    fs, _ = open_fs(http_server, timeout_s=5)
    urls = [f"{http_server}/ok/{i}" for i in range(20)] + [
        f"{http_server}/missing",
        f"{http_server}/slow",
    ]
    start = time.monotonic()
    results = fetch_many(fs, urls, concurrency=8, timeout_s=0.7)
    assert time.monotonic() - start < 2.5
    assert len(results) == len(urls)
    assert results[:20] == [f"payload:/ok/{i}".encode() for i in range(20)]
    assert isinstance(results[20], PermanentRemoteError)
    assert isinstance(results[21], RemoteTimeout) and "/slow" in str(results[21])


def test_fetch_many_thread_path_for_sync_filesystems(tmp_path: Any) -> None:
    (tmp_path / "a").write_bytes(b"A")
    fs, root = open_fs(f"file://{tmp_path}")
    results = fetch_many(fs, [f"{root}/a", f"{root}/b"], concurrency=2, timeout_s=5)
    assert results[0] == b"A" and isinstance(results[1], PermanentRemoteError)


def test_a_read_that_hangs_does_not_hold_up_later_fetches(tmp_path: Any) -> None:
    """A FIFO without a writer blocks its reader for good, as a dead NFS mount does: it is
    reported as a timeout, and the fetch threads kept between calls are not left stuck behind
    it."""
    import os

    (tmp_path / "a").write_bytes(b"A")
    os.mkfifo(tmp_path / "hang")
    fs, root = open_fs(f"file://{tmp_path}")
    try:
        first = fetch_many(fs, [f"{root}/hang", f"{root}/a"], concurrency=1, timeout_s=0.5)
        assert isinstance(first[0], RemoteTimeout) and "hang" in str(first[0])
        for _ in range(3):
            assert fetch_many(fs, [f"{root}/a"], concurrency=1, timeout_s=5) == [b"A"]
    finally:
        with open(tmp_path / "hang", "wb"):  # lets the hung thread finish
            pass


def _start_moto(port: int) -> Any:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def _stop_moto(server: Any) -> None:
    server.stop()
    server._server.server_close()  # stop() leaves the socket listening; free the port for a restart


def test_s3_outage_then_recovery_is_retried(
    s3: S3Env, unreachable_endpoint: str, s3_options_for: Any
) -> None:
    import s3fs

    s3fs.S3FileSystem(**s3.storage_options).pipe_file(f"{s3.bucket}/obj", b"data")
    port = int(unreachable_endpoint.rsplit(":", 1)[1])
    server = _start_moto(port)  # a second endpoint on moto's shared in-process state
    try:
        fs, _ = open_fs(
            "s3://", s3_options_for(unreachable_endpoint), timeout_s=5, connect_timeout_s=1
        )
        url = f"s3://{s3.bucket}/obj"
        assert call(fs, "cat_file", f"{s3.bucket}/obj", timeout_s=5) == b"data"
        _stop_moto(server)
        with pytest.raises(SourceUnavailable, match=url), translate_errors(url):
            call(fs, "cat_file", f"{s3.bucket}/obj", timeout_s=5)
        restarter = threading.Timer(
            0.8, lambda: globals().__setitem__("_restarted", _start_moto(port))
        )
        restarter.start()
        start = time.monotonic()
        data = retry(
            lambda: call(fs, "cat_file", f"{s3.bucket}/obj", timeout_s=5),
            url=url,
            attempts=20,
            base_s=0.1,
            max_s=0.4,
            deadline_s=15,
        )
        assert data == b"data" and time.monotonic() - start >= 0.5
        restarter.join()
        server = globals().pop("_restarted")
    finally:
        _stop_moto(server)
        s3fs.S3FileSystem.clear_instance_cache()


def test_backoff_has_full_jitter_and_respects_deadline() -> None:
    delays: list[float] = []

    def fail() -> None:
        raise ConnectionRefusedError("refused")

    with pytest.raises(SourceUnavailable):
        retry(
            fail,
            url="x://y",
            attempts=6,
            base_s=0.1,
            max_s=0.5,
            sleep=delays.append,
            rng=random.Random(1),
        )
    assert len(delays) == 5
    assert all(0 <= d <= min(0.5, 0.1 * 2**i) for i, d in enumerate(delays))
    calls = 0

    def slow_fail() -> None:
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        raise TimeoutError()

    start = time.monotonic()
    with pytest.raises(RemoteTimeout):
        retry(slow_fail, url="x://y", attempts=1000, base_s=0.01, max_s=0.02, deadline_s=0.3)
    assert time.monotonic() - start < 0.6 and calls < 20


def test_translate_error_classes() -> None:
    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

    assert isinstance(translate_error(FileNotFoundError("k"), "u"), PermanentRemoteError)
    assert isinstance(translate_error(PermissionError("k"), "u"), PermanentRemoteError)
    assert isinstance(translate_error(TimeoutError(), "u"), RemoteTimeout)
    assert isinstance(translate_error(ConnectionResetError(), "u"), SourceUnavailable)
    assert isinstance(
        translate_error(EndpointConnectionError(endpoint_url="http://h"), "u"), SourceUnavailable
    )
    assert isinstance(
        translate_error(ReadTimeoutError(endpoint_url="http://h"), "u"), RemoteTimeout
    )
    error = translate_error(OSError("boom"), "s3://b/k")
    assert error.url == "s3://b/k" and "s3://b/k" in str(error)
    with pytest.raises(ValueError), translate_errors("u"):  # not a remote library error: untouched
        raise ValueError("mine")


def test_redact_options_masks_nested_credentials() -> None:
    options = {
        "key": "AKIA",
        "secret": "s3cr3t",
        "token": "t",
        "endpoint_url": "http://e",
        "client_kwargs": {"region_name": "r", "aws_session_token": "tok"},
        "anon": False,
    }
    assert redact_options(options) == {
        "key": "***",
        "secret": "***",
        "token": "***",
        "endpoint_url": "http://e",
        "client_kwargs": {"region_name": "r", "aws_session_token": "***"},
        "anon": False,
    }
    assert options["secret"] == "s3cr3t"  # a copy


def test_bandwidth_limiter_keeps_the_average_rate() -> None:
    limiter = BandwidthLimiter(100_000, burst_s=0.1)
    start = time.monotonic()
    threads = [threading.Thread(target=limiter.consume, args=(10_000,)) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # 50 kB at 100 kB/s with a 10 kB burst: about 0.4 s, whether callers are serial or concurrent
    assert 0.35 < time.monotonic() - start < 0.8
    with pytest.raises(ValueError, match="bandwidth"):
        BandwidthLimiter(0)


def test_source_fetch_with_retries_refetches_only_transient_failures(http_server: str) -> None:
    from epochcache.ingest.layouts import SampleRef, SourceSpec, open_source

    source = open_source(SourceSpec(url=http_server, checks=()), concurrency=4)
    refs = [SampleRef("flaky-2/a"), SampleRef("missing"), SampleRef("ok/1"), SampleRef("flaky-9/b")]
    results = source.fetch_with_retries(refs, attempts=4, base_s=0.01, max_s=0.02)
    outcome = {r.key: v for r, v in results}
    assert outcome["flaky-2/a"] == b"payload:/flaky-2/a" and outcome["ok/1"] == b"payload:/ok/1"
    assert isinstance(outcome["missing"], PermanentRemoteError)
    assert isinstance(outcome["flaky-9/b"], SourceUnavailable) and "flaky-9/b" in str(
        outcome["flaky-9/b"]
    )
    assert FlakyHandler.hits["/flaky-2/a"] == 3 and FlakyHandler.hits["/missing"] == 1
    assert FlakyHandler.hits["/ok/1"] == 1 and FlakyHandler.hits["/flaky-9/b"] == 4


def test_a_throttled_object_is_asked_for_again_past_the_retry_attempts(http_server: str) -> None:
    """A 429 is the remote's rate, not the object's fault: the same key is asked for again
    (after a backoff) until it is served, however many attempts that takes, and each answer
    is counted."""
    from epochcache.errors import Throttled
    from epochcache.ingest.layouts import SampleRef, SourceSpec, open_source

    source = open_source(SourceSpec(url=http_server, checks=(), retries=2), concurrency=4)
    refs = [SampleRef("busy-6/a"), SampleRef("ok/2")]
    outcome = {r.key: v for r, v in source.fetch_with_retries(refs, attempts=2, base_s=0.01)}
    assert outcome == {"busy-6/a": b"payload:/busy-6/a", "ok/2": b"payload:/ok/2"}
    assert FlakyHandler.hits["/busy-6/a"] == 7
    counted = source.gate.stats.as_dict()
    assert counted["gets"] == 8 and counted["throttled"] == 6 and counted["retries"] == 6
    # ... within a deadline: past it, the key fails (transiently: fetched again on a later pass)
    source.throttled_for_s = 0.3
    [(_ref, error)] = source.fetch_with_retries([SampleRef("busy-99/b")], attempts=2)
    assert isinstance(error, Throttled) and "busy-99/b" in str(error)
    assert isinstance(error, SourceUnavailable)  # transient: never quarantined


def test_configured_source_wires_sampler_settings(tmp_path: Any) -> None:
    from epochcache.config import parse_config
    from epochcache.ingest.layouts import open_configured_source

    config = parse_config(
        {
            "source": {"url": f"file://{tmp_path}", "checks": ["size"]},
            "cache": {"dir": str(tmp_path / "c"), "capacity": "1GB"},
            "sampler": {"concurrency": 3, "check": False, "bandwidth_limit": "4MB", "processes": 2},
        }
    )
    source = open_configured_source(config)
    assert source.concurrency == 3 and source.checks == frozenset()
    assert source.limiter is not None and source.limiter.bytes_per_s == 2_000_000


def test_an_http_server_throttling_with_429_is_paced_and_asked_again(
        http_server: str, remote_proxy: Any) -> None:
    """The remote-manners proxy answers 429 above 20 requests/s: every object arrives, the
    429s are counted, and the source's control paces its requests."""
    from epochcache.ingest.concurrency import AutoConcurrency
    from epochcache.ingest.layouts import SampleRef, SourceSpec, open_source
    from epochcache.ingest.requests import RequestGate

    proxy = remote_proxy(http_server, latency_s=0.005, rate_per_s=20, burst=2, style="http")
    source = open_source(SourceSpec(url=proxy.endpoint, checks=()))
    source.gate = RequestGate(AutoConcurrency())
    refs = [SampleRef(f"ok/{i}") for i in range(40)]
    results = source.fetch_with_retries(refs)
    assert [data for _, data in results] == [f"payload:/ok/{i}".encode() for i in range(40)]
    assert proxy.stats.throttled > 0 and proxy.manners.status == 429
    counted = source.gate.stats.as_dict()
    assert counted["throttled"] == proxy.stats.throttled and counted["errors"] == 0
    assert source.gate.control.pace is not None  # it slowed down to the server's rate
