"""Side tables of a cache: quarantine rows, daemon/sampler state documents, stats history.

These are small JSON rows next to the samples: the quarantine keeps the newest rejected remote
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
from typing import Any

import lmdb

from ..limits import KEY_SHOWN_CHARS, cut_key, cut_text, key_digest
from .counters import Counters
from .env import Env
from .records import (
    C_QUARANTINE_BYTES,
    C_QUARANTINE_DROPPED,
    DB_HISTORY,
    DB_META,
    DB_QUARANTINE,
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
