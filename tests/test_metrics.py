"""Prometheus ``/metrics`` of the daemon: a real HTTP GET of a running ``epochcache daemon``,
parsed with prometheus-client's own text-format parser, checked against ``status``."""

from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.daemonproc import daemon_state, read_cache, sampler_states, wait_for, wait_running
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

from epochcache import Cache
from epochcache.demo import write_demo_data

pytestmark = pytest.mark.timeout(180)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, labels): value}`` of one GET of ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def config(tmp_path: Path, **extra: Any) -> Path:
    for name, samples in (("web", 120), ("books", 80)):
        write_demo_data((tmp_path / name).as_uri(), samples, "files", sample_bytes=1024)
    data = {
        "sources": [{"name": name, "url": (tmp_path / name).as_uri(), "pattern": "*.npy"}
                    for name in ("web", "books")],
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "16MiB"},
        "sampler": {"processes": 2, "concurrency": 4, "batch_size": 16},
        **extra,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_daemon_serves_metrics_that_match_status(tmp_path: Path, start_daemon: Any) -> None:
    port = free_port()
    cache_dir = tmp_path / "cache"
    daemon = start_daemon(config(tmp_path), daemon_args=("--metrics-port", str(port)))
    wait_running(daemon, cache_dir)
    wait_for(lambda: (read_cache(cache_dir, len) or 0) == 200, 60, "200 samples cached")
    url = f"http://127.0.0.1:{port}/metrics"
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["metrics"] == url
    with Cache(cache_dir) as cache:
        snapshot = cache.snapshot(label="test")  # a lease: count and age
        wait_for(lambda: scrape(url)[("epochcache_oldest_lease_age_seconds", ())] > 0.2, 10,
                 "the lease to age")
        stats = cache.stats()
        metrics = scrape(url)
        snapshot.release()

    def value(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert value("epochcache_cache_samples") == stats["samples"] == 200
    assert value("epochcache_cache_bytes") == stats["bytes"]
    assert value("epochcache_cache_capacity_bytes") == 16 * 2**20
    assert value("epochcache_cache_effective_capacity_bytes") == stats["effective_capacity"]
    assert value("epochcache_ingested_samples_total") == stats["inserted"] == 200
    assert value("epochcache_ingested_bytes_total") == stats["bytes"]
    assert value("epochcache_evicted_samples_total") == 0
    assert value("epochcache_evicted_bytes_total") == 0
    assert value("epochcache_quarantined_samples_total") == 0
    assert value("epochcache_leases") == 1
    assert value("epochcache_oldest_lease_age_seconds") > 0.2
    assert value("epochcache_writer_lease_wait_seconds_total") >= 0
    for kind in ("timeout", "unavailable", "permanent", "other"):
        assert value("epochcache_remote_errors_total", kind=kind) == 0
    for name, count in (("web", 120), ("books", 80)):
        assert value("epochcache_source_samples", source=name) == count
        assert value("epochcache_source_ingested_samples_total", source=name) == count
        assert value("epochcache_source_bytes", source=name) == stats["sources"][name]["bytes"]
        assert value("epochcache_source_quarantined_samples_total", source=name) == 0
    assert value("epochcache_sampler_restarts_total", sampler="0") == 0
    assert value("epochcache_sampler_up", sampler="1") == 1

    # A sampler killed with SIGKILL is restarted, and counted.
    pid = doc["samplers"]["0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: scrape(url)[("epochcache_sampler_restarts_total", (("sampler", "0"),))] == 1,
             30, "the restart to be counted")
    assert daemon.terminate() == 0
    with pytest.raises(OSError):  # the endpoint is gone with the daemon
        scrape(url)



def test_remote_errors_are_counted_by_kind(tmp_path: Path, start_daemon: Any) -> None:
    port = free_port()
    cfg = config(tmp_path, sampler={"processes": 1, "concurrency": 2, "batch_size": 8,
                                    "bandwidth_limit": 20_000},
                 daemon={"metrics_port": port})
    daemon = start_daemon(cfg)
    wait_running(daemon, tmp_path / "cache")
    for path in sorted((tmp_path / "books").glob("*.npy"))[:40]:
        path.unlink()  # listed, then gone: fetching them fails for good ("not found")
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: scrape(url)[("epochcache_remote_errors_total", (("kind", "permanent"),))] > 0,
             60, "failed fetches to be counted")
    errors = sum(h.get("errors", 0) for h in sampler_states(tmp_path / "cache").values())
    metrics = scrape(url)
    assert metrics[("epochcache_remote_errors_total", (("kind", "permanent"),))] <= errors + 16
    assert metrics[("epochcache_remote_errors_total", (("kind", "timeout"),))] == 0
    assert daemon.terminate() == 0


def _hide_prometheus(tmp_path: Path) -> str:
    """A PYTHONPATH entry under which ``import prometheus_client`` fails, as when it is not
    installed."""
    fake = tmp_path / "no_prometheus"
    fake.mkdir()
    (fake / "prometheus_client.py").write_text("raise ImportError('not installed (simulated)')\n")
    return str(fake)


def test_without_prometheus_client_metrics_are_a_config_error_and_the_rest_works(
    tmp_path: Path, start_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [_hide_prometheus(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cfg = config(tmp_path)
    refused = start_daemon(cfg, daemon_args=("--metrics-port", str(free_port())))
    assert refused.wait(30) == 2
    assert "daemon.metrics_port: serving /metrics needs prometheus-client" in refused.logs()
    assert "pip install 'epochcache[metrics]'" in refused.logs()
    assert daemon_state(tmp_path / "cache") is None  # nothing was started
    plain = start_daemon(cfg)  # the default needs no prometheus-client
    wait_running(plain, tmp_path / "cache")
    assert plain.terminate() == 0


def test_a_port_in_use_fails_the_start(tmp_path: Path, start_daemon: Any) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        daemon = start_daemon(config(tmp_path), daemon_args=("--metrics-port", str(port)))
        assert daemon.wait(30) == 2
    assert f"daemon.metrics_port: cannot serve /metrics on 127.0.0.1:{port}" in daemon.logs()
    assert daemon.session_pids() == []
