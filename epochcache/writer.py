"""The write path of a cache: framing, commits in batches, eviction and back-pressure.

``put_many`` commits as many samples per transaction as fit within capacity + headroom, evicting
the oldest unleased samples first; when leases pin the rest it waits (back-pressure) instead of
failing or overfilling. A full disk or LMDB map is met by evicting in a transaction of its own
and then lowering the effective capacity, never by corrupting the cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lmdb

from . import codec
from .counters import Counters
from .errors import CacheError, CacheFull, SampleTooLarge
from .eviction import Eviction, evict_oldest
from .leases import Lease, read_leases, reclaim_dead
from .schema import DB_KEYS, DB_LEASES, DB_META, DB_SAMPLES, seq_key
from .units import format_size

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("epochcache.cache")  # one logger for everything a Cache does

Value = bytes | Mapping[str, bytes]


@dataclass
class PutResult:
    """What :meth:`Cache.put_many` committed."""

    inserted: int = 0
    skipped: int = 0
    seqs: list[int] = field(default_factory=list)
    evicted: int = 0



def is_disk_full(exc: lmdb.Error) -> bool:
    """MapFullError, ENOSPC, or the EIO LMDB reports for a short write on a full disk."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    text = str(exc)
    return "Input/output error" in text or "No space left" in text


class WriterMixin:
    """``put``/``put_many``/``evict`` of :class:`~epochcache.cache.Cache`."""

    path: str
    compress: bool
    level: int
    capacity_bytes: int
    headroom_bytes: int
    lease_timeout_s: float
    _store: Store
    _full_logged: float

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        raise NotImplementedError

    @property
    def effective_capacity(self) -> int:
        raise NotImplementedError

    def _headroom_for(self, limit: int) -> int:
        raise NotImplementedError

    def _lower_capacity(self, exc: Exception, incoming: int) -> None:
        raise NotImplementedError

    def encode(self, key: str, value: Value) -> bytes:
        """Frame one sample as a record (done by samplers before they take the write lock)."""
        return codec.encode_record(key, value, level=self.level, compress=self.compress)

    def put(self, key: str, value: Value, **kwargs: Any) -> PutResult:
        return self.put_many([(key, value)], **kwargs)

    def put_many(
        self,
        items: Iterable[tuple[str, Value]],
        *,
        encoded: bool = False,
        wait: bool = True,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> PutResult:
        """Store samples; samples whose key is already cached are skipped.

        Eviction makes room, oldest first. When leases pin too much to stay within capacity +
        headroom, the call waits (back-pressure) until space returns, ``timeout_s`` passes or
        ``stop`` is set; with ``wait=False`` it raises :class:`CacheFull` at once. Samples are
        committed in order, as many per transaction as fit; when the call returns, every
        sample is committed. A :class:`CacheFull` carries ``.result``, what was committed.

        Args:
            items: ``(source key, value)`` pairs; a value is ``bytes`` or a dict of fields.
            encoded: the values are records already made by :meth:`encode`.

        Raises:
            CacheFull: no room and ``wait`` is False, the timeout passed, or ``stop`` was set.
            SampleTooLarge: a sample could never fit the capacity.
        """
        batch: dict[bytes, bytes] = {}
        for key, value in items:
            record = value if encoded else self.encode(key, value)
            if len(record) > self.capacity_bytes:
                raise SampleTooLarge(
                    f"{self.path}: sample {key!r} is {format_size(len(record))}, larger than the "
                    f"cache capacity {format_size(self.capacity_bytes)}; raise cache.capacity"
                )
            batch.setdefault(key.encode("utf-8"), record)  # type: ignore[arg-type]
        pending = list(batch.items())
        total = PutResult()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay, attempts_full = 0.02, 0
        while pending:
            limit = self.effective_capacity
            try:
                result, pending, blocked = self._store.write(
                    lambda txn: self._put_txn(txn, pending, limit)
                )
            except lmdb.Error as exc:
                if not is_disk_full(exc):
                    raise
                attempts_full += 1
                if attempts_full > 16:
                    raise CacheError(
                        f"{self.path}: disk full even after lowering the capacity; free disk space"
                    ) from exc
                incoming = sum(len(r) for _, r in pending)
                # LMDB reuses freed pages only after the freeing transaction commits, so evict
                # in a transaction of its own before trying the insert again.
                freed = self._evict_quietly(limit - incoming)
                if freed.count:
                    continue
                if freed.blocked_by is None:
                    self._lower_capacity(exc, incoming)
                    continue
                result, blocked = PutResult(), freed.blocked_by  # a lease pins it: wait
            total.inserted += result.inserted
            total.skipped += result.skipped
            total.evicted += result.evicted
            total.seqs.extend(result.seqs)
            if blocked is None or not pending:
                continue
            if result.inserted:
                delay = 0.02  # progress: space is coming back
            expired = deadline is not None and time.monotonic() >= deadline
            if not wait or expired or (stop is not None and stop.is_set()):
                error = CacheFull(self._full_message(blocked))
                error.result = total
                raise error
            self._log_waiting(blocked)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, 0.25)  # a released lease should unblock writers promptly
        return total

    def _evict_quietly(self, limit: int) -> Eviction:
        try:
            return self.evict(max(0, limit))
        except lmdb.Error as exc:
            if not is_disk_full(exc):
                raise
            return Eviction()

    def _put_txn(
        self, txn: lmdb.Transaction, pending: list[tuple[bytes, bytes]], limit: int
    ) -> tuple[PutResult, list[tuple[bytes, bytes]], Lease | None]:
        """Commit the longest prefix of ``pending`` that fits; return the rest and the blocker."""
        meta, keys_db = self.dbs[DB_META], self.dbs[DB_KEYS]
        counters = Counters.load(txn, meta)
        fresh = [(k, r) for k, r in pending if txn.get(k, db=keys_db) is None]
        result = PutResult(skipped=len(pending) - len(fresh))
        incoming = sum(len(r) for _, r in fresh)
        blocker: Lease | None = None
        if counters.bytes + incoming > limit:
            leases = read_leases(txn, self.dbs[DB_LEASES])
            evicted = evict_oldest(txn, self.dbs, counters, max(0, limit - incoming), leases)
            headroom = self._headroom_for(limit)
            if counters.bytes + incoming > limit + headroom and self._reclaim(txn):
                leases = read_leases(txn, self.dbs[DB_LEASES])
                more = evict_oldest(txn, self.dbs, counters, max(0, limit - incoming), leases)
                evicted = Eviction(evicted.count + more.count, evicted.bytes + more.bytes, more.blocked_by)
            result.evicted = evicted.count
            room = limit + headroom - counters.bytes
            if incoming > room:
                blocker = evicted.blocked_by or Lease.new(0, 0, 0, label="(none: disk limit)")
                fits, used = 0, 0
                for _, record in fresh:
                    if used + len(record) > room:
                        break
                    used += len(record)
                    fits += 1
                fresh, rest = fresh[:fits], fresh[fits:]
                incoming = used
            else:
                rest = []
        else:
            rest = []
        first = counters.next_seq
        result.seqs = list(range(first, first + len(fresh)))
        if fresh:
            cursor = txn.cursor(db=self.dbs[DB_SAMPLES])
            # Sequence keys are big-endian and increasing, so append=True is valid (fast path).
            cursor.putmulti([(seq_key(s), r) for s, (_, r) in zip(result.seqs, fresh)], append=True)
            for seq, (key, _) in zip(result.seqs, fresh):
                txn.put(key, seq_key(seq), db=keys_db)
        counters.next_seq += len(fresh)
        counters.samples += len(fresh)
        counters.inserted += len(fresh)
        counters.bytes += incoming
        if fresh or result.evicted:
            counters.save(txn, meta)  # an unchanged transaction commits without an fsync
        result.inserted = len(fresh)
        return result, rest, blocker

    def _reclaim(self, txn: lmdb.Transaction) -> list[Lease]:
        dead = reclaim_dead(txn, self.dbs[DB_LEASES], self.lease_timeout_s)
        for lease in dead:
            log.info(
                "%s: reclaimed lease %s of dead process %d on %s (%d samples)",
                self.path, lease.lease_id[:8], lease.pid, lease.host, lease.count,
            )
        return dead

    def _full_message(self, blocker: Lease) -> str:
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
        """Evict oldest unleased samples until at most ``limit_bytes`` (default capacity) remain."""
        limit = self.effective_capacity if limit_bytes is None else limit_bytes

        def run(txn: lmdb.Transaction) -> Eviction:
            counters = Counters.load(txn, self.dbs[DB_META])
            result = evict_oldest(txn, self.dbs, counters, limit, read_leases(txn, self.dbs[DB_LEASES]))
            counters.save(txn, self.dbs[DB_META])
            return result

        return self._store.write(run)

