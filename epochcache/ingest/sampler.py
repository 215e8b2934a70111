"""One sampler process: choose keys, fetch them concurrently, validate, compress, commit.

A sampler runs until its stop flag is set or its daemon disappears. Fetching and committing
overlap: the next batches are fetched (their requests through each source's gate: how many in
flight, the pace after throttling, the counters; see `feed`) while a committer thread
(`committer`) writes the previous one, so the cache's write lock and fsync never leave the network idle; what it holds
in flight is bounded in bytes (`committer.InFlight`). Its position in the key order is saved in the
cache after each commit, so a restarted sampler goes on where it stopped instead of fetching the
same first samples again. With several sources (``sources:``) it holds a `Feed`
per source and takes batches from each in proportion to its weight; a source that is down
rests while the others go on (see `feed`). Per-sample faults never stop it: corrupt objects and samples the cache
cannot hold are quarantined, failed fetches counted and logged with their key and retried on a
later pass. A fault that is not per-sample (the committer dies) ends the process with exit
status 1 within seconds, so that the daemon restarts it; the death of the daemon ends it at
once (`process.Lifeline`).

This module must not import torch: sampler processes stay small.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import EpochcacheConfig
from ..errors import (
    CorruptSample,
    PermanentRemoteError,
    SampleRejected,
    SourceError,
    SourceRefused,
)
from ..limits import cut_key, cut_text
from ..redact import install_log_redaction
from ..store import SampleStore
from .committer import Batch, Committer, InFlight, state_name
from .feed import (
    FETCH_DEPTH,
    IDLE_WAIT_S,
    MAX_BATCHES,
    Feed,
    error_kind,
    next_feed,
)
from .health import FAILING_AFTER_S, saved_requests, source_label
from .layouts import STREAMED, Piece, SampleRef
from .lineage import OriginTagger
from .process import Lifeline, kill_with_parent, reuse_freed_buffers
from .requests import RequestBudget

#: Libraries whose INFO lines (botocore's "Found credentials in ...") a sampler started
#: without its daemon's levels leaves out.
QUIET_LIBRARIES = dict.fromkeys(("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3",
                                  "asyncio"), logging.WARNING)

log = logging.getLogger(__name__)

#: Aim for commits of about this many bytes: 64 samples of 1 MiB would hold the pipeline for a
#: 64 MiB round (fetch, then commit) where 8 MiB rounds keep fetching and committing overlapped.
BATCH_BYTES = 8 * 1024 * 1024
#: How often a wait for a fetch looks at the committer and the daemon.
_POLL_S = 0.25


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
    last_ok: float = 0.0  # time of the last successful fetch
    last_failed: float = 0.0  # time of the last failed fetch
    # "complete": a whole pass over this sampler's keys brought nothing new and no fetch failed
    # (each key is cached or quarantined); "failing": nothing new, and fetches failed; "": busy.
    idle: str = ""
    waiting_for_space: bool = False
    # The key order position: of the source, or {name: position} of each of ``sources:``.
    position: dict[str, Any] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)  # failed fetches by error_kind()
    lease_wait_s: float = 0.0  # seconds its commits waited for leases to free space
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)  # {name: {errors, down}}
    # {source label: {gets, lists, bytes, throttled, ..., concurrency, pace}} (.health)
    requests: dict[str, dict[str, float]] = field(default_factory=dict)
    # {source label: {since, error, stopped}}: sources none of whose reads succeeded since
    # `since` (wall time), or stopped by a refusal; status shows them failing after a minute
    failing: dict[str, dict[str, Any]] = field(default_factory=dict)
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


@dataclass
class _Fetching:
    """A batch being fetched: its future, its feed, where that feed's key order stands after
    it, its bytes."""

    future: Future[list[Any]]
    feed: Feed
    refs: list[SampleRef]
    position: dict[str, Any]
    reserved: int
    started: float
    indices: list[int] = field(default_factory=list)  # the refs' listing indices
    estimate: float = 0.0  # samples the mix counted the batch for


class Sampler:
    """The fetch loop of one sampler process: choose keys, fetch them, hand them to the committer.

    Args:
        config: the validated config.
        index: this sampler's index among ``sampler.processes``.
        stop: the daemon's `StopFlag` (anything with ``is_set``/``wait``/``set``); set, the
            sampler stops after committing what it has fetched.
        parent_pid: the daemon; if it disappears, the sampler stops too (no orphans).
        sources: names of the ``sources:`` entries to sample (default all; the daemon leaves
            out optional ones it could not reach).
    """

    def __init__(self, config: EpochcacheConfig, index: int, stop: Any,
                 parent_pid: int | None = None, sources: Sequence[str] | None = None) -> None:
        self.index, self.stop = index, stop
        self.lifeline = Lifeline(parent_pid)
        # sync: false skips the fsync per commit. A killed process still loses nothing committed
        # (the data is in the page cache); only a power loss or kernel crash can cost recent
        # commits, or the cache (rebuild it from the remote). It is what large samples need to
        # ingest at link speed on a busy node (docs/benchmarks.md).
        self.cache = SampleStore(config.cache.dir, compression=config.cache.compression,
                                 level=config.cache.level, sync=config.cache.sync)
        saved = self.cache.tables.get_state(state_name(index)) or {}
        limit = config.sampler.max_bytes_in_flight
        self.in_flight = InFlight(limit)
        # FETCH_DEPTH batches in fetch, one queued and one committing: each gets a share.
        self.batch_bytes = max(1, min(BATCH_BYTES, limit // (FETCH_DEPTH + 2),
                                      # a commit fits a small cache beside what it holds: a
                                      # batch past capacity + headroom was cut with a warning
                                      # telling the user to "write smaller batches"
                                      config.cache.capacity // 4))
        per_s = config.sampler.max_requests_per_s
        self.request_budget = RequestBudget.in_cache(config.cache.dir, per_s) if per_s else None
        entries = [e for e in config.source_entries() if sources is None or e.name in sources]
        self.feeds = [Feed(entry, config, index, _saved_position(saved, entry.name),
                           self.batch_bytes, self.cache, self.request_budget,
                           saved_requests(saved, source_label(entry.name)))
                      for entry in entries]
        self._by_prefix = {feed.name: feed for feed in self.feeds}
        # One bandwidth budget per process, whatever the source: a source that is down leaves
        # its share of the link to the others.
        for feed in self.feeds[1:]:
            feed.source.limiter = self.feeds[0].source.limiter
        self.health = SamplerHealth(index=index)
        for name in ("fetched", "fetched_bytes", "committed", "skipped", "errors", "quarantined",
                     "deferred"):
            setattr(self.health, name, int(saved.get(name, 0)))
        self.health.lease_wait_s = float(saved.get("lease_wait_s", 0.0))
        self.health.error_kinds = {str(k): int(v)
                                   for k, v in (saved.get("error_kinds") or {}).items()}
        self.health.sources = {feed.name: {"errors": 0, "down": False}
                               for feed in self.feeds if feed.name}
        kept = saved.get("requests")  # of sources left out now: kept as they were
        self._requests_kept = {str(k): v for k, v in kept.items()
                               if k not in {source_label(f.name) for f in self.feeds}} \
            if isinstance(kept, dict) else {}
        self.publish_requests()
        # Where each feed starts: the health document is written before anything commits
        # (idle, failing), and an empty position there was a restart's lost place.
        if config.sources is not None:  # sources left out (unreachable) keep theirs
            kept = saved.get("position")
            kept = kept if isinstance(kept, dict) else {}
            self.health.position = {**kept, **{f.name: f.position() for f in self.feeds}}
        else:
            self.health.position = self.feeds[0].position()
        self.tagger = OriginTagger(self.cache, config.sampler.node())  # coverage, manifests
        self.committer = Committer(self.cache, self.health, stop=stop,
                                   should_stop=self.should_stop, quarantine=self.quarantine,
                                   done=self._done, before_save=self.publish_requests)
        # Keys quarantined by this process: corrupt objects are not fetched (and counted) again
        # every pass; a restarted daemon tries them once more.
        self.quarantined: set[str] = set()
        self._said_failing: set[str] = set()  # sources said to be failing (_note_failing)
        # Keys fetched but not committed yet: not cached, yet they must not be fetched again
        # (a small pass wraps around while its last batches are still being committed).
        self._in_flight: set[str] = set()
        self._in_flight_lock = threading.Lock()
        # Pieces of tar shards are encoded in their fetch threads: the health counters that
        # encoding updates are the main thread's too.
        self._encode_lock = threading.Lock()
        self._piece_records: dict[Feed, int] = {}  # records of pieces of each feed's shards
        self._errors_before = self.health.errors  # when the current fruitless stretch began
        self.fetching: collections.deque[_Fetching] = collections.deque()
        # Up to MAX_BATCHES batches per source: a source that stopped answering holds its own
        # threads, never the others' (with sources:, sampler.concurrency is per source).
        self.pool = ThreadPoolExecutor(max_workers=MAX_BATCHES * len(self.feeds),
                                       thread_name_prefix="epochcache-fetch")

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
        for feed in self.feeds:
            start = feed.order.position
            log.info("%s: %d %ss, starting at %s %d of pass %d", feed.source.url,
                     len(feed.table), feed.source.unit, feed.source.unit, start.offset,
                     start.pass_index)
        try:
            while not self.should_stop():
                self.committer.check()
                now = time.monotonic()
                for feed in self.feeds:
                    if feed.follower is not None:
                        feed.follow_listing()
                    if feed.tend(now):
                        # A whole pass brought nothing new (everything cached, corrupt or
                        # failing): rest, at a cost that does not grow with the keys (.idle).
                        self._note_idle()
                due = next_feed(self.feeds, now)
                if due is None:  # every source rests, or waits for a remote
                    if self.fetching:
                        self._hand_over()
                    else:
                        wake = min(f.idle.until for f in self.feeds)
                        self.stop.wait(min(IDLE_WAIT_S, max(0.01, wake - now)))
                    continue
                feed = due
                if feed.busy:  # the source due is busy: wait for a batch
                    self._hand_over()
                    continue
                picked, indices, position = feed.pick(self.cache, self.batch_bytes, self._skip)
                if picked and not self._reserve_and_submit(feed, picked, indices, position):
                    break
                if feed.busy or (self.fetching and not picked):
                    self._hand_over()
            # Stopping: what is being fetched is committed too (graceful stop loses nothing).
            while self.fetching:
                self._hand_over()
        except SourceError as exc:
            self.health.last_error = str(exc)[:300]
            raise

    def _skip(self, cache_key: str) -> bool:
        return cache_key in self.quarantined or self._is_in_flight(cache_key)

    def _reserve_and_submit(self, feed: Feed, picked: list[SampleRef], indices: list[int],
                            position: dict[str, Any]) -> bool:
        """Reserve the batch's bytes (handing over fetched batches meanwhile) and start
        fetching it; False if the sampler is stopping instead."""
        # A tar shard is streamed a piece at a time, each piece taking its own bytes when it is
        # handed over (_hand_over_piece): the batch reserves what its fetch holds up front.
        need = sum(feed.source.held_bytes(ref, feed.sizes.of(ref), self.batch_bytes)
                   for ref in picked)
        while self.fetching and not self.in_flight.fits(need):
            self._hand_over()
        if not self.in_flight.wait(need, self._stop_or_committer_dead):
            self.committer.check()
            return False
        self.in_flight.take(need)
        keys = [feed.cache_key(ref.key) for ref in picked]
        with self._in_flight_lock:
            self._in_flight.update(keys)
        streaming: dict[str, Any] = {}
        if feed.source.unit == "shard":
            shards = dict(zip((ref.key for ref in picked), indices))
            generation = position.get("listing", feed.generation)
            streaming = {"on_piece": functools.partial(self._hand_over_piece, feed, shards,
                                                      generation),
                         "piece_bytes": self.batch_bytes}
        future = self.pool.submit(feed.source.fetch_with_retries, picked,
                                  deadline_s=feed.deadline_s, **streaming)
        started = time.monotonic()
        feed.fetch_started.append(started)
        self.fetching.append(_Fetching(future, feed, picked, position, need, started, indices,
                                       len(picked) * feed.samples_per_ref))
        return True

    def _stop_or_committer_dead(self) -> bool:
        return self.should_stop() or self.committer.error is not None or not self.committer.is_alive()

    def _wait_fetched(self) -> _Fetching | None:
        """The oldest batch that is fetched and has no older batch of its feed still being
        fetched (so each feed's positions are saved in order, while a source that is down holds
        up no other), once there is one; None if the daemon is gone meanwhile. A dead committer
        raises (`Committer.check`).

        Only each feed's oldest batch is waited on: a later batch that is done already would
        make ``wait(FIRST_COMPLETED)`` return at once, and the loop would spin holding the GIL
        that the fetch threads and the IO loop need (batches of one source often finish out of
        order)."""
        while True:
            heads: dict[int, _Fetching] = {}
            for fetching in self.fetching:
                heads.setdefault(id(fetching.feed), fetching)
            for fetching in heads.values():
                if fetching.future.done():
                    self.fetching.remove(fetching)
                    return fetching
            wait([f.future for f in heads.values()], timeout=_POLL_S, return_when=FIRST_COMPLETED)
            self.committer.check()
            if self.lifeline.parent_gone():
                return None

    def _hand_over(self) -> None:
        """Wait for a fetched batch (see `_wait_fetched`) and queue it for commit."""
        fetching = self._wait_fetched()
        if fetching is None:  # the daemon is gone: nobody will read what we would commit
            self.stop.set()
            dropped = self.fetching.popleft()
            dropped.feed.fetch_started.remove(dropped.started)
            keys = [dropped.feed.cache_key(ref.key) for ref in dropped.refs]
            self._done(Batch([], dropped.position, keys, dropped.reserved))
            return
        feed = fetching.feed
        feed.fetch_started.remove(fetching.started)
        results = fetching.future.result()
        keys = [feed.cache_key(ref.key) for ref in fetching.refs]
        # refused as a whole: the source stops (feed.batch_done), its keys are not quarantined
        refused = any(isinstance(p, SourceRefused) for _, p in results) and all(
            isinstance(p, BaseException) for _, p in results)
        with self._encode_lock:
            records, fetched = self._encode_results(feed, results, refused)
            streamed = self._piece_records.pop(feed, 0)  # records of pieces handed over before
        feed.batch_done(results, len(records) + streamed)
        self._note_failing(feed)
        feed.samples_read(len(fetching.refs), fetching.estimate, results)
        if fetching.position.get("listing", feed.generation) == feed.generation:
            index_of = dict(zip((ref.key for ref in fetching.refs), fetching.indices))
            for ref, payload in results:  # failed, not quarantined: fetched again after the pass
                if isinstance(payload, BaseException) and \
                        feed.cache_key(ref.key) not in self.quarantined:
                    i = index_of.get(ref.key)
                    if i is not None:
                        feed.idle.note_failed(i)
        if feed.name:
            self.health.sources[feed.name]["down"] = feed.down
        unknown = [ref for ref in fetching.refs if not ref.size]
        if unknown and fetched:
            feed.sizes.observe(fetched * len(unknown) // max(1, len(fetching.refs)), len(unknown))
            feed.observed_sizes()
        # From here on the batch holds its records (the fetched payloads are dropped).
        nbytes = sum(len(record) for _, record in records)
        self.in_flight.adjust(fetching.reserved, nbytes)
        if records or streamed:
            feed.brought_new()
            self.health.idle = ""
            self._errors_before = self.health.errors
        origins = self.tagger.origins(feed, fetching.refs, fetching.indices, results,
                                      fetching.position.get("listing", feed.generation))
        self.committer.hand_over(Batch(records, fetching.position, keys, nbytes, feed.name,
                                       origins))

    def _hand_over_piece(self, feed: Feed, shards: dict[str, int], generation: str,
                         piece: Piece) -> None:
        """A piece of a tar shard being streamed, from its fetch thread: encoded and queued for
        commit once the in-flight budget has room for it (the wait bounds what a shard of any
        size holds), with the origin of each sample (``shards``: the listing index of each
        shard of the batch, picked from the listing of ``generation``). It saves no
        position: the batch the shard belongs to does, after it."""
        results = piece.results
        with self._encode_lock:
            records, _fetched = self._encode_results(feed, results)
            self._piece_records[feed] = self._piece_records.get(feed, 0) + len(records)
        if not records:
            return
        nbytes = sum(len(record) for _, record in records)
        if not self.in_flight.wait(nbytes, self._stop_or_committer_dead):
            self.committer.check()  # dead: raises; stopping: what is fetched is committed
        self.in_flight.take(nbytes)
        index = shards.get(piece.shard.key)
        origins = ({} if index is None else
                   self.tagger.piece_origins(feed, index, generation, piece))
        self.committer.hand_over(Batch(records, None, [], nbytes, feed.name, origins))

    def _note_idle(self) -> None:
        """A source finished a pass that brought nothing new: with every source there, the
        sampler is idle, ``complete`` (all cached or quarantined) or ``failing`` (fetches
        failed meanwhile). Runs waiting for train.min_samples read it from the health."""
        now = time.monotonic()
        if all(feed.exhausted or feed.resting or feed.idle.until > now for feed in self.feeds):
            failed = self.health.errors > self._errors_before
            self.health.idle = "failing" if failed else "complete"
            self._errors_before = self.health.errors

    def _encode_results(self, feed: Feed, results: list[tuple[SampleRef, Any]],
                        refused: bool = False) -> tuple[list[tuple[str, bytes]], int]:
        """Records of the fetched samples (errors counted; corrupt ones, and those that failed
        for good, quarantined, unless the whole batch was ``refused``: the source stops
        instead), and the bytes fetched."""
        records: list[tuple[str, bytes]] = []
        fetched = 0
        health = self.health
        for ref, payload in results:
            if payload is STREAMED:  # a piece of its shard, encoded when it was handed over
                continue
            key = feed.cache_key(ref.key)
            if isinstance(payload, CorruptSample):
                self.quarantine(key, str(payload))
            elif isinstance(payload, BaseException):
                health.errors += 1
                kind = error_kind(payload)
                health.error_kinds[kind] = health.error_kinds.get(kind, 0) + 1
                if feed.name:
                    health.sources[feed.name]["errors"] += 1
                health.last_failed = time.time()
                health.last_error = f"{key}: {payload}"[:300]
                if isinstance(payload, PermanentRemoteError) and not refused:
                    # retrying cannot help (gone, a key the client cannot name, or refused
                    # while the source's other keys are read)
                    self.quarantine(key, str(payload))
                elif not refused:
                    log.info("fetch failed for %s (retried next pass): %s", cut_key(key),
                             cut_text(str(payload), keys=(ref.key,)))
            else:
                size = _payload_bytes(payload)
                health.fetched += 1
                health.last_ok = time.time()
                health.fetched_bytes += size
                fetched += size
                try:
                    records.append((key, self.cache.writer.encode(key, payload, adaptive=True)))
                except SampleRejected as exc:
                    self.quarantine(key, str(exc))
                except Exception as exc:  # noqa: BLE001 - one sample's bytes, never the process
                    # Untrusted names or bytes the record format cannot frame: this sample is
                    # quarantined and the rest of its batch commits (a crash here restarted
                    # the sampler on the same batch until the daemon gave up).
                    self.quarantine(key, f"cannot be encoded: {type(exc).__name__}: "
                                         f"{str(exc)[:300]}")
        return records, fetched

    def _note_failing(self, feed: Feed) -> None:
        """Publish whether ``feed``'s reads all fail (`Feed.failing_since`), saying so in the
        log once they have for `FAILING_AFTER_S`, and once they succeed again."""
        label = source_label(feed.name)
        if feed.failing_since is None:
            if self.health.failing.pop(label, None) is not None and label in self._said_failing:
                log.warning("%s: reads succeed again (no longer failing)", feed.source.url)
            self._said_failing.discard(label)
            return
        self.health.failing[label] = {"since": feed.failing_since,
                                      "error": cut_text(feed.last_error, 300),
                                      "stopped": feed.refused is not None}
        if (time.time() - feed.failing_since >= FAILING_AFTER_S
                and label not in self._said_failing):
            self._said_failing.add(label)
            log.warning("%s is failing: no read succeeded for %.0f s (last error: %s)",
                        feed.source.url, time.time() - feed.failing_since,
                        cut_text(feed.last_error, 300))

    # -- shared with the committer thread ---------------------------------------------------------

    def publish_requests(self) -> None:
        """Copy each source's request counters into the health document (before it is saved)."""
        requests = dict(self._requests_kept)
        for feed in self.feeds:
            feed.gate.publish()
            requests[source_label(feed.name)] = feed.gate.stats.as_dict()
        self.health.requests = requests

    def _feed_of(self, cache_key: str) -> Feed:
        if len(self.feeds) == 1:
            return self.feeds[0]
        return self._by_prefix.get(cache_key.split("/", 1)[0], self.feeds[0])

    def quarantine(self, key: str, reason: str) -> None:
        """Count, log (with its URL) and record a sample that cannot be cached (``key``: its
        cache key); it is not fetched again by this process. The key is someone else's name:
        it is logged and kept cut (`cut_key`), and a failure to
        record it (a full map) is logged, never the end of the sampler."""
        feed = self._feed_of(key)
        source_key = key[len(feed.prefix):]
        url = cut_text(feed.source.object_url(source_key), keys=(source_key,))
        self.quarantined.add(key)
        self.health.quarantined += 1
        log.warning("quarantined %s: %s", url, cut_text(reason, keys=(key, source_key)))
        try:
            self.cache.tables.quarantine(key, reason, url=url)
        except Exception as exc:  # noqa: BLE001 - the sample is refused either way
            log.warning("sampler %d: %s is quarantined but could not be recorded in the cache "
                        "(%s: %s); it is counted in this sampler's health", self.index, url,
                        type(exc).__name__, cut_text(str(exc), 300))

    def _is_in_flight(self, key: str) -> bool:
        with self._in_flight_lock:
            return key in self._in_flight

    def _done(self, batch: Batch) -> None:
        """A batch is finished with: its keys may be fetched again, its bytes are free."""
        with self._in_flight_lock:
            self._in_flight.difference_update(batch.keys)
        self.in_flight.release(batch.nbytes)

    # -- ending -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop fetching, let the committer finish, save the health document, close the cache.

        Raises:
            CommitterDied: the committer failed.
        """
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.committer.finish()
        self._save_health()
        self.cache.close()

    def _save_health(self) -> None:
        self.publish_requests()
        self.health.heartbeat = time.time()
        self.cache.tables.put_state(state_name(self.index), asdict(self.health))

    def abort(self, error: BaseException) -> None:
        """After a fatal error: record it in the health document, best effort, and return
        without waiting for fetches or the committer (the process exits next)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.health.last_error = f"sampler exited: {type(error).__name__}: {error}"[:300]
        try:
            self._save_health()
        except Exception as exc:  # noqa: BLE001 - the cache may be what failed
            log.warning("sampler %d: could not save its health: %s", self.index, exc)


def _saved_position(saved: dict[str, Any], name: str) -> Any:
    """Where a feed stopped: the whole saved position for a single source, else its entry."""
    position = saved.get("position")
    if not name or not isinstance(position, dict):
        return position
    return position.get(name)


def log_levels() -> dict[str, int]:
    """The levels this process's logging sets (the root's and each logger given one): what a
    sampler it starts logs at, so that ``-q`` and ``-v`` reach the samplers too."""
    levels = {"": logging.getLogger().level}
    for name, logger in logging.getLogger().manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            levels[name] = logger.level
    return levels


def run_sampler(config_data: dict[str, Any], index: int, stop: Any,
                parent_pid: int | None = None, sources: Sequence[str] | None = None,
                levels: dict[str, int] | None = None) -> None:
    """Entry point of a sampler process (started with ``spawn`` by the daemon).

    Returns when stopped. On a fatal error (the committer died, the cache failed) it logs the
    error and ends the process with exit status 1 at once, without waiting for fetches in
    flight: the daemon restarts it. Committed samples are durable either way.

    Args:
        config_data: the validated config, as ``EpochcacheConfig.to_transfer()``.
        index, stop, parent_pid, sources: as `Sampler`'s.
        levels: the daemon's `log_levels` (default INFO, libraries' chatter at WARNING).
    """
    if parent_pid is not None:
        kill_with_parent()
        if os.getppid() != parent_pid:  # the daemon died before the kernel was told
            return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    # SIGTERM to the whole process group (systemd, timeout): stop after the batch in flight.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # The daemon started us with both blocked (Supervisor._start): one that came meanwhile is
    # handled now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    reuse_freed_buffers()
    config = EpochcacheConfig.from_transfer(config_data)
    levels = {"": logging.INFO, **QUIET_LIBRARIES} if levels is None else levels
    logging.basicConfig(level=levels.get("", logging.INFO),
                        format=f"%(asctime)s sampler {index}: %(message)s")
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    install_log_redaction(secrets=set(config.secrets))  # URLs in any library's log lines
    sampler = Sampler(config, index, stop, parent_pid, sources)
    try:
        sampler.run()
        sampler.close()
    except BaseException as exc:  # any failure: exit now, the daemon restarts us
        log.error("sampler %d is exiting on %s: %s (the daemon restarts it)", index,
                  type(exc).__name__, exc, exc_info=exc)
        sampler.abort(exc)
        logging.shutdown()
        os._exit(1)  # not sys.exit: it would wait for fetch threads stuck on the remote
