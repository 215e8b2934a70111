"""Which data a cache holds: a source's identity, and the sources behind a cache.

A run must train on the samples of its own sources (invariant 11): a cache directory may have
been filled from another dataset, earlier or by a daemon running now. So every place that says
where samples come from names the source by its *identity*: what decides which objects are
read, and nothing else.

* In: the URL, normalised (a plain path and ``file://`` are one local path, resolved; a
  trailing slash, an upper-case scheme or host, and the URL's credentials and query do not
  count), the layout, the pattern, the shard list and the manifest, and the endpoint of an
  S3-compatible store (the same bucket name on two stores is two datasets).
* Out: credentials and every other storage option (region, client, timeouts), the checks, the
  ``sources:`` entry's name and weight (a name labels a source, a weight mixes it: neither
  changes which samples it has).

An identity travels as a short hash (`identity_key`) with the URL for messages: in the
listing registry (each listing a sampler registers, `epochcache.store.listings`), and in
the daemon's lock file while it runs (`daemon_doc`, read back by `daemon_sources`).
`cached_sources` says which sources the cached samples came from (their origins).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ..boot import boot_id
from ..config import EpochcacheConfig
from ..redact import redact_url
from ..store import SampleStore
from ..store.listings import listings
from ..store.origins import UNKNOWN, cached_listing_counts
from ..store.owners import lock_held
from .layouts import SourceSpec, source_fingerprint, source_spec

#: The daemon's lock file in the cache directory (see `epochcache.ingest.supervisor`).
DAEMON_LOCK_FILE = "daemon.lock"


class SourceName(NamedTuple):
    """A source as a cache or a config names it: its identity's key, its URL (normalised,
    without credentials), its ``sources:`` name ("" for ``source:``)."""

    identity: str
    url: str
    name: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.url}" if self.name else self.url


def normalized_url(url: str) -> str:
    """``url`` as its identity compares it (see the module docstring)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file", "local") or len(scheme) == 1:  # a path (or a drive letter)
        path = url if scheme == "" or len(scheme) == 1 else parts.netloc + parts.path
        return os.path.realpath(os.path.expanduser(path))
    host = (parts.hostname or "").lower() + (f":{parts.port}" if parts.port else "")
    return f"{scheme}://{host}{parts.path.rstrip('/')}"


def source_identity(spec: SourceSpec) -> dict[str, Any]:
    """What decides which objects ``spec`` reads (see the module docstring)."""
    options = spec.storage_options or {}
    endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url")
    manifest = spec.manifest
    if manifest is not None and ("://" in manifest or os.path.isabs(manifest)):
        manifest = normalized_url(manifest)
    return {"url": normalized_url(spec.url), "layout": spec.layout,
            "pattern": spec.effective_pattern, "shards": spec.shards, "manifest": manifest,
            "endpoint": normalized_url(str(endpoint)) if endpoint else None}


def identity_key(spec: SourceSpec) -> str:
    """`source_identity` as a short hash (kept in the cache; never holds a credential)."""
    encoded = json.dumps(source_identity(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()[:24]


def source_name(spec: SourceSpec, name: str = "") -> SourceName:
    return SourceName(identity_key(spec), redact_url(normalized_url(spec.url)), name)


def config_sources(config: EpochcacheConfig) -> list[SourceName]:
    """The sources of a config, in its order."""
    return [source_name(source_spec(entry.config), entry.name)
            for entry in config.source_entries()]


def daemon_doc(config: EpochcacheConfig) -> dict[str, Any]:
    """What a daemon writes into its lock file: who it is and which sources it fills from."""
    return {"pid": os.getpid(), "boot": boot_id(),
            "sources": [source._asdict() for source in config_sources(config)]}


def daemon_sources(cache_dir: str) -> tuple[int, list[SourceName] | None] | None:
    """The daemon filling ``cache_dir`` now, if any: ``(pid, its sources)``, the sources None
    where it did not say (an older version)."""
    path = os.path.join(cache_dir, DAEMON_LOCK_FILE)
    if lock_held(path) is not True:
        return None
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    try:
        doc = json.loads(text)
        return int(doc["pid"]), [SourceName(**source) for source in doc["sources"]]
    except (ValueError, KeyError, TypeError):
        return int(text) if text.strip().isdigit() else 0, None


class CachedSource(NamedTuple):
    """Samples a cache holds from one listing of a source (see `cached_sources`)."""

    source: SourceName
    samples: int
    fingerprint: str  # the listing's source_fingerprint (what an older version registered)


def cached_sources(cache_dir: str) -> tuple[list[CachedSource], int]:
    """Where the cached samples of ``cache_dir`` came from: one entry per listing that has
    samples in the cache now, and how many samples have no recorded origin (put through the
    Python API, or cached by an older version)."""
    cache = SampleStore(cache_dir, readonly=True)
    try:
        counts = cached_listing_counts(cache.env)
        registry = listings(cache.env)
    finally:
        cache.close()
    found = []
    for lid, samples in sorted(counts.items()):
        entry = registry.get(lid)
        if lid == UNKNOWN or entry is None:
            continue
        url = str(entry.get("url") or "")
        found.append(CachedSource(
            SourceName(str(entry.get("identity") or ""), redact_url(normalized_url(url)),
                       str(entry.get("source") or "")),
            samples, str(entry.get("fingerprint") or "")))
    unknown = sum(samples for lid, samples in counts.items()
                  if lid == UNKNOWN or lid not in registry)
    return found, unknown


def is_among(cached: CachedSource, config: EpochcacheConfig) -> bool:
    """Whether the samples of ``cached`` come from one of ``config``'s sources."""
    specs = [source_spec(entry.config) for entry in config.source_entries()]
    if cached.source.identity:
        return cached.source.identity in {identity_key(spec) for spec in specs}
    # Registered by an older version, without an identity: the same listing, or the same URL.
    return (cached.fingerprint in {source_fingerprint(spec) for spec in specs}
            or cached.source.url in {redact_url(normalized_url(spec.url)) for spec in specs})


def describe(sources: Iterable[SourceName]) -> str:
    return ", ".join(str(source) for source in sources) or "none"
