"""Requests as the remote sees them: counted by kind, charged to the budget, and bounded by a
deadline on silence, not on a body's length.

A user's bucket bills every request and throttles above a rate, so what ``status`` counts and
what ``sampler.max_requests_per_s`` charges must be what the remote receives. A counting proxy
(``common.remoteproxy``) stands between the sources and the servers (moto's S3, a static HTTP
server that answers ``Range``) and says what arrived; each transport (s3fs, obstore, HTTP)
must count the same. A shard read through a slow link must complete as long as bytes keep
coming, a stalled one must fail after ``timeout_s`` of silence, and the retry must go on from
the last sample handed over (a ``Range`` from the byte after it), not from the shard's start.
"""

from __future__ import annotations

import io
import socket
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import s3fs
from common.rangeserver import range_server

from epochcache.ingest.concurrency import FixedConcurrency
from epochcache.ingest.layouts import SourceSpec, open_source
from epochcache.ingest.requests import RequestBudget, RequestGate

if TYPE_CHECKING:
    from conftest import S3Env

pytestmark = pytest.mark.timeout(120)

MEMBER_BYTES = 256 * 1024


def shard_bytes(name: str, samples: int) -> bytes:
    """A WebDataset shard of ``samples`` samples of `MEMBER_BYTES` (a ``.bin`` and a
    ``.cls`` each), every byte of a sample telling its number."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for i in range(samples):
            for ext, data in (("bin", bytes([i % 251]) * MEMBER_BYTES), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"{name}-{i:04d}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class CountingBudget(RequestBudget):
    """The real shared budget, also counting the requests charged to it."""

    charged = 0

    def reserve(self) -> float:
        self.charged += 1
        return super().reserve()


class Transport:
    """Shards behind a counting proxy, reached by one client: ``url``, ``options``."""

    def __init__(self, url: str, options: dict[str, Any], client: str, proxy: Any) -> None:
        self.url, self.options, self.client, self.proxy = url, options, client, proxy

    def source(self, **fields: Any) -> Any:
        spec = SourceSpec(url=self.url, layout="tar", pattern="*.tar",
                          storage_options=self.options, client=self.client, checks=(),
                          **fields)
        return open_source(spec, concurrency=4)


@pytest.fixture(params=["s3fs", "obstore", "http"])
def transport(request: pytest.FixtureRequest, tmp_path: Path,
              remote_proxy: Any) -> Iterator[Any]:
    """``transport(shards, **manners)``: the shards (name -> bytes) on a server, behind a
    proxy with those manners, for the parametrized client."""
    kind = request.param
    if kind == "http":
        root = tmp_path / "www" / "shards"
        root.mkdir(parents=True)
        with range_server(tmp_path / "www") as endpoint:
            def start_http(shards: dict[str, bytes], **manners: Any) -> Transport:
                for name, data in shards.items():
                    (root / name).write_bytes(data)
                proxy = remote_proxy(endpoint, latency_s=0.0, style="http", **manners)
                return Transport(f"{proxy.endpoint}/shards/", {}, "auto", proxy)

            yield start_http
        return
    s3: S3Env = request.getfixturevalue("s3")
    fs = s3fs.S3FileSystem(**s3.storage_options)

    def start_s3(shards: dict[str, bytes], **manners: Any) -> Transport:
        for name, data in shards.items():
            fs.pipe_file(f"{s3.bucket}/shards/{name}", data)
        proxy = remote_proxy(s3.endpoint_url, latency_s=0.0, **manners)
        options = {**s3.storage_options, "endpoint_url": proxy.endpoint}
        return Transport(s3.url("shards"), options, kind, proxy)

    yield start_s3


def _samples(pieces: list[Any]) -> Counter[str]:
    return Counter(ref.key for piece in pieces for ref, _ in piece.results)


def test_every_request_a_shard_costs_is_counted_by_kind_and_charged(
        transport: Any, tmp_path: Path) -> None:
    """Shards larger than a client's read-ahead block (s3fs read 8 MiB blocks after a HEAD:
    four requests counted as one GET): what the source counts, by kind, is what arrived."""
    shards = {"a.tar": shard_bytes("a", 40), "b.tar": shard_bytes("b", 36)}
    remote = transport(shards)
    source = remote.source()
    budget = CountingBudget(tmp_path / "budget", 10_000)
    source.gate = RequestGate(FixedConcurrency(4), budget=budget)
    refs = source.list_keys()
    pieces: list[Any] = []
    results = source.fetch_with_retries(refs, on_piece=pieces.append, piece_bytes=1 << 20)
    assert _samples(pieces) == Counter([f"a.tar/a-{i:04d}" for i in range(40)]
                                      + [f"b.tar/b-{i:04d}" for i in range(36)])
    assert not [p for _, p in results if isinstance(p, BaseException)]
    seen = remote.proxy.stats.by_kind
    stats = source.gate.stats.as_dict()
    assert (stats["gets"], stats.get("heads"), stats["lists"]) == (
        seen.get("GET", 0), seen.get("HEAD", 0), seen.get("LIST", 0)), remote.proxy.stats.seen
    assert stats["gets"] >= 2 and stats["lists"] >= 1
    # every object request passed the budget before it was sent (listing is the daemon's)
    assert budget.charged == stats["gets"] + stats.get("heads", 0)
    # (what follows an archive's end marker is not read without a size check)
    assert stats["bytes"] >= sum(len(data) - 10240 for data in shards.values())


@pytest.fixture
def refusing_endpoint() -> Iterator[str]:
    """An endpoint whose port is held (bound, never listening: connections are refused), so
    that no server another test starts meanwhile can take it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


def test_a_request_that_never_reached_the_remote_is_not_counted(
        transport: Any, refusing_endpoint: str) -> None:
    """Nothing listens at the endpoint: the reads fail, and no GET is counted for them."""
    unreachable_endpoint = refusing_endpoint
    remote = transport({"a.tar": shard_bytes("a", 2)})
    refs = remote.source().list_keys()
    if remote.client == "auto":  # http: the URL names the endpoint
        url, options = f"{unreachable_endpoint}/shards/", {}
    else:
        url, options = remote.url, {**remote.options, "endpoint_url": unreachable_endpoint}
    source = Transport(url, options, remote.client, None).source(timeout_s=2,
                                                                  connect_timeout_s=1)
    [(ref, error)] = source.fetch_with_retries(refs, attempts=2, base_s=0.01)
    assert isinstance(error, BaseException), error
    stats = source.gate.stats.as_dict()
    assert stats["gets"] == 0 and stats.get("heads", 0) == 0 and stats["errors"] >= 1, (
        stats, error)


# s3fs slow (7 s): obstore is the default client where installed; the counts run both
@pytest.mark.parametrize("transport", [pytest.param("s3fs", marks=pytest.mark.slow), "obstore",
                                       "http"], indirect=True)
def test_a_slow_shard_completes_and_a_stalled_one_resumes_after_its_last_piece(
        transport: Any) -> None:
    """A link of 2.5 MiB/s brings a 6 MiB shard in more than ``timeout_s`` (2 s): bytes keep
    coming, so it completes. Half-way, the remote stops sending for a minute: after 2 s of
    silence the request fails, and the retry asks for the shard from the byte after the last
    sample handed over, so every sample arrives once."""
    data = shard_bytes("s", 24)
    remote = transport({"s.tar": data}, bandwidth_bytes_per_s=2.5 * 2**20,
                       stall_after_bytes=3 * 2**20, stall_s=60.0)
    source = remote.source(timeout_s=2, connect_timeout_s=1, retries=4)
    refs = source.list_keys()
    pieces: list[Any] = []
    started = time.monotonic()
    results = source.fetch_with_retries(refs, on_piece=pieces.append, piece_bytes=512 * 1024,
                                        base_s=0.05)
    elapsed = time.monotonic() - started
    assert not [p for _, p in results if isinstance(p, BaseException)], results[-1]
    handed = _samples(pieces)
    assert handed == Counter(f"s.tar/s-{i:04d}" for i in range(24))  # each once: resumed
    assert remote.proxy.stats.stalled == 1
    assert elapsed < 40, elapsed  # the stall (60 s) was cut by the 2 s of silence
    gets = [(path, rng) for kind, path, rng in remote.proxy.stats.seen if kind == "GET"]
    assert len(gets) == 2, remote.proxy.stats.seen
    # the second asks from the end of a sample handed over, past the shard's start
    resumed = int(gets[1][1].removeprefix("bytes=").split("-")[0])
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        ends = {m.offset_data + -(-m.size // 512) * 512 for m in archive.getmembers()
                if m.name.endswith(".cls")}
    assert resumed in ends and 0 < resumed < 3 * 2**20, (resumed, gets)
    assert source.gate.stats["gets"] == 2


def test_a_manifest_read_is_counted_as_the_requests_the_remote_received(
        transport: Any) -> None:
    remote = transport({"a.tar": shard_bytes("a", 2), "list.txt": b"a.tar\n"})
    source = remote.source(manifest="list.txt")
    [ref] = source.list_keys()
    assert ref.key == "a.tar"
    seen = remote.proxy.stats.by_kind
    stats = source.gate.stats.as_dict()
    assert (stats["gets"], stats.get("heads", 0), stats["lists"]) == (
        seen.get("GET", 0), seen.get("HEAD", 0), seen.get("LIST", 0)), remote.proxy.stats.seen
    assert stats["gets"] == 1
