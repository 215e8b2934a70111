"""One sampler process: choose keys, fetch them concurrently, validate, compress, commit.

A sampler runs until its stop event is set (or its daemon disappears). Fetching and committing
overlap: the next batch is fetched while a committer thread writes the previous one, so the
cache's write lock and fsync never leave the network idle. Its position in the key order is
saved in the cache after each commit, so a restarted sampler goes on where it stopped instead
of fetching the same first samples again. Per-sample faults never stop it: corrupt objects are
quarantined, failed fetches counted and logged with their key, and retried on a later pass.

This module must not import torch: sampler processes stay small.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import EpochcacheConfig
from ..errors import CacheFull, CorruptSample, PermanentRemoteError, SourceError
from ..redact import install_log_redaction
from ..store import SampleStore
from .from_config import open_configured_source
from .keyorder import KeyOrder
from .sources import SampleRef, Source, list_keys_cached

log = logging.getLogger(__name__)

#: Seconds between sampler health documents when nothing is committed (stalled remote).
HEALTH_INTERVAL_S = 2.0
#: Seconds between health/position writes while commits flow.
STATE_INTERVAL_S = 0.5
#: Pause after a whole pass found every sample already cached (the dataset fits the cache).
IDLE_WAIT_S = 1.0
#: Batches fetched at the same time (``sampler.concurrency`` is split among them).
FETCH_DEPTH = 2


def _is_cached(cache: SampleStore, source: Source, ref: SampleRef) -> bool:
    if source.unit == "sample":
        return ref.key in cache
    return cache.has_key_prefix(ref.key.rstrip("/") + "/")


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


def state_name(index: int) -> str:
    return f"sampler/{index}"


class _Committer(threading.Thread):
    """Writes fetched batches to the cache in order, one batch behind the fetcher."""

    def __init__(self, cache: SampleStore, health: SamplerHealth, stop: Any) -> None:
        super().__init__(name="epochcache-committer", daemon=True)
        self.cache, self.health, self.stop_event = cache, health, stop
        self.batches: queue.Queue[tuple[list[tuple[str, bytes]], dict[str, int], list[str]] | None] = (
            queue.Queue(maxsize=1)
        )
        self.error: BaseException | None = None
        # Keys fetched but not committed yet: not cached, yet they must not be fetched again
        # (a small pass wraps around while its last batches are still queued here).
        self.in_flight: set[str] = set()
        self._lock = threading.Lock()

    def mark_in_flight(self, keys: list[str]) -> None:
        """Keys being fetched: cleared once their batch is committed."""
        with self._lock:
            self.in_flight.update(keys)

    def is_in_flight(self, key: str) -> bool:
        with self._lock:
            return key in self.in_flight

    def run(self) -> None:
        try:
            while (item := self.batches.get()) is not None:
                records, position, keys = item
                self._commit(records)
                with self._lock:
                    self.in_flight.difference_update(keys)
                self.health.position = position
                now = time.time()
                # At most one health/position write per STATE_INTERVAL_S: each is a commit with
                # an fsync of its own. A position that lags is harmless: on restart, keys already
                # cached are skipped before fetching.
                if now - self.health.heartbeat >= STATE_INTERVAL_S:
                    self.health.heartbeat = now
                    self.cache.tables.put_state(state_name(self.health.index), asdict(self.health))
        except BaseException as exc:  # surfaced by the fetch loop
            self.error = exc

    def _commit(self, records: list[tuple[str, bytes]]) -> None:
        while records:
            try:
                result = self.cache.put_many(records, encoded=True, stop=self.stop_event, timeout_s=HEALTH_INTERVAL_S)
                self.health.committed += result.inserted
                self.health.skipped += result.skipped
                self.health.waiting_for_space = False
                return
            except CacheFull as full:
                # Whatever part was committed is skipped as a duplicate on the next attempt.
                if full.result is not None:
                    self.health.committed += full.result.inserted  # type: ignore[attr-defined]
                self.health.waiting_for_space = True
                self.health.heartbeat = time.time()
                self.cache.tables.put_state(state_name(self.health.index), asdict(self.health))
                if self.stop_event.is_set():
                    log.info("sampler %d: stopping with %d samples not committed", self.health.index, len(records))
                    return


def _encode_results(
    cache: SampleStore, source: Source, results: list[tuple[SampleRef, Any]], health: SamplerHealth
) -> list[tuple[str, bytes]]:
    records: list[tuple[str, bytes]] = []
    for ref, payload in results:
        if isinstance(payload, CorruptSample):
            health.quarantined += 1
            log.warning("quarantined %s: %s", source.object_url(ref.key), payload)
            cache.tables.quarantine(ref.key, str(payload), url=source.object_url(ref.key))
        elif isinstance(payload, BaseException):
            health.errors += 1
            health.last_error = f"{ref.key}: {payload}"[:300]
            level = logging.WARNING if isinstance(payload, PermanentRemoteError) else logging.INFO
            log.log(level, "fetch failed for %s (retried next pass): %s", ref.key, payload)
        else:
            health.fetched += 1
            size = len(payload) if isinstance(payload, bytes) else sum(len(v) for v in payload.values())
            health.fetched_bytes += size
            records.append((ref.key, cache.encode(ref.key, payload)))
    return records


#: Aim for commits of about this many bytes: 64 samples of 1 MiB would hold the pipeline for a
#: 64 MiB round (fetch, then commit) where 8 MiB rounds keep fetching and committing overlapped.
BATCH_BYTES = 8 * 1024 * 1024


def _samples_per_batch(configured: int, refs: list[SampleRef], unit: str, concurrency: int) -> int:
    """Samples per fetch/commit round: ``sampler.batch_size``, fewer for large objects."""
    if unit != "sample":
        return max(1, min(4, concurrency))  # whole shards
    sizes = [ref.size for ref in refs[:1000] if ref.size]
    if not sizes:
        return configured
    mean = sum(sizes) / len(sizes)
    return max(1, min(configured, int(BATCH_BYTES // max(1.0, mean))))


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
        self.index, self.stop, self.parent_pid = index, stop, parent_pid
        # sync: false skips the fsync per commit. A killed process still loses nothing committed
        # (the data is in the page cache); only a power loss or kernel crash can cost recent
        # commits, or the cache (rebuild it from the remote). It is what large samples need to
        # ingest at link speed on a busy node (docs/benchmarks.md).
        self.cache = SampleStore(config.cache.dir, sync=config.cache.sync)
        self.source = open_configured_source(config)
        self.refs = list_keys_cached(self.source, config.cache.dir)
        saved = self.cache.tables.get_state(state_name(index)) or {}
        self.order = _key_order(config, len(self.refs), self.refs, index, saved.get("position"))
        self.health = SamplerHealth(index=index)
        for name in ("fetched", "fetched_bytes", "committed", "skipped", "errors", "quarantined"):
            setattr(self.health, name, int(saved.get(name, 0)))
        self.committer = _Committer(self.cache, self.health, stop)
        self.per_batch = _samples_per_batch(config.sampler.batch_size, self.refs, self.source.unit,
                                            config.sampler.concurrency)
        # FETCH_DEPTH batches are fetched at once, each with its share of `concurrency`: while
        # one drains its slowest requests, the other keeps the link busy (one batch at a time
        # left the link idle at every batch boundary: 0.6x a bare fetch, 0.9x+ with two).
        self.source.concurrency = max(1, -(-config.sampler.concurrency // FETCH_DEPTH))
        self.deadline_s = config.source.timeout_s * 4
        # Keys quarantined by this process: corrupt objects are not fetched (and counted) again
        # every pass; a restarted daemon tries them once more.
        self.quarantined: set[str] = set()
        self.fruitless = 0  # offsets taken since the last batch that brought anything new
        self.fetching: collections.deque[tuple[Future[list[Any]], dict[str, int], list[str]]] = (
            collections.deque())
        self.pool = ThreadPoolExecutor(max_workers=FETCH_DEPTH, thread_name_prefix="epochcache-fetch")

    def run(self) -> None:
        """Fetch and commit until stopped; what is in flight then is committed too."""
        self.committer.start()
        log.info("%d %ss, starting at %s", len(self.refs), self.source.unit, self.order.position)
        try:
            while not self.stop.is_set():
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    log.warning("daemon %d is gone; stopping", self.parent_pid)
                    break
                if self.committer.error is not None:
                    raise self.committer.error
                if self.fruitless >= self.order.pass_length and not self.fetching:
                    # A whole pass brought nothing new (everything cached, corrupt or failing):
                    # wait instead of spinning on the cache and the remote.
                    self.stop.wait(IDLE_WAIT_S)
                    self.fruitless = 0
                picked = self._pick()
                if picked:
                    self._submit(picked)
                if len(self.fetching) >= FETCH_DEPTH or (self.fetching and not picked):
                    self._hand_over()
            # Stopping: what is being fetched is committed too (graceful stop loses nothing).
            while self.fetching:
                self._hand_over()
        except SourceError as exc:
            self.health.last_error = str(exc)[:300]
            raise

    def _pick(self) -> list[SampleRef]:
        """The next batch of refs in key order that are neither cached nor on their way."""
        picked = [self.refs[int(i)] for i in self.order.take(self.per_batch)]
        self.fruitless += self.per_batch
        unique = {ref.key: ref for ref in picked}  # a small dataset can wrap within one batch
        return [
            ref for ref in unique.values()
            if ref.key not in self.quarantined
            and not self.committer.is_in_flight(ref.key)
            and not _is_cached(self.cache, self.source, ref)  # the whole dataset may fit
        ]

    def _submit(self, picked: list[SampleRef]) -> None:
        keys = [ref.key for ref in picked]
        self.committer.mark_in_flight(keys)
        future = self.pool.submit(self.source.fetch_with_retries, picked,
                                  deadline_s=self.deadline_s)
        self.fetching.append((future, self.order.state(), keys))

    def _hand_over(self) -> None:
        """Wait for the oldest batch in flight and queue it for commit (in order)."""
        future, position, keys = self.fetching.popleft()
        results = future.result()
        self.quarantined.update(
            ref.key for ref, payload in results if isinstance(payload, CorruptSample))
        records = _encode_results(self.cache, self.source, results, self.health)
        if records:
            self.fruitless = 0
        self.committer.batches.put((records, position, keys))

    def close(self) -> None:
        """Stop fetching, let the committer finish, save the health document, close the cache.

        Raises:
            BaseException: the committer's error, if it failed.
        """
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.committer.batches.put(None)
        if self.committer.is_alive():
            self.committer.join()
        self.health.heartbeat = time.time()
        self.cache.tables.put_state(state_name(self.index), asdict(self.health))
        self.cache.close()
        if self.committer.error is not None:
            raise self.committer.error


def _key_order(config: EpochcacheConfig, num_keys: int, refs: list[SampleRef], index: int,
               position: dict[str, int] | None) -> KeyOrder:
    node_rank, num_nodes = config.sampler.node()
    weights = None
    if config.sampler.strategy == "weighted":
        weights = [r.weight if r.weight is not None else 1.0 for r in refs]
    return KeyOrder(
        num_keys,
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

    Args:
        config_data: the validated config, as ``EpochcacheConfig.to_transfer()``.
        index: this sampler's index among ``sampler.processes``.
        stop: the daemon's :class:`StopFlag`; set, the sampler stops after committing what it
            has fetched.
        parent_pid: the daemon; if it disappears, the sampler stops too (no orphans).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    # SIGTERM to the whole process group (systemd, timeout): stop after the batch in flight.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = EpochcacheConfig.from_transfer(config_data)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s sampler {index}: %(message)s")
    install_log_redaction(secrets=set(config.secrets))  # URLs in any library's log lines
    sampler = Sampler(config, index, stop, parent_pid)
    try:
        sampler.run()
    finally:
        sampler.close()
