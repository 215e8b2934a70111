"""What the library's own layers call on a store, beside its public storage methods.

The public class ([`epochcache.Cache`][epochcache.Cache] is a `SampleStore`) carries what
users call; adopting and reclaiming leases, a leased snapshot's samples, per-source counters
and the stats history are the layers' (daemon, samplers, loaders, status), written here as
functions over a store (release plans are `reads`' functions over its path). They may change
between releases.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from .leases import Lease, adopt, end_reason, write_lease
from .owners import sweep_dead_owners
from .reads import read_seqs, sweep_plans
from .records import DB_KEYS, DB_LEASES, DB_META, DB_SAMPLES, DB_STATE, seq_key
from .snapshot import hold_lease
from .tables import SourceCounters, register_sources_in

if TYPE_CHECKING:
    from .sample_store import SampleStore

log = logging.getLogger("epochcache.cache")


def has_key_prefix(store: SampleStore, prefix: str) -> bool:
    """Whether any cached source key starts with ``prefix`` (a tar shard's samples).

    Keys indexed under a digest (longer than 511 bytes) are found for prefixes of up to
    478 bytes; past that a shard may be fetched again, and its samples skipped as cached.
    """
    raw = prefix.encode("utf-8")
    with store.env.read() as txn:
        cursor = txn.cursor(db=store.env.dbs[DB_KEYS])
        return bool(cursor.set_range(raw)) and bytes(cursor.key()).startswith(raw)


def effective_headroom(store: SampleStore) -> int:
    """Headroom in force (scaled down with a lowered capacity). While epochs hold
    snapshots of the newest capacity's worth of samples, a sample larger than this cannot
    get in: the writer would wait for it forever."""
    return store.capacity.headroom_for(store.capacity.effective)


def register_sources(store: SampleStore, names: Iterable[str]) -> list[str]:
    """Count samples per source from now on (keys ``<name>/...``; see
    `epochcache.store.tables`); return the names that were new."""
    return store.env.write(
        lambda txn: register_sources_in(txn, store.env.dbs, store.env.dbs[DB_META], list(names)))


def source_stats(store: SampleStore) -> dict[str, dict[str, int]]:
    """``{name: {samples, bytes, ingested, quarantined, ...}}`` of the registered sources
    (empty for a cache fed by one ``source``)."""
    with store.env.read() as txn:
        sources = SourceCounters.load(txn, store.env.dbs[DB_META])
        return {} if sources is None else sources.as_dict()


def leased_seqs(store: SampleStore, lo: int, hi: int, count: int) -> np.ndarray:
    """The sequence numbers of a snapshot known by its lease's range and count.

    A snapshot is every sample in ``[lo, hi)`` (the newest that fit, see
    `select_snapshot`) and a lease without a plan keeps them there, so any process
    can rebuild it from these three numbers: a range when it has no gaps, else the stored
    keys in it. (A lease with a plan may have lost released samples: its samples as taken
    are in the plan, `reads.read_seqs`.)
    """
    if hi - lo == count:
        return np.arange(lo, hi, dtype=np.uint64)
    with store.env.read() as txn:
        cursor = txn.cursor(db=store.env.dbs[DB_SAMPLES])
        keys: list[bytes] = []
        if cursor.set_range(seq_key(lo)):
            for key in cursor.iternext(keys=True, values=False):
                if bytes(key) >= seq_key(hi):
                    break
                keys.append(bytes(key))
    return np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64)


def snapshot_seqs(store: SampleStore, lease_id: str | None, lo: int, hi: int, count: int) -> np.ndarray:
    """The samples of a leased snapshot as taken, whatever was evicted from it since: from
    its plan when it has one (`reads.read_seqs`: read-only, mapped), else from its range
    (`leased_seqs`)."""
    seqs = read_seqs(store.path, lease_id) if lease_id else None
    return leased_seqs(store, lo, hi, count) if seqs is None else seqs


def lease_end(store: SampleStore, lease_id: str) -> str | None:
    """Why lease ``lease_id`` ended, and when, if it ended recently (None: unknown)."""
    with store.env.read() as txn:
        return end_reason(txn, store.env.dbs[DB_STATE], lease_id)


def adopt_lease(store: SampleStore, lease_id: str, *, owner: str | None = None, pid: int | None = None,
                whole: bool = False) -> Lease | None:
    """Hold the lease of an interrupted epoch from now on (a resumed run): this process's
    owner lock keeps it, and its heartbeat is refreshed while the returned lease is not
    released (`release_lease`). None when it is gone (reclaimed: its owner died
    longer than its grace ago, or no checkpoint named it).

    Args:
        lease_id: the lease.
        owner, pid: hold it in the name of another process of this host instead (a
            stream's workers adopt for their main process, whose owner lock is ``owner``);
            this process then refreshes nothing.
        whole: protect its whole range from now on, not only its unread samples (a resumed
            epoch whose readers are not those its plan was written for).
    """
    db = store.env.dbs[DB_LEASES]

    def run(txn: lmdb.Transaction, owner: str) -> Lease | None:
        raw = txn.get(lease_id.encode(), db=db)
        if raw is None:
            return None
        lease = adopt(Lease.from_bytes(raw), owner=owner, pid=pid)
        if whole:
            lease.plan_parts = 0
        write_lease(txn, db, lease)
        return lease

    if owner is not None:
        return store.env.write(functools.partial(run, owner=owner))
    return hold_lease(store, run, lambda lease: None if lease is None else lease.lease_id)


def reclaim_leases(store: SampleStore) -> list[Lease]:
    """Delete leases whose owner died, then evict what they pinned beyond capacity; also
    delete the owner files of dead processes that no lease names."""
    dead = store.env.write(store.writer.reclaim)
    if dead:
        store.evict()
    if not store.env.readonly:
        leases = store.leases()
        sweep_dead_owners(store.path, {lease.owner for lease in leases})
        sweep_plans(store.path, {lease.lease_id for lease in leases})
    return dead


def append_history(store: SampleStore, row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Append a stats row (counters, effective capacity and ``row``) to the history."""
    doc: dict[str, Any] = {"time": time.time(), **store.counters().as_dict(), **(row or {})}
    doc["capacity"] = store.effective_capacity
    # stored bytes may go past the capacity by the headroom while epochs hold snapshots:
    # the plots draw the line they stay under
    doc["headroom"] = store.capacity.headroom_for(doc["capacity"])
    store.tables.append_history(doc)
    return doc
