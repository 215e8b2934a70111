"""Snapshot leases: who holds which samples, and reclaiming the leases of dead owners.

A lease protects the sequence range ``[lo, hi)`` of one snapshot from eviction. It names its
owner (a lock file the holding process keeps locked while it lives, see
`epochcache.store.owners`), the owner's pid, host and start time (for ``status``), its
heartbeat and the timeout after which an owner whose lock cannot be tested is presumed dead. A
lease whose owner is gone is reclaimed, so a crashed trainer cannot pin the cache forever
(invariant 1), while a live one is kept however long its epoch runs, whatever PID namespace or
hostname its owner has. Leases written by versions without owners are judged as they were:
by pid on the same host, by heartbeat elsewhere.

Lease records are JSON; fields this version does not know (a newer version's) are ignored and
fields it misses (an older version's) take their defaults, so versions can share a cache.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, fields

import lmdb

from ..paths import pid_alive, process_start_ticks
from .owners import owner_alive, remove_owner
from .reads import Part, part_path, record_reads, remove_plan

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

#: An owner whose lock cannot be tested is presumed dead after this long without a
#: heartbeat (its heartbeat thread refreshes it every quarter of that).
DEFAULT_LEASE_TIMEOUT_S = 600.0


@dataclass
class Lease:
    """One live snapshot lease, as stored in the ``leases`` sub-database."""

    lease_id: str
    lo: int
    hi: int
    count: int
    pid: int
    host: str
    start_ticks: int | None
    created_ns: int
    heartbeat_ns: int
    label: str = ""
    owner: str = ""  # its owner's lock (owners/<owner>.lock); "" from older versions
    timeout_s: float = 0.0  # the owner's heartbeat timeout; 0: the judge's own
    #: Parts of its release plan (see `epochcache.store.reads`); 0: no plan, the whole
    #: range is protected until the lease ends.
    plan_parts: int = 0
    #: Set when a checkpoint names this lease (a run that can resume mid-epoch): after its
    #: owner dies the lease is kept this long past its last heartbeat, for the resumed run to
    #: adopt (`adopt`), then reclaimed as any other. 0: reclaimed as soon as it is dead.
    resume_grace_s: float = 0.0

    @classmethod
    def new(cls, lo: int, hi: int, count: int, label: str = "", owner: str = "",
            timeout_s: float = 0.0, pid: int | None = None, plan_parts: int = 0) -> Lease:
        """A lease held by ``owner`` (an owner lock of this process) or, without one, by
        ``pid`` (default: this process) on this host, alive as long as that process is."""
        now = time.time_ns()
        pid = os.getpid() if pid is None else pid
        return cls(
            lease_id=uuid.uuid4().hex,
            lo=lo,
            hi=hi,
            count=count,
            pid=pid,
            host=socket.gethostname(),
            start_ticks=process_start_ticks(pid),
            created_ns=now,
            heartbeat_ns=now,
            label=label,
            owner=owner,
            timeout_s=timeout_s,
            plan_parts=plan_parts,
        )

    def to_bytes(self) -> bytes:
        # vars, not asdict: the fields are plain values, and asdict's deep copy was most of
        # the time of a snapshot's lease write.
        return json.dumps(vars(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> Lease:
        doc = json.loads(bytes(raw))
        return cls(**{k: v for k, v in doc.items() if k in _FIELDS})

    def awaits_resume(self, now_ns: int) -> bool:
        """Whether a checkpoint names this lease and its grace after the last heartbeat
        (`resume_grace_s`) has not run out: kept even if its owner is dead."""
        return (self.resume_grace_s > 0
                and now_ns - self.heartbeat_ns < self.resume_grace_s * 1e9)

    def is_alive(self, now_ns: int, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 cache_path: str = "") -> bool:
        """Whether the owner lives: its lock is held; where that cannot be tested, a
        heartbeat within the lease's timeout (an older version's lease: its pid on this host).
        """
        if self.owner and cache_path:
            alive = owner_alive(cache_path, self.owner)
            if alive is not None:
                return alive
        elif not self.owner and self.host == socket.gethostname():
            return pid_alive(self.pid, self.start_ticks)
        return (now_ns - self.heartbeat_ns) < (self.timeout_s or timeout_s) * 1e9


_FIELDS = frozenset(f.name for f in fields(Lease))


def read_leases(txn: lmdb.Transaction, db: lmdb._Database) -> list[Lease]:
    return [Lease.from_bytes(value) for _key, value in txn.cursor(db=db)]


def write_lease(txn: lmdb.Transaction, db: lmdb._Database, lease: Lease) -> None:
    txn.put(lease.lease_id.encode(), lease.to_bytes(), db=db)


def delete_lease(txn: lmdb.Transaction, db: lmdb._Database, lease_id: str) -> bool:
    return bool(txn.delete(lease_id.encode(), db=db))


#: The ``state`` document that keeps why the last leases ended, for a resume that finds the
#: lease of its checkpoint gone: it says why instead of guessing (see `end_reason`).
ENDS_DOC = b"lease-ends"
_ENDS_KEPT = 64


#: The ends document this process wrote last, and its entries as encoded in it.
_last_ends: tuple[bytes, list[bytes]] = (b"", [])


def note_end(txn: lmdb.Transaction, state_db: lmdb._Database, lease_id: str,
             reason: str) -> None:
    """Record in ``txn`` why lease ``lease_id`` ended (the last 64 ends are kept)."""
    global _last_ends
    raw = txn.get(ENDS_DOC, db=state_db)
    doc = b"" if raw is None else bytes(raw)
    written, entries = _last_ends
    if doc != written:
        # Parsed only when the document is not the one this process wrote last (another
        # process's end, or an aborted transaction): decoding and encoding all 64 ends was
        # a third of an epoch's release. The encoding is the same either way.
        entries = [json.dumps(end, separators=(",", ":")).encode()
                   for end in (json.loads(doc) if doc else [])]
    entries = [*entries[1 - _ENDS_KEPT :],
               json.dumps([lease_id, time.time(), reason], separators=(",", ":")).encode()]
    doc = b"[" + b",".join(entries) + b"]"
    txn.put(ENDS_DOC, doc, db=state_db)
    _last_ends = (doc, entries)


def end_reason(txn: lmdb.Transaction, state_db: lmdb._Database, lease_id: str) -> str | None:
    """Why lease ``lease_id`` ended, with when, if it ended recently (see `note_end`)."""
    raw = txn.get(ENDS_DOC, db=state_db)
    for ended, at, reason in reversed([] if raw is None else json.loads(bytes(raw))):
        if ended == lease_id:
            return f"{reason}, at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))}"
    return None


def _death_reason(lease: Lease, now_ns: int) -> str:
    if lease.resume_grace_s > 0:
        return (f"reclaimed: its owner (pid {lease.pid} on {lease.host}) stopped "
                f"{(now_ns - lease.heartbeat_ns) / 1e9:.0f} s before, longer than the resume "
                f"grace a checkpoint gave it ({lease.resume_grace_s:g} s, "
                "cache.resume_grace_s)")
    return (f"reclaimed: its owner (pid {lease.pid} on {lease.host}) died before any "
            "checkpoint named the lease")


def reclaim_dead(
    txn: lmdb.Transaction, db: lmdb._Database, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    *, path: str = "", state_db: lmdb._Database | None = None,
    dbs: dict[bytes, lmdb._Database] | None = None,
) -> list[Lease]:
    """Delete the leases whose owners are gone, log each with ``path`` (and, with
    ``state_db``, record why: `note_end`; with ``dbs``, what their readers read:
    `record_reads`); return them."""
    now = time.time_ns()
    leases = read_leases(txn, db)
    dead = [lease for lease in leases if not lease.is_alive(now, timeout_s, path)
            and not lease.awaits_resume(now)]
    for lease in dead:
        delete_lease(txn, db, lease.lease_id)
        if state_db is not None:
            note_end(txn, state_db, lease.lease_id, _death_reason(lease, now))
        if path:
            if dbs is not None:
                record_reads(txn, dbs, path, lease.lease_id)
            remove_plan(path, lease.lease_id)
        log.info("%s: reclaimed lease %s (%s) of dead process %d on %s (%d samples)",
                 path, lease.lease_id[:8], lease.label or "snapshot", lease.pid, lease.host,
                 lease.count)
    dead_ids = {lease.lease_id for lease in dead}
    live_owners = {lease.owner for lease in leases if lease.lease_id not in dead_ids}
    for owner in {lease.owner for lease in dead if lease.owner} - live_owners:
        remove_owner(path, owner)
    return dead


def adopt(lease: Lease, *, owner: str, pid: int | None = None) -> Lease:
    """``lease`` held from now on by ``owner`` (an owner lock of this process) or ``pid``, as a
    resumed run does with the lease of the interrupted epoch. Its heartbeat starts afresh."""
    fresh = Lease.new(lease.lo, lease.hi, lease.count, label=lease.label, owner=owner,
                      timeout_s=lease.timeout_s, pid=pid, plan_parts=lease.plan_parts)
    fresh.lease_id, fresh.created_ns = lease.lease_id, lease.created_ns
    fresh.resume_grace_s = lease.resume_grace_s
    return fresh


def unread(cache_path: str, lease: Lease) -> int:
    """Samples of a lease's snapshot its readers have not read yet (what it protects)."""
    if not lease.plan_parts:
        return lease.count
    total = 0
    for part in range(lease.plan_parts):
        try:
            mapped = Part(part_path(cache_path, lease.lease_id, part))
        except (OSError, ValueError):
            return lease.count  # the plan is not complete: the whole snapshot is protected
        lengths = mapped.offsets[1:] - mapped.offsets[:-1]
        total += int((lengths - mapped.positions).sum())
    return min(total, lease.count) if lease.plan_parts == 1 else total
