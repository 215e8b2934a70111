"""What a sampler holds between fetching and committing: the committer thread that writes
fetched batches to the cache, one behind the fetcher, and the bound on the bytes in flight.

A sampler fetches several batches at once (`FETCH_DEPTH` or more) while the committer writes
another: with skewed object sizes (or tar shards of a GiB) a bound on requests alone lets a
sampler hold many GiB. So each batch reserves its expected bytes (`InFlight`) before it is
fetched (the listed or manifest size, else an estimate learnt from what was fetched:
`SizeEstimate`), the reservation is corrected to the real size once fetched, and released when
the batch is committed. A single object larger than the whole limit is still fetched, alone.

What the committer must never do is stall its sampler silently:

* a sample the cache can never hold (larger than the capacity, a key no record can hold) is
  handed back by the store (``on_reject``) and quarantined; the rest of its batch commits;
* any other error on a batch is retried record by record: records that fail alone while the
  others commit are quarantined (the cache works, the record does not); when every record
  fails, the cache itself is failing and the committer dies with that error;
* a dead committer is seen by the fetch loop at its next hand-over (`Committer.hand_over`
  never blocks on a full queue for long), and the sampler process exits non-zero so that the
  daemon restarts it;
* while the cache is full behind a lease it waits in rounds of `HEALTH_INTERVAL_S`,
  writing its health each round and checking ``should_stop`` (stop asked, or daemon gone);
* batches that queued up behind a slow commit are committed together (one transaction and
  one fsync for all, up to `GROUP_BYTES`);
* a sample larger than the headroom is set aside when leases hold the cache full: while
  epochs train, snapshots pin the newest capacity's worth of samples, so it could never get in
  and would hold up every batch behind it. It is counted (``deferred``), logged once with its
  key, and fetched again on a later pass, when it may fit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import CacheFull, SampleRejected
from ..limits import cut_key
from ..store import SampleStore
from ..store.origins import Origin
from ..store.plumbing import effective_headroom
from ..units import format_size
from .layouts import SampleRef

log = logging.getLogger(__name__)

#: Seconds between sampler health documents when nothing is committed (idle, stalled remote).
HEALTH_INTERVAL_S = 2.0
#: Seconds between health/position writes while commits flow.
STATE_INTERVAL_S = 0.5
#: How long one attempt to queue a batch (or to wait for one) lasts before checking again.
_POLL_S = 0.25
#: Batches that may wait for the committer...
QUEUED_BATCHES = 8
#: ... and the most bytes of them committed in one transaction (one fsync with cache.sync).
GROUP_BYTES = 64 * 1024 * 1024
#: At most one warning of a sample larger than the headroom per this many seconds...
DEFERRED_LOG_S = 60.0
#: ... and the keys already named in one are remembered up to this many (the oldest go).
DEFERRED_KEYS = 1024


def state_name(index: int) -> str:
    return f"sampler/{index}"


class CommitterDied(RuntimeError):
    """The committer thread stopped on an error; the sampler process must exit (and be
    restarted by its daemon). The original error is chained."""


@dataclass
class Batch:
    """One fetched batch on its way to the cache.

    Attributes:
        records: ``(source key, encoded record)`` pairs.
        position: the key order position to save once the batch is committed (None: a piece
            of a streamed shard, whose batch saves the position after it).
        keys: every key the batch was fetched for (committed or not): no longer in flight.
        nbytes: bytes this batch holds against the sampler's in-flight budget.
        source: the ``sources:`` entry it was fetched from ("" for a single ``source:``).
        origins: where each record's sample came from, by key (`origins`).
    """

    records: list[tuple[str, bytes]]
    position: dict[str, int] | None
    keys: list[str]
    nbytes: int = 0
    source: str = ""
    origins: dict[str, Origin] | None = None


class Committer(threading.Thread):
    """Writes batches to ``cache`` in the order they are handed over.

    Args:
        cache: the sampler's store.
        health: the sampler's health document (a ``SamplerHealth``), updated in place.
        stop: passed to ``put_many`` so that a stop ends a wait for space at once.
        should_stop: stop asked, or the daemon is gone: end waits for space.
        quarantine: ``quarantine(key, reason)`` for a sample that cannot be stored.
        done: ``done(batch)`` once a batch is finished with (committed, quarantined or
            dropped at a stop): releases its keys and bytes.
        before_save: called before each health document is written (fills in what the fetch
            side counts: the request counters).
    """

    def __init__(
        self,
        cache: SampleStore,
        health: Any,
        *,
        stop: Any,
        should_stop: Callable[[], bool],
        quarantine: Callable[[str, str], None],
        done: Callable[[Batch], None],
        before_save: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="epochcache-committer", daemon=True)
        self.cache, self.health, self.stop_flag = cache, health, stop
        self.should_stop, self.quarantine, self.done = should_stop, quarantine, done
        self.before_save = before_save
        # Room for batches to pile up behind a slow commit (grouped, see _group); what they
        # hold is bounded by the sampler's limit on bytes in flight, not by this queue.
        self._batches: queue.Queue[Batch | None] = queue.Queue(maxsize=QUEUED_BATCHES)
        #: batches committed in the transaction of an earlier one (see _group)
        self.grouped = 0
        self.error: BaseException | None = None
        self._rejected: set[str] = set()
        self._origins: dict[str, Origin] = {}  # of the group being committed
        self._deferred_logged: dict[str, None] = {}  # insertion-ordered: a bounded set
        self._deferred_log_at = 0.0  # monotonic time of the last deferral warning
        self._deferred_since = 0  # samples deferred since that warning
        # Lease waits of earlier processes (the health document's) plus this one's writer's.
        self._lease_wait_base = float(getattr(health, "lease_wait_s", 0.0))

    # -- the fetch loop's side ------------------------------------------------------------------

    def hand_over(self, batch: Batch | None) -> None:
        """Queue ``batch`` (None: no more) for commit, waiting while the previous one commits.

        Raises:
            CommitterDied: the committer is dead (its error chained); nothing more commits.
        """
        while True:
            self.check()
            try:
                self._batches.put(batch, timeout=_POLL_S)
                return
            except queue.Full:
                continue  # the committer is busy (or waiting for space): check it again

    def check(self) -> None:
        """Raise `CommitterDied` if the committer has died."""
        if self.error is not None:
            raise CommitterDied(f"sampler {self.health.index}: the committer failed: "
                                f"{type(self.error).__name__}: {self.error}") from self.error
        if self.ident is not None and not self.is_alive():
            raise CommitterDied(f"sampler {self.health.index}: the committer exited")

    def finish(self) -> None:
        """Let the committer write what is queued, then end it.

        Raises:
            CommitterDied: it failed, before or while finishing.
        """
        if self.is_alive():
            self.hand_over(None)
            while self.is_alive():
                self.join(_POLL_S)
        if self.error is not None:
            self.check()

    # -- the committer thread -----------------------------------------------------------------

    def run(self) -> None:
        try:
            while True:
                try:
                    batch = self._batches.get(timeout=HEALTH_INTERVAL_S)
                except queue.Empty:
                    # Nothing to commit (idle, or the remote is failing): the health document
                    # still shows the counters and errors of the last seconds.
                    self._save_health()
                    continue
                if batch is None:
                    break
                group, ending = self._group(batch)
                self._origins = {key: origin for one in group for key, origin in
                                 (one.origins or {}).items()}
                try:
                    self._commit([record for one in group for record in one.records])
                finally:
                    for one in group:
                        self.done(one)
                for one in group:
                    if one.position is None:
                        continue
                    if one.source:  # one position per source (see feed.py)
                        self.health.position = {**self.health.position, one.source: one.position}
                    else:
                        self.health.position = one.position
                if ending:
                    break
                now = time.time()
                # At most one health/position write per STATE_INTERVAL_S: each is a commit with
                # an fsync of its own. A position that lags is harmless: on restart, keys already
                # cached are skipped before fetching.
                if now - self.health.heartbeat >= STATE_INTERVAL_S:
                    self._save_health(now)
        except BaseException as exc:  # surfaced by the fetch loop (check / hand_over)
            self.error = exc
            log.error("sampler %d: committer failed: %s: %s", self.health.index,
                      type(exc).__name__, exc, exc_info=exc)

    def _group(self, batch: Batch) -> tuple[list[Batch], bool]:
        """``batch`` and the batches queued behind it, up to `GROUP_BYTES`, to commit in
        one transaction; and whether the end (None) was queued among them.

        Batches queue up while a commit is slow (an fsync on a busy disk, a wait for a lease):
        committing them together pays one fsync and one transaction for all, so the slower the
        disk, the larger the commits, with no timer and no added latency when it is fast."""
        group, size, ending = [batch], batch.nbytes, False
        while size < GROUP_BYTES and not ending:
            try:
                more = self._batches.get_nowait()
            except queue.Empty:
                break
            if more is None:
                ending = True
            else:
                group.append(more)
                size += more.nbytes
        self.grouped += len(group) - 1
        return group, ending

    def _save_health(self, now: float | None = None) -> None:
        if self.before_save is not None:
            self.before_save()
        self.health.heartbeat = time.time() if now is None else now
        self.health.lease_wait_s = round(
            self._lease_wait_base + self.cache.writer.lease_wait_s, 3)
        self.cache.tables.put_state(state_name(self.health.index), asdict(self.health))

    def _commit(self, records: list[tuple[str, bytes]]) -> None:
        self._rejected.clear()
        try:
            self._put(records)
        except Exception as exc:  # per-record or systemic: _commit_each decides
            if len(records) < 2:
                raise
            self._commit_each(records, exc)

    def _commit_each(self, records: list[tuple[str, bytes]], batch_error: Exception) -> None:
        """Commit one record at a time; quarantine those that fail while others succeed."""
        log.info("sampler %d: a batch of %d failed to commit (%s: %s); committing its samples "
                 "one at a time", self.health.index, len(records), type(batch_error).__name__,
                 batch_error)
        failed: list[tuple[str, Exception]] = []
        inserted = 0
        for key, record in records:
            try:
                inserted += self._put([(key, record)])
            except Exception as exc:  # noqa: BLE001 - judged below
                failed.append((key, exc))
        if failed and not inserted:
            raise batch_error  # not one sample could be written: the cache is failing
        for key, error in failed:
            self.quarantine(key, f"cannot be written to the cache: {type(error).__name__}: {error}")

    def _set_aside_too_large(self, records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The records that can fit once leases move on; the others are deferred (see the
        module doc)."""
        headroom = effective_headroom(self.cache)
        keep = []
        for key, record in records:
            if len(record) <= headroom:
                keep.append((key, record))
                continue
            self.health.deferred += 1
            self._warn_deferred(key, len(record), headroom)
        return keep

    def _warn_deferred(self, key: str, size: int, headroom: int) -> None:
        """Warn of a deferred sample: rate-limited, each key once while remembered."""
        if key in self._deferred_logged:
            return
        now = time.monotonic()
        if self._deferred_log_at and now - self._deferred_log_at < DEFERRED_LOG_S:
            self._deferred_since += 1
            return
        more = (f"; {self._deferred_since} more such samples were skipped since the last "
                "warning" if self._deferred_since else "")
        log.warning(
            "sampler %d: %r is %s, more than the cache's headroom (%s): it cannot be cached "
            "while epochs hold snapshots of the rest; skipped until a later pass (raise "
            "cache.headroom to cache samples this large during training)%s",
            self.health.index, cut_key(key), format_size(size), format_size(headroom), more)
        self._deferred_log_at, self._deferred_since = now, 0
        self._deferred_logged[key] = None
        while len(self._deferred_logged) > DEFERRED_KEYS:
            del self._deferred_logged[next(iter(self._deferred_logged))]

    def _on_reject(self, key: str, exc: SampleRejected) -> None:
        if key not in self._rejected:
            self._rejected.add(key)
            self.quarantine(key, str(exc))

    def _put(self, records: list[tuple[str, bytes]]) -> int:
        """``put_many`` until committed, waiting for space in rounds (see the module doc);
        returns how many samples were inserted."""
        inserted = 0
        while records:
            try:
                result = self.cache.put_many(records, encoded=True, stop=self.stop_flag,
                                             timeout_s=HEALTH_INTERVAL_S, on_reject=self._on_reject,
                                             origins=self._origins)
                self.health.committed += result.inserted
                self.health.skipped += result.skipped
                self.health.waiting_for_space = False
                return inserted + result.inserted
            except CacheFull as full:
                # Whatever part was committed is skipped as a duplicate on the next attempt.
                if full.result is not None:
                    inserted += full.result.inserted  # type: ignore[attr-defined]
                    self.health.committed += full.result.inserted  # type: ignore[attr-defined]
                records = self._set_aside_too_large(
                    [(key, record) for key, record in records if key not in self._rejected])
                self.health.waiting_for_space = True
                self._save_health()
                if self.should_stop():
                    log.info("sampler %d: stopping with %d samples not committed",
                             self.health.index, len(records))
                    return inserted
        return inserted


class InFlight:
    """Bytes reserved by the batches in flight, at most ``limit`` (one batch may exceed it alone).

    Args:
        limit: bytes a sampler may hold; positive.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"in-flight byte limit: must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be reserved now (always, when nothing is reserved)."""
        with self._cond:
            return self.used == 0 or self.used + nbytes <= self.limit

    def wait(self, nbytes: int, should_stop: Callable[[], bool], poll_s: float = 0.25) -> bool:
        """Wait until ``nbytes`` fit; False if ``should_stop()`` turned true first."""
        with self._cond:
            while not (self.used == 0 or self.used + nbytes <= self.limit):
                if should_stop():
                    return False
                self._cond.wait(poll_s)
        return True

    def take(self, nbytes: int) -> None:
        with self._cond:
            self.used += nbytes

    def adjust(self, reserved: int, actual: int) -> None:
        """Replace a reservation of ``reserved`` bytes by the ``actual`` size fetched."""
        with self._cond:
            self.used += actual - reserved
            self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used = max(0, self.used - nbytes)
            self._cond.notify_all()


class SizeEstimate:
    """The expected size of a ref: its listed size, else the mean of sizes seen so far.

    Until anything is known, an unknown size counts as ``unknown_bytes`` (a whole batch), so
    that the first batches of objects of unknown size are fetched one at a time.

    Args:
        sizes: listed sizes (of the listing's first keys: their mean seeds the estimate).
        unknown_bytes: what a ref of unknown size counts for before any size is known.
    """

    def __init__(self, sizes: Sequence[int] | np.ndarray, unknown_bytes: int) -> None:
        sizes = [int(size) for size in sizes if size and size > 0]
        self.total = float(sum(sizes))
        self.count = len(sizes)
        self.unknown_bytes = unknown_bytes

    @property
    def mean(self) -> int:
        return int(self.total / self.count) if self.count else self.unknown_bytes

    def of(self, ref: SampleRef) -> int:
        return int(ref.size) if ref.size else self.mean

    def observe(self, nbytes: int, count: int = 1) -> None:
        """Learn from ``count`` objects fetched with ``nbytes`` in all."""
        if count > 0:
            self.total += nbytes
            self.count += count
