"""Snapshot leases: who holds which samples, and reclaiming the leases of dead holders.

A lease protects the sequence range ``[lo, hi)`` of one snapshot from eviction. It records its
owner (pid, host, the process start time so a recycled pid is not mistaken for the owner) and
a heartbeat. A lease whose owner process is gone is reclaimed, so a crashed trainer cannot pin
the cache forever (invariant 1). Owners on another host (a cache on a shared filesystem) are
judged by their heartbeat instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import lmdb

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

#: Holders on other hosts are presumed dead after this long without a heartbeat.
DEFAULT_LEASE_TIMEOUT_S = 600.0


def process_stat(pid: int) -> tuple[str, int | None] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields:
        return None
    try:
        ticks: int | None = int(fields[19])
    except (IndexError, ValueError):
        ticks = None
    return fields[0].decode("ascii", errors="replace"), ticks


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), or None if unknown."""
    stat = process_stat(pid)
    return None if stat is None else stat[1]


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` exists (and is the same process that had ``start_ticks``)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    if start_ticks is not None:
        stat = process_stat(pid)
        if stat is not None:
            state, ticks = stat
            if (ticks is not None and ticks != start_ticks) or state == "Z":
                return False  # a recycled pid, or a zombie: neither holds anything
    return True


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

    @classmethod
    def new(cls, lo: int, hi: int, count: int, label: str = "", pid: int | None = None) -> Lease:
        """A lease held by ``pid`` (default: this process), alive as long as that process is."""
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
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> Lease:
        return cls(**json.loads(bytes(raw)))

    def holds(self, seq: int) -> bool:
        return self.lo <= seq < self.hi

    def is_alive(self, now_ns: int, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> bool:
        if self.host == socket.gethostname():
            return pid_alive(self.pid, self.start_ticks)
        return (now_ns - self.heartbeat_ns) < timeout_s * 1e9


def read_leases(txn: lmdb.Transaction, db: lmdb._Database) -> list[Lease]:
    return [Lease.from_bytes(value) for _key, value in txn.cursor(db=db)]


def write_lease(txn: lmdb.Transaction, db: lmdb._Database, lease: Lease) -> None:
    txn.put(lease.lease_id.encode(), lease.to_bytes(), db=db)


def delete_lease(txn: lmdb.Transaction, db: lmdb._Database, lease_id: str) -> bool:
    return bool(txn.delete(lease_id.encode(), db=db))


def reclaim_dead(
    txn: lmdb.Transaction, db: lmdb._Database, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    *, path: str = "",
) -> list[Lease]:
    """Delete the leases whose holders are gone, log each with ``path``; return them."""
    now = time.time_ns()
    dead = [lease for lease in read_leases(txn, db) if not lease.is_alive(now, timeout_s)]
    for lease in dead:
        delete_lease(txn, db, lease.lease_id)
        log.info("%s: reclaimed lease %s of dead process %d on %s (%d samples)",
                 path, lease.lease_id[:8], lease.pid, lease.host, lease.count)
    return dead


def protected(leases: Iterable[Lease], seq: int) -> Lease | None:
    """The first lease that holds ``seq``, if any."""
    for lease in leases:
        if lease.holds(seq):
            return lease
    return None
