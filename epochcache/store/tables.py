"""What a cache keeps beside its samples: counters, per-source counters and side tables.

**Counters** live in ``meta`` and change in the same transaction as the records they count,
so they never drift: ``verify`` recomputes them from the records and any difference is a bug,
not a crash artefact. A cache fed by several sources (``sources:``) keys each sample
``<name>/<key>``; the daemon registers the names (`register_sources_in`), and from then on
every transaction that inserts, evicts or quarantines a sample of a registered source also
updates that **source's counters**, next to the global ones. A cache with one ``source:`` pays
one ``get`` a transaction and nothing else. Registering a name counts what the cache already
holds under its prefix; names are never unregistered (a dropped source is counted until its
samples age out).

The **side tables** are small JSON rows: the quarantine keeps the newest rejected remote
objects (the counter counts all of them), ``state`` holds one document per name (the daemon's
heartbeat, each sampler's position and health), and ``history`` the bounded time series that
``status`` rates and ``plot`` are drawn from.

A quarantined key is someone else's name (a tar member's may be megabytes): a row keeps it
cut (`cut_key`: whole up to 1,024 characters, else head, tail, length
and digest, the digest also under ``key_sha256``) and its reason and URL cut, and the table is
bounded in bytes (`QUARANTINE_MAX_BYTES`) as well as rows, the oldest rows
dropped and counted (``quarantine_dropped``). 800 names of 100 kB grew a 1 MiB cache's file to
57 MiB and then filled its map on every restart.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import lmdb

from ..limits import KEY_SHOWN_CHARS, cut_key, cut_text, key_digest
from .env import Env
from .records import (
    C_BYTES,
    C_EVICTED,
    C_EVICTED_BYTES,
    C_INSERTED,
    C_NEXT_SEQ,
    C_QUARANTINE_BYTES,
    C_QUARANTINE_DROPPED,
    C_QUARANTINED,
    C_SAMPLES,
    DB_HISTORY,
    DB_KEYS,
    DB_META,
    DB_QUARANTINE,
    DB_SAMPLES,
    DB_STATE,
    HISTORY_MAX_ROWS,
    QUARANTINE_MAX_BYTES,
    QUARANTINE_MAX_ROWS,
    pack_u64,
    unpack_u64,
)


class SideTables:
    """Quarantine rows, state documents and stats history of one cache.

    Args:
        env: the cache's LMDB environment.
    """

    def __init__(self, env: Env) -> None:
        self._env = env

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        return self._env.dbs

    def quarantine(self, key: str, reason: str, **extra: Any) -> None:
        """Count a rejected remote object (and for its source, if ``key`` is ``<name>/...`` of
        a registered source) and remember why (the newest rows are kept, the key and texts
        cut: see the module docstring)."""
        row = json.dumps(quarantine_row(key, reason, **extra)).encode()

        def run(txn: lmdb.Transaction) -> None:
            counters = Counters.load(txn, self.dbs[DB_META])
            counters.quarantined += 1
            if counters.sources is not None:
                counters.sources.quarantined(key)
            counters.save(txn, self.dbs[DB_META])
            _append_quarantine(txn, self.dbs, row)

        self._env.write(run)

    def quarantined(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest quarantine rows, oldest first (rows of earlier versions cut as well)."""
        return [_cut_row(row) for row in self._tail(DB_QUARANTINE, limit)]

    def quarantine_dropped(self) -> int:
        """Quarantine rows dropped to keep the table within its bounds."""
        with self._env.read() as txn:
            return unpack_u64(txn.get(C_QUARANTINE_DROPPED, db=self.dbs[DB_META]))

    def put_state(self, name: str, doc: Mapping[str, Any]) -> None:
        """Store a small JSON document (daemon heartbeat, sampler position) under ``name``."""
        raw = json.dumps(doc, separators=(",", ":")).encode()
        self._env.write(lambda txn: txn.put(name.encode(), raw, db=self.dbs[DB_STATE]))

    def get_state(self, name: str) -> dict[str, Any] | None:
        with self._env.read() as txn:
            raw = txn.get(name.encode(), db=self.dbs[DB_STATE])
            return None if raw is None else dict(json.loads(bytes(raw)))

    def states(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self._env.read() as txn:
            cursor = txn.cursor(db=self.dbs[DB_STATE])
            if cursor.set_range(prefix.encode()):
                for key, value in cursor:
                    name = bytes(key).decode()
                    if not name.startswith(prefix):
                        break
                    out[name] = json.loads(bytes(value))
        return out

    def delete_state(self, name: str) -> None:
        self._env.write(lambda txn: txn.delete(name.encode(), db=self.dbs[DB_STATE]))

    def append_history(self, doc: Mapping[str, Any]) -> None:
        """Append a stats row to the bounded history used by rates and plots."""
        raw = json.dumps(doc, separators=(",", ":")).encode()
        self._env.write(lambda txn: _append_bounded(txn, self.dbs[DB_HISTORY], raw, HISTORY_MAX_ROWS))

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        return self._tail(DB_HISTORY, limit)

    def _tail(self, db_name: bytes, limit: int | None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with self._env.read() as txn:
            cursor = txn.cursor(db=self.dbs[db_name])
            if not cursor.last():
                return rows
            for _key, value in cursor.iterprev():
                rows.append(json.loads(bytes(value)))
                if limit is not None and len(rows) >= limit:
                    break
        rows.reverse()
        return rows


def quarantine_row(key: str, reason: str, **extra: Any) -> dict[str, Any]:
    """The row the quarantine keeps for ``key``: the key cut, with its digest when cut, and
    every text (the reason, the URL) cut, the key in them cut the same way."""
    row: dict[str, Any] = {"key": cut_key(key)}
    if len(key) > KEY_SHOWN_CHARS:
        row["key_sha256"] = key_digest(key)[len("sha256:"):]
        row["key_chars"] = len(key)
    row["reason"] = cut_text(reason, keys=(key,))
    row["time"] = time.time()
    for name, value in extra.items():
        row[name] = cut_text(value, keys=(key,)) if isinstance(value, str) else value
    return row


def _cut_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row as shown: those written whole by earlier versions are cut on the way out."""
    key = row.get("key")
    if isinstance(key, str) and len(key) > KEY_SHOWN_CHARS:
        row = {**row, "key": cut_key(key), "key_sha256": key_digest(key)[len("sha256:"):],
               "key_chars": len(key)}
    return {name: cut_text(value) if isinstance(value, str) else value
            for name, value in row.items()}


def _append_quarantine(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
                       row: bytes) -> None:
    """Append a quarantine row and drop the oldest past `QUARANTINE_MAX_ROWS` rows or
    `QUARANTINE_MAX_BYTES` bytes, counting them."""
    db, meta = dbs[DB_QUARANTINE], dbs[DB_META]
    raw = txn.get(C_QUARANTINE_BYTES, db=meta)
    if raw is None:  # a table written before its bytes were counted: once
        total = sum(len(value) for _key, value in txn.cursor(db=db))
    else:
        total = unpack_u64(raw)
    dropped = unpack_u64(txn.get(C_QUARANTINE_DROPPED, db=meta))
    _append_bounded(txn, db, row, None)
    total += len(row)
    entries = int(txn.stat(db)["entries"])
    cursor = txn.cursor(db=db)
    while entries > 1 and (entries > QUARANTINE_MAX_ROWS or total > QUARANTINE_MAX_BYTES):
        if not cursor.first():
            break
        total -= len(cursor.value())
        cursor.delete()
        entries -= 1
        dropped += 1
    txn.put(C_QUARANTINE_BYTES, pack_u64(max(0, total)), db=meta)
    txn.put(C_QUARANTINE_DROPPED, pack_u64(dropped), db=meta)


def _append_bounded(txn: lmdb.Transaction, db: lmdb._Database, value: bytes,
                    max_rows: int | None) -> None:
    key = pack_u64(time.time_ns())
    cursor = txn.cursor(db=db)
    if cursor.last() and bytes(cursor.key()) >= key:
        key = pack_u64(unpack_u64(bytes(cursor.key())) + 1)  # keep keys increasing
    txn.put(key, value, db=db, append=True)
    if max_rows is None:
        return
    excess = txn.stat(db)["entries"] - max_rows
    if excess > 0 and cursor.first():
        for _ in range(excess):
            if not cursor.delete():
                break


#: Field name -> key in ``meta``.
_KEYS = {
    "samples": C_SAMPLES,
    "bytes": C_BYTES,
    "next_seq": C_NEXT_SEQ,
    "evicted": C_EVICTED,
    "evicted_bytes": C_EVICTED_BYTES,
    "inserted": C_INSERTED,
    "quarantined": C_QUARANTINED,
}


@dataclass
class Counters:
    """A transaction's working copy of the counters; `save` writes all of them back."""

    samples: int = 0
    bytes: int = 0
    next_seq: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    inserted: int = 0
    quarantined: int = 0
    #: The per-source counters (None: no source registered), saved with these.
    sources: SourceCounters | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, txn: lmdb.Transaction, db: lmdb._Database) -> Counters:
        counters = cls()
        for name, key in _KEYS.items():
            setattr(counters, name, unpack_u64(txn.get(key, db=db)))
        counters.sources = SourceCounters.load(txn, db)
        return counters

    def save(self, txn: lmdb.Transaction, db: lmdb._Database) -> None:
        for name, key in _KEYS.items():
            txn.put(key, pack_u64(getattr(self, name)), db=db)
        if self.sources is not None:
            self.sources.save(txn)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _KEYS}


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
        for counter, delta in changes.items():
            values[counter] += delta
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
            for counter, value in self._values[name].items():
                txn.put(_key(name, counter), pack_u64(value), db=self._meta)
        self._dirty.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{name: {samples, bytes, ingested, quarantined, ...}}`` for ``status``."""
        return {name: {**self.get(name), "ingested": self.get(name)["inserted"]}
                for name in self.names}


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
        for counter in FIELDS:
            txn.put(_key(name, counter), pack_u64(start.get(counter, 0)), db=meta)
    if new:
        txn.put(C_SOURCES, json.dumps(sorted(known + new)).encode(), db=meta)
    return new
