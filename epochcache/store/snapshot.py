"""Freeze the cache's current samples into a compact index held by a lease.

A snapshot is the array of sequence numbers an epoch trains on (8 bytes per sample, no Python
object per sample, so forked DataLoader workers do not copy it page by page as refcounts
change). It covers the newest samples that fit the capacity: samples that only sit in the
headroom because an older lease pinned them are left out, so once that older lease is released
they can be evicted, and the cache turns over even though some epoch always holds a lease.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import lmdb
import numpy as np

from ..errors import SnapshotClosed
from .leases import Lease, write_lease
from .owners import begin_lease, end_lease, heartbeats
from .records import DB_LEASES, seq_of
from .tables import Counters

if TYPE_CHECKING:
    from .env import Env

log = logging.getLogger(__name__)

T = TypeVar("T")


def select_snapshot(
    txn: lmdb.Transaction,
    samples_db: lmdb._Database,
    counters: Counters,
    limit_bytes: int,
) -> np.ndarray:
    """The sequence numbers of the newest samples whose stored bytes fit ``limit_bytes``."""
    cursor = txn.cursor(db=samples_db)
    if counters.samples == 0 or not cursor.first():
        return np.empty(0, dtype=np.uint64)
    first = seq_of(bytes(cursor.key()))
    skip = 0
    excess = counters.bytes - limit_bytes
    if excess > 0:
        # Only the headroom is walked (at most ~10% of the samples): the oldest samples beyond
        # capacity are excluded from the snapshot, so nothing new pins them.
        freed = 0
        while freed < excess:
            freed += len(cursor.value())
            skip += 1
            if not cursor.next():
                break
    if counters.next_seq - first == counters.samples:
        return np.arange(first + skip, counters.next_seq, dtype=np.uint64)
    # Gaps (left by `verify --repair`): read the keys themselves.
    cursor.first()
    raw = b"".join(bytes(k) for k in cursor.iternext(keys=True, values=False))
    seqs = np.frombuffer(raw, dtype=">u8").astype(np.uint64)
    return seqs[skip:]


class Leases(Protocol):
    """What a snapshot calls on its cache (a `SampleStore`, which makes snapshots: typed by
    the calls so that this module does not import the store's top)."""

    @property
    def path(self) -> str: ...

    @property
    def env(self) -> Env: ...

    lease_timeout_s: float

    def release_lease(self, lease_id: str, *, finished: bool = True,
                      reason: str = "") -> bool: ...


def hold_lease(cache: Leases, write: Callable[[lmdb.Transaction, str], T],
               lease_of: Callable[[T], str | None]) -> T:
    """``write(txn, owner)`` in a write transaction, for a lease this process holds under its
    owner lock (`begin_lease`): the lease it wrote (``lease_of`` its result; None: none, and
    the lock is given back, as on an error) is refreshed from now on until it is released."""
    owner = begin_lease(cache.path)
    try:
        result = cache.env.write(lambda txn: write(txn, owner))
    except BaseException:
        end_lease(cache.path)
        raise
    lease_id = lease_of(result)
    if lease_id is None:
        end_lease(cache.path)
    else:
        heartbeats().add(cache.path, lease_id, functools.partial(heartbeat_leases, cache),
                         cache.lease_timeout_s / 4)
    return result


def heartbeat_leases(cache: Leases, lease_ids: list[str]) -> None:
    """Refresh the heartbeat of these leases (one transaction); a lease that is no longer
    there was reclaimed: logged, and left to its snapshot's readers to report."""
    def run(txn: lmdb.Transaction) -> list[str]:
        gone = []
        now = time.time_ns()
        for lease_id in lease_ids:
            raw = txn.get(lease_id.encode(), db=cache.env.dbs[DB_LEASES])
            if raw is None:
                gone.append(lease_id)
                continue
            lease = Lease.from_bytes(raw)
            lease.heartbeat_ns = now
            write_lease(txn, cache.env.dbs[DB_LEASES], lease)
        return gone

    for lease_id in cache.env.write(run):
        if heartbeats().remove(cache.path, lease_id):
            end_lease(cache.path)
        log.error("%s: lease %s of this process was reclaimed by another process (it took "
                  "the owner for dead); reads of its snapshot fail once its samples are "
                  "evicted", cache.path, lease_id[:8])


class Snapshot:
    """The samples of one epoch, frozen and protected from eviction until `release`.

    Obtained from `SampleStore.snapshot`. Use it as a context manager, or call
    `release`; a snapshot dropped without release is released when garbage collected
    (in the process that took it only), and its lease is reclaimed if that process dies. While
    it is open its lease lives, however long: this process holds the lease's owner lock, and
    a thread refreshes its heartbeat (`epochcache.store.owners`).
    """

    def __init__(self, cache: Leases, seqs: np.ndarray, lease_id: str, epoch: int | None) -> None:
        self.cache = cache
        self.seqs = seqs
        self.lease_id = lease_id
        self.epoch = epoch
        self._owner_pid = os.getpid()
        self._released = False
        self._finalizer = weakref.finalize(
            self, _release_quietly, cache, lease_id, self._owner_pid
        )

    def __len__(self) -> int:
        return int(self.seqs.shape[0])

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Snapshot(epoch={self.epoch}, samples={len(self)}, lease={self.lease_id[:8]}, {state})"

    @property
    def released(self) -> bool:
        return self._released

    def check_open(self) -> None:
        if self._released:
            raise SnapshotClosed(
                f"snapshot of epoch {self.epoch} was released; take a new one with cache.snapshot()"
            )

    def heartbeat(self) -> None:
        """Refresh the lease's heartbeat now (a thread of this process already does it while
        the snapshot is open; see `epochcache.store.owners`)."""
        self.check_open()
        heartbeat_leases(self.cache, [self.lease_id])

    def release(self, *, finished: bool = True) -> None:
        """Release the lease: its samples may be evicted from now on. Idempotent.

        ``finished=False``: the epoch was abandoned before its end; a lease a checkpoint named
        is then left for the resumed run (see `SampleStore.release_lease`).
        """
        if self._released:
            return
        self._released = True
        self._finalizer.detach()
        if os.getpid() == self._owner_pid:
            self.cache.release_lease(self.lease_id, finished=finished)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a Snapshot owns a lease and cannot be pickled; pass snapshot.seqs (or the Dataset)"
        )


def _release_quietly(cache: Leases, lease_id: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return
    try:
        # Collected or at exit: whoever dropped it did not say the epoch was over.
        cache.release_lease(lease_id, finished=False)
    except Exception:  # interpreter shutdown: the lease is reclaimed once we are gone
        log.debug("could not release lease %s at exit", lease_id, exc_info=True)
