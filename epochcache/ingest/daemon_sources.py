"""The sources a daemon samples: listed at start, re-listed, and retried when optional.

At start every source is listed (or its saved listing reused). A source that cannot be reached
fails the start, naming it (``epochcache daemon`` exits 2, nothing is started), unless its
``sources:`` entry says ``optional: true``: then the daemon starts without it, logs why, and
lists it again every :data:`RETRY_S` in a background thread. Once it answers, the daemon
restarts its samplers in order so that they take it in (each commits what it fetched first).

Each reachable source with ``listing_ttl_s`` gets a :class:`~.relist.Relister` of its own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ..config import EpochcacheConfig, SourceEntry
from ..errors import SourceError, SourceUnavailable
from .from_config import open_configured_source
from .relist import Relister
from .sources import Source, listing_cached

log = logging.getLogger(__name__)

#: Seconds between attempts to list an optional source that was unreachable.
RETRY_S = 60.0


@dataclass
class _Listed:
    entry: SourceEntry
    source: Source
    listed_at: float
    keys: int


def _label(entry: SourceEntry) -> str:
    return f"source {entry.name!r} ({entry.config.url})" if entry.name else entry.config.url


class DaemonSources:
    """Lists the sources of ``config`` for a daemon (see the module docstring).

    Args:
        config: the validated config.
        retry_s: seconds between attempts on an unreachable optional source.
    """

    def __init__(self, config: EpochcacheConfig, retry_s: float = RETRY_S) -> None:
        self.config = config
        self.cache_dir = str(config.cache.dir)
        self.retry_s = retry_s
        self.listed: list[_Listed] = []
        self.missing: list[SourceEntry] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retrier: threading.Thread | None = None
        self._relisters: list[Relister] = []
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
                            "every %.0fs", _label(entry), exc, self.retry_s)
                self.missing.append(entry)
        if not self.listed:
            raise SourceUnavailable("sources: none of the sources can be reached (see above)")
        return sum(item.keys for item in self.listed)

    def _list(self, entry: SourceEntry) -> _Listed:
        source = open_configured_source(self.config, entry.config)
        listing = listing_cached(source, self.cache_dir)
        log.info("%s: %d %ss to sample from", _label(entry), len(listing.refs), source.unit)
        return _Listed(entry, source, listing.created, len(listing.refs))

    @property
    def names(self) -> list[str]:
        """Names of the ``sources:`` entries the samplers take (all listed ones)."""
        with self._lock:
            return [item.entry.name for item in self.listed]

    def start(self) -> None:
        """Start the re-listers, and the retries of missing optional sources."""
        for item in self.listed:
            self._start_relister(item)
        if self.missing:
            self._retrier = threading.Thread(target=self._retry, name="epochcache-retry-sources",
                                             daemon=True)
            self._retrier.start()

    def _start_relister(self, item: _Listed) -> None:
        ttl = item.entry.config.listing_ttl_s
        if ttl:
            relister = Relister(item.source, self.cache_dir, ttl, item.listed_at)
            relister.start()
            self._relisters.append(relister)

    def _retry(self) -> None:
        while self.missing and not self._stop.wait(self.retry_s):
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
                self._start_relister(item)
                self.joined.set()

    def stop(self) -> None:
        """Stop the background threads (daemon threads: a listing under way is abandoned)."""
        self._stop.set()
        for relister in self._relisters:
            relister.stop()
