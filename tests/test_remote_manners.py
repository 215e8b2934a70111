"""The remote as it really is: an object store 20-100 ms away that throttles with 503 SlowDown.

Moto's server through ``common.remoteproxy`` (first-byte latency, request-rate limit) is what
the daemon fills from here, as a user's bucket would be. The user's events:

* the bucket throttles well below what the samplers ask: the cache still fills, no sample is
  quarantined or failed, the 503s are counted, the samplers pace themselves below their cap;
* the bucket is far away: ``concurrency: auto`` raises the requests in flight above its start;
* of two ``sources:``, one throttles: the other is not held to its pace;
* ``status``, ``status --json`` and the Prometheus metrics say what the requests cost.

Internals: per-source counters are read with ``plumbing.source_stats``, what ``status`` shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from common.daemonproc import (
    REPO,
    cache_len,
    read_cache,
    sampler_states,
    upload,
    wait_for,
    wait_running,
    write_config,
)
from conftest import free_port

from epochcache.ingest.concurrency import START_LIMIT
from epochcache.store.plumbing import source_stats

if TYPE_CHECKING:
    from conftest import S3Env

pytestmark = pytest.mark.timeout(240)


def status_json(cache_dir: Path) -> dict[str, Any]:
    """``epochcache status --json`` as the user runs it."""
    out = subprocess.run([sys.executable, "-m", "epochcache", "status", "--json", str(cache_dir)],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def fetch_health(cache_dir: Path) -> tuple[int, int, int]:
    """(failed fetches, quarantined, fetched) over the samplers."""
    states = sampler_states(cache_dir).values()
    return (sum(s["errors"] for s in states), sum(s["quarantined"] for s in states),
            sum(s["fetched"] for s in states))


# s3fs slow: obstore is the default client where installed (the S3 contract runs both)
@pytest.mark.parametrize("client", [pytest.param("s3fs", marks=pytest.mark.slow), "obstore"])
def test_a_throttling_bucket_still_fills_the_cache_with_503s_counted(
        s3: S3Env, tmp_path: Path, start_daemon: Any, remote_proxy: Any, client: str) -> None:
    keys = upload(s3.url, s3.storage_options, "train", 200, "files")
    # 30 GETs/s, a burst of 3: far below what one sampler asks at 20 ms (400/s at its start)
    proxy = remote_proxy(s3.endpoint_url, latency_s=0.02, rate_per_s=30, burst=3)
    cache_dir = tmp_path / "cache"
    port = free_port()
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("train"), cache_dir=cache_dir,
        storage_options={**s3.storage_options, "endpoint_url": proxy.endpoint},
        source={"client": client},
        sampler={"processes": 1, "concurrency": "auto", "batch_size": 64})
    daemon = start_daemon(config, daemon_args=("--metrics-port", str(port)))
    wait_running(daemon, cache_dir)
    # while it fills: throttled, counted, and paced well below the cap of its concurrency
    live = wait_for(lambda: (r := status_json(cache_dir)["requests"].get("source"))
                    and r["throttled"] > 0 and r["pace"] > 0 and r, 120, "throttling counted")
    assert 0 < live["concurrency"] < 1024 and live["pace"] < 200
    wait_for(lambda: cache_len(cache_dir) == len(keys), 180, "the whole bucket cached")
    assert proxy.stats.throttled > 0  # the remote did throttle
    # (the health documents follow the commits within a second)
    wait_for(lambda: fetch_health(cache_dir)[2] == len(keys), 30, "the samplers' counts")
    errors, quarantined, fetched = fetch_health(cache_dir)
    # a 503 is a rate to adapt to: the same keys were asked for again, none failed or was
    # quarantined
    assert (errors, quarantined, fetched) == (0, 0, len(keys)), daemon.logs()[-3000:]
    stats = status_json(cache_dir)
    assert stats["quarantined"] == 0
    requests = stats["requests"]["source"]
    assert requests["gets"] >= len(keys) + requests["throttled"] - 5  # sent: served + refused
    assert requests["throttled"] >= 1 and requests["retries"] >= 1
    assert requests["bytes"] >= len(keys) * 4096 and requests["lists"] >= 1
    # the same counters as Prometheus metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'epochcache_remote_requests_total{kind="get",source="source"}' in text
    assert 'epochcache_remote_throttled_total{source="source"}' in text
    assert "epochcache_remote_concurrency" in text
    # and in the human status
    human = subprocess.run([sys.executable, "-m", "epochcache", "status", str(cache_dir)],
                           capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
                           env={**os.environ, "COLUMNS": "250"})
    assert "requests source" in human.stdout and "GETs" in human.stdout and "throttled" in \
        human.stdout


def test_auto_concurrency_grows_past_its_start_against_a_far_bucket(
        s3: S3Env, tmp_path: Path, start_daemon: Any, remote_proxy: Any) -> None:
    keys = upload(s3.url, s3.storage_options, "far", 400, "files")
    proxy = remote_proxy(s3.endpoint_url, latency_s=0.1)  # 100 ms to the first byte
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("far"), cache_dir=cache_dir,
        storage_options={**s3.storage_options, "endpoint_url": proxy.endpoint},
        sampler={"processes": 1, "concurrency": "auto", "batch_size": 64})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_for(lambda: cache_len(cache_dir) == len(keys), 180, "the whole bucket cached")
    assert daemon.terminate() == 0
    [health] = sampler_states(cache_dir).values()
    reached = health["requests"]["source"]["concurrency"]
    # 8 in flight at 100 ms is 80 objects/s; more in flight brought more, so it grew
    assert reached > START_LIMIT, health["requests"]
    assert proxy.stats.max_in_flight > START_LIMIT
    assert health["errors"] == 0 and health["fetched"] == len(keys)


def test_a_throttled_source_does_not_hold_back_the_other(
        s3: S3Env, tmp_path: Path, start_daemon: Any, remote_proxy: Any) -> None:
    upload(s3.url, s3.storage_options, "slow", 150, "files")
    upload(s3.url, s3.storage_options, "fast", 150, "files")
    throttling = remote_proxy(s3.endpoint_url, latency_s=0.02, rate_per_s=4, burst=2)
    plain = remote_proxy(s3.endpoint_url, latency_s=0.02)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url="unused", cache_dir=cache_dir, storage_options={},
        sampler={"processes": 1, "concurrency": "auto", "batch_size": 16})
    import yaml

    data = yaml.safe_load(config.read_text())
    base = data.pop("source")
    data["sources"] = [
        # timeout_s as by default: a batch of the throttled source is slow, not stalled
        {**base, "name": name, "url": s3.url(name), "timeout_s": 30,
         "storage_options": {**s3.storage_options, "endpoint_url": proxy.endpoint}}
        for name, proxy in (("slow", throttling), ("fast", plain))]
    config.write_text(yaml.safe_dump(data))
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)

    def per_source() -> dict[str, int]:
        return read_cache(cache_dir, lambda c: {k: v["samples"]
                                                 for k, v in source_stats(c).items()}) or {}

    wait_for(lambda: per_source().get("fast", 0) == 150, 120, "the fast source cached whole")
    # with equal weights, a mix held to the throttled source's pace would have taken as many
    # from it: at 4 GETs/s it has brought a fraction
    counts = per_source()
    assert counts.get("slow", 0) < 75, counts
    requests = status_json(cache_dir)["requests"]
    assert requests["slow"]["throttled"] > 0 and requests["fast"]["throttled"] == 0
    errors, quarantined, _ = fetch_health(cache_dir)
    assert errors == 0 and quarantined == 0
    # and the throttled one goes on, at its pace
    wait_for(lambda: per_source().get("slow", 0) > counts.get("slow", 0), 60,
             "the throttled source still progressing")


def test_max_requests_per_s_holds_for_all_the_samplers_together(
        s3: S3Env, tmp_path: Path, start_daemon: Any, remote_proxy: Any) -> None:
    """A budget of 25 requests/s shared by two sampler processes: the remote never sees more
    (beyond a quarter second's burst), and the cache still fills."""
    keys = upload(s3.url, s3.storage_options, "budget", 120, "files")
    proxy = remote_proxy(s3.endpoint_url, latency_s=0.01)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("budget"), cache_dir=cache_dir,
        storage_options={**s3.storage_options, "endpoint_url": proxy.endpoint},
        sampler={"processes": 2, "concurrency": "auto", "batch_size": 16,
                 "max_requests_per_s": 25})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_for(lambda: cache_len(cache_dir) == len(keys), 120, "the whole bucket cached")
    arrivals = sorted(proxy.stats.arrivals)
    assert len(arrivals) >= len(keys)
    # any second holds at most a second's budget plus the bucket's burst (0.25 s worth), and a
    # little for the gap between a request's instant and its arrival
    busiest = max(sum(1 for t in arrivals[i:] if t < start + 1.0)
                  for i, start in enumerate(arrivals))
    assert busiest <= 25 + 7 + 3, busiest
    errors, quarantined, _ = fetch_health(cache_dir)
    assert errors == 0 and quarantined == 0
