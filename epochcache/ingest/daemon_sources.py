"""The sources a daemon samples: listed at start, re-listed (samplers follow), and retried
when optional.

At start every source is listed (or its saved listing reused). A source that cannot be reached
fails the start, naming it (``epochcache daemon`` exits 2, nothing is started), unless its
``sources:`` entry says ``optional: true``: then the daemon starts without it, logs why, and
lists it again every `RETRY_S` in a background thread. Once it answers, the daemon
restarts its samplers in order so that they take it in (each commits what it fetched first).

A large bucket (no manifest, no shard pattern) is listed page by page (`paging`):
the start waits for the first `START_KEYS` keys only, unless
``sample_while_listing`` is false or the strategy is ``weighted``; the rest is listed in a
background thread, saved as it goes (the samplers follow the saved listing), and a page that
fails after its retries is tried again `RETRY_S` later, from where it stopped. A listing
interrupted by a stop or a crash goes on from its last save at the next start.

Re-listing a growing source (``source.listing_ttl_s``): the daemon lists, samplers follow.
Each reachable source with a TTL gets a `Relister` thread of its own, once its listing is
complete: it lists the source again once the saved listing is older than the TTL, in the
background, and saves it grown (new keys appended as a block; see `listing`). Each sampler's
`ListingFollower` notices the new file and loads it off the fetch loop; the sampler then adds
the new keys to its key order without restarting its pass (`add_block`). Listing happens once
per node, not once per sampler. A failed re-list is logged and tried again a minute later; the
samplers go on with the keys they have.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..config import EpochcacheConfig, SourceEntry
from ..errors import SourceError, SourceUnavailable
from ..redact import redact_url
from .health import RequestStats, saved_requests, source_label
from .layouts import (
    Listing,
    PagedListing,
    Source,
    listing_cached,
    listing_path,
    open_configured_source,
    read_listing,
    read_listing_header,
    relist,
    source_fingerprint,
)

log = logging.getLogger(__name__)

#: How long a stop waits for a listing under way to save what it listed.
STOP_JOIN_S = 10.0
#: A listing that failed is tried again after this long, seconds: a re-list (or after the TTL,
#: if shorter), and an optional source unreachable at the daemon's start.
RETRY_S = 60.0
#: How often a sampler looks at the listing file's modification time.
FOLLOW_CHECK_S = 2.0


@dataclass
class _Listed:
    entry: SourceEntry
    source: Source
    listed_at: float
    keys: int
    paged: PagedListing | None = None  # a listing still under way


def _label(entry: SourceEntry) -> str:
    return f"source {entry.name!r} ({entry.config.url})" if entry.name else entry.config.url


class DaemonSources:
    """Lists the sources of ``config`` for a daemon (see the module docstring).

    Args:
        config: the validated config.
    """

    def __init__(self, config: EpochcacheConfig) -> None:
        self.config = config
        self.saved: dict[str, Any] = {}  # the last daemon's state document (`requests`)
        self.cache_dir = str(config.cache.dir)
        self.listed: list[_Listed] = []
        self.missing: list[SourceEntry] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retrier: threading.Thread | None = None
        self._opened: dict[str, Source] = {}  # by entry name, listed or not (yet)
        self._relisters: list[Relister] = []
        self._listers: list[threading.Thread] = []
        #: Set when a missing source was listed: the samplers should be restarted.
        self.joined = threading.Event()

    def list_all(self) -> int:
        """List every source; return the keys to sample from.

        Raises:
            SourceUnavailable: a source that is not optional cannot be listed (the message
                names it), or no source at all can.
        """
        for entry in self.config.source_entries():
            try:
                self.listed.append(self._list(entry))
            except SourceError as exc:
                if not entry.optional:
                    if not entry.name:
                        raise
                    raise SourceUnavailable(
                        f"sources: {_label(entry)} is unreachable: {exc} (fix it, or set "
                        f"optional: true on it to start without it)", url=entry.config.url,
                    ) from exc
                log.warning("%s is unreachable (%s); starting without it, trying it again "
                            "every %.0fs", _label(entry), exc, RETRY_S)
                self.missing.append(entry)
        if not self.listed:
            raise SourceUnavailable("sources: none of the sources can be reached (see above)")
        return sum(item.keys for item in self.listed)

    def _list(self, entry: SourceEntry) -> _Listed:
        source = open_configured_source(self.config, entry.config)
        source.gate.stats = RequestStats(saved_requests(self.saved, source_label(entry.name)))
        with self._lock:
            self._opened[entry.name] = source
        fingerprint = source_fingerprint(source.spec)
        header = read_listing_header(self.cache_dir, fingerprint)
        if header is not None and header.get("complete", True):  # no need to load its keys
            log.info("%s: %d %ss to sample from (the saved listing)", _label(entry),
                     int(header["count"]), source.unit)
            return _Listed(entry, source, float(header.get("created", 0)), int(header["count"]))
        saved = read_listing(self.cache_dir, fingerprint)
        paged = None
        if saved is not None and saved.complete:  # saved by an earlier version
            listing = saved
        elif source.paged:
            paged = PagedListing(source, self.cache_dir, stop=self._stop, saved=saved)
            wait = (not entry.config.sample_while_listing
                    or self.config.sampler.strategy == "weighted")
            listing = paged.run(until_started=not wait)
        else:
            listing = listing_cached(source, self.cache_dir)
        if listing.complete:
            paged = None
            log.info("%s: %d %ss to sample from", _label(entry), len(listing), source.unit)
        else:
            log.info("%s: sampling starts from the first %d %ss listed while the listing goes "
                     "on (source.sample_while_listing)", _label(entry), len(listing), source.unit)
        return _Listed(entry, source, listing.created, len(listing), paged)

    def _finish_listing(self, item: _Listed) -> None:
        """Run in a thread: list the rest of a large bucket, from where it stopped after a
        failed page, then start its re-lister."""
        paged = item.paged
        assert paged is not None
        listing: Listing | None = None
        while not self._stop.is_set():
            try:
                listing = paged.run()
                break
            except SourceError as exc:
                log.warning("%s: %s; the samplers go on with the %d keys listed, the listing "
                            "goes on from there in %.0fs", _label(item.entry), exc,
                            len(paged.builder), RETRY_S)
                self._stop.wait(RETRY_S)
        if listing is None or not listing.complete:
            return  # stopped: the listing so far is saved, the next start goes on with it
        item.paged, item.keys, item.listed_at = None, len(listing), listing.created
        if not self._stop.is_set():
            self._start_relister(item)

    def progress(self) -> dict[str, dict[str, object]]:
        """Each listed source's keys so far and whether its listing is complete (for the
        daemon's state document: ``status --json`` shows a large bucket's listing grow)."""
        with self._lock:
            items = list(self.listed)
        out: dict[str, dict[str, object]] = {}
        for item in items:
            paged = item.paged
            keys = len(paged.builder) if paged is not None else item.keys
            out[item.entry.name or redact_url(item.entry.config.url)] = {
                "keys": keys, "complete": paged is None}
        return out

    def requests(self) -> dict[str, dict[str, float]]:
        """The request counters of the daemon's listings, by source (``lists``; see
        `health`), for its state document."""
        saved = self.saved.get("requests")
        out = {str(k): v for k, v in saved.items()} if isinstance(saved, dict) else {}
        with self._lock:
            opened = dict(self._opened)
        for name, source in opened.items():
            out[source_label(name)] = source.gate.stats.as_dict()
        return out

    @property
    def names(self) -> list[str]:
        """Names of the ``sources:`` entries the samplers take (all listed ones)."""
        with self._lock:
            return [item.entry.name for item in self.listed]

    def start(self) -> None:
        """Start the re-listers, and the retries of missing optional sources."""
        for item in self.listed:
            self._start_background(item)
        if self.missing:
            self._retrier = threading.Thread(target=self._retry, name="epochcache-retry-sources",
                                             daemon=True)
            self._retrier.start()

    def _start_background(self, item: _Listed) -> None:
        """The rest of a listing under way, else the re-lister (with ``listing_ttl_s``)."""
        if item.paged is None:
            self._start_relister(item)
            return
        thread = threading.Thread(target=self._finish_listing, args=(item,),
                                  name="epochcache-listing", daemon=True)
        thread.start()
        self._listers.append(thread)

    def _start_relister(self, item: _Listed) -> None:
        ttl = item.entry.config.listing_ttl_s
        if ttl:
            relister = Relister(item.source, self.cache_dir, ttl, item.listed_at)
            relister.start()
            self._relisters.append(relister)

    def _retry(self) -> None:
        while self.missing and not self._stop.wait(RETRY_S):
            for entry in list(self.missing):
                try:
                    item = self._list(entry)
                except SourceError as exc:
                    log.info("%s is still unreachable: %s", _label(entry), exc)
                    continue
                log.warning("%s is reachable now: the samplers are restarted to take it in",
                            _label(entry))
                with self._lock:
                    self.listed.append(item)
                    self.missing.remove(entry)
                self._start_background(item)
                self.joined.set()

    def stop(self) -> None:
        """Stop the background threads: a listing under way saves what it listed (waited for
        up to `STOP_JOIN_S`); a re-list under way is abandoned."""
        self._stop.set()
        for relister in self._relisters:
            relister.stop()
        for thread in self._listers:
            thread.join(STOP_JOIN_S)


class Relister(threading.Thread):
    """Lists ``source`` again every ``ttl_s`` seconds, counted from when it was last listed.

    Args:
        source: the daemon's source.
        cache_dir: where the listing is saved.
        ttl_s: ``source.listing_ttl_s``.
        listed_at: when the saved listing was made (seconds since the epoch).
    """

    def __init__(self, source: Source, cache_dir: str, ttl_s: float, listed_at: float) -> None:
        super().__init__(name="epochcache-relist", daemon=True)
        self.source, self.cache_dir, self.ttl_s = source, cache_dir, ttl_s
        self.next_at = listed_at + ttl_s
        self._stop = threading.Event()  # set from the supervision loop, never from a signal

    def run(self) -> None:
        while not self._stop.wait(max(0.0, self.next_at - time.time())):
            started = time.monotonic()
            try:
                listing, added = relist(self.source, self.cache_dir)
            except (SourceError, OSError) as exc:
                retry = min(self.ttl_s, RETRY_S)
                log.warning("%s: re-listing failed (%s); the samplers go on with the keys they "
                            "have, trying again in %.0fs", self.source.url, exc, retry)
                self.next_at = time.time() + retry
                continue
            log.info("%s: re-listed in %.1fs: %d new keys, %d in all, %d gone",
                     self.source.url, time.monotonic() - started, added, len(listing),
                     len(listing.gone))
            self.next_at = time.time() + self.ttl_s

    def stop(self) -> None:
        self._stop.set()


def listing_mtime(source: Source, cache_dir: str) -> int | None:
    """The modification time (ns) of ``source``'s saved listing, None if there is none."""
    return _mtime_ns(listing_path(cache_dir, source_fingerprint(source.spec)))


def _mtime_ns(path: str | os.PathLike[str]) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


class ListingFollower:
    """Notices that the daemon saved a new listing and loads it in a background thread.

    Args:
        source: this sampler's source (names the listing file).
        cache_dir: where the listing is saved.
        mtime: the file's modification time when the listing in use was read (see
            `listing_mtime`; taken before reading, so a save in between is not missed).
    """

    def __init__(self, source: Source, cache_dir: str, mtime: int | None = None) -> None:
        self.cache_dir = cache_dir
        self.fingerprint = source_fingerprint(source.spec)
        self.path = listing_path(cache_dir, self.fingerprint)
        self._mtime = _mtime_ns(self.path) if mtime is None else mtime
        self._next_check = time.monotonic() + FOLLOW_CHECK_S
        self._loader: threading.Thread | None = None
        self._loaded: Listing | None = None

    def poll(self) -> Listing | None:
        """A newly saved listing, once; None when there is nothing new (never blocks)."""
        if self._loaded is not None:
            listing, self._loaded = self._loaded, None
            return listing
        now = time.monotonic()
        if (self._loader is not None and self._loader.is_alive()) or now < self._next_check:
            return None
        self._next_check = now + FOLLOW_CHECK_S
        mtime = _mtime_ns(self.path)
        if mtime is None or mtime == self._mtime:
            return None
        self._mtime = mtime
        self._loader = threading.Thread(target=self._load, name="epochcache-listing", daemon=True)
        self._loader.start()
        return None

    def _load(self) -> None:
        self._loaded = read_listing(self.cache_dir, self.fingerprint)
