"""Which data a cache holds: a source's identity, the sources behind a cache, and the origins
a sampler records with each commit (which listing, which index, which member).

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
listing registry (each listing a sampler registers, `epochcache.store.origins`), and in
the daemon's lock file while it runs (`daemon_doc`, read back by `daemon_sources`).
`cached_sources` says which sources the cached samples came from (their origins).

The origins: a sampler knows where every sample it fetched comes from, the listing its feed
samples and the index of the ref it picked there (for a ``tar`` sample, the shard's index, and
the sample's ordinal among the samples the shard yielded). `OriginTagger` registers each
listing with the cache (`epochcache.store.origins`, under its identity), hands the committer
an `Origin` per sample, and when a feed takes in a new generation of its listing maps the
coverage ledger and the old generation's origin rows onto it by key (`index_map`,
`epochcache.coverage.ledger.remap`). Cost per batch: a dict of the batch's samples; per
listing change: one write transaction (a new generation: a sort of both listings' keys, as a
re-list's merge does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

import numpy as np

from ..config import EpochcacheConfig
from ..coverage.ledger import remap
from ..paths import boot_id
from ..redact import redact_url
from ..store import SampleStore
from ..store.origins import UNKNOWN, Origin, cached_listing_counts, listings, register_listing
from ..store.owners import lock_held
from .layouts import KeyTable, Piece, SampleRef, SourceSpec, source_fingerprint, source_spec

if TYPE_CHECKING:
    from .feed import Feed

log = logging.getLogger(__name__)

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


def index_map(old: KeyTable, new: KeyTable) -> np.ndarray:
    """For each index of ``old``, the index of the same key in ``new`` (-1: not there)."""
    old_keys, new_keys = old.key_bytes(), new.key_bytes()
    width = max(1, max(map(len, old_keys), default=1), max(map(len, new_keys), default=1))
    # Fixed-width byte strings: numpy sorts and searches them in C (keys hold no NUL byte).
    old_arr = np.array(old_keys, dtype=f"S{width}")
    new_arr = np.array(new_keys, dtype=f"S{width}")
    del old_keys, new_keys
    if not len(new_arr):
        return np.full(len(old_arr), -1, dtype=np.int64)
    order = np.argsort(new_arr, kind="stable")
    sorted_new = new_arr[order]
    pos = np.minimum(np.searchsorted(sorted_new, old_arr), len(sorted_new) - 1)
    found = sorted_new[pos] == old_arr
    return np.where(found, order[pos], -1).astype(np.int64)


@dataclass
class _Seen:
    state: tuple[Any, ...]
    table: KeyTable
    lid: int
    info: dict[str, Any]


class OriginTagger:
    """Origins of a sampler's samples (see the module docstring).

    Args:
        cache: the sampler's store.
        node: ``(node_rank, num_nodes)`` of this daemon (its partition of each listing).
    """

    def __init__(self, cache: SampleStore, node: tuple[int, int]) -> None:
        self.cache = cache
        self.node_rank, self.num_nodes = node
        self._seen: dict[int, _Seen] = {}
        self._names: dict[int, tuple[str, str]] = {}

    def _info(self, feed: Feed) -> dict[str, Any]:
        known = self._names.get(id(feed))
        if known is None:
            spec = feed.source.spec
            known = self._names[id(feed)] = (source_fingerprint(spec), identity_key(spec))
        fingerprint, identity = known
        return {"source": feed.name, "fingerprint": fingerprint, "generation": feed.generation,
                "url": feed.source.url, "unit": feed.source.unit, "listed": len(feed.table),
                "gone": len(feed.gone), "complete": feed.complete, "node_rank": self.node_rank,
                "num_nodes": self.num_nodes, "identity": identity}

    def listing_id(self, feed: Feed) -> int:
        """The id of the listing ``feed`` samples now, registered (or brought up to date)."""
        state = (feed.generation, len(feed.table), len(feed.gone), feed.complete)
        seen = self._seen.get(id(feed))
        if seen is not None and seen.state == state:
            return seen.lid
        info = self._info(feed)
        if seen is not None and seen.info["generation"] != feed.generation:
            mapping = index_map(seen.table, feed.table)
            lid = remap(self.cache, seen.info, info, seen.lid, mapping)
        else:
            lid = register_listing(self.cache.env, info)
        self._seen[id(feed)] = _Seen(state, feed.table, lid, info)
        return lid

    def origins(self, feed: Feed, refs: Sequence[SampleRef], indices: Sequence[int],
                results: Sequence[tuple[SampleRef, Any]], generation: str) -> dict[str, Origin]:
        """The origin of each fetched sample, by cache key. ``refs`` were picked at
        ``indices`` of the listing of ``generation``; a batch picked from a listing the feed
        has left since gets none (its samples are unattributed)."""
        lid = self.listing_id(feed)
        if generation != feed.generation:
            return {}
        index_of = dict(zip((ref.key for ref in refs), indices))
        out: dict[str, Origin] = {}
        if feed.source.unit == "sample":
            for ref, payload in results:
                i = index_of.get(ref.key)
                if i is not None and not isinstance(payload, BaseException):
                    out[feed.cache_key(ref.key)] = Origin(lid, int(i))
            return out
        members: dict[str, int] = {}  # a shard's results hold every sample (STREAMED too)
        for ref, _payload in results:
            if ref.shard is not None:
                members[ref.shard] = members.get(ref.shard, 0) + 1
        ordinal: dict[str, int] = {}
        for ref, payload in results:
            shard = ref.shard
            if shard is None:
                continue
            member = ordinal.get(shard, 0)
            ordinal[shard] = member + 1
            i = index_of.get(shard)
            if i is not None and not isinstance(payload, BaseException):
                out[feed.cache_key(ref.key)] = Origin(lid, int(i), member, members[shard])
        return out

    def piece_origins(self, feed: Feed, index: int, generation: str, piece: Piece
                     ) -> dict[str, Origin]:
        """The origin of each sample of a streamed piece of the shard at ``index`` of the
        listing of ``generation`` (see `origins`). Before its last piece a shard's count
        is not known: its samples say the count so far, and the coverage ledger takes the
        largest it sees (`slots_of`)."""
        lid = self.listing_id(feed)
        if generation != feed.generation:
            return {}
        members = piece.members if piece.members is not None else piece.first + len(piece.results)
        return {feed.cache_key(ref.key): Origin(lid, int(index), piece.first + i, members)
                for i, (ref, payload) in enumerate(piece.results)
                if not isinstance(payload, BaseException)}
