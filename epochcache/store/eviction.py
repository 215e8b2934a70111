"""Oldest-first eviction that never touches a leased sample.

Eviction only ever removes the cache's oldest sample (the first key of ``samples``) and stops
at the first sample a live lease holds. So at every moment the evicted samples are exactly the
oldest ones (invariant 3), and the samples present form a contiguous run of sequence numbers,
which is what makes a snapshot O(1) to take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

from .codec import record_key
from .counters import Counters
from .leases import Lease, protected
from .schema import DB_KEYS, DB_SAMPLES


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
) -> Eviction:
    """Evict oldest samples until ``counters.bytes <= limit_bytes`` or a lease blocks.

    ``counters`` is updated in place; the caller saves it in the same transaction.
    """
    result = Eviction()
    if counters.bytes <= limit_bytes:
        return result
    samples_db, keys_db = dbs[DB_SAMPLES], dbs[DB_KEYS]
    cursor = txn.cursor(db=samples_db)
    if not cursor.first():
        return result
    while counters.bytes > limit_bytes:
        seq_bytes = bytes(cursor.key())
        holder = protected(leases, int.from_bytes(seq_bytes, "big"))
        if holder is not None:
            result.blocked_by = holder
            break
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
        # delete() moves the cursor to the next record; False means the store is now empty.
        if not cursor.delete():
            break
        if not cursor.key():
            break
    return result
