"""Check every stored record and the counters; repair only when asked.

``verify`` reads the whole cache in one read transaction, so it sees one consistent state even
while samplers keep writing (at the price of pinning that state's pages until it finishes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import lmdb

from ..errors import CacheCorrupted
from .cache import SampleStore
from .codec import check_record, record_key
from .counters import Counters
from .schema import DB_KEYS, DB_META, DB_SAMPLES, seq_key, seq_of, unpack_u64

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_cache`. ``ok`` is True when nothing was found."""

    path: str
    checked: int = 0
    checked_bytes: int = 0
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    counter_mismatches: dict[str, tuple[int, int]] = field(default_factory=dict)
    index_problems: list[str] = field(default_factory=list)
    repaired: int = 0

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.counter_mismatches or self.index_problems)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "corrupt": self.corrupt,
            "counter_mismatches": {k: {"stored": a, "actual": b} for k, (a, b) in self.counter_mismatches.items()},
            "index_problems": self.index_problems,
            "repaired": self.repaired,
        }


def _scan(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], report: VerifyReport) -> Counters:
    actual = Counters()
    last_seq = -1
    keys_db = dbs[DB_KEYS]
    for raw_key, record in txn.cursor(db=dbs[DB_SAMPLES]):
        seq = seq_of(bytes(raw_key))
        last_seq = seq
        report.checked += 1
        report.checked_bytes += len(record)
        actual.samples += 1
        actual.bytes += len(record)
        try:
            info = check_record(record)
        except (CacheCorrupted, UnicodeDecodeError, ValueError) as exc:
            report.corrupt.append({"seq": seq, "error": str(exc)})
            continue
        indexed = txn.get(record_key(record), db=keys_db)
        if indexed is None or unpack_u64(indexed) != seq:
            report.index_problems.append(f"sample {seq} ({info.key!r}) is missing from the key index")
    key_count = txn.stat(keys_db)["entries"]
    if key_count != actual.samples:
        report.index_problems.append(f"key index has {key_count} entries for {actual.samples} samples")
    actual.next_seq = last_seq + 1
    return actual


def verify_cache(path: str, *, repair: bool = False) -> VerifyReport:
    """Check every record's checksum and decodability, the key index and the counters.

    With ``repair``, corrupt records are deleted and the counters rewritten from the records;
    without it nothing is modified.
    """
    cache = SampleStore(path, readonly=not repair)
    try:
        report = VerifyReport(path=cache.path)
        with cache.store.read() as txn:
            actual = _scan(txn, cache.dbs, report)
            stored = Counters.load(txn, cache.dbs[DB_META])
        for name in ("samples", "bytes"):
            if getattr(stored, name) != getattr(actual, name):
                report.counter_mismatches[name] = (getattr(stored, name), getattr(actual, name))
        if stored.next_seq < actual.next_seq:
            report.counter_mismatches["next_seq"] = (stored.next_seq, actual.next_seq)
        if repair and not report.ok:
            report.repaired = _repair(cache, report)
        return report
    finally:
        cache.close()


def _repair(cache: SampleStore, report: VerifyReport) -> int:
    bad = [item["seq"] for item in report.corrupt]

    def run(txn: lmdb.Transaction) -> int:
        samples_db, keys_db = cache.dbs[DB_SAMPLES], cache.dbs[DB_KEYS]
        for seq in bad:
            record = txn.get(seq_key(seq), db=samples_db)
            if record is not None:
                txn.delete(record_key(record), db=keys_db)
                txn.delete(seq_key(seq), db=samples_db)
        # Rebuild the key index and counters from what remains.
        txn.drop(keys_db, delete=False)
        counters = Counters.load(txn, cache.dbs[DB_META])
        counters.samples = counters.bytes = 0
        for raw_key, record in txn.cursor(db=samples_db):
            txn.put(record_key(record), bytes(raw_key), db=keys_db)
            counters.samples += 1
            counters.bytes += len(record)
            counters.next_seq = max(counters.next_seq, seq_of(bytes(raw_key)) + 1)
        counters.save(txn, cache.dbs[DB_META])
        return len(bad)

    repaired = cache.store.write(run)
    log.warning("%s: repaired: removed %d corrupt records, rebuilt index and counters", cache.path, repaired)
    return repaired
