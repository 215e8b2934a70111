"""Permanent remote errors fail fast (issue 34, item 3), against moto's server as real daemons.

A key that is gone (404) is quarantined, not asked for again every pass; a refusal of the
whole source (403 from a bucket policy) stops the source with one message naming the URL and
what to do, and ``status`` (and ``--json``), the log and the Prometheus metrics show it failing,
not busy. The same for a source none of whose reads succeeds for a minute (slow: it waits the
minute).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from common.daemonproc import (
    read_cache,
    sampler_states,
    upload,
    wait_cached,
    wait_for,
    wait_running,
    write_config,
)
from conftest import S3Env, free_port

from epochcache import Cache
from epochcache.status import collect_stats, render

pytestmark = pytest.mark.timeout(120)


def _status(cache_dir: Path) -> tuple[dict[str, Any], str]:
    """What ``status --json`` prints (as a dict) and the human table (as text)."""
    from rich.console import Console

    def both(cache: Cache) -> tuple[dict[str, Any], str]:
        stats = collect_stats(cache)
        console = Console(record=True, width=400)
        console.print(render(stats))
        return json.loads(json.dumps(stats, default=str)), console.export_text()

    found = read_cache(cache_dir, both)
    assert found is not None
    return found


def _errors(cache_dir: Path) -> int:
    return sum(h.get("errors", 0) for h in sampler_states(cache_dir).values())


def _deny_reads(s3: S3Env) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-west-2",
                          aws_access_key_id="testing-key-id",
                          aws_secret_access_key="testing-secret-value")
    client.put_bucket_policy(Bucket=s3.bucket, Policy=json.dumps({
        "Version": "2012-10-17", "Statement": [{
            "Effect": "Deny", "Principal": "*", "Action": "s3:GetObject",
            "Resource": f"arn:aws:s3:::{s3.bucket}/*"}]}))


@pytest.mark.parametrize("client", ["obstore"])
def test_access_denied_stops_the_source_and_status_shows_it(
        s3: S3Env, tmp_path: Path, start_daemon: Any, client: str) -> None:
    """The bucket lists, but a policy denies every GET (403): the source stops after one
    batch with a message naming the URL and the credentials to check, instead of retrying
    every key forever; status, --json and /metrics say so. Before: each 403 was logged,
    retried next pass, and the source showed as busy."""
    upload(s3.url, s3.storage_options, "ds", 40, "files")
    _deny_reads(s3)
    cache_dir = tmp_path / "cache"
    port = free_port()
    config = write_config(tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
                          storage_options=s3.storage_options, source={"client": client},
                          sampler={"processes": 1, "concurrency": 4, "batch_size": 8})
    daemon = start_daemon(config, daemon_args=("--metrics-port", str(port)))
    wait_running(daemon, cache_dir)
    wait_for(lambda: "stopped" in daemon.logs(), 60, "the source to stop")
    logs = daemon.logs()
    line = next(line for line in logs.splitlines() if "stopped:" in line)  # one line
    assert "s3://test-bucket/ds" in line and "access denied" in line, line
    assert "check the credentials" in line and "testing-secret-value" not in logs
    wait_for(lambda: _status(cache_dir)[0]["failing"], 30, "status to show the source failing")
    stats, table = _status(cache_dir)
    assert stats["failing"]["source"]["stopped"] is True, stats["failing"]
    assert "access denied" in stats["failing"]["source"]["error"]
    assert "source source" in table and "stopped" in table, table
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'epochcache_source_failing{source="source"} 1.0' in metrics, metrics
    # Stopped: nothing more is asked of the remote (a batch or two were in flight).
    errors = _errors(cache_dir)
    time.sleep(3)
    assert _errors(cache_dir) == errors <= 16
    assert read_cache(cache_dir, lambda c: c.stats()["quarantined"]) == 0  # nothing is lost
    assert daemon.terminate() == 0, daemon.logs()


@pytest.mark.parametrize("client", [pytest.param("s3fs", marks=pytest.mark.slow), "obstore"])
def test_a_listed_key_that_is_gone_is_quarantined_not_retried(
        s3: S3Env, tmp_path: Path, start_daemon: Any, client: str) -> None:
    """Keys listed (here by a manifest) whose objects are gone (404): each is quarantined
    once, with its URL, and never asked for again; the rest is cached. Before: each was
    retried on every pass, for ever."""
    import s3fs

    keys = upload(s3.url, s3.storage_options, "ds", 30, "files")
    gone = [f"gone-{i}.npy" for i in range(4)]
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe_file(f"{s3.bucket}/ds/keys.txt", "\n".join(keys + gone).encode())
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
                          storage_options=s3.storage_options,
                          source={"client": client, "manifest": s3.url("ds/keys.txt")},
                          sampler={"processes": 1, "concurrency": 4, "batch_size": 8})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, len(keys))

    def quarantined() -> list[dict[str, Any]] | None:
        rows = read_cache(cache_dir, lambda c: c.quarantined()) or []
        return rows if {row["key"] for row in rows} >= set(gone) else None

    rows = wait_for(quarantined, 30, "the gone keys to be quarantined")
    for row in rows:
        assert "not found" in row["reason"] and f"s3://test-bucket/ds/{row['key']}" in row["url"]
    # the health document is saved after the commit that follows the quarantine
    errors = wait_for(lambda: _errors(cache_dir) >= len(gone) and _errors(cache_dir), 10,
                      "the failed fetches to be counted")
    assert errors == len(gone)
    time.sleep(2.5)  # the idle feed would retry failed keys: these are not failed but gone
    assert _errors(cache_dir) == errors
    assert daemon.terminate() == 0, daemon.logs()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_source_whose_every_read_fails_for_a_minute_shows_as_failing(
        tmp_path: Path, start_daemon: Any) -> None:
    """The endpoint goes away mid-fill (transient errors, retried): after a minute of nothing
    read, status, the log and /metrics show the source failing, not busy; when the endpoint
    is back, reads go on and it is no longer failing."""
    from common.daemonproc import cache_len
    from common.s3server import S3ServerProcess
    from conftest import s3_options

    objects = tmp_path / "objects"
    (objects / "outage-bucket" / "ds").mkdir(parents=True)
    for i in range(300):
        (objects / "outage-bucket" / "ds" / f"sample-{i:06d}.npy").write_bytes(bytes([i % 256]) * 4096)
    server = S3ServerProcess(free_port(), objects, tmp_path / "s3server.log")
    server.start()
    try:
        cache_dir = tmp_path / "cache"
        port = free_port()
        config = write_config(
            tmp_path / "cfg.yaml", url="s3://outage-bucket/ds", cache_dir=cache_dir,
            storage_options=s3_options(server.endpoint),
            source={"timeout_s": 2, "connect_timeout_s": 1, "retries": 2, "pattern": "*.npy",
                    "checks": []},  # the bytes are not .npy files
            sampler={"processes": 1, "bandwidth_limit": 100_000})
        daemon = start_daemon(config, daemon_args=("--metrics-port", str(port)))
        wait_running(daemon, cache_dir)
        wait_cached(daemon, cache_dir, 20)
        server.kill()
        wait_for(lambda: _status(cache_dir)[0]["failing"], 150, "status to show it failing")
        stats, table = _status(cache_dir)
        failing = stats["failing"]["source"]
        assert failing["stopped"] is False and failing["for_s"] >= 60, failing
        assert "outage-bucket" in failing["error"] and "failing:" in table, table
        # said by the sampler after its next batch (a source down retries at most a minute
        # apart)
        wait_for(lambda: "is failing: no read succeeded" in daemon.logs(), 90, "the log line")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert 'epochcache_source_failing{source="source"} 1.0' in response.read().decode()
        server.start()
        before = cache_len(cache_dir)
        wait_for(lambda: cache_len(cache_dir) > before and not _status(cache_dir)[0]["failing"],
                 120, "reads to go on and the source to be no longer failing")
        assert daemon.terminate() == 0, daemon.logs()
    finally:
        server.kill()
