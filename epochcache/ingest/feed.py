"""One source as a sampler process samples it, and the choice of which source goes next.

A sampler process holds a :class:`Feed` per source it samples (one for ``source:``, one per
entry of ``sources:``): the source, its listing and key order, the refs taken but not fetched
yet, and its state as the mixer sees it. :func:`next_feed` picks the feed whose share of the
samples taken so far lags its weight most, so that over many batches the samples taken from
each source are in proportion to the weights; each sampler process does the same, so the
cache's intake is too.

A feed whose batch failed as a whole (the remote is down) *rests*: it is left out for a backoff
of 1 s doubling to 60 s, then tried with one batch again, while the others take its share. A
feed whose whole pass brought nothing new (everything cached, corrupt or failing) rests too,
for :data:`IDLE_WAIT_S`. A resting feed keeps pace on paper (its count is moved up with the
others'), so that when it is back it takes its share from then on instead of catching up in a
burst that would starve the others.

Cache keys: a single ``source:`` caches a sample under its source key, so existing caches
stay valid; an entry of ``sources:`` under ``<name>/<source key>``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config import EpochcacheConfig, SourceEntry
from ..errors import CorruptSample, PermanentRemoteError, RemoteTimeout, SourceUnavailable
from ..store import SampleStore
from .from_config import open_configured_source
from .inflight import SizeEstimate
from .keyorder import KeyOrder, key_hashes
from .relist import ListingFollower
from .sources import Listing, SampleRef, listing_cached

log = logging.getLogger(__name__)

#: Pause after a whole pass of a feed found every sample already cached (the source fits).
IDLE_WAIT_S = 1.0
#: A feed whose batches fail as a whole rests this long at first, doubling up to the maximum.
DOWN_FIRST_S, DOWN_MAX_S = 1.0, 60.0


def error_kind(error: BaseException) -> str:
    """The ``kind`` label of a failed fetch (status and the remote-errors metric)."""
    if isinstance(error, RemoteTimeout):
        return "timeout"
    if isinstance(error, SourceUnavailable):
        return "unavailable"
    if isinstance(error, PermanentRemoteError):
        return "permanent"
    return "other"


def _samples_per_batch(configured: int, refs: list[SampleRef], unit: str, concurrency: int,
                       batch_bytes: int) -> int:
    """Samples per fetch/commit round: ``sampler.batch_size``, fewer for large objects."""
    if unit != "sample":
        return max(1, min(4, concurrency))  # whole shards
    sizes = [ref.size for ref in refs[:1000] if ref.size]
    if not sizes:
        return configured
    mean = sum(sizes) / len(sizes)
    return max(1, min(configured, int(batch_bytes // max(1.0, mean))))


def _key_order(config: EpochcacheConfig, refs: list[SampleRef], index: int,
               position: Any) -> KeyOrder:
    node_rank, num_nodes = config.sampler.node()
    weights = None
    if config.sampler.strategy == "weighted":
        weights = [r.weight if r.weight is not None else 1.0 for r in refs]
    return KeyOrder(
        len(refs),
        seed=config.sampler.seed,
        node_rank=node_rank,
        num_nodes=num_nodes,
        strategy=config.sampler.strategy,
        weights=weights,
        process_index=index,
        num_processes=config.sampler.processes,
        position=position if isinstance(position, dict) and position else None,
    )


class Feed:
    """One source of one sampler process (see the module docstring).

    Args:
        entry: the source, its name ("" for a single ``source:``) and weight.
        config: the validated config.
        index: this sampler's index among ``sampler.processes``.
        position: where this process's key order of this source stopped (None: the start).
        batch_bytes: the bytes a batch aims for.
        fetch_concurrency: requests in flight per batch.
    """

    def __init__(self, entry: SourceEntry, config: EpochcacheConfig, index: int, position: Any,
                 batch_bytes: int, fetch_concurrency: int) -> None:
        self.name, self.prefix, self.weight = entry.name, entry.key_prefix, entry.weight
        cache_dir = str(config.cache.dir)
        self.source = open_configured_source(config, entry.config)
        listing = listing_cached(self.source, cache_dir)
        self.refs = listing.refs
        # The original listing is the key order's base; blocks a re-list added join it by key
        # hash. Weighted sampling draws from the whole listing (no re-listing: see config).
        weighted = config.sampler.strategy == "weighted"
        self.blocks = list(listing.blocks) if weighted else [listing.blocks[0]]
        self.gone = listing.gone  # keys a re-list no longer found: skipped
        self.order = _key_order(config, self.refs[: self.blocks[-1]], index, position)
        self.add_blocks(listing)  # keys added by earlier re-lists, before the saved position
        self.follower = (ListingFollower(self.source, cache_dir)
                         if entry.config.listing_ttl_s else None)
        self.per_batch = _samples_per_batch(config.sampler.batch_size, self.refs,
                                            self.source.unit, config.sampler.concurrency,
                                            batch_bytes)
        self.sizes = SizeEstimate(self.refs, batch_bytes)
        self.source.concurrency = fetch_concurrency
        self.deadline_s = entry.config.timeout_s * 4
        # Refs taken from the key order but not fetched yet (a batch is cut to batch_bytes),
        # and the position before they were taken (saved until they are all fetched).
        self.carry: collections.deque[SampleRef] = collections.deque()
        self.carry_position: dict[str, int] = self.order.state()
        self.fruitless = 0  # offsets taken since the last batch that brought anything new
        self.fetch_started: collections.deque[float] = collections.deque()  # batches in fetch
        # A batch still fetching after this long (a remote that stopped answering) stalls the
        # feed: the mixer goes on with the others instead of waiting for it.
        self.stall_s = entry.config.timeout_s
        self.taken = 0.0  # samples taken for fetching (the mixer's measure)
        self.rest_until = 0.0
        self.failures = 0  # batches in a row that failed as a whole

    def cache_key(self, key: str) -> str:
        """The key a sample of this source is cached under."""
        return self.prefix + key

    def cached(self, cache: SampleStore, refs: list[SampleRef]) -> list[bool]:
        """Whether each ref is cached (a shard: whether any of its samples is); the samples
        of a batch in one read transaction."""
        if self.source.unit == "sample":
            return cache.contains_many([self.cache_key(ref.key) for ref in refs])
        return [cache.has_key_prefix(self.cache_key(ref.key.rstrip("/") + "/")) for ref in refs]

    # -- choosing keys ----------------------------------------------------------------------

    def pick(self, cache: SampleStore, batch_bytes: int,
             skip: Callable[[str], bool]) -> tuple[list[SampleRef], dict[str, int]]:
        """The next refs in key order that are neither cached nor ``skip``-ped (by cache
        key), cut to ``batch_bytes``, and the key order position to save once committed."""
        if not self.carry:
            self.carry_position = self.order.state()
            taken = [self.refs[i] for i in map(int, self.order.take(self.per_batch))
                     if i not in self.gone]
            self.fruitless += self.per_batch
            unique = {ref.key: ref for ref in taken}  # a small dataset can wrap within one batch
            wanted = [ref for ref in unique.values() if not skip(self.cache_key(ref.key))]
            # the whole dataset may fit: skip what is cached
            self.carry.extend(ref for ref, cached in zip(wanted, self.cached(cache, wanted))
                              if not cached)
        batch: list[SampleRef] = []
        total = 0
        while self.carry:
            size = self.sizes.of(self.carry[0])
            if batch and total + size > batch_bytes:
                break
            batch.append(self.carry.popleft())
            total += size
        self.taken += len(batch)
        # Until the rest of what was taken is fetched, a restart must take it again (what is
        # committed by then is skipped as cached): save the position from before the take.
        position = self.carry_position if self.carry else self.order.state()
        return batch, position

    @property
    def exhausted(self) -> bool:
        """A whole pass brought nothing new, and nothing of it is on its way."""
        pass_keys = self.order.pass_length + self.order.num_added
        return self.fruitless >= pass_keys and not self.carry and not self.fetch_started

    @property
    def in_fetch(self) -> int:
        return len(self.fetch_started)

    def stalled(self, now: float) -> bool:
        """Its oldest batch in fetch has taken longer than :attr:`stall_s`."""
        return bool(self.fetch_started) and now - self.fetch_started[0] > self.stall_s

    def available(self, now: float) -> bool:
        """Neither resting nor stalled, nor down with its probe batch on the way: the mixer
        may take a batch from it."""
        if self.down and self.fetch_started:
            return False  # one batch at a time tells whether a source is back
        return self.rest_until <= now and not self.stalled(now)

    # -- resting ----------------------------------------------------------------------------

    def rest(self, seconds: float, now: float | None = None) -> None:
        self.rest_until = (time.monotonic() if now is None else now) + seconds

    def batch_done(self, results: Sequence[tuple[SampleRef, Any]], brought: int) -> None:
        """Judge a fetched batch: one that failed as a whole (nothing fetched, nothing
        corrupt) sends the feed to rest; anything fetched brings it back."""
        failed = [p for _, p in results if isinstance(p, BaseException)]
        if results and len(failed) == len(results) and not brought and not any(
                isinstance(p, CorruptSample) for p in failed):
            self.failures += 1
            wait = min(DOWN_MAX_S, DOWN_FIRST_S * 2 ** (self.failures - 1))
            self.rest(wait)
            if self.failures == 1 or wait == DOWN_MAX_S:
                log.warning("source %s (%s): a whole batch failed (%s); %s, trying it again in "
                            "%.0fs", self.name or "-", self.source.url, failed[0],
                            "the other sources go on" if self.name else "waiting", wait)
        elif self.failures and len(failed) < len(results):
            log.warning("source %s (%s) is back after %d failed batches", self.name or "-",
                        self.source.url, self.failures)
            self.failures = 0

    @property
    def down(self) -> bool:
        return self.failures > 0

    # -- growing listings -------------------------------------------------------------------

    def follow_listing(self) -> None:
        """Take the keys of a listing the daemon re-listed into the key order (this pass)."""
        listing = self.follower.poll() if self.follower is not None else None
        if listing is None:
            return
        if listing.blocks[: len(self.blocks)] != self.blocks:
            log.warning("the saved listing of %s was rebuilt rather than grown; this sampler "
                        "goes on with its %d keys until it is restarted", self.source.url,
                        len(self.refs))
            return
        before = self.order.num_added
        self.refs, self.gone = listing.refs, listing.gone
        self.add_blocks(listing)
        log.info("the listing grew to %d keys (%d gone); %d more for this sampler (%s)",
                 len(self.refs), len(self.gone), self.order.num_added - before, self.source.url)

    def add_blocks(self, listing: Listing) -> None:
        for b in range(len(self.blocks), len(listing.blocks)):
            lo, hi = listing.blocks[b - 1], listing.blocks[b]
            keys = [ref.key for ref in listing.refs[lo:hi]]
            self.order.add_block(np.arange(lo, hi), key_hashes(keys))
            self.blocks.append(hi)


def next_feed(feeds: Sequence[Feed], now: float) -> Feed | None:
    """The feed due for the next batch: of those :meth:`~Feed.available`, the one whose samples
    taken lag its weight most; None when none is. The others are moved up to the chosen one's
    pace (see the module docstring). A feed that is due but has its batches in fetch already
    is waited for, not passed over: the mix follows the weights, not the fastest remote."""
    ready = [feed for feed in feeds if feed.available(now)]
    if not ready:
        return None
    chosen = min(ready, key=lambda feed: feed.taken / feed.weight)
    pace = chosen.taken / chosen.weight
    for feed in feeds:
        if not feed.available(now):
            feed.taken = max(feed.taken, pace * feed.weight)
    return chosen
