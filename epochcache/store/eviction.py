"""Oldest-first eviction of the samples no live lease protects.

Eviction takes the cache's oldest sample that no lease protects (invariant 3), and never one
newer than every snapshot (those have not been trained on: evicting them for newer ones would
only waste the remote's bandwidth; writers wait instead). A lease without a plan protects its
whole range; a lease with a plan only its samples not yet read (progressive release, see
:mod:`epochcache.store.release`). So the samples present are no longer one contiguous run: a
snapshot reads the keys when there are gaps (:func:`~.snapshot.select_snapshot`).

Each victim is the older of two candidates: the first sample outside every lease's range
(found by a cursor seek per gap between ranges), and the oldest released sample of the plan
leases (found from per-block counts). The common cases stay a cursor walk: no lease at all, or
old samples below every lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from .codec import record_key
from .counters import Counters
from .leases import Lease
from .release import Protection
from .schema import DB_KEYS, DB_SAMPLES, seq_key, seq_of


@dataclass
class Eviction:
    """What one eviction pass did, and the lease that stopped it, if one did."""

    count: int = 0
    bytes: int = 0
    blocked_by: Lease | None = None


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
    samples_db, keys_db = dbs[DB_SAMPLES], dbs[DB_KEYS]
    cursor = txn.cursor(db=samples_db)
    gap_from = 0  # no unranged sample below this is left
    while counters.bytes > limit_bytes:
        unranged = _first_unranged(cursor, protection, gap_from)
        released = protection.released_candidate()
        if unranged is None and released is None:
            result.blocked_by = _blocker(cursor, protection)
            break
        if unranged is not None and (released is None or unranged < released[0]):
            gap_from = unranged
        else:
            assert released is not None
            if not cursor.set_key(seq_key(released[0])):
                protection.evicted(released[0])  # another process evicted it
                continue
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
        protection.evicted(seq_of(bytes(cursor.key())))
        cursor.delete()
    return result


def _first_unranged(cursor: lmdb.Cursor, protection: Protection, start: int) -> int | None:
    """The oldest sample at or after ``start`` outside every lease's range and before the
    frontier (the cursor is left on it), or None."""
    gap = protection.unranged_after(start)
    while gap is not None:
        if not cursor.set_range(seq_key(gap[0])):
            return None  # no sample at or after the gap
        seq = seq_of(bytes(cursor.key()))
        if seq < gap[1]:
            return seq
        gap = protection.unranged_after(seq)  # the gap at or after the next sample
    return None


def _blocker(cursor: lmdb.Cursor, protection: Protection) -> Lease | None:
    """The lease that keeps the oldest sample, for the writers' message."""
    if not cursor.first():
        return None
    seq = seq_of(bytes(cursor.key()))
    holder = protection.protector(seq)
    if holder is not None:
        return holder
    return max(protection.leases, key=lambda lease: lease.hi, default=None)
