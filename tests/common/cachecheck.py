"""Inspect a cache from the outside: recount counters from the records, check every record.

These checks deliberately re-derive everything from the raw LMDB records (``samples`` and
``keys`` sub-databases) instead of trusting the cache's own bookkeeping, so a test fails when
the counters drift, a record is torn, the key index lies, or a sequence number goes missing
from the books (every sequence number below ``next_seq`` is present or counted evicted).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import lmdb

from epochcache import Cache
from epochcache.errors import CacheCorrupted
from epochcache.store.leases import read_leases
from epochcache.store.records import (
    DB_KEYS,
    DB_LEASES,
    DB_META,
    DB_SAMPLES,
    check_record,
    decode_payload,
    index_key,
    pack_fields,
    read_info,
    seq_of,
    unpack_u64,
)
from epochcache.store.tables import Counters


def content_for(key: str, size: int | None = None, *, compressible: bool | None = None) -> bytes:
    """Deterministic sample bytes derived from ``key`` (so any process can recompute them).

    Without ``size`` the size is drawn from the key (1-8 KiB). Without ``compressible`` half
    of the keys give compressible text and half incompressible noise.
    """
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    rng = random.Random(seed)
    if size is None:
        size = rng.randint(1024, 8192)
    if compressible is None:
        compressible = bool(seed & 1)
    if compressible:
        line = f"{key} says hello {seed % 97}\n".encode()
        return (line * (size // len(line) + 1))[:size]
    return rng.randbytes(size)


def digest(value: bytes | dict[str, bytes]) -> str:
    """A stable content hash of a sample value (bytes or a dict of fields)."""
    if isinstance(value, dict):
        value = pack_fields(dict(sorted(value.items())))
    return hashlib.sha256(value).hexdigest()


@dataclass
class CacheState:
    """What a full scan found. ``problems`` is empty when the cache is consistent."""

    seqs: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    bytes: int = 0
    counters: Counters = field(default_factory=Counters)
    leases: list[Any] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def key_to_seq(self) -> dict[str, int]:
        return dict(zip(self.keys, self.seqs))

    @property
    def first_seq(self) -> int | None:
        return self.seqs[0] if self.seqs else None


def scan(cache: Cache) -> CacheState:
    """Read every record in one read transaction and cross-check counters and the key index."""
    state = CacheState()
    env = cache.env
    with env.read() as txn:
        dbs = env.dbs  # taken after the read began: the handles of this process's env
        state.counters = Counters.load(txn, dbs[DB_META])
        state.leases = read_leases(txn, dbs[DB_LEASES])
        for raw_key, record in txn.cursor(db=dbs[DB_SAMPLES]):
            seq = seq_of(bytes(raw_key))
            try:
                info = check_record(record)
                decode_payload(record)
            except (CacheCorrupted, ValueError) as exc:
                state.problems.append(f"sample {seq}: {exc}")
                continue
            state.seqs.append(seq)
            state.keys.append(info.key)
            state.sizes.append(len(record))
            state.bytes += len(record)
            indexed = txn.get(index_key(info.key.encode("utf-8")), db=dbs[DB_KEYS])
            if indexed is None:
                state.problems.append(f"sample {seq} ({info.key!r}) missing from the key index")
            elif unpack_u64(indexed) != seq:
                state.problems.append(
                    f"key index maps {info.key!r} to {unpack_u64(indexed)}, record is at {seq}"
                )
        index_entries = txn.stat(dbs[DB_KEYS])["entries"]
    n = len(state.seqs)
    c = state.counters
    if index_entries != n:
        state.problems.append(f"key index has {index_entries} entries for {n} samples")
    if c.samples != n:
        state.problems.append(f"counter samples={c.samples}, recount {n}")
    if c.bytes != state.bytes:
        state.problems.append(f"counter bytes={c.bytes}, recount {state.bytes}")
    if c.inserted - c.evicted != c.samples:
        state.problems.append(f"inserted {c.inserted} - evicted {c.evicted} != samples {c.samples}")
    if c.next_seq != c.inserted:
        state.problems.append(f"next_seq {c.next_seq} != inserted {c.inserted}")
    if n:
        # Eviction may leave gaps (released samples of a snapshot go before unread ones), but
        # every sequence number below next_seq is present or counted evicted.
        if state.seqs != sorted(set(state.seqs)) or state.seqs[-1] >= c.next_seq:
            state.problems.append(f"present samples out of order: {_ranges(state.seqs)}")
        if n + c.evicted != c.next_seq:
            state.problems.append(f"{n} present + {c.evicted} evicted != next_seq {c.next_seq}")
    for lease in state.leases:
        if lease.lo > lease.hi:
            state.problems.append(f"lease {lease.lease_id} has lo {lease.lo} > hi {lease.hi}")
    return state


def _ranges(seqs: list[int]) -> str:
    out, start = [], seqs[0]
    for a, b in zip(seqs, seqs[1:] + [None]):  # type: ignore[operator]
        if b != a + 1:
            out.append(f"{start}-{a}")
            start = b
    return ",".join(out[:20])


def assert_consistent(cache: Cache) -> CacheState:
    """:func:`scan` and fail the test on any problem."""
    state = scan(cache)
    assert not state.problems, "cache inconsistent:\n  " + "\n  ".join(state.problems)
    return state


def full_check(path: str) -> CacheState:
    """Open the cache at ``path`` as a fresh process would, scan it, and run ``verify_cache``
    when the package has it."""
    cache = Cache(path)
    try:
        state = assert_consistent(cache)
    finally:
        cache.close()
    try:
        from epochcache.store.verify import verify_cache
    except ImportError:  # pragma: no cover - verify not written yet
        return state
    report = verify_cache(path)
    assert report.ok, f"verify_cache({path!r}) is not clean: {report}"
    assert report.checked == len(state.seqs)
    return state


def recount(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
            names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {samples, bytes}}`` recomputed from the records: the oracle the per-source
    counters (`epochcache.store.tables`) are checked against."""
    out: dict[str, dict[str, Any]] = {name: {"samples": 0, "bytes": 0} for name in names}
    for _seq, record in txn.cursor(db=dbs[DB_SAMPLES]):
        key = read_info(record).key
        name = key.split("/", 1)[0] if "/" in key else None
        if name in out:
            out[name]["samples"] += 1
            out[name]["bytes"] += len(record)
    return out
