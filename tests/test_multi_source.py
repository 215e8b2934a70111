"""``sources:``: several sources mixed by weight, keys namespaced by source name, per-source
counters through eviction, a source unreachable at start, and an outage of one source mid-run.

Real daemons (``epochcache daemon`` processes), ``file://`` sources and a moto S3 server in a
process of its own that is killed for the outage.

Internals: per-source counters are read with ``plumbing.source_stats`` and the raw tables
(``cache.env``), what ``status`` shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.cachecheck import full_check, recount
from common.daemonproc import (
    REPO,
    all_samplers,
    daemon_state,
    read_cache,
    wait_for,
    wait_running,
)
from common.s3server import S3ServerProcess
from conftest import free_port, s3_options

from epochcache.demo import make_samples, write_demo_data
from epochcache.store import plumbing

pytestmark = pytest.mark.timeout(180)


def file_source(tmp_path: Path, name: str, samples: int, seed: int = 0) -> str:
    url = (tmp_path / name).as_uri()
    write_demo_data(url, samples, "files", sample_bytes=1024, seed=seed)
    return url


def write(path: Path, sources: list[dict[str, Any]], cache_dir: Path, capacity: str,
          **sampler: Any) -> Path:
    common = {"pattern": "*.npy", "timeout_s": 2, "connect_timeout_s": 1, "list_deadline_s": 3,
              "retries": 2}
    data = {
        "sources": [{**common, **entry} for entry in sources],
        "cache": {"dir": str(cache_dir), "capacity": capacity},
        "sampler": {"processes": 2, "concurrency": 4, "batch_size": 16, **sampler},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def status_json(cache_dir: Path) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "epochcache", "status", str(cache_dir), "--json"],
                            capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def source_stats(cache_dir: Path) -> dict[str, dict[str, int]]:
    return read_cache(cache_dir, plumbing.source_stats) or {}


def test_sources_are_mixed_by_weight_namespaced_and_counted_through_eviction(
    tmp_path: Path, start_daemon: Any
) -> None:
    # Both sources hold the same key names: the cache keeps them apart by source name.
    web = file_source(tmp_path, "web", 4000, seed=1)
    books = file_source(tmp_path, "books", 2000, seed=2)
    cache_dir = tmp_path / "cache"
    # ~900 samples fit: the cache turns over twice while 2,000+ are ingested.
    config = write(tmp_path / "cfg.yaml", [{"name": "web", "url": web, "weight": 3},
                                           {"name": "books", "url": books, "weight": 1}],
                   cache_dir, "1MiB")
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_for(lambda: sum(s["ingested"] for s in source_stats(cache_dir).values()) >= 2000, 120,
             "2,000 samples ingested")
    assert daemon.terminate() == 0, daemon.logs()[-3000:]

    status = status_json(cache_dir)
    sources = status["sources"]
    ingested = {name: sources[name]["ingested"] for name in ("web", "books")}
    total = sum(ingested.values())
    assert total >= 2000
    assert abs(ingested["web"] / total - 0.75) <= 0.05, ingested
    assert abs(ingested["books"] / total - 0.25) <= 0.05, ingested
    # Eviction is by age across both (the cache holds a contiguous run of the newest samples),
    # and each source's samples/bytes equal a recount of the records.
    state = full_check(str(cache_dir))
    assert status["evicted"] > 0 and all(sources[n]["evicted"] > 0 for n in ("web", "books"))
    counted = read_cache(cache_dir, lambda c: _recount(c, ["web", "books"]))
    for name in ("web", "books"):
        assert {k: sources[name][k] for k in ("samples", "bytes")} == counted[name]  # type: ignore[index]
        assert sources[name]["quarantined"] == 0
    assert sum(sources[n]["samples"] for n in ("web", "books")) == status["samples"]
    assert all(key.split("/", 1)[0] in ("web", "books") for key in state.keys)
    names = {key.split("/", 1)[1] for key in state.keys}
    assert any(f"web/{k}" in state.keys and f"books/{k}" in state.keys for k in names) or \
        status["samples"] < 200  # the same key from both sources, cached twice


def _recount(cache: Any, names: list[str]) -> dict[str, dict[str, int]]:
    with cache.env.read() as txn:
        return recount(txn, cache.env.dbs, names)


def test_an_unreachable_source_fails_the_start_unless_optional(
    tmp_path: Path, start_daemon: Any, unreachable_endpoint: str
) -> None:
    books = file_source(tmp_path, "books", 50)
    down = {"name": "web", "url": "s3://bucket/web", "storage_options": s3_options(unreachable_endpoint)}
    cache_dir = tmp_path / "cache"
    config = write(tmp_path / "cfg.yaml", [{"name": "books", "url": books}, down], cache_dir, "16MiB")
    daemon = start_daemon(config)
    assert daemon.wait(30) == 2, daemon.logs()
    logs = daemon.logs()
    assert "source 'web' (s3://bucket/web)" in logs and "optional: true" in logs
    assert "testing-secret-value" not in logs
    assert daemon.session_pids() == [] and daemon_state(cache_dir) is None

    config = write(tmp_path / "cfg2.yaml", [{"name": "books", "url": books},
                                            {**down, "optional": True}], cache_dir, "16MiB")
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_for(lambda: source_stats(cache_dir).get("books", {}).get("samples") == 50, 60,
             "the reachable source to be cached")
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["sources"]["web"]["active"] is False
    assert doc["sources"]["books"]["active"] is True
    assert source_stats(cache_dir)["web"]["samples"] == 0
    assert "source 'web' (s3://bucket/web) is unreachable" in daemon.logs()
    assert daemon.terminate() == 0


def test_an_outage_of_one_source_leaves_the_others_ingesting(
    tmp_path: Path, start_daemon: Any
) -> None:
    objects = tmp_path / "objects"
    root = objects / "bucket" / "web"
    root.mkdir(parents=True)
    payloads, _ = make_samples(600, sample_bytes=1024)
    for i, payload in enumerate(payloads):
        (root / f"sample-{i:06d}.npy").write_bytes(payload)
    server = S3ServerProcess(free_port(), objects, tmp_path / "s3server.log")
    server.start()
    try:
        books = file_source(tmp_path, "books", 600)
        cache_dir = tmp_path / "cache"
        # ~400 samples fit, so both sources keep ingesting (evicted samples are fetched again
        # on later passes); 100 KB/s keeps it to about 100 samples/s.
        config = write(tmp_path / "cfg.yaml", [
            {"name": "web", "url": "s3://bucket/web", "storage_options": s3_options(server.endpoint)},
            {"name": "books", "url": books},
        ], cache_dir, "512KiB", bandwidth_limit=100_000)
        daemon = start_daemon(config)
        wait_running(daemon, cache_dir)
        wait_for(lambda: min(s["ingested"] for s in source_stats(cache_dir).values()) >= 50, 60,
                 "both sources ingesting")
        server.kill()  # every connection to the S3 source dies
        # The samplers notice (a whole batch fails): the S3 source rests, books takes its share.
        wait_for(lambda: all_samplers(cache_dir, 2,
                                      lambda h: h.get("sources", {}).get("web", {}).get("down")), 30,
                 "both samplers to report the S3 source down")
        before = source_stats(cache_dir)
        # A web batch that was fetching when the server died is retried until its deadline,
        # and batches commit in order: books may wait for it once, then goes on at its rate.
        wait_for(lambda: source_stats(cache_dir)["books"]["ingested"]
                 >= before["books"]["ingested"] + 100, 40, "books to go on ingesting")
        after = source_stats(cache_dir)
        # at most a batch per sampler fetched before the outage, committed behind a failed one
        assert after["web"]["ingested"] - before["web"]["ingested"] <= 32, (before, after)
        assert daemon.alive()
        server.start()  # back: its share resumes
        wait_for(lambda: source_stats(cache_dir)["web"]["ingested"] > after["web"]["ingested"] + 50,
                 90, "the S3 source to ingest again")
        doc = daemon_state(cache_dir)
        assert doc is not None and all(s["restarts"] == 0 for s in doc["samplers"].values())
        assert daemon.terminate() == 0, daemon.logs()[-3000:]
        assert "source web (s3://bucket/web): a whole batch failed" in daemon.logs()
        full_check(str(cache_dir))
    finally:
        server.kill()
