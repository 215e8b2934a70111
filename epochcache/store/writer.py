"""The write path of a cache: framing, commits in batches, eviction and back-pressure.

`Writer.put_many` commits as many samples per transaction as fit within capacity +
headroom, evicting the oldest unleased samples first; when leases pin the rest it waits
(back-pressure) instead of failing or overfilling. A full disk or LMDB map is met by evicting in
a transaction of its own and then lowering the effective capacity for a while (a back-off that
recovers by itself, see `epochcache.store.capacity`), never by corrupting the cache. A disk
that fails a write with EIO stops the writer ([`CacheIOError`][epochcache.CacheIOError]).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TypeVar

import lmdb

from ..errors import CacheError, CacheFull, SampleRejected, SampleTooLarge
from ..units import format_size
from . import records
from .capacity import Capacity
from .env import Env
from .eviction import DEFAULT_POLICY, Eviction, policy_of
from .leases import Lease, read_leases, reclaim_dead
from .origins import Origin, write_row
from .reads import Reads
from .records import (
    DB_KEYS,
    DB_LEASES,
    DB_META,
    DB_SAMPLES,
    DB_STATE,
    Value,
    index_key,
    pack_u64,
    seq_key,
)
from .release import Protection
from .tables import Counters

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

#: Rounds of "disk full, evict or lower the capacity, try again" before giving up.
_MAX_DISK_FULL_ROUNDS = 16
#: Label of the blocker when not even eviction can commit (the writer waits for readers).
_STUCK = "(none: too full to evict)"
_NO_ROOM = "(none: nothing left to evict)"
#: ``meta`` key written to advance LMDB's transaction id on a full disk (`Writer._advance`).
_M_FULL_MARK = b"last_full_disk_ns"

T = TypeVar("T")

#: Called with each sample `Writer.put_many` leaves out instead of raising.
OnReject = Callable[[str, SampleRejected], None]


@dataclass
class PutResult:
    """What [`Cache.put_many`][epochcache.Cache.put_many] committed."""

    inserted: int = 0
    skipped: int = 0
    seqs: list[int] = field(default_factory=list)
    evicted: int = 0

    def add(self, other: PutResult) -> None:
        self.inserted += other.inserted
        self.skipped += other.skipped
        self.evicted += other.evicted
        self.seqs.extend(other.seqs)


def is_disk_full(exc: lmdb.Error) -> bool:
    """MapFullError, ENOSPC, or the EIO LMDB reports for a short write on a full disk (any
    other EIO is raised by `Env.write` as [`CacheIOError`][epochcache.CacheIOError])."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    text = str(exc)
    return "Input/output error" in text or "No space left" in text


class _Backoff:
    """The waits of a writer held back by leases: 20 ms doubling to 250 ms (a released lease
    should unblock writers promptly), until an optional deadline."""

    def __init__(self, timeout_s: float | None) -> None:
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.delay = 0.02

    def reset(self) -> None:
        self.delay = 0.02

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def sleep(self, stop: threading.Event | None) -> None:
        if stop is not None:
            stop.wait(self.delay)
        else:
            time.sleep(self.delay)
        self.delay = min(self.delay * 2, 0.25)


class Writer:
    """Puts samples into one cache and evicts its oldest ones.

    Args:
        env: the cache's LMDB environment.
        capacity: the cache's limits.
        compress: zstd-compress samples that shrink (incompressible ones are stored raw).
        level: the zstd level.
        lease_timeout_s: see `Lease`.
    """

    def __init__(self, env: Env, capacity: Capacity, *, compress: bool, level: int,
                 lease_timeout_s: float, eviction: str = DEFAULT_POLICY) -> None:
        self.env, self.capacity = env, capacity
        #: What eviction takes (`epochcache.store.eviction`): the cache's stored policy.
        self.policy = policy_of(eviction)
        #: The read log, for a policy that orders by reads.
        self.reads = Reads(env.path)
        self.compress, self.level, self.lease_timeout_s = compress, level, lease_timeout_s
        self._full_logged = 0.0
        #: Seconds put_many has waited for leases to free space (back-pressure), in total.
        self.lease_wait_s = 0.0
        self._trial = records.CompressionTrial()
        #: What the live leases protect, as this process evicts (plan leases tracked here).
        self.protection = Protection(env.path)
        # One thread at a time through the protection's bookkeeping (see _write).
        self._protection_lock = threading.Lock()

    @property
    def path(self) -> str:
        return self.env.path

    def encode(self, key: str, value: Value, *, adaptive: bool = False) -> bytes:
        """Frame one sample as a record (done by samplers before they take the write lock).

        ``adaptive`` (samplers) skips compression attempts for kinds of samples that have not
        compressed lately (`CompressionTrial`); then a record's size depends on what
        was framed before, so it is off for everything else (a record is a function of its
        sample)."""
        return records.encode_record(key, value, level=self.level, compress=self.compress,
                                   trial=self._trial if adaptive else None)

    def put_many(
        self,
        items: Iterable[tuple[str, Value]],
        *,
        encoded: bool = False,
        wait: bool = True,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
        on_reject: OnReject | None = None,
        origins: dict[str, Origin] | None = None,
    ) -> PutResult:
        """See `epochcache.store.SampleStore.put_many`."""
        # origin_of: by key index entry (what the transaction sees), for each commit's row
        pending, origin_of = self._frame(items, encoded, on_reject, origins)
        total = PutResult()
        backoff = _Backoff(timeout_s)
        disk_full_rounds = 0
        while pending:
            self.capacity.probe()  # a capacity lowered after a full disk recovers by itself
            limit = self.capacity.effective
            with self.env.read() as txn:
                leases = read_leases(txn, self.env.dbs[DB_LEASES])
            with self._protection_lock:
                self.protection.preload(leases)
            try:
                result, pending, blocked = self._write(
                    lambda txn: self._put_txn(txn, pending, limit, origin_of)  # noqa: B023 - now
                )
            except lmdb.Error as exc:
                if not is_disk_full(exc):
                    raise
                disk_full_rounds += 1
                blocked = self._make_room(exc, pending, limit, disk_full_rounds)
                if blocked is None:
                    continue
                result = PutResult()
            else:
                self.capacity.settle()  # a write succeeded: publish a changed limit now
            total.add(result)
            if blocked is None or not pending:
                continue
            if result.inserted:
                backoff.reset()  # progress: space is coming back
            if not wait or backoff.expired() or (stop is not None and stop.is_set()):
                error = CacheFull(self._full_message(blocked))
                error.result = total
                raise error
            self._log_waiting(blocked)
            started = time.monotonic()
            backoff.sleep(stop)
            self.lease_wait_s += time.monotonic() - started
            disk_full_rounds = 0  # waiting, not lowering: the rounds start again
        return total

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """``env.write(fn)`` for a transaction that may evict. What eviction marks gone in
        `protection` stands once the transaction commits: an attempt that a full map or
        disk undoes, or that is run again after the map grew, leaves its samples in the cache,
        and they stay candidates (they used to be left unevictable by this process for as long
        as their lease lived)."""
        protection = self.protection

        def attempt(txn: lmdb.Transaction) -> T:
            protection.begin()  # undoes what an attempt before this one marked
            return fn(txn)

        with self._protection_lock:
            try:
                result = self.env.write(attempt)
            except BaseException:
                protection.rollback()
                raise
            protection.commit()
        return result

    def _frame(self, items: Iterable[tuple[str, Value]], encoded: bool,
               on_reject: OnReject | None, origins: dict[str, Origin] | None = None,
               ) -> tuple[list[tuple[bytes, bytes]], dict[bytes, Origin]]:
        """``(key index entry, record)`` of each item, the first of each key only, and the
        origins of those given one, by key index entry.

        Raises:
            SampleRejected: a sample can never be stored (``SampleTooLarge``: it could never
                fit the capacity), and there is no ``on_reject`` to hand it to.
        """
        batch: dict[bytes, bytes] = {}
        origin_of: dict[bytes, Origin] = {}
        for key, value in items:
            try:
                record = value if encoded else self.encode(key, value)
                if len(record) > self.capacity.capacity_bytes:
                    raise SampleTooLarge(
                        f"{self.path}: sample {key!r} is {format_size(len(record))}, larger than "
                        f"the cache capacity {format_size(self.capacity.capacity_bytes)}; raise "
                        "cache.capacity", key=key,
                    )
            except SampleRejected as exc:
                if on_reject is None:
                    raise
                on_reject(key, exc)
                continue
            entry = index_key(key.encode("utf-8"))
            if entry not in batch:
                batch[entry] = record  # type: ignore[assignment]
                origin = origins.get(key) if origins else None
                if origin is not None:
                    origin_of[entry] = origin
        return list(batch.items()), origin_of

    def _make_room(self, exc: lmdb.Error, pending: list[tuple[bytes, bytes]], limit: int,
                   rounds: int) -> Lease | None:
        """After a full disk or map: evict in a transaction of its own, else lower the capacity.

        Returns the lease that stops eviction (the writer then waits), or None to try again now.
        """
        if rounds > _MAX_DISK_FULL_ROUNDS:
            raise CacheError(
                f"{self.path}: disk full even after lowering the capacity; free disk space"
            ) from exc
        incoming = sum(len(r) for _, r in pending)
        # LMDB reuses freed pages only after the freeing transaction commits, so evict in a
        # transaction of its own before trying the insert again.
        self._advance()
        freed, stuck = self._evict_quietly(limit - incoming)
        if freed.count:
            self._advance()
            return None
        # Pages freed while a reader is open are not reused until it ends; a reader slot left
        # by a killed process would hold them forever, so clear those first.
        if self.env.lmdb_env.reader_check():
            return None
        if stuck:
            # Not even a delete commits: pages are held by a long read transaction. Lowering
            # the capacity would only evict more once they come back, so wait instead.
            return Lease.new(0, 0, 0, label=_STUCK)
        if freed.blocked_by is None:
            self.capacity.lower(exc, incoming)
            return None
        return freed.blocked_by

    def _advance(self) -> None:
        """Commit a tiny write on a full disk or map: LMDB reuses the pages a commit frees only
        from the second commit after it, and failed attempts commit nothing, so without it
        neither eviction nor the retry could use the pages the last commits freed."""
        meta = self.env.dbs[DB_META]
        try:
            self.env.write(lambda txn: txn.put(_M_FULL_MARK, pack_u64(time.time_ns()), db=meta))
        except lmdb.Error as exc:
            if not is_disk_full(exc):
                raise

    def _evict_quietly(self, limit: int) -> tuple[Eviction, bool]:
        """Evict down to ``limit``; also whether the disk or map was too full even for that."""
        try:
            return self.evict(max(0, limit)), False
        except lmdb.Error as exc:
            if not is_disk_full(exc):
                raise
            return Eviction(), True

    def _put_txn(
        self, txn: lmdb.Transaction, pending: list[tuple[bytes, bytes]], limit: int,
        origin_of: dict[bytes, Origin] | None = None,
    ) -> tuple[PutResult, list[tuple[bytes, bytes]], Lease | None]:
        """Commit the longest prefix of ``pending`` that fits; return the rest and the blocker."""
        dbs = self.env.dbs
        counters = Counters.load(txn, dbs[DB_META])
        fresh = [(k, r) for k, r in pending if txn.get(k, db=dbs[DB_KEYS]) is None]
        result = PutResult(skipped=len(pending) - len(fresh))
        blocker: Lease | None = None
        rest: list[tuple[bytes, bytes]] = []
        incoming = sum(len(r) for _, r in fresh)
        if counters.bytes + incoming > limit:
            evicted = self._evict_for(txn, counters, limit, incoming)
            result.evicted = evicted.count
            room = limit + self.capacity.headroom_for(limit) - counters.bytes
            if incoming > room:
                blocker = evicted.blocked_by or Lease.new(0, 0, 0, label=_NO_ROOM)
                # how many of the first records fit in ``room`` bytes
                fits = bisect.bisect_right(list(accumulate(len(r) for _, r in fresh)), room)
                fresh, rest = fresh[:fits], fresh[fits:]
                incoming = sum(len(r) for _, r in fresh)
        first = counters.next_seq
        result.seqs = list(range(first, first + len(fresh)))
        if fresh:
            cursor = txn.cursor(db=dbs[DB_SAMPLES])
            # Sequence keys are big-endian and increasing, so append=True is valid (fast path).
            cursor.putmulti([(seq_key(s), r) for s, (_, r) in zip(result.seqs, fresh)], append=True)
            for seq, (key, _) in zip(result.seqs, fresh):
                txn.put(key, seq_key(seq), db=dbs[DB_KEYS])
            get = (origin_of or {}).get
            write_row(txn, dbs, first, [records.record_source_key(r) for _, r in fresh],
                      [get(k) for k, _ in fresh])
        if counters.sources is not None:
            for key, record in fresh:
                counters.sources.inserted(key, len(record))
        counters.next_seq += len(fresh)
        counters.samples += len(fresh)
        counters.inserted += len(fresh)
        counters.bytes += incoming
        if fresh or result.evicted:
            counters.save(txn, dbs[DB_META])  # an unchanged transaction commits without an fsync
        result.inserted = len(fresh)
        return result, rest, blocker

    def _evict_for(self, txn: lmdb.Transaction, counters: Counters, limit: int,
                   incoming: int) -> Eviction:
        """Evict to make room for ``incoming`` bytes; past the headroom, reclaim dead leases
        first. ``counters`` is updated in place."""
        target = max(0, limit - incoming)
        evicted = self._policy_pass(txn, counters, target)
        over_headroom = counters.bytes + incoming > limit + self.capacity.headroom_for(limit)
        if over_headroom and self.reclaim(txn):
            more = self._policy_pass(txn, counters, target)
            evicted = Eviction(evicted.count + more.count, evicted.bytes + more.bytes,
                               more.blocked_by)
        return evicted

    def _policy_pass(self, txn: lmdb.Transaction, counters: Counters, limit: int) -> Eviction:
        """One pass of the cache's policy down to ``limit``, under the leases of ``txn``."""
        leases = read_leases(txn, self.env.dbs[DB_LEASES])
        return self.policy.evict(txn, self.env.dbs, counters, limit, leases, self.protection,
                                 self.reads)

    def reclaim(self, txn: lmdb.Transaction) -> list[Lease]:
        """Delete (and log) the leases of dead owners, in ``txn``."""
        return reclaim_dead(txn, self.env.dbs[DB_LEASES], self.lease_timeout_s, path=self.path,
                            state_db=self.env.dbs[DB_STATE], dbs=self.env.dbs)

    def _full_message(self, blocker: Lease) -> str:
        if blocker.label == _STUCK:
            return (f"{self.path}: the disk or LMDB map is too full even to evict: pages are held "
                    "by a long read transaction (a verify, a stuck reader); writers wait until "
                    "it ends")
        if blocker.label == _NO_ROOM:
            return (f"{self.path}: the batch does not fit even with every sample evicted: it is "
                    "larger than capacity + headroom, or a disk short of space lowered the "
                    "capacity in force (`epochcache status` shows it); write smaller batches "
                    "or give the cache more room")
        return (
            f"{self.path}: cache is at capacity + headroom and the oldest samples are held by "
            f"lease {blocker.lease_id[:8]} ({blocker.label or 'snapshot'}) of pid {blocker.pid} "
            f"on {blocker.host}; writers wait until it is released"
        )

    def _log_waiting(self, blocker: Lease) -> None:
        now = time.monotonic()
        if now - self._full_logged > 60:
            self._full_logged = now
            log.info("%s", self._full_message(blocker))

    def evict(self, limit_bytes: int | None = None) -> Eviction:
        """See `SampleStore.evict`; the default limit is this process's `Capacity.effective`."""
        limit = self.capacity.effective if limit_bytes is None else limit_bytes
        dbs = self.env.dbs

        def run(txn: lmdb.Transaction) -> Eviction:
            counters = Counters.load(txn, dbs[DB_META])
            result = self._policy_pass(txn, counters, limit)
            counters.save(txn, dbs[DB_META])
            return result

        return self._write(run)

