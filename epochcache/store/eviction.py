"""Eviction: which samples go when a writer needs room. The policy is a seam; the one in use
is oldest-first.

What every policy keeps: it never takes a sample a lease protects (a snapshot's sample its
epoch has not delivered yet, `epochcache.store.release`), it stops where everything left is
protected (naming a lease in the way, so writers wait: back-pressure), it deletes through
`take` (the record, its key's index entry, the counters), and once it took samples it prunes
the origin rows nothing reaches back to any more (`prune`).
[`EvictionPolicy`][epochcache.store.eviction.EvictionPolicy] is the interface; one
`epochcache.registry.register_policy` line makes a policy selectable by name. The policy is a
setting of the cache, stored in it (``cache.eviction``, ``Cache(eviction=)``), so that every
writer process evicts alike. A policy gets, in the writer's transaction, the live leases and
what they protect (`Protection.protects` answers for any samples) and, if it orders by reads
(``uses_reads``), the read log (`epochcache.store.reads`).

**Oldest first** (`OldestFirst`, the default, invariant 3):

Eviction takes the cache's oldest sample that no lease protects (invariant 3), and never one
newer than every snapshot (those have not been trained on: evicting them for newer ones would
only waste the remote's bandwidth; writers wait instead). A lease without a plan protects its
whole range; a lease with a plan only its samples not yet read (progressive release, see
`epochcache.store.release`). So the samples present are no longer one contiguous run: a
snapshot reads the keys when there are gaps (`select_snapshot`).

Each victim is the older of two candidates: the first sample outside every lease's range
(found by a cursor seek per gap between ranges), and the oldest released sample of the plan
leases (found from per-block counts). The common cases stay a cursor walk: no lease at all, or
old samples below every lease.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import lmdb

from ..registry import EVICTION
from .leases import Lease
from .origins import prune
from .reads import Reads
from .records import DB_KEYS, DB_SAMPLES, record_key, seq_key, seq_of
from .release import Protection
from .tables import Counters

#: The policy of a cache that was never told one (`epochcache.registry` names the others).
DEFAULT_POLICY = "oldest"


@dataclass
class Eviction:
    """What one eviction pass did, and the lease that stopped it, if one did."""

    count: int = 0
    bytes: int = 0
    blocked_by: Lease | None = None


class EvictionPolicy(abc.ABC):
    """Chooses what eviction takes, inside a writer's transaction (see the module docstring).

    One instance per writer (per process and cache): it may keep state across passes.
    Whatever it does, it keeps invariants 1-3: it never takes a sample ``protection``
    protects (`Protection.protects`, after `Protection.sync` with ``leases``), and it
    stops only at ``limit_bytes`` or when everything left is protected.
    """

    #: The name it is registered and selected under (`epochcache.registry.register_policy`).
    name: ClassVar[str]
    #: Whether it orders by reads: then ending a lease records its reads (the read log,
    #: `epochcache.store.reads`), and `evict` gets them.
    uses_reads: ClassVar[bool] = False

    @abc.abstractmethod
    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection, reads: Reads) -> Eviction:
        """Take samples no lease protects until ``counters.bytes <= limit_bytes``, or until
        everything left is protected (then ``blocked_by`` names a lease in the way).
        ``counters`` is updated in place; the caller saves it in the same transaction.
        ``reads`` gives the read log (`Reads.current`) to a policy that ``uses_reads``."""


class OldestFirst(EvictionPolicy):
    """The oldest sample no lease protects, and never one newer than every snapshot."""

    name = "oldest"

    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection, reads: Reads) -> Eviction:
        return evict_oldest(txn, dbs, counters, limit_bytes, leases, protection)


def policy_of(name: str) -> EvictionPolicy:
    """A new instance of the policy registered as ``name`` (`epochcache.registry`).

    Raises:
        ValueError: no policy has that name (the message lists those that do), or what is
            registered under it is not an `EvictionPolicy`.
    """
    entry = EVICTION.get(name)
    if entry is None:
        raise ValueError(f"eviction: expected one of {', '.join(EVICTION)}, got {name!r} "
                         "(a policy of your own: epochcache.registry.register_policy before "
                         "the cache opens)")
    cls = entry.resolve()
    if not issubclass(cls, EvictionPolicy):
        raise ValueError(f"eviction: {name!r} is registered as {cls.__name__}, not an "
                         "EvictionPolicy")
    return cls()


def evict_oldest(
    txn: lmdb.Transaction,
    dbs: dict[bytes, lmdb._Database],
    counters: Counters,
    limit_bytes: int,
    leases: Sequence[Lease],
    protection: Protection,
) -> Eviction:
    """`OldestFirst`'s pass (what `EvictionPolicy.evict` does, oldest first), for a policy
    of its own to fall back on; ``protection`` is the calling process's tracker of plan
    leases."""
    result = Eviction()
    if counters.bytes <= limit_bytes:
        return result
    protection.sync(leases)
    keys_db = dbs[DB_KEYS]
    walk = _Gaps(txn.cursor(db=dbs[DB_SAMPLES]), protection.gaps())
    samples = txn.cursor(db=dbs[DB_SAMPLES])  # for released samples, anywhere
    released = protection.released()
    taken = 0  # released candidates used up (evicted, or found gone)
    while counters.bytes > limit_bytes:
        if taken == len(released) and len(released):
            protection.evicted(released[:taken])
            released = protection.released()
            taken = 0
        gap_seq = walk.head()
        next_released = int(released[taken]) if taken < len(released) else None
        if gap_seq is None and next_released is None:
            # The lease that keeps the oldest sample, for the writers' message.
            result.blocked_by = (protection.blocker(seq_of(bytes(samples.key())))
                                 if samples.first() else None)
            break
        if gap_seq is not None and (next_released is None or gap_seq < next_released):
            cursor = walk.cursor
        else:
            assert next_released is not None
            taken += 1
            cursor = samples
            if not cursor.set_key(seq_key(next_released)):
                continue  # another process evicted it
            walk.moved()
        take(txn, cursor, keys_db, counters, result)
    # The candidates used up are gone (evicted here, or by another process): no candidates
    # of any plan lease any more.
    protection.evicted(released[:taken])
    if result.count:
        prune_origins(txn, dbs, leases)
    return result


def prune_origins(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
                  leases: Sequence[Lease]) -> None:
    """After a pass that took samples: delete the origin rows no sample and no lease's range
    reaches back to any more (a lease's samples released and evicted mid-epoch keep theirs,
    for the epoch's manifest)."""
    prune(txn, dbs, [lease.lo for lease in leases])


def take(txn: lmdb.Transaction, cursor: lmdb.Cursor, keys_db: lmdb._Database,
         counters: Counters, result: Eviction) -> None:
    """Delete the sample under ``cursor`` (its record, its key's index entry) and count it:
    what every policy's victim goes through."""
    record = cursor.value()
    size = len(record)
    key = record_key(record)
    txn.delete(key, db=keys_db)
    if counters.sources is not None:
        counters.sources.evicted(key, size)
    counters.samples -= 1
    counters.bytes -= size
    counters.evicted += 1
    counters.evicted_bytes += size
    result.count += 1
    result.bytes += size
    cursor.delete()


class _Gaps:
    """Walks the samples outside every lease's range, below the frontier, oldest first."""

    def __init__(self, cursor: lmdb.Cursor, gaps: list[tuple[int, int]]) -> None:
        self.cursor, self._gaps, self._gap = cursor, gaps, 0
        self._seq: int | None = None
        self._stale = True  # the cursor must be positioned (again)

    def moved(self) -> None:
        """Another cursor deleted a record: position again before trusting this one."""
        self._stale = True

    def head(self) -> int | None:
        """The oldest such sample (the cursor is left on it), or None."""
        cursor = self.cursor
        while self._gap < len(self._gaps):
            start, end = self._gaps[self._gap]
            if self._stale:
                found = cursor.set_range(seq_key(max(start, self._seq or 0)))
                self._stale = False
            else:
                found = bool(cursor.key())  # after a delete the cursor is on the next record
            if not found:
                self._gap = len(self._gaps)
                return None
            seq = seq_of(bytes(cursor.key()))
            if seq < end:
                self._seq = seq
                return seq
            # Past this gap: the next gap holding ``seq`` or after it.
            while self._gap < len(self._gaps) and self._gaps[self._gap][1] <= seq:
                self._gap += 1
            if self._gap < len(self._gaps) and self._gaps[self._gap][0] > seq:
                self._stale = True
                self._seq = self._gaps[self._gap][0]
        return None

