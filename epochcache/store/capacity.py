"""The byte limits of a cache: the configured capacity and headroom, and the limit in force.

Capacity and headroom are stored in the cache's ``meta`` table, so every process that opens
the cache (samplers, trainers, ``status``) works to the same limits. The limit in force, the
*effective capacity*, is the configured capacity lowered when the disk cannot hold it: at open
time to what the free disk allows, and after a full disk or LMDB map to a little below what is
stored. Headroom shrinks in proportion with it.
"""

from __future__ import annotations

import logging
import os
import shutil

import lmdb

from ..errors import CacheError
from ..units import format_size, headroom_bytes, parse_headroom
from .counters import Counters
from .env import Store
from .schema import C_EFFECTIVE_CAPACITY, C_FORMAT, DB_META, FORMAT_VERSION, pack_u64, unpack_u64

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

_M_CAPACITY = b"capacity"
_M_HEADROOM = b"headroom"
#: Keep this fraction of the disk's free space unused when sizing the cache to the disk.
_DISK_RESERVE = 0.05


def stored_limits(path: str) -> tuple[int | None, int | None]:
    """``(capacity, headroom)`` in bytes as stored in the cache at ``path`` (None: not stored)."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None, None
    store = Store(path, readonly=True)
    try:
        with store.read() as txn:
            meta = store.dbs[DB_META]
            cap, head = txn.get(_M_CAPACITY, db=meta), txn.get(_M_HEADROOM, db=meta)
            return (
                None if cap is None else unpack_u64(cap),
                None if head is None else unpack_u64(head),
            )
    finally:
        store.close()


def resolve_limits(
    path: str, capacity: int | None, headroom: float | int | str
) -> tuple[int, int, bool]:
    """``(capacity, headroom, changed)`` in bytes for opening the cache at ``path``.

    A given capacity wins (and the headroom is computed from it); None keeps the stored one.
    ``changed`` tells whether the result differs from what the cache stores.

    Raises:
        CacheError: no capacity was given and the cache stores none.
    """
    stored_cap, stored_head = stored_limits(path)
    if capacity is None and stored_cap is None:
        exists = os.path.exists(os.path.join(path, "data.mdb"))
        raise CacheError(
            f"{path}: "
            + ("the cache has no stored capacity (its creation was interrupted?)" if exists
               else "no cache here")
            + "; open it with Cache(path, capacity='...')"
        )
    cap = capacity if capacity is not None else int(stored_cap or 0)
    if capacity is not None or stored_head is None:
        head = headroom_bytes(parse_headroom(headroom), cap)
    else:
        head = stored_head
    return cap, head, (stored_cap, stored_head) != (cap, head)


class Capacity:
    """The limits of one open cache.

    Args:
        store: the cache's LMDB environment.
        capacity_bytes: stored bytes to keep.
        headroom_bytes: extra bytes writers may use while leases pin the oldest samples.
    """

    def __init__(self, store: Store, capacity_bytes: int, headroom_bytes: int) -> None:
        self.store = store
        self.capacity_bytes = capacity_bytes
        self.headroom_bytes = headroom_bytes
        self._disk_limit: int | None = None

    def save(self, txn: lmdb.Transaction) -> None:
        """Store the format version, capacity and headroom (refusing another format)."""
        meta = self.store.dbs[DB_META]
        version = txn.get(C_FORMAT, db=meta)
        if version is not None and unpack_u64(version) != FORMAT_VERSION:
            raise CacheError(
                f"{self.store.path}: cache format {unpack_u64(version)} is not supported by this "
                f"version (format {FORMAT_VERSION}); use a new cache directory"
            )
        txn.put(C_FORMAT, pack_u64(FORMAT_VERSION), db=meta)
        txn.put(_M_CAPACITY, pack_u64(self.capacity_bytes), db=meta)
        txn.put(_M_HEADROOM, pack_u64(self.headroom_bytes), db=meta)

    def fit_to_disk(self) -> None:
        """Lower the effective capacity when the disk cannot hold capacity + headroom."""
        usage = shutil.disk_usage(self.store.path)
        room = int((usage.free + self.store.file_bytes()) * (1 - _DISK_RESERVE))
        need = self.capacity_bytes + self.headroom_bytes
        if need > room:
            fit = int(room * self.capacity_bytes / need)
            log.warning(
                "%s: capacity %s + headroom %s does not fit the %s free on this disk; "
                "using an effective capacity of %s (free space or lower cache.capacity)",
                self.store.path,
                format_size(self.capacity_bytes),
                format_size(self.headroom_bytes),
                format_size(usage.free),
                format_size(fit),
            )
            self._disk_limit = fit

    @property
    def effective(self) -> int:
        """Capacity in force: the configured one, lowered after a full disk."""
        limits = [self.capacity_bytes]
        if self._disk_limit is not None:
            limits.append(self._disk_limit)
        with self.store.read() as txn:
            lowered = txn.get(C_EFFECTIVE_CAPACITY, db=self.store.dbs[DB_META])
            if lowered is not None and unpack_u64(lowered) > 0:
                limits.append(unpack_u64(lowered))
        return min(limits)

    def headroom_for(self, limit: int) -> int:
        """Headroom scaled down with the capacity when the disk forced a lower one."""
        if limit >= self.capacity_bytes or self.capacity_bytes == 0:
            return self.headroom_bytes
        return int(self.headroom_bytes * limit / self.capacity_bytes)

    def lower(self, exc: Exception, incoming: int) -> None:
        """A write failed on a full disk or map: lower the limit below what is stored."""
        with self.store.read() as txn:
            stored = Counters.load(txn, self.store.dbs[DB_META]).bytes
        new_limit = max(0, min(self.effective, stored) - max(incoming, stored // 10))
        log.warning(
            "%s: the disk or LMDB map is full (%s) with %s stored; lowering the effective "
            "capacity to %s. Free disk space, or lower cache.capacity, then restart.",
            self.store.path,
            type(exc).__name__,
            format_size(stored),
            format_size(new_limit),
        )
        self._disk_limit = new_limit
        meta = self.store.dbs[DB_META]
        try:
            self.store.write(lambda txn: txn.put(C_EFFECTIVE_CAPACITY, pack_u64(new_limit), db=meta))
        except (lmdb.MapFullError, lmdb.DiskError):
            pass  # kept in memory for this process; the next full write lowers it again

    def reset(self) -> None:
        """Forget a capacity lowered after a full disk (after space was freed)."""
        self._disk_limit = None
        meta = self.store.dbs[DB_META]
        self.store.write(lambda txn: txn.delete(C_EFFECTIVE_CAPACITY, db=meta))
        self.fit_to_disk()
