"""Eviction: which samples go when a writer needs room. The policy is a seam; the one in use
is oldest-first.

What every policy keeps: it never takes a sample a lease protects (a snapshot's sample its
epoch has not delivered yet, `epochcache.store.release`), it stops where everything left is
protected (naming a lease in the way, so writers wait: back-pressure), it deletes through
`_take` (the record, its key's index entry, the counters), and once it took samples it prunes
the origin rows nothing reaches back to any more (`prune`).
[`EvictionPolicy`][epochcache.store.eviction.EvictionPolicy] is the interface;
`register_policy` makes one selectable by name (the writer's ``eviction``); a
least-read-first policy, say, is one module with its class and one registration.

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

from .codec import record_key
from .counters import Counters
from .leases import Lease
from .origins import prune, prune_bound
from .records import DB_KEYS, DB_SAMPLES, seq_key, seq_of
from .release import Protection


@dataclass
class Eviction:
    """What one eviction pass did, and the lease that stopped it, if one did."""

    count: int = 0
    bytes: int = 0
    blocked_by: Lease | None = None


class EvictionPolicy(abc.ABC):
    """Chooses what eviction takes, inside a writer's transaction (see the module docstring).

    One instance per writer (per process and cache): it may keep state across passes.
    """

    #: The name it is registered and selected under.
    name: ClassVar[str]

    @abc.abstractmethod
    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection) -> Eviction:
        """Take samples no lease protects until ``counters.bytes <= limit_bytes``, or until
        everything left is protected (then ``blocked_by`` names a lease in the way).
        ``counters`` is updated in place; the caller saves it in the same transaction."""


class OldestFirst(EvictionPolicy):
    """The oldest sample no lease protects, and never one newer than every snapshot."""

    name = "oldest"

    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection) -> Eviction:
        return evict_oldest(txn, dbs, counters, limit_bytes, leases, protection)


_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make ``cls`` selectable by its ``name`` (usable as a class decorator)."""
    _POLICIES[cls.name] = cls
    return cls


def policy_of(name: str) -> EvictionPolicy:
    """A new instance of the policy registered as ``name``.

    Raises:
        ValueError: no policy has that name (the message lists those that do).
    """
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction: expected one of {', '.join(sorted(_POLICIES))}, got "
                         f"{name!r}") from None


register_policy(OldestFirst)


def evict_oldest(
    txn: lmdb.Transaction,
    dbs: dict[bytes, lmdb._Database],
    counters: Counters,
    limit_bytes: int,
    leases: Sequence[Lease],
    protection: Protection | None = None,
) -> Eviction:
    """Evict oldest unprotected samples until ``counters.bytes <= limit_bytes``, or until
    everything left is protected (then ``blocked_by`` names a lease in the way).

    ``counters`` is updated in place; the caller saves it in the same transaction.
    ``protection`` is the calling process's tracker of plan leases; without one every lease
    protects its whole range.
    """
    result = Eviction()
    if counters.bytes <= limit_bytes:
        return result
    if protection is None:
        protection = Protection("")
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
            result.blocked_by = _blocker(samples, protection)
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
        _take(txn, cursor, keys_db, counters, result)
    # The candidates used up are gone (evicted here, or by another process): no candidates
    # of any plan lease any more.
    protection.evicted(released[:taken])
    if result.count:
        # Origin rows go once no sample and no lease's range reaches back to them: a lease's
        # samples released and evicted mid-epoch keep theirs, for the epoch's manifest.
        prune(txn, dbs, prune_bound(txn, dbs, [lease.lo for lease in leases]))
    return result


def _take(txn: lmdb.Transaction, cursor: lmdb.Cursor, keys_db: lmdb._Database,
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


def _blocker(cursor: lmdb.Cursor, protection: Protection) -> Lease | None:
    """The lease that keeps the oldest sample, for the writers' message."""
    if not cursor.first():
        return None
    seq = seq_of(bytes(cursor.key()))
    protector = protection.protector(seq)
    if protector is not None:
        return protector
    return max(protection.leases, key=lambda lease: lease.hi, default=None)
