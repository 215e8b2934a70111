"""Side tables of a cache: quarantine rows, daemon/sampler state documents, stats history.

These are small JSON rows next to the samples: the quarantine keeps the newest rejected remote
objects (the counter counts all of them), ``state`` holds one document per name (the daemon's
heartbeat, each sampler's position and health), and ``history`` the bounded time series that
``status`` rates and ``plot`` are drawn from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import lmdb

from .counters import Counters
from .env import Store
from .schema import (
    DB_HISTORY,
    DB_META,
    DB_QUARANTINE,
    DB_STATE,
    HISTORY_MAX_ROWS,
    QUARANTINE_MAX_ROWS,
    pack_u64,
    unpack_u64,
)


class SideTables:
    """Quarantine rows, state documents and stats history of one cache.

    Args:
        store: the cache's LMDB environment.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        return self._store.dbs

    def quarantine(self, key: str, reason: str, **extra: Any) -> None:
        """Count a rejected remote object (and for its source, if ``key`` is ``<name>/...`` of
        a registered source) and remember why (the newest rows are kept)."""
        row = json.dumps({"key": key, "reason": reason, "time": time.time(), **extra}).encode()

        def run(txn: lmdb.Transaction) -> None:
            counters = Counters.load(txn, self.dbs[DB_META])
            counters.quarantined += 1
            if counters.sources is not None:
                counters.sources.quarantined(key)
            counters.save(txn, self.dbs[DB_META])
            _append_bounded(txn, self.dbs[DB_QUARANTINE], row, QUARANTINE_MAX_ROWS)

        self._store.write(run)

    def quarantined(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._tail(DB_QUARANTINE, limit)

    def put_state(self, name: str, doc: Mapping[str, Any]) -> None:
        """Store a small JSON document (daemon heartbeat, sampler position) under ``name``."""
        raw = json.dumps(doc, separators=(",", ":")).encode()
        self._store.write(lambda txn: txn.put(name.encode(), raw, db=self.dbs[DB_STATE]))

    def get_state(self, name: str) -> dict[str, Any] | None:
        with self._store.read() as txn:
            raw = txn.get(name.encode(), db=self.dbs[DB_STATE])
            return None if raw is None else dict(json.loads(bytes(raw)))

    def states(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self._store.read() as txn:
            cursor = txn.cursor(db=self.dbs[DB_STATE])
            if cursor.set_range(prefix.encode()):
                for key, value in cursor:
                    name = bytes(key).decode()
                    if not name.startswith(prefix):
                        break
                    out[name] = json.loads(bytes(value))
        return out

    def delete_state(self, name: str) -> None:
        self._store.write(lambda txn: txn.delete(name.encode(), db=self.dbs[DB_STATE]))

    def append_history(self, doc: Mapping[str, Any]) -> None:
        """Append a stats row to the bounded history used by rates and plots."""
        raw = json.dumps(doc, separators=(",", ":")).encode()
        self._store.write(lambda txn: _append_bounded(txn, self.dbs[DB_HISTORY], raw, HISTORY_MAX_ROWS))

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        return self._tail(DB_HISTORY, limit)

    def _tail(self, db_name: bytes, limit: int | None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        with self._store.read() as txn:
            cursor = txn.cursor(db=self.dbs[db_name])
            if not cursor.last():
                return rows
            for _key, value in cursor.iterprev():
                rows.append(json.loads(bytes(value)))
                if limit is not None and len(rows) >= limit:
                    break
        rows.reverse()
        return rows


def _append_bounded(txn: lmdb.Transaction, db: lmdb._Database, value: bytes, max_rows: int) -> None:
    key = pack_u64(time.time_ns())
    cursor = txn.cursor(db=db)
    if cursor.last() and bytes(cursor.key()) >= key:
        key = pack_u64(unpack_u64(bytes(cursor.key())) + 1)  # keep keys increasing
    txn.put(key, value, db=db, append=True)
    excess = txn.stat(db)["entries"] - max_rows
    if excess > 0 and cursor.first():
        for _ in range(excess):
            if not cursor.delete():
                break
