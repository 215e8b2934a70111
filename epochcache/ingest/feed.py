"""One source as a sampler process samples it, and the choice of which source goes next.

A sampler process holds a `Feed` per source it samples (one for ``source:``, one per
entry of ``sources:``): the source, its listing and key order, the refs taken but not fetched
yet, and its state as the mixer sees it. `next_feed` picks the feed whose share of the
samples taken so far lags its weight most, so that over many batches the samples taken from
each source are in proportion to the weights; each sampler process does the same, so the
cache's intake is too.

Weights count *samples*: a ``tar`` ref is a whole shard, so a shard taken counts as the
samples it holds, estimated from the shards read so far (the mean) until its own count is
known, then corrected. The mix holds over batches: at any time each source is at most about
one batch (``sampler.batch_size`` samples, or up to 4 shards) ahead of or behind its share.

A feed whose batch failed as a whole (the remote is down) *rests*: it is left out for a backoff
of 1 s doubling to 60 s, then tried with one batch again, while the others take its share. A
feed whose whole pass brought nothing new (everything cached, corrupt or failing) goes idle
(`idle`): it retries only the keys that failed, and scans again only when the cache lost
samples or its listing changed. A resting feed keeps pace on paper (its count is moved up with
the others'), so that when it is back it takes its share from then on instead of catching up in
a burst that would starve the others. So does a feed whose remote throttles it (503 SlowDown,
429) while all its batches are in fetch: the mix follows the weights while every remote keeps
up, never a remote's rate limit.

Each feed's source reads through a request gate (`requests`): requests in flight per
``sampler.concurrency`` (``auto``: `concurrency`), shared by the batches of the feed in
fetch (two, or more while the concurrency needs them: `Feed.max_in_fetch`), the pace
after throttling (`concurrency.Pace`), the daemon's request budget, and the request counters.

The listing is held as a `KeyTable` (no object per key). A listing still under
way (a large bucket) is sampled as it grows; once it is complete it is saved as a new
*generation*, and the key order starts afresh over all keys. Saved positions name their
generation: one saved over another listing (another ``source.url``, a listing made afresh) is
not applied, the source starts at the start of its own order, and the log says why.

Cache keys: a single ``source:`` caches a sample under its source key, so existing caches
stay valid; an entry of ``sources:`` under ``<name>/<source key>``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..config import EpochcacheConfig, SourceEntry
from ..errors import (
    CorruptSample,
    PermanentRemoteError,
    RemoteTimeout,
    SourceRefused,
    SourceUnavailable,
    Throttled,
)
from ..store import SampleStore
from ..store.plumbing import has_key_prefix
from .committer import SizeEstimate
from .concurrency import AutoConcurrency, FixedConcurrency, Pace, SharedPaceState
from .daemon_sources import ListingFollower, listing_mtime
from .health import RequestStats, source_label
from .idle import IdleState
from .keyorder import KeyOrder, key_hashes
from .layouts import KeyTable, Listing, SampleRef, listing_for_sampling, open_configured_source
from .requests import RequestBudget, RequestGate

log = logging.getLogger(__name__)

#: The longest a sampler sleeps between looks at its feeds when all of them rest.
IDLE_WAIT_S = 1.0
#: Samples a shard counts for before any shard of its source was read.
SHARD_SAMPLES_GUESS = 1.0
#: A feed whose batches fail as a whole rests this long at first, doubling up to the maximum.
DOWN_FIRST_S, DOWN_MAX_S = 1.0, 60.0
#: Batches of a feed fetched at once: at least FETCH_DEPTH (while one drains its slowest
#: requests, the next keeps the link busy; one at a time left the link idle at every batch
#: boundary: 0.6x a bare fetch, 0.9x+ with two), more while the requests allowed in flight
#: need them, at most MAX_BATCHES (with sampler.max_bytes_in_flight bounding their bytes).
FETCH_DEPTH, MAX_BATCHES = 2, 32
#: Tar shards per batch (a shard is large; the concurrency comes from more batches).
SHARDS_PER_BATCH = 4
#: A feed whose batches meet a refusal of the whole source (`SourceRefused`: access denied,
#: another region, a scheme refused) stops, and tries one batch again after this long.
REFUSED_RECHECK_S = 600.0
#: A feed throttled this recently, its batches all in fetch, is passed over by the mixer: the
#: other sources go on at their own pace instead of waiting for a remote that holds it back.
THROTTLED_RECENTLY_S = 5.0


def error_kind(error: BaseException) -> str:
    """The ``kind`` label of a failed fetch (status and the remote-errors metric)."""
    return next((kind for kind, cls in (("timeout", RemoteTimeout), ("throttled", Throttled),
                                        ("unavailable", SourceUnavailable),
                                        ("permanent", PermanentRemoteError))
                 if isinstance(error, cls)), "other")


def _samples_per_batch(configured: int, table: KeyTable, unit: str, concurrency: int | str,
                       batch_bytes: int) -> int:
    """Samples per fetch/commit round: ``sampler.batch_size``, fewer for large objects."""
    if unit != "sample":  # whole shards
        return max(1, min(SHARDS_PER_BATCH,
                          concurrency if isinstance(concurrency, int) else SHARDS_PER_BATCH))
    sizes = table.known_sizes()
    if not len(sizes):
        return configured
    mean = float(sizes.mean())
    return max(1, min(configured, int(batch_bytes // max(1.0, mean))))


def _key_order(config: EpochcacheConfig, table: KeyTable, count: int, index: int,
               position: Any) -> KeyOrder:
    """The key order over the first ``count`` keys of ``table`` (the base block)."""
    node_rank, num_nodes = config.sampler.node()
    weights = None
    if config.sampler.strategy == "weighted":
        weights = table.weights_or_ones()[:count]
    return KeyOrder(
        count,
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
        cache: the sampler's store (the idle feed reads its removal counter).
        budget: the daemon's shared request budget (``sampler.max_requests_per_s``).
        saved_requests: this source's request counters as the sampler last saved them.
    """

    def __init__(self, entry: SourceEntry, config: EpochcacheConfig, index: int, position: Any,
                 batch_bytes: int, cache: SampleStore,
                 budget: RequestBudget | None = None,
                 saved_requests: Mapping[str, Any] | None = None) -> None:
        self.name, self.prefix, self.weight = entry.name, entry.key_prefix, entry.weight
        self._config, self._index = config, index
        cache_dir = str(config.cache.dir)
        self.source = open_configured_source(config, entry.config)
        mtime = listing_mtime(self.source, cache_dir)  # before reading: a save after is seen
        listing = listing_for_sampling(self.source, cache_dir)
        self._take_listing(listing, self._own_position(position, listing))
        self.follower = (ListingFollower(self.source, cache_dir, mtime)
                         if entry.config.listing_ttl_s or not listing.complete else None)
        self._follow_always = bool(entry.config.listing_ttl_s)
        self.per_batch = _samples_per_batch(config.sampler.batch_size, self.table,
                                            self.source.unit, config.sampler.concurrency,
                                            batch_bytes)
        self.sizes = SizeEstimate(self.table.known_sizes(), batch_bytes)
        wanted = config.sampler.concurrency
        pacer = Pace(SharedPaceState.in_cache(cache_dir, source_label(self.name)))
        control = (FixedConcurrency(wanted, pacer=pacer) if isinstance(wanted, int)
                   else AutoConcurrency(cap=self._byte_cap(), pacer=pacer))
        self.source.gate = RequestGate(control, RequestStats(saved_requests), budget)
        self.deadline_s = entry.config.timeout_s * 4
        # Refs taken from the key order but not fetched yet (a batch is cut to batch_bytes),
        # with their listing indices, and the position before they were taken (saved until
        # they are all fetched).
        self.carry: collections.deque[tuple[int, SampleRef]] = collections.deque()
        self.carry_position: dict[str, Any] = self.position()
        self.fruitless = 0  # offsets taken since the last batch that brought anything new
        self.fetch_started: collections.deque[float] = collections.deque()  # batches in fetch
        # A batch still fetching after this long (a remote that stopped answering) stalls the
        # feed: the mixer goes on with the others instead of waiting for it.
        self.stall_s = entry.config.timeout_s
        self.taken = 0.0  # samples taken for fetching (the mixer's measure)
        self.shards_read = 0  # tar: shards read and the samples they held, for the estimate
        self.shard_samples = 0
        self.failures = 0  # batches in a row that failed as a whole
        # The refusal that stopped this source (None: not stopped; see batch_done).
        self.refused: SourceRefused | None = None
        # Wall time of the first failed read since the last one that succeeded (None: the
        # last read succeeded), and the last error meanwhile: see health.FAILING_AFTER_S.
        self.failing_since: float | None = None
        self.last_error = ""

        def removed() -> int:
            counters = cache.counters()
            return counters.inserted - counters.samples

        self.idle = IdleState(removed)

    # -- the listing ------------------------------------------------------------------------

    def _take_listing(self, listing: Listing, position: Any) -> None:
        """Sample ``listing`` from ``position`` (None: the start of its key order)."""
        self.table, self.gone = listing.table, listing.gone  # gone: skipped
        self.generation, self.complete = listing.generation, listing.complete
        # The original listing is the key order's base; blocks a re-list added join it by key
        # hash. Weighted sampling draws from the whole listing (no re-listing: see config).
        weighted = self._config.sampler.strategy == "weighted"
        self.blocks = list(listing.blocks) if weighted else [listing.blocks[0]]
        self.order = _key_order(self._config, self.table, self.blocks[-1], self._index, position)
        self.add_blocks(listing)  # keys added by earlier re-lists, before the saved position

    def _own_position(self, position: Any, listing: Listing) -> Any:
        """``position`` if it was saved in this listing's generation (or before generations
        were saved), else None: a position is an offset in one listing's key order."""
        if not isinstance(position, dict) or not position:
            return None
        saved = position.get("listing")
        if saved is not None and saved != listing.generation:
            log.info("%s: the saved sampling position belongs to another listing (%s; this one "
                     "is %s: source.url or the listing changed), so this source starts at the "
                     "start of its own key order", self.source.url, saved,
                     listing.generation or "unnamed")
            return None
        return position

    def position(self) -> dict[str, Any]:
        """Where the key order stands, naming the listing generation it belongs to."""
        state: dict[str, Any] = dict(self.order.state())
        if self.generation:
            state["listing"] = self.generation
        return state

    def cache_key(self, key: str) -> str:
        """The key a sample of this source is cached under."""
        return self.prefix + key

    def cached(self, cache: SampleStore, keys: list[str]) -> list[bool]:
        """Whether each source key is cached (a shard: whether any of its samples is); the
        samples of a batch in one read transaction."""
        if self.source.unit == "sample":
            return cache.contains_many([self.cache_key(key) for key in keys])
        return [has_key_prefix(cache, self.cache_key(key.rstrip("/") + "/")) for key in keys]

    # -- choosing keys ----------------------------------------------------------------------

    def pick(self, cache: SampleStore, batch_bytes: int, skip: Callable[[str], bool]
             ) -> tuple[list[SampleRef], list[int], dict[str, Any]]:
        """The next refs in key order (or, retrying, the keys that failed) that are neither
        cached nor ``skip``-ped (by cache key), cut to ``batch_bytes``; their listing indices;
        and the key order position to save once committed."""
        if not self.carry:
            self.carry_position = self.position()
            if self.idle.mode == "retry":
                indices = self.idle.take_retries(self.per_batch)
            else:
                indices = [i for i in map(int, self.order.take(self.per_batch))
                           if i not in self.gone]
                self.fruitless += self.per_batch
            unique = list(dict.fromkeys(indices))  # a small dataset can wrap within a batch
            keys = self.table.keys_at(unique)
            wanted = [(i, key) for i, key in zip(unique, keys) if not skip(self.cache_key(key))]
            cached = self.cached(cache, [key for _, key in wanted])
            # the whole dataset may fit: skip what is cached (a ref is made only for the rest:
            # at a million keys, refs of cached keys were 40% of a pass)
            self.carry.extend((i, self.table.ref(i)) for (i, _), hit in zip(wanted, cached)
                              if not hit)
        batch: list[SampleRef] = []
        indices = []
        total = 0
        while self.carry:
            size = self.sizes.of(self.carry[0][1])
            if batch and total + size > batch_bytes:
                break
            i, ref = self.carry.popleft()
            batch.append(ref)
            indices.append(i)
            total += size
        self.taken += len(batch) * self.samples_per_ref
        # Until the rest of what was taken is fetched, a restart must take it again (what is
        # committed by then is skipped as cached): save the position from before the take.
        position = self.carry_position if self.carry else self.position()
        return batch, indices, position

    @property
    def samples_per_ref(self) -> float:
        """What one ref counts for in the mix: 1, or a shard's estimated samples."""
        if self.source.unit == "sample":
            return 1.0
        if not self.shards_read:
            return SHARD_SAMPLES_GUESS
        return self.shard_samples / self.shards_read

    def samples_read(self, refs: int, estimated: float, results: Sequence[tuple[SampleRef, Any]]
                     ) -> None:
        """Correct the mix's count once a batch of ``refs`` shards, counted as ``estimated``
        samples, is read: each shard counts for the samples it held."""
        if self.source.unit == "sample":
            return
        whole = [ref for ref, payload in results if ref.shard is None]  # a shard that failed
        samples = len(results) - len(whole)
        read = refs - len(whole)
        if read > 0:
            self.shards_read += read
            self.shard_samples += samples
        self.taken += samples + len(whole) * self.samples_per_ref - estimated

    @property
    def exhausted(self) -> bool:
        """A whole pass (or round of retries) brought nothing new, and nothing of it is on its
        way."""
        if self.carry or self.fetch_started:
            return False
        if self.idle.mode == "retry":
            return not self.idle.queue
        pass_keys = self.order.pass_length + self.order.num_added
        return self.fruitless >= pass_keys

    def tend(self, now: float) -> bool:
        """Move the feed between scanning, retrying and idle (see `idle`); True when it
        just came to rest with nothing new to fetch."""
        idle = self.idle
        if idle.mode == "idle":
            if idle.changed(now):
                self.wake()
            return False
        if idle.mode == "retry" and idle.until <= now and idle.full_pass:
            self.wake()  # too many failed to remember: the whole pass again
            return False
        if self.exhausted and idle.until <= now:
            idle.round_over(now)
            self.fruitless = 0
            return True
        return False

    def wake(self) -> None:
        """Scan all keys again (something may be fetchable now)."""
        self.idle.wake()
        self.fruitless = 0

    def brought_new(self) -> None:
        """A batch of this feed brought new samples: the pass goes on."""
        self.fruitless = 0
        self.idle.brought()

    @property
    def resting(self) -> bool:
        """Idle, or waiting to retry what failed (see `idle`)."""
        return self.idle.mode != "scan"

    @property
    def gate(self) -> RequestGate:
        return self.source.gate

    @property
    def max_in_fetch(self) -> int:
        """Batches fetched at once (see `MAX_BATCHES`): enough to keep the requests
        allowed in flight busy, plus one to draining."""
        needed = -(-self.gate.slots // max(1, self.per_batch)) + 1
        return max(FETCH_DEPTH, min(MAX_BATCHES, needed))

    @property
    def busy(self) -> bool:
        """As many batches in fetch as it may have."""
        return len(self.fetch_started) >= self.max_in_fetch

    def _byte_cap(self) -> int:
        """The most requests in flight whose bytes fit ``sampler.max_bytes_in_flight``."""
        return max(1, self._config.sampler.max_bytes_in_flight // max(1, self.sizes.mean))

    def observed_sizes(self) -> None:
        """The size estimate changed: an ``auto`` concurrency's cap follows it."""
        control = self.gate.control
        if isinstance(control, AutoConcurrency):
            control.set_cap(self._byte_cap())

    def throttled(self, now: float) -> bool:
        """The remote throttled this feed's requests lately."""
        return self.gate.control.throttled_within(THROTTLED_RECENTLY_S, now)

    def stalled(self, now: float) -> bool:
        """Its oldest batch in fetch has taken longer than `stall_s`."""
        return bool(self.fetch_started) and now - self.fetch_started[0] > self.stall_s

    def available(self, now: float) -> bool:
        """Neither resting nor stalled, nor down with its probe batch on the way, nor
        throttled with all its batches in fetch: the mixer may take a batch from it."""
        if self.down and self.fetch_started:
            return False  # one batch at a time tells whether a source is back
        if self.busy and self.throttled(now):
            return False  # the remote holds it back: the others must not wait for it
        if self.idle.mode == "idle" or (self.idle.mode == "retry" and not self.idle.queue):
            return False
        return self.idle.until <= now and not self.stalled(now)

    # -- resting ----------------------------------------------------------------------------

    def rest(self, seconds: float) -> None:
        self.idle.until = time.monotonic() + seconds

    def batch_done(self, results: Sequence[tuple[SampleRef, Any]], brought: int) -> None:
        """Judge a fetched batch: one that failed as a whole (nothing fetched, nothing
        corrupt, no key missing) sends the feed to rest, and one refused as a whole
        (`SourceRefused`) stops it for `REFUSED_RECHECK_S`; anything fetched brings it
        back."""
        failed = [p for _, p in results if isinstance(p, BaseException)]
        read = len(failed) < len(results) or any(isinstance(p, CorruptSample) for p in failed)
        if read:
            self.failing_since = None
        elif failed:
            self.failing_since = self.failing_since or time.time()
            self.last_error = str(failed[0])
        refusal = next((p for p in failed if isinstance(p, SourceRefused)), None)
        if results and not read and not brought and refusal is not None:
            self._stop(refusal)
            return
        if self.refused is not None and read:
            log.warning("source %s (%s) is read again: the refusal that stopped it is gone",
                        self.name or "-", self.source.url)
            self.refused = None
        # a key gone (404) or not nameable is quarantined: the remote answered
        answered = any(isinstance(p, PermanentRemoteError) and not isinstance(p, SourceRefused)
                       for p in failed)
        if results and not read and not brought and not answered:
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

    def _stop(self, refusal: SourceRefused) -> None:
        """Every key of the source would be refused: stop fetching it (one error line, not
        one per key), and try one batch again after `REFUSED_RECHECK_S` (a credential
        fixed, a policy changed: the source resumes without a restart)."""
        if self.refused is None or str(self.refused) != str(refusal):
            log.error("source %s stopped: %s. Its keys are not fetched; it is tried again in "
                      "%.0f s or when the daemon restarts", self.name or self.source.url,
                      " ".join(str(refusal).split()), REFUSED_RECHECK_S)
        self.refused = refusal
        self.rest(REFUSED_RECHECK_S)

    @property
    def down(self) -> bool:
        return self.failures > 0 or self.refused is not None

    # -- growing listings -------------------------------------------------------------------

    def follow_listing(self) -> None:
        """Take the keys of a listing the daemon saved since (a re-list, or a listing under
        way) into the key order."""
        listing = self.follower.poll() if self.follower is not None else None
        if listing is None or (listing.generation == self.generation
                               and listing.blocks == self.blocks
                               and listing.complete == self.complete
                               and listing.gone == self.gone):
            return  # nothing new (saved again as it was)
        weighted = self._config.sampler.strategy == "weighted"
        if (listing.generation != self.generation or weighted
                or listing.blocks[: len(self.blocks)] != self.blocks):
            # A new listing (the one under way is complete, or it was made afresh): its key
            # order starts at its start.
            log.info("%s: a new listing of %d keys (%s); sampling it from the start of its key "
                     "order", self.source.url, len(listing.table),
                     "complete" if listing.complete else "still being listed")
            self.carry.clear()  # refs of the old listing's order: the new order has them
            self._take_listing(listing, None)
        else:
            before = self.order.num_added
            self.table, self.gone, self.complete = listing.table, listing.gone, listing.complete
            self.add_blocks(listing)
            log.info("the listing grew to %d keys (%d gone); %d more for this sampler (%s)",
                     len(self.table), len(self.gone), self.order.num_added - before,
                     self.source.url)
        if self.complete and not self._follow_always:
            self.follower = None  # the listing is done: nothing more to follow
        self.wake()

    def add_blocks(self, listing: Listing) -> None:
        for b in range(len(self.blocks), len(listing.blocks)):
            lo, hi = listing.blocks[b - 1], listing.blocks[b]
            keys = listing.table.keys(lo, hi)
            self.order.add_block(np.arange(lo, hi), key_hashes(keys))
            self.blocks.append(hi)


def next_feed(feeds: Sequence[Feed], now: float) -> Feed | None:
    """The feed due for the next batch: of those `available`, the one whose samples
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
