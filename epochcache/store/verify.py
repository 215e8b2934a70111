"""Check every stored record, the key index and the counters; repair only when asked.

A read transaction pins every page freed while it is open, so one transaction over a whole
cache of a live daemon would let the LMDB map fill up. ``verify`` therefore reads the samples
in chunks, each in a short transaction of its own (at most `CHUNK_RECORDS` records,
`CHUNK_BYTES` bytes or `CHUNK_S` seconds), while samplers keep writing:

* each record's checksum, decompression and key index entry are checked in its chunk's
  transaction (records never change once written);
* the counters are checked in one last short transaction, against the sizes gathered by the
  chunks. That is exact while samplers write and evict, because eviction only ever removes the
  oldest samples (a prefix of the sequence numbers) and new samples get higher ones: the
  samples present at the end are the scanned ones from the first present sequence number on,
  plus the few inserted since the scan passed (read in that last transaction). When that
  does not add up (something else deleted samples), the sizes are recounted in one
  transaction that reads only record lengths.

``--repair`` removes corrupt records, fixes the key index (missing or wrong entries, entries
of no sample, duplicate samples of one key) and rewrites the counters from the records, in
short write transactions, then verifies again: the report says what was found, what was
repaired, and whether the cache is consistent now. Each repair step touches only what is
wrong, so a repair of a large cache neither holds the write lock for long nor rewrites the
whole key index (which could fill the LMDB map):

1. corrupt records are deleted, with their key index entries (counted as evicted);
2. samples whose key index entry is missing or points elsewhere get their entry; when it
   points to another sample of the same key (a duplicate), the older sample is deleted;
3. key index entries of no sample are deleted (found by a chunked scan of the index);
4. the counters (samples, bytes, next sequence number) are rewritten from the records, in one
   write transaction that reads only record lengths.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from ..errors import CacheCorrupted
from ..limits import cut_key, cut_text
from .records import (
    DB_KEYS,
    DB_META,
    DB_SAMPLES,
    check_record,
    record_key,
    seq_key,
    seq_of,
    source_key,
    unpack_u64,
)
from .sample_store import SampleStore
from .tables import Counters

log = logging.getLogger(__name__)

#: Bounds of one read transaction of the scan.
CHUNK_RECORDS = 1024
CHUNK_BYTES = 16 * 1024 * 1024
CHUNK_S = 0.2
#: Passes over samples inserted during the scan before the last (counting) transaction.
_TAIL_PASSES = 8


@dataclass
class VerifyReport:
    """The outcome of `verify_cache`.

    ``corrupt``, ``counter_mismatches`` and ``index_problems`` are what the scan found;
    ``repairs`` what ``--repair`` did (``repaired`` counts them); ``ok`` is True when the cache
    is consistent at the end (after the repair, if one ran).
    """

    path: str
    checked: int = 0
    checked_bytes: int = 0
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    counter_mismatches: dict[str, tuple[int, int]] = field(default_factory=dict)
    index_problems: list[str] = field(default_factory=list)
    repairs: dict[str, int] = field(default_factory=dict)
    transactions: int = 0
    consistent_after_repair: bool | None = None
    #: seqs whose key index entry is missing or wrong (for the repair)
    unindexed: list[int] = field(default_factory=list, repr=False)

    @property
    def found_problems(self) -> bool:
        return bool(self.corrupt or self.counter_mismatches or self.index_problems)

    @property
    def repaired(self) -> int:
        return sum(self.repairs.values())

    @property
    def ok(self) -> bool:
        if self.consistent_after_repair is not None:
            return self.consistent_after_repair
        return not self.found_problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "transactions": self.transactions,
            "corrupt": self.corrupt,
            "counter_mismatches": {k: {"stored": a, "actual": b} for k, (a, b) in self.counter_mismatches.items()},
            "index_problems": self.index_problems,
            "repaired": self.repaired,
            "repairs": self.repairs,
        }


class _Scan:
    """The chunked scan of one cache: what it checked and the sizes it saw."""

    def __init__(self, cache: SampleStore, report: VerifyReport,
                 progress: Callable[[int], None] | None) -> None:
        self.cache, self.report, self.progress = cache, report, progress
        self.seqs: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []
        self.next_seq = 0  # scan from here on

    def chunk(self) -> int:
        """Check the next chunk of records in one read transaction; return how many."""
        seqs: list[int] = []
        sizes: list[int] = []
        started = time.monotonic()
        read = 0
        with self.cache.env.read() as txn:
            self.report.transactions += 1
            dbs = self.cache.env.dbs
            cursor = txn.cursor(db=dbs[DB_SAMPLES])
            if not cursor.set_range(seq_key(self.next_seq)):
                return 0
            for raw_key, record in cursor:
                seq = seq_of(bytes(raw_key))
                self.check(txn, dbs, seq, record)
                seqs.append(seq)
                sizes.append(len(record))
                read += len(record)
                if (len(seqs) >= CHUNK_RECORDS or read >= CHUNK_BYTES
                        or time.monotonic() - started >= CHUNK_S):
                    break
        if seqs:
            self.seqs.append(np.asarray(seqs, dtype=np.int64))
            self.sizes.append(np.asarray(sizes, dtype=np.int64))
            self.next_seq = seqs[-1] + 1
            if self.progress is not None:
                self.progress(len(seqs))
        return len(seqs)

    def check(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], seq: int,
              record: bytes | memoryview) -> None:
        """Check one record (checksum, decompression, key index entry) in ``txn``."""
        report = self.report
        report.checked += 1
        report.checked_bytes += len(record)
        try:
            info = check_record(record)
        except (CacheCorrupted, UnicodeDecodeError, ValueError) as exc:
            key = _key_of(record)
            report.corrupt.append({"seq": seq, "key": cut_key(key),
                                   "error": cut_text(str(exc), keys=(key,))})
            return
        indexed = txn.get(record_key(record), db=dbs[DB_KEYS])
        if indexed is None or unpack_u64(indexed) != seq:
            where = "missing from" if indexed is None else "not the entry of"
            report.index_problems.append(
                f"sample {seq} ({cut_key(info.key)!r}) is {where} the key index")
            report.unindexed.append(seq)

    def scanned_bytes_from(self, first: int) -> tuple[int, int]:
        """``(count, bytes)`` of the scanned records with seq >= ``first``."""
        if not self.seqs:
            return 0, 0
        seqs, sizes = np.concatenate(self.seqs), np.concatenate(self.sizes)
        keep = seqs >= first
        return int(keep.sum()), int(sizes[keep].sum())


def _key_of(record: bytes | memoryview) -> str:
    try:
        return source_key(record)
    except (IndexError, ValueError):
        return "?"


def _check_counters(cache: SampleStore, scan: _Scan, report: VerifyReport) -> None:
    """Compare the counters with the records, in one short read transaction (module doc)."""
    dbs = cache.env.dbs
    with cache.env.read() as txn:
        report.transactions += 1
        stored = Counters.load(txn, dbs[DB_META])
        entries = int(txn.stat(dbs[DB_SAMPLES])["entries"])
        key_entries = int(txn.stat(dbs[DB_KEYS])["entries"])
        cursor = txn.cursor(db=dbs[DB_SAMPLES])
        first = seq_of(bytes(cursor.key())) if cursor.first() else scan.next_seq
        last = seq_of(bytes(cursor.key())) if cursor.last() else -1
        count, total = scan.scanned_bytes_from(first)
        if cursor.set_range(seq_key(scan.next_seq)):
            for raw_key, record in cursor:  # inserted since the scan passed: a few at most
                scan.check(txn, dbs, seq_of(bytes(raw_key)), record)
                count += 1
                total += len(record)
        if count != entries:
            # Samples went missing other than oldest first: count the sizes here instead.
            total = sum(len(record) for _key, record in txn.cursor(db=dbs[DB_SAMPLES]))
    actual = {"samples": entries, "bytes": total}
    for name, value in actual.items():
        if getattr(stored, name) != value:
            report.counter_mismatches[name] = (getattr(stored, name), value)
    if stored.next_seq < last + 1:
        report.counter_mismatches["next_seq"] = (stored.next_seq, last + 1)
    if key_entries != entries:
        report.index_problems.append(f"key index has {key_entries} entries for {entries} samples")


def scan_cache(cache: SampleStore, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check ``cache`` in chunks of short read transactions; modify nothing."""
    report = VerifyReport(path=cache.path)
    scan = _Scan(cache, report, progress)
    while scan.chunk():
        pass
    for _ in range(_TAIL_PASSES):  # samples inserted meanwhile: catch up in chunks
        if scan.chunk() < CHUNK_RECORDS // 2:
            break
        while scan.chunk():
            pass
    _check_counters(cache, scan, report)
    return report


def verify_cache(path: str, *, repair: bool = False,
                 progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every record's checksum and decodability, the key index and the counters.

    Without ``repair`` nothing is modified. With it, problems found are repaired and the cache
    is checked again (``report.ok`` then says whether it is consistent now).

    Args:
        path: the cache directory.
        repair: remove corrupt records, fix the key index, rewrite the counters.
        progress: called with the number of records checked by each chunk.
    """
    cache = SampleStore(path, readonly=not repair)
    try:
        report = scan_cache(cache, progress)
        if repair and report.found_problems:
            orphans = any("entries for" in problem for problem in report.index_problems)
            report.repairs = repair_cache(cache, [int(item["seq"]) for item in report.corrupt],
                                          report.unindexed, orphans)
            report.consistent_after_repair = not scan_cache(cache).found_problems
            log.warning("%s: repaired %s; the cache is %s", cache.path,
                        ", ".join(f"{n} {what}" for what, n in report.repairs.items() if n)
                        or "nothing", "consistent" if report.ok else "still inconsistent")
        return report
    finally:
        cache.close()


#: Entries changed or read per write/read transaction of a repair step.
BATCH = 1024


def repair_cache(cache: SampleStore, corrupt: list[int], unindexed: list[int],
                 orphans: bool) -> dict[str, int]:
    """Repair what a scan (`verify.scan_cache`) found; return what was done, by kind.

    Args:
        cache: the cache, open for writing.
        corrupt: sequence numbers of corrupt records.
        unindexed: sequence numbers of samples whose key index entry is missing or wrong.
        orphans: whether the index may hold entries of no sample.
    """
    removed = _per_sample(cache, corrupt, _remove_corrupt)
    index = _per_sample(cache, unindexed, _fix_entry)
    done = {
        "corrupt_removed": removed["removed"],
        "index_entries_fixed": index["fixed"],
        "duplicates_removed": index["duplicate"],
        "index_orphans_removed": 0,
        "counters_rewritten": 0,
    }
    if orphans or index["fixed"] or index["duplicate"]:
        done["index_orphans_removed"] = _remove_orphans(cache)
    done["counters_rewritten"] = _rewrite_counters(cache)
    return done


#: ``repair(txn, dbs, counters, seq)``: one sample's repair step; what it did, or None.
_Repair = Callable[[lmdb.Transaction, dict[bytes, lmdb._Database], Counters, int], str | None]


def _per_sample(cache: SampleStore, seqs: list[int], repair: _Repair) -> collections.Counter[str]:
    """Run ``repair`` on each of ``seqs``, `BATCH` samples per write transaction (the counters
    loaded and saved around each); count what it did, by what it returned."""
    dbs = cache.env.dbs
    done: collections.Counter[str] = collections.Counter()
    for start in range(0, len(seqs), BATCH):

        def run(txn: lmdb.Transaction, batch: Sequence[int] = seqs[start : start + BATCH],
                ) -> collections.Counter[str]:
            counters = Counters.load(txn, dbs[DB_META])
            did = collections.Counter(what for seq in batch
                                      if (what := repair(txn, dbs, counters, seq)) is not None)
            counters.save(txn, dbs[DB_META])
            return did

        done += cache.env.write(run)
    return done


def _remove_corrupt(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
                    counters: Counters, seq: int) -> str | None:
    record = txn.get(seq_key(seq), db=dbs[DB_SAMPLES])
    if record is None:
        return None  # evicted meanwhile
    try:
        key = record_key(record)
        indexed = txn.get(key, db=dbs[DB_KEYS])
        if indexed is not None and unpack_u64(indexed) == seq:
            txn.delete(key, db=dbs[DB_KEYS])
    except (IndexError, ValueError, lmdb.BadValsizeError):
        pass  # the header is damaged too: its entry, if any, is an orphan (step 3)
    _remove(txn, dbs, counters, seq, len(record))
    return "removed"


def _remove(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], counters: Counters,
            seq: int, size: int) -> None:
    """Delete sample ``seq``, counted as evicted so that inserted - evicted stays samples."""
    txn.delete(seq_key(seq), db=dbs[DB_SAMPLES])
    counters.samples -= 1
    counters.bytes -= size
    counters.evicted += 1
    counters.evicted_bytes += size


def _fix_entry(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], counters: Counters,
               seq: int) -> str | None:
    record = txn.get(seq_key(seq), db=dbs[DB_SAMPLES])
    if record is None:
        return None
    key = record_key(record)
    indexed = txn.get(key, db=dbs[DB_KEYS])
    other = None if indexed is None else unpack_u64(indexed)
    if other == seq:
        return None
    named = None if other is None else txn.get(seq_key(other), db=dbs[DB_SAMPLES])
    if named is not None and record_key(named) == key and other is not None:
        # Two samples of one key: keep the newer, which the index must name.
        older, newer = sorted((seq, other))
        gone = len(record) if older == seq else len(named)
        _remove(txn, dbs, counters, older, gone)
        txn.put(key, seq_key(newer), db=dbs[DB_KEYS])
        return "duplicate"
    txn.put(key, seq_key(seq), db=dbs[DB_KEYS])
    return "fixed"


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
