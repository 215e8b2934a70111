"""Re-listing a growing source (``source.listing_ttl_s``): the daemon lists, samplers follow.

The daemon's `Relister` thread lists the source again once the saved listing is older
than the TTL, in the background, and saves it grown (new keys appended as a block; see
`listing`). Each sampler's `ListingFollower` notices the new file and loads
it off the fetch loop; the sampler then adds the new keys to its key order without restarting
its pass (`add_block`). Listing happens once per
node, not once per sampler. A failed re-list is logged and tried again a minute later; the
samplers go on with the keys they have.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..errors import SourceError
from .layouts import Listing, Source, listing_path, read_listing, relist, source_fingerprint

log = logging.getLogger(__name__)

#: A listing that failed is tried again after this long, seconds: a re-list (or after the TTL,
#: if shorter), and an optional source unreachable at the daemon's start (`daemon_sources`).
RETRY_S = 60.0
#: How often a sampler looks at the listing file's modification time.
FOLLOW_CHECK_S = 2.0


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
