"""Per-source counters of a cache fed by several sources (``sources:`` in the config).

A cache fed by several sources keys each sample ``<name>/<key>``. The daemon registers the names
(`register_sources_in`, in a write transaction); from then on every transaction that inserts,
evicts or quarantines a sample of a registered source also updates that source's counters, in
``meta`` next to the global ones, so they never drift from the records (like `counters`). A
cache with no registered source (one ``source:``) pays one ``get`` per transaction and nothing
else.

Registering a name counts what the cache already holds under its prefix, so the counters are
right even when samples were cached before the name was registered. Names are never
unregistered: a source dropped from the config keeps being counted until its samples age out.
"""

from __future__ import annotations

import json

import lmdb

from .records import DB_KEYS, DB_SAMPLES, pack_u64, unpack_u64

#: ``meta`` key of the registered names (a JSON list).
C_SOURCES = b"sources"
#: Per-source counters; ``inserted`` is what ``status`` calls ``ingested``.
FIELDS = ("samples", "bytes", "inserted", "inserted_bytes", "evicted", "evicted_bytes",
          "quarantined")


def _key(name: str, field: str) -> bytes:
    return b"source/" + name.encode() + b"/" + field.encode()


def registered_names(txn: lmdb.Transaction, meta: lmdb._Database) -> list[str]:
    """The source names registered in this cache (empty for a single-source cache)."""
    raw = txn.get(C_SOURCES, db=meta)
    return [] if raw is None else list(json.loads(bytes(raw)))


class SourceCounters:
    """A transaction's working copy of the per-source counters (only those it touches).

    Args:
        txn: the transaction the counters are read in (and saved in, for a write).
        meta: the ``meta`` sub-database.
        names: the registered names.
    """

    def __init__(self, txn: lmdb.Transaction, meta: lmdb._Database, names: list[str]) -> None:
        self._txn, self._meta = txn, meta
        self._names = {name.encode(): name for name in names}
        self._values: dict[str, dict[str, int]] = {}
        self._dirty: set[str] = set()

    @classmethod
    def load(cls, txn: lmdb.Transaction, meta: lmdb._Database) -> SourceCounters | None:
        """The counters of ``txn``, or None when no source is registered."""
        names = registered_names(txn, meta)
        return cls(txn, meta, names) if names else None

    @property
    def names(self) -> list[str]:
        return sorted(self._names.values())

    def source_of(self, index_key: bytes) -> str | None:
        """The registered source a cache key (as indexed) belongs to, or None."""
        slash = index_key.find(b"/")
        return self._names.get(index_key[:slash]) if slash > 0 else None

    def get(self, name: str) -> dict[str, int]:
        values = self._values.get(name)
        if values is None:
            values = {f: unpack_u64(self._txn.get(_key(name, f), db=self._meta)) for f in FIELDS}
            self._values[name] = values
        return values

    def _bump(self, index_key: bytes, changes: dict[str, int]) -> None:
        name = self.source_of(index_key)
        if name is None:
            return
        values = self.get(name)
        for field, delta in changes.items():
            values[field] += delta
        self._dirty.add(name)

    def inserted(self, index_key: bytes, nbytes: int) -> None:
        self._bump(index_key, {"samples": 1, "bytes": nbytes, "inserted": 1,
                               "inserted_bytes": nbytes})

    def evicted(self, index_key: bytes, nbytes: int) -> None:
        self._bump(index_key, {"samples": -1, "bytes": -nbytes, "evicted": 1,
                               "evicted_bytes": nbytes})

    def quarantined(self, key: str) -> None:
        self._bump(key.encode("utf-8"), {"quarantined": 1})

    def save(self, txn: lmdb.Transaction) -> None:
        """Write the counters this transaction changed (in ``txn``, the one they were read in)."""
        for name in self._dirty:
            for field, value in self._values[name].items():
                txn.put(_key(name, field), pack_u64(value), db=self._meta)
        self._dirty.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{name: {samples, bytes, ingested, quarantined, ...}}`` for ``status``."""
        out = {}
        for name in self.names:
            values = dict(self.get(name))
            values["ingested"] = values["inserted"]
            out[name] = values
        return out


def count_prefix(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
                 name: str) -> tuple[int, int]:
    """``(samples, bytes)`` the cache holds under ``<name>/``, from the records themselves."""
    prefix = name.encode() + b"/"
    samples = nbytes = 0
    cursor = txn.cursor(db=dbs[DB_KEYS])
    if cursor.set_range(prefix):
        for key, seq in cursor:
            if not bytes(key).startswith(prefix):
                break
            record = txn.get(bytes(seq), db=dbs[DB_SAMPLES])
            if record is not None:
                samples += 1
                nbytes += len(record)
    return samples, nbytes


def register_sources_in(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], meta: lmdb._Database,
                     names: list[str]) -> list[str]:
    """Register ``names`` (keeping those registered before); return the new ones, whose
    counters start from what the cache holds under their prefix."""
    known = registered_names(txn, meta)
    new = [name for name in names if name not in known]
    for name in new:
        samples, nbytes = count_prefix(txn, dbs, name)
        start = {"samples": samples, "bytes": nbytes, "inserted": samples, "inserted_bytes": nbytes}
        for field in FIELDS:
            txn.put(_key(name, field), pack_u64(start.get(field, 0)), db=meta)
    if new:
        txn.put(C_SOURCES, json.dumps(sorted(known + new)).encode(), db=meta)
    return new

