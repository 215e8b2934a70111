"""``verify --repair``: fix what a scan found, in short write transactions.

Each step touches only what is wrong, so that a repair of a large cache neither holds the write
lock for long nor rewrites the whole key index (which could fill the LMDB map):

1. corrupt records are deleted, with their key index entries (counted as evicted);
2. samples whose key index entry is missing or points elsewhere get their entry; when it
   points to another sample of the same key (a duplicate), the older sample is deleted;
3. key index entries of no sample are deleted (found by a chunked scan of the index);
4. the counters (samples, bytes, next sequence number) are rewritten from the records, in one
   write transaction that reads only record lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import lmdb

from .records import DB_KEYS, DB_META, DB_SAMPLES, record_key, seq_key, seq_of, unpack_u64
from .sample_store import SampleStore
from .tables import Counters

log = logging.getLogger(__name__)

#: Entries changed or read per write/read transaction of a repair step.
BATCH = 1024


def _batches(items: Sequence[int]) -> Iterator[Sequence[int]]:
    for start in range(0, len(items), BATCH):
        yield items[start : start + BATCH]


def repair_cache(cache: SampleStore, corrupt: list[int], unindexed: list[int],
                 orphans: bool) -> dict[str, int]:
    """Repair what a scan (`verify.scan_cache`) found; return what was done, by kind.

    Args:
        cache: the cache, open for writing.
        corrupt: sequence numbers of corrupt records.
        unindexed: sequence numbers of samples whose key index entry is missing or wrong.
        orphans: whether the index may hold entries of no sample.
    """
    done = {
        "corrupt_removed": _remove_corrupt(cache, corrupt),
        "index_entries_fixed": 0,
        "duplicates_removed": 0,
        "index_orphans_removed": 0,
        "counters_rewritten": 0,
    }
    fixed, duplicates = _fix_index(cache, unindexed)
    done["index_entries_fixed"], done["duplicates_removed"] = fixed, duplicates
    if orphans or fixed or duplicates:
        done["index_orphans_removed"] = _remove_orphans(cache)
    done["counters_rewritten"] = _rewrite_counters(cache)
    return done


def _remove_corrupt(cache: SampleStore, seqs: list[int]) -> int:
    dbs = cache.env.dbs
    removed = 0
    for batch in _batches(seqs):

        def run(txn: lmdb.Transaction, batch: Sequence[int] = batch) -> int:
            counters = Counters.load(txn, dbs[DB_META])
            count = 0
            for seq in batch:
                record = txn.get(seq_key(seq), db=dbs[DB_SAMPLES])
                if record is None:
                    continue  # evicted meanwhile
                try:
                    key = record_key(record)
                    indexed = txn.get(key, db=dbs[DB_KEYS])
                    if indexed is not None and unpack_u64(indexed) == seq:
                        txn.delete(key, db=dbs[DB_KEYS])
                except (IndexError, ValueError, lmdb.BadValsizeError):
                    pass  # the header is damaged too: its entry, if any, is an orphan (step 3)
                _remove(txn, dbs, counters, seq, len(record))
                count += 1
            counters.save(txn, dbs[DB_META])
            return count

        removed += cache.env.write(run)
    return removed


def _remove(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], counters: Counters,
            seq: int, size: int) -> None:
    """Delete sample ``seq``, counted as evicted so that inserted - evicted stays samples."""
    txn.delete(seq_key(seq), db=dbs[DB_SAMPLES])
    counters.samples -= 1
    counters.bytes -= size
    counters.evicted += 1
    counters.evicted_bytes += size


def _fix_index(cache: SampleStore, seqs: list[int]) -> tuple[int, int]:
    dbs = cache.env.dbs
    fixed = duplicates = 0
    for batch in _batches(seqs):

        def run(txn: lmdb.Transaction, batch: Sequence[int] = batch) -> tuple[int, int]:
            counters = Counters.load(txn, dbs[DB_META])
            fixed = duplicates = 0
            for seq in batch:
                record = txn.get(seq_key(seq), db=dbs[DB_SAMPLES])
                if record is None:
                    continue
                key = record_key(record)
                indexed = txn.get(key, db=dbs[DB_KEYS])
                other = None if indexed is None else unpack_u64(indexed)
                if other == seq:
                    continue
                named = None if other is None else txn.get(seq_key(other), db=dbs[DB_SAMPLES])
                if named is not None and record_key(named) == key and other is not None:
                    # Two samples of one key: keep the newer, which the index must name.
                    older, newer = sorted((seq, other))
                    gone = len(record) if older == seq else len(named)
                    _remove(txn, dbs, counters, older, gone)
                    txn.put(key, seq_key(newer), db=dbs[DB_KEYS])
                    duplicates += 1
                    continue
                txn.put(key, seq_key(seq), db=dbs[DB_KEYS])
                fixed += 1
            counters.save(txn, dbs[DB_META])
            return fixed, duplicates

        more_fixed, more_duplicates = cache.env.write(run)
        fixed += more_fixed
        duplicates += more_duplicates
    return fixed, duplicates


def _remove_orphans(cache: SampleStore) -> int:
    """Delete key index entries that name no sample (or a sample of another key)."""
    dbs = cache.env.dbs
    orphans: list[bytes] = []
    after = b""
    while True:
        with cache.env.read() as txn:
            cursor = txn.cursor(db=dbs[DB_KEYS])
            found = cursor.set_range(after) if after else cursor.first()
            count = 0
            while found and count < BATCH:
                key, value = bytes(cursor.key()), bytes(cursor.value())
                if key != after:
                    count += 1
                    record = txn.get(value, db=dbs[DB_SAMPLES]) if len(value) == 8 else None
                    if record is None or record_key(record) != key:
                        orphans.append(key)
                after = key
                found = cursor.next()
        if not found:
            break

    def run(txn: lmdb.Transaction) -> int:
        count = 0
        for key in orphans:
            value = txn.get(key, db=dbs[DB_KEYS])
            if value is None:
                continue
            record = txn.get(bytes(value), db=dbs[DB_SAMPLES]) if len(value) == 8 else None
            if record is None or record_key(record) != key:  # still an orphan
                txn.delete(key, db=dbs[DB_KEYS])
                count += 1
        return count

    return cache.env.write(run) if orphans else 0


def _rewrite_counters(cache: SampleStore) -> int:
    """Recount samples and bytes from the records; return how many counters changed."""
    dbs = cache.env.dbs

    def run(txn: lmdb.Transaction) -> int:
        counters = Counters.load(txn, dbs[DB_META])
        before = (counters.samples, counters.bytes, counters.next_seq)
        counters.samples = int(txn.stat(dbs[DB_SAMPLES])["entries"])
        counters.bytes = sum(len(record) for _key, record in txn.cursor(db=dbs[DB_SAMPLES]))
        cursor = txn.cursor(db=dbs[DB_SAMPLES])
        if cursor.last():
            counters.next_seq = max(counters.next_seq, seq_of(bytes(cursor.key())) + 1)
        after = (counters.samples, counters.bytes, counters.next_seq)
        if after != before:
            counters.save(txn, dbs[DB_META])
        return sum(a != b for a, b in zip(before, after))

    return cache.env.write(run)
