"""One sampler process: choose keys, fetch them concurrently, validate, compress, commit.

A sampler runs until its stop flag is set or its daemon disappears. Fetching and committing
overlap: the next batches are fetched while a committer thread (:mod:`.committer`) writes the
previous one, so the cache's write lock and fsync never leave the network idle; what it holds
in flight is bounded in bytes (:mod:`.inflight`). Its position in the key order is saved in the
cache after each commit, so a restarted sampler goes on where it stopped instead of fetching the
same first samples again. Per-sample faults never stop it: corrupt objects and samples the cache
cannot hold are quarantined, failed fetches counted and logged with their key and retried on a
later pass. A fault that is not per-sample (the committer dies) ends the process with exit
status 1 within seconds, so that the daemon restarts it; the death of the daemon ends it at
once (:mod:`.lifeline`).

This module must not import torch: sampler processes stay small.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..config import EpochcacheConfig
from ..errors import CorruptSample, PermanentRemoteError, SampleRejected, SourceError
from ..redact import install_log_redaction
from ..store import SampleStore
from .committer import Batch, Committer, state_name
from .from_config import open_configured_source
from .heap import reuse_freed_buffers
from .inflight import ByteBudget, SizeEstimate
from .keyorder import KeyOrder, key_hashes
from .lifeline import Lifeline, kill_with_parent
from .relist import ListingFollower
from .sources import Listing, SampleRef, Source, listing_cached

__all__ = ["Sampler", "SamplerHealth", "StopFlag", "run_sampler", "state_name"]

log = logging.getLogger(__name__)

#: Pause after a whole pass found every sample already cached (the dataset fits the cache).
IDLE_WAIT_S = 1.0
#: Batches fetched at the same time (``sampler.concurrency`` is split among them).
FETCH_DEPTH = 2
#: Aim for commits of about this many bytes: 64 samples of 1 MiB would hold the pipeline for a
#: 64 MiB round (fetch, then commit) where 8 MiB rounds keep fetching and committing overlapped.
BATCH_BYTES = 8 * 1024 * 1024
#: How often a wait for a fetch looks at the committer and the daemon.
_POLL_S = 0.25


def _cached(cache: SampleStore, source: Source, refs: list[SampleRef]) -> list[bool]:
    """Whether each ref is cached (a shard: whether any of its samples is)."""
    if source.unit == "sample":
        return cache.contains_many([ref.key for ref in refs])
    return [cache.has_key_prefix(ref.key.rstrip("/") + "/") for ref in refs]


def _payload_bytes(payload: Any) -> int:
    return len(payload) if isinstance(payload, bytes) else sum(len(v) for v in payload.values())


@dataclass
class SamplerHealth:
    """What a sampler reports in the cache's ``state`` (``sampler/<index>``)."""

    index: int
    pid: int = field(default_factory=os.getpid)
    fetched: int = 0
    fetched_bytes: int = 0
    committed: int = 0
    skipped: int = 0
    errors: int = 0
    quarantined: int = 0
    deferred: int = 0  # samples larger than the headroom, skipped while leases pin the cache
    last_error: str = ""
    waiting_for_space: bool = False
    position: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    heartbeat: float = field(default_factory=time.time)


class StopFlag:
    """A stop signal shared with sampler processes, polled rather than waited on.

    ``multiprocessing.Event`` is not used on purpose: its ``set()`` blocks forever when a
    process died (kill -9) while waiting on it, which would hang the daemon's shutdown.
    """

    POLL_S = 0.05

    def __init__(self, ctx: Any) -> None:
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(self.POLL_S if left is None else min(self.POLL_S, left))
        return True


def _samples_per_batch(configured: int, refs: list[SampleRef], unit: str, concurrency: int) -> int:
    """Samples per fetch/commit round: ``sampler.batch_size``, fewer for large objects."""
    if unit != "sample":
        return max(1, min(4, concurrency))  # whole shards
    sizes = [ref.size for ref in refs[:1000] if ref.size]
    if not sizes:
        return configured
    mean = sum(sizes) / len(sizes)
    return max(1, min(configured, int(BATCH_BYTES // max(1.0, mean))))


@dataclass
class _Fetching:
    """A batch being fetched: its future, where the key order stands after it, its bytes."""

    future: Future[list[Any]]
    refs: list[SampleRef]
    position: dict[str, int]
    reserved: int


class Sampler:
    """The fetch loop of one sampler process: choose keys, fetch them, hand them to the committer.

    Args:
        config: the validated config.
        index: this sampler's index among ``sampler.processes``.
        stop: the daemon's :class:`StopFlag` (anything with ``is_set``/``wait``/``set``).
        parent_pid: the daemon; if it disappears, the sampler stops too (no orphans).
    """

    def __init__(self, config: EpochcacheConfig, index: int, stop: Any,
                 parent_pid: int | None = None) -> None:
        self.index, self.stop = index, stop
        self.lifeline = Lifeline(parent_pid)
        # sync: false skips the fsync per commit. A killed process still loses nothing committed
        # (the data is in the page cache); only a power loss or kernel crash can cost recent
        # commits, or the cache (rebuild it from the remote). It is what large samples need to
        # ingest at link speed on a busy node (docs/benchmarks.md).
        self.cache = SampleStore(config.cache.dir, compression=config.cache.compression,
                                 level=config.cache.level, sync=config.cache.sync)
        self.source = open_configured_source(config)
        listing = listing_cached(self.source, config.cache.dir)
        self.refs = listing.refs
        # The original listing is the key order's base; blocks a re-list added join it by key
        # hash. Weighted sampling draws from the whole listing (no re-listing: see config).
        weighted = config.sampler.strategy == "weighted"
        self.blocks = list(listing.blocks) if weighted else [listing.blocks[0]]
        self.gone = listing.gone  # keys a re-list no longer found: skipped
        saved = self.cache.tables.get_state(state_name(index)) or {}
        self.order = _key_order(config, self.refs[: self.blocks[-1]], index, saved.get("position"))
        self._add_blocks(listing)  # keys added by earlier re-lists, before the saved position
        self.follower = (ListingFollower(self.source, str(config.cache.dir))
                         if config.source.listing_ttl_s else None)
        self.health = SamplerHealth(index=index)
        for name in ("fetched", "fetched_bytes", "committed", "skipped", "errors", "quarantined",
                     "deferred"):
            setattr(self.health, name, int(saved.get(name, 0)))
        self.committer = Committer(self.cache, self.health, stop=stop,
                                   should_stop=self.should_stop, quarantine=self.quarantine,
                                   done=self._done)
        self.per_batch = _samples_per_batch(config.sampler.batch_size, self.refs, self.source.unit,
                                            config.sampler.concurrency)
        limit = config.sampler.max_bytes_in_flight
        self.budget = ByteBudget(limit)
        # FETCH_DEPTH batches in fetch, one queued and one committing: each gets a share.
        self.batch_bytes = max(1, min(BATCH_BYTES, limit // (FETCH_DEPTH + 2)))
        self.sizes = SizeEstimate(self.refs, self.batch_bytes)
        # FETCH_DEPTH batches are fetched at once, each with its share of `concurrency`: while
        # one drains its slowest requests, the other keeps the link busy (one batch at a time
        # left the link idle at every batch boundary: 0.6x a bare fetch, 0.9x+ with two).
        self.source.concurrency = max(1, -(-config.sampler.concurrency // FETCH_DEPTH))
        self.deadline_s = config.source.timeout_s * 4
        # Keys quarantined by this process: corrupt objects are not fetched (and counted) again
        # every pass; a restarted daemon tries them once more.
        self.quarantined: set[str] = set()
        # Keys fetched but not committed yet: not cached, yet they must not be fetched again
        # (a small pass wraps around while its last batches are still being committed).
        self._in_flight: set[str] = set()
        self._in_flight_lock = threading.Lock()
        # Refs taken from the key order but not fetched yet (a batch is cut to batch_bytes),
        # and the position before they were taken (saved until they are all fetched).
        self.carry: collections.deque[SampleRef] = collections.deque()
        self._carry_position: dict[str, int] = self.order.state()
        self.fruitless = 0  # offsets taken since the last batch that brought anything new
        self.fetching: collections.deque[_Fetching] = collections.deque()
        self.pool = ThreadPoolExecutor(max_workers=FETCH_DEPTH, thread_name_prefix="epochcache-fetch")

    # -- stopping ---------------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Stop asked by the daemon (or SIGTERM), or the daemon is gone (then stop is set)."""
        if self.lifeline.parent_gone():
            self.stop.set()
        return bool(self.stop.is_set())

    # -- the fetch loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Fetch and commit until stopped; what is in flight then is committed too.

        Raises:
            CommitterDied: the committer failed (the process must exit and be restarted).
        """
        self.committer.start()
        log.info("%d %ss, starting at %s", len(self.refs), self.source.unit, self.order.position)
        try:
            while not self.should_stop():
                self.committer.check()
                if self.follower is not None:
                    self._follow_listing()
                pass_keys = self.order.pass_length + self.order.num_added
                if self.fruitless >= pass_keys and not self.fetching and not self.carry:
                    # A whole pass brought nothing new (everything cached, corrupt or failing):
                    # wait instead of spinning on the cache and the remote.
                    self.stop.wait(IDLE_WAIT_S)
                    self.fruitless = 0
                    continue
                picked, position = self._pick()
                if picked and not self._reserve_and_submit(picked, position):
                    break
                if len(self.fetching) >= FETCH_DEPTH or (self.fetching and not picked):
                    self._hand_over()
            # Stopping: what is being fetched is committed too (graceful stop loses nothing).
            while self.fetching:
                self._hand_over()
        except SourceError as exc:
            self.health.last_error = str(exc)[:300]
            raise

    def _pick(self) -> tuple[list[SampleRef], dict[str, int]]:
        """The next batch of refs in key order that are neither cached nor on their way, cut
        to :attr:`batch_bytes`, and the key order position to save once it is committed."""
        if not self.carry:
            self._carry_position = self.order.state()
            taken = [self.refs[i] for i in map(int, self.order.take(self.per_batch))
                     if i not in self.gone]
            self.fruitless += self.per_batch
            unique = {ref.key: ref for ref in taken}  # a small dataset can wrap within one batch
            wanted = [ref for ref in unique.values()
                      if ref.key not in self.quarantined and not self._is_in_flight(ref.key)]
            # the whole dataset may fit: skip what is cached
            self.carry.extend(ref for ref, cached in zip(wanted, _cached(self.cache, self.source,
                                                                          wanted)) if not cached)
        batch: list[SampleRef] = []
        total = 0
        while self.carry:
            size = self.sizes.of(self.carry[0])
            if batch and total + size > self.batch_bytes:
                break
            batch.append(self.carry.popleft())
            total += size
        # Until the rest of what was taken is fetched, a restart must take it again (what is
        # committed by then is skipped as cached): save the position from before the take.
        position = self._carry_position if self.carry else self.order.state()
        return batch, position

    def _follow_listing(self) -> None:
        """Take the keys of a listing the daemon re-listed into the key order (this pass)."""
        listing = self.follower.poll() if self.follower is not None else None
        if listing is None:
            return
        if listing.blocks[: len(self.blocks)] != self.blocks:
            log.warning("the saved listing was rebuilt rather than grown; this sampler goes on "
                        "with its %d keys until it is restarted", len(self.refs))
            return
        before = self.order.num_added
        self.refs, self.gone = listing.refs, listing.gone
        self._add_blocks(listing)
        log.info("the listing grew to %d keys (%d gone); %d more for this sampler",
                 len(self.refs), len(self.gone), self.order.num_added - before)

    def _add_blocks(self, listing: Listing) -> None:
        for b in range(len(self.blocks), len(listing.blocks)):
            lo, hi = listing.blocks[b - 1], listing.blocks[b]
            keys = [ref.key for ref in listing.refs[lo:hi]]
            self.order.add_block(np.arange(lo, hi), key_hashes(keys))
            self.blocks.append(hi)

    def _reserve_and_submit(self, picked: list[SampleRef], position: dict[str, int]) -> bool:
        """Reserve the batch's bytes (handing over fetched batches meanwhile) and start
        fetching it; False if the sampler is stopping instead."""
        need = sum(self.sizes.of(ref) for ref in picked)
        while self.fetching and not self.budget.fits(need):
            self._hand_over()
        if not self.budget.wait(need, self._stop_or_committer_dead):
            self.committer.check()
            return False
        self.budget.take(need)
        keys = [ref.key for ref in picked]
        with self._in_flight_lock:
            self._in_flight.update(keys)
        future = self.pool.submit(self.source.fetch_with_retries, picked,
                                  deadline_s=self.deadline_s)
        self.fetching.append(_Fetching(future, picked, position, need))
        return True

    def _stop_or_committer_dead(self) -> bool:
        return self.should_stop() or self.committer.error is not None or not self.committer.is_alive()

    def _hand_over(self) -> None:
        """Wait for the oldest batch in flight and queue it for commit (in order)."""
        fetching = self.fetching.popleft()
        keys = [ref.key for ref in fetching.refs]
        while True:
            try:
                results = fetching.future.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                self.committer.check()
                if self.lifeline.parent_gone():  # nobody will read what we would commit
                    self.stop.set()
                    self._done(Batch([], fetching.position, keys, fetching.reserved))
                    return
        self.quarantined.update(
            ref.key for ref, payload in results if isinstance(payload, CorruptSample))
        records, fetched = self._encode_results(results)
        unknown = [ref for ref in fetching.refs if not ref.size]
        if unknown and fetched:
            self.sizes.observe(fetched * len(unknown) // max(1, len(fetching.refs)), len(unknown))
        # From here on the batch holds its records (the fetched payloads are dropped).
        nbytes = sum(len(record) for _, record in records)
        self.budget.adjust(fetching.reserved, nbytes)
        if records:
            self.fruitless = 0
        self.committer.hand_over(Batch(records, fetching.position, keys, nbytes))

    def _encode_results(self, results: list[tuple[SampleRef, Any]]) -> tuple[list[tuple[str, bytes]], int]:
        """Records of the fetched samples (errors counted, corrupt ones quarantined), and the
        bytes fetched."""
        records: list[tuple[str, bytes]] = []
        fetched = 0
        health = self.health
        for ref, payload in results:
            if isinstance(payload, CorruptSample):
                self.quarantine(ref.key, str(payload))
            elif isinstance(payload, BaseException):
                health.errors += 1
                health.last_error = f"{ref.key}: {payload}"[:300]
                level = logging.WARNING if isinstance(payload, PermanentRemoteError) else logging.INFO
                log.log(level, "fetch failed for %s (retried next pass): %s", ref.key, payload)
            else:
                size = _payload_bytes(payload)
                health.fetched += 1
                health.fetched_bytes += size
                fetched += size
                try:
                    records.append((ref.key, self.cache.encode(ref.key, payload)))
                except SampleRejected as exc:
                    self.quarantine(ref.key, str(exc))
        return records, fetched

    # -- shared with the committer thread ---------------------------------------------------------

    def quarantine(self, key: str, reason: str) -> None:
        """Count, log (with its URL) and record a sample that cannot be cached; it is not
        fetched again by this process."""
        url = self.source.object_url(key)
        self.quarantined.add(key)
        self.health.quarantined += 1
        log.warning("quarantined %s: %s", url, reason)
        self.cache.tables.quarantine(key, reason, url=url)

    def _is_in_flight(self, key: str) -> bool:
        with self._in_flight_lock:
            return key in self._in_flight

    def _done(self, batch: Batch) -> None:
        """A batch is finished with: its keys may be fetched again, its bytes are free."""
        with self._in_flight_lock:
            self._in_flight.difference_update(batch.keys)
        self.budget.release(batch.nbytes)

    # -- ending -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop fetching, let the committer finish, save the health document, close the cache.

        Raises:
            CommitterDied: the committer failed.
        """
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.committer.finish()
        self.health.heartbeat = time.time()
        self.cache.tables.put_state(state_name(self.index), asdict(self.health))
        self.cache.close()

    def abort(self, error: BaseException) -> None:
        """After a fatal error: record it in the health document, best effort, and return
        without waiting for fetches or the committer (the process exits next)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.health.last_error = f"sampler exited: {type(error).__name__}: {error}"[:300]
        self.health.heartbeat = time.time()
        try:
            self.cache.tables.put_state(state_name(self.index), asdict(self.health))
        except Exception as exc:  # noqa: BLE001 - the cache may be what failed
            log.warning("sampler %d: could not save its health: %s", self.index, exc)


def _key_order(config: EpochcacheConfig, refs: list[SampleRef], index: int,
               position: dict[str, int] | None) -> KeyOrder:
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
        position=position or None,
    )


def run_sampler(config_data: dict[str, Any], index: int, stop: Any,
                parent_pid: int | None = None) -> None:
    """Entry point of a sampler process (started with ``spawn`` by the daemon).

    Returns when stopped. On a fatal error (the committer died, the cache failed) it logs the
    error and ends the process with exit status 1 at once, without waiting for fetches in
    flight: the daemon restarts it. Committed samples are durable either way.

    Args:
        config_data: the validated config, as ``EpochcacheConfig.to_transfer()``.
        index: this sampler's index among ``sampler.processes``.
        stop: the daemon's :class:`StopFlag`; set, the sampler stops after committing what it
            has fetched.
        parent_pid: the daemon; if it disappears, the sampler stops too (no orphans).
    """
    if parent_pid is not None:
        kill_with_parent()
        if os.getppid() != parent_pid:  # the daemon died before the kernel was told
            return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    # SIGTERM to the whole process group (systemd, timeout): stop after the batch in flight.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reuse_freed_buffers()
    config = EpochcacheConfig.from_transfer(config_data)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s sampler {index}: %(message)s")
    install_log_redaction(secrets=set(config.secrets))  # URLs in any library's log lines
    sampler = Sampler(config, index, stop, parent_pid)
    try:
        sampler.run()
        sampler.close()
    except BaseException as exc:  # any failure: exit now, the daemon restarts us
        log.error("sampler %d is exiting on %s: %s (the daemon restarts it)", index,
                  type(exc).__name__, exc, exc_info=exc)
        sampler.abort(exc)
        logging.shutdown()
        os._exit(1)  # not sys.exit: it would wait for fetch threads stuck on the remote
