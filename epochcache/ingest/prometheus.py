"""Prometheus ``/metrics`` for a daemon (``daemon.metrics_port``, ``--metrics-port``).

Nothing is counted in the hot paths for this: every value is read at scrape time from what the
cache already keeps (counters, per-source counters, leases) and from the documents the daemon
and its samplers write (restarts, remote errors by kind, time writers waited on leases). So a
scrape costs a few read transactions, and a daemon without ``metrics_port`` pays nothing.

Names follow Prometheus conventions: an ``epochcache_`` prefix, base units in the name
(``_bytes``, ``_seconds``), ``_total`` on counters. Counters come from the cache and the health
documents, so they go on across daemon and sampler restarts.

prometheus-client is an optional dependency (``pip install 'epochcache[metrics]'``): it is
imported only when metrics are asked for, and its absence is a config error naming the field.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..coverage import coverage
from ..errors import ConfigError
from ..store import SampleStore
from ..store.plumbing import source_stats
from .health import daemon_health, failing_sources, request_totals

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'epochcache[metrics]' (or prometheus-client)"
#: The kinds of failed remote fetches (see ``ingest.feed.error_kind``), always exported.
ERROR_KINDS = ("timeout", "throttled", "unavailable", "permanent", "other")


def require_prometheus(field: str) -> None:
    """Raise a [`ConfigError`][epochcache.ConfigError] naming ``field`` if prometheus-client is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError(f"{field}: serving /metrics needs prometheus-client: {INSTALL_HINT}, "
                          f"or remove {field}") from None


class MetricsServer:
    """``/metrics`` served from a background thread for one registry's collectors.

    Args:
        collect: yields the metric families of one scrape.
        host: the address to listen on.
        port: the port (0: any free one; see `port`).
        field: the config field that asked for it (named in errors).

    Raises:
        ConfigError: prometheus-client is missing, or the address cannot be bound.
    """

    def __init__(self, collect: Callable[[], Iterator[Any]], host: str, port: int,
                 field: str) -> None:
        require_prometheus(field)
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        class _Collector:
            def collect(self) -> Iterator[Any]:
                return collect()

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector())
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError(f"{field}: cannot serve /metrics on {host}:{port} ({reason}); "
                              "pick another port") from exc
        self.host, self.port = host, int(self._server.server_port)
        log.info("serving Prometheus metrics on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def _family(kind: str, name: str, doc: str, **kwargs: Any) -> Any:
    """A ``counter`` or ``gauge`` family (prometheus-client's, imported when scraped)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, **kwargs)


def _per_source(rows: Sequence[tuple[str, Mapping[str, Any]]],
                metrics: Sequence[tuple[str, str, str, str]]) -> Iterator[Any]:
    """One family per ``(field, kind, name, help)`` of ``metrics``, labelled by source: each of
    the ``(source, values)`` rows adds its ``values[field]``."""
    for field, kind, name, doc in metrics:
        family = _family(kind, name, doc, labels=["source"])
        for source, values in rows:
            family.add_metric([source], float(values[field]))
        yield family


def daemon_metrics(cache: SampleStore) -> Iterator[Any]:
    """The metric families of one scrape of a daemon's cache (see the module docstring)."""
    counters = cache.counters()
    yield _family("gauge", "epochcache_cache_samples", "Samples in the cache.",
                  value=counters.samples)
    yield _family("gauge", "epochcache_cache_bytes", "Stored bytes in the cache.",
                  value=counters.bytes)
    yield _family("gauge", "epochcache_cache_capacity_bytes", "Configured capacity.",
                  value=cache.capacity_bytes)
    yield _family("gauge", "epochcache_cache_effective_capacity_bytes",
                  "Capacity in force (lowered after a full disk).", value=cache.effective_capacity)
    yield _family("gauge", "epochcache_cache_headroom_bytes",
                  "Bytes writers may use beyond capacity while leases pin samples.",
                  value=cache.headroom_bytes)
    yield _family("counter", "epochcache_ingested_samples", "Samples inserted into the cache.",
                  value=counters.inserted)
    yield _family("counter", "epochcache_ingested_bytes", "Stored bytes inserted into the cache.",
                  value=counters.bytes + counters.evicted_bytes)
    yield _family("counter", "epochcache_evicted_samples", "Samples evicted (oldest first).",
                  value=counters.evicted)
    yield _family("counter", "epochcache_evicted_bytes", "Stored bytes evicted.",
                  value=counters.evicted_bytes)
    yield _family("counter", "epochcache_quarantined_samples",
                  "Remote objects quarantined (corrupt, or never storable).",
                  value=counters.quarantined)

    leases = cache.leases()
    now_ns = time.time_ns()
    oldest = max(((now_ns - lease.created_ns) / 1e9 for lease in leases), default=0.0)
    yield _family("gauge", "epochcache_leases", "Snapshot leases held (epochs training).",
                  value=len(leases))
    yield _family("gauge", "epochcache_oldest_lease_age_seconds",
                  "Age of the oldest lease (0 without leases).", value=oldest)

    daemon = cache.tables.get_state("daemon") or {}
    healths = cache.tables.states("sampler/")
    restarts = _family("counter", "epochcache_sampler_restarts",
                       "Times the daemon restarted a sampler that died.", labels=["sampler"])
    up = _family("gauge", "epochcache_sampler_up", "1 while the sampler process runs.",
                 labels=["sampler"])
    for index, sampler in sorted((daemon.get("samplers") or {}).items()):
        restarts.add_metric([str(index)], float(sampler.get("restarts", 0)))
        up.add_metric([str(index)], 1.0 if sampler.get("alive") else 0.0)
    yield restarts
    yield up
    errors = _family("counter", "epochcache_remote_errors",
                     "Failed remote fetches by kind (after retries).", labels=["kind"])
    kinds: dict[str, float] = dict.fromkeys(ERROR_KINDS, 0.0)
    wait_s = 0.0
    for health in healths.values():
        for kind, count in (health.get("error_kinds") or {}).items():
            kinds[kind] = kinds.get(kind, 0.0) + count
        wait_s += float(health.get("lease_wait_s", 0.0))
    for kind, count in sorted(kinds.items()):
        errors.add_metric([kind], count)
    yield errors
    failing = _family("gauge", "epochcache_source_failing", "1 while no read of the source "
                      "succeeded for a minute, or a refusal (403, region, scheme) stopped it; "
                      "0 otherwise.", labels=["source"])
    found = failing_sources(daemon_health(daemon) if daemon else None)
    for label in sorted(set(request_totals(cache)) | set(found)):
        failing.add_metric([label], 1.0 if label in found else 0.0)
    yield failing
    yield _family("counter", "epochcache_writer_lease_wait_seconds",
                  "Seconds samplers waited for leases to free space, summed over samplers "
                  "(its rate over the sampler count is the fraction of time writers wait: "
                  "low turnover, see cache.headroom).", value=wait_s)
    stats = source_stats(cache)
    if stats:
        yield from _per_source(sorted(stats.items()), _SOURCE_METRICS)
    yield from coverage_metrics(cache)
    yield from _request_metrics(cache)


#: What the cache holds of each source (`store.plumbing.source_stats`): its field, the kind, the
#: name and help of its family.
_SOURCE_METRICS = (
    ("samples", "gauge", "epochcache_source_samples", "Samples in the cache, per source."),
    ("bytes", "gauge", "epochcache_source_bytes", "Stored bytes in the cache, per source."),
    ("inserted", "counter", "epochcache_source_ingested_samples",
     "Samples inserted, per source."),
    ("inserted_bytes", "counter", "epochcache_source_ingested_bytes",
     "Stored bytes inserted, per source."),
    ("evicted", "counter", "epochcache_source_evicted_samples", "Samples evicted, per source."),
    ("quarantined", "counter", "epochcache_source_quarantined_samples",
     "Remote objects quarantined, per source."),
)
#: What training has seen of each source (a row of ``cache.coverage()``), as above.
_COVERAGE_METRICS = (
    ("samples", "gauge", "epochcache_coverage_listed_samples", "Samples the source's listing "
     "holds (estimated for tar until every shard was trained)."),
    ("covered", "gauge", "epochcache_coverage_covered_samples", "Distinct samples of the "
     "source trained on at least once."),
    ("fraction", "gauge", "epochcache_coverage_ratio", "covered / listed (0-1)."),
    ("share_fraction", "gauge", "epochcache_coverage_share_ratio", "covered / this node's "
     "share of the source (0-1)."),
    ("coverage_per_s", "gauge", "epochcache_coverage_growth_samples_per_second", "Distinct "
     "samples newly trained on per second (last hour of updates)."),
)
#: What each source cost (`health.request_totals`), as above.
_REQUEST_METRICS = (
    ("bytes", "counter", "epochcache_remote_bytes", "Bytes received in object bodies "
     "(egress), per source."),
    ("throttled", "counter", "epochcache_remote_throttled", "Answers of 503 SlowDown or 429, "
     "per source."),
    ("retries", "counter", "epochcache_remote_retries", "Requests sent again for the same "
     "object or page, per source."),
    ("timeouts", "counter", "epochcache_remote_timeouts", "Requests that timed out, per "
     "source."),
    ("concurrency", "gauge", "epochcache_remote_concurrency", "Requests the samplers allow in "
     "flight now (sampler.concurrency; auto moves it), per source."),
    ("pace", "gauge", "epochcache_remote_pace_requests_per_second", "The pace samplers keep "
     "to after throttling (0: none), per source."),
)


def coverage_metrics(cache: SampleStore) -> Iterator[Any]:
    """What training has seen of each source (``cache.coverage()``): read from the coverage
    ledgers' headers at scrape time, labelled by source (its name, else its URL)."""
    report = coverage(cache)
    rows = [(row["source"] or str(row["url"]), row) for row in report["sources"]]
    yield from _per_source(rows, _COVERAGE_METRICS)
    epochs = _family("gauge", "epochcache_coverage_epochs_samples", "Samples of the source by "
                     "the number of epochs they were trained in (bucket label; 0: never).",
                     labels=["source", "epochs"])
    eta = _family("gauge", "epochcache_coverage_eta_seconds", "Time to train on every sample "
                  "of this node's share once at the current ingest rate (absent while nothing "
                  "is ingested).", labels=["source"])
    for name, row in rows:
        for label, count in row["histogram"].items():
            epochs.add_metric([name, label], float(count))
        if row["eta_s"] is not None:
            eta.add_metric([name], float(row["eta_s"]))
    yield epochs
    yield eta
    yield _family("counter", "epochcache_coverage_unattributed_samples", "Trained samples with "
                  "no recorded origin (cached by an older version, or put through the Python "
                  "API).", value=report["unattributed"])


def _request_metrics(cache: SampleStore) -> Iterator[Any]:
    """What each source cost in requests and egress (``ingest.health``)."""
    totals = sorted(request_totals(cache).items())
    requests = _family("counter", "epochcache_remote_requests", "Requests sent to the remote, "
                       "per source and kind (get: object reads, throttled ones included; list: "
                       "listing pages).", labels=["source", "kind"])
    for name, values in totals:
        for kind in ("get", "head", "list"):
            requests.add_metric([name, kind], float(values[kind + "s"]))
    yield requests
    yield from _per_source(totals, _REQUEST_METRICS)
