"""The byte limits of a cache: the configured capacity and headroom, and the limit in force.

Capacity and headroom are stored in the cache's ``meta`` table, so every process that opens
the cache (samplers, trainers, ``status``) works to the same limits. The limit in force, the
*effective capacity*, is the configured capacity unless the disk cannot hold it: then it is a
runtime back-off of the process that found out (at open, or after a full disk or LMDB map),
which recovers by itself and is never stored as a limit (`epochcache.store.lowered_capacity`).
Headroom shrinks in proportion with it.
"""

from __future__ import annotations

import os
from typing import Any

import lmdb

from ..errors import CacheUnusable
from ..units import headroom_bytes, parse_headroom
from .datafile import no_cache_here
from .env import Env
from .lowered_capacity import LoweredCapacity, published
from .records import C_FORMAT, DB_META, FORMAT_VERSION, pack_u64, unpack_u64
from .tables import Counters

_M_CAPACITY = b"capacity"
_M_HEADROOM = b"headroom"


def stored_limits(path: str) -> tuple[int | None, int | None]:
    """``(capacity, headroom)`` in bytes as stored in the cache at ``path`` (None: not stored).

    Raises:
        CacheUnusable: the cache is of another format (a newer epochcache made it), or its
            data file is not one LMDB can open (`epochcache.store.datafile`).
    """
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None, None
    env = Env(path, readonly=True)
    try:
        with env.read() as txn:
            meta = env.dbs[DB_META]
            check_stored_format(path, txn.get(C_FORMAT, db=meta))
            cap, head = txn.get(_M_CAPACITY, db=meta), txn.get(_M_HEADROOM, db=meta)
            return (
                None if cap is None else unpack_u64(cap),
                None if head is None else unpack_u64(head),
            )
    finally:
        env.close()


def check_stored_format(path: str, stored: bytes | memoryview | None) -> None:
    """Refuse a cache whose stored format version is not this version's (None: a cache being
    created)."""
    if stored is None or unpack_u64(stored) == FORMAT_VERSION:
        return
    version = unpack_u64(stored)
    newer = version > FORMAT_VERSION
    fix = ("upgrade epochcache (pip install -U epochcache) to open it" if newer
           else "open it with the version that made it")
    raise CacheUnusable(
        f"{path}: cache format {version}, made by {'a newer' if newer else 'an older'} "
        f"epochcache (this version reads format {FORMAT_VERSION}); {fix}, or delete the "
        "directory and let a daemon fill it anew (every sample is still in the remote)")


def resolve_limits(
    path: str, capacity: int | None, headroom: float | int | str
) -> tuple[int, int, bool]:
    """``(capacity, headroom, changed)`` in bytes for opening the cache at ``path``.

    A given capacity wins (and the headroom is computed from it); None keeps the stored one.
    ``changed`` tells whether the result differs from what the cache stores.

    Raises:
        CacheUnusable: no capacity was given and the cache stores none (or there is none).
    """
    stored_cap, stored_head = stored_limits(path)
    if capacity is None and stored_cap is None:
        if not os.path.exists(os.path.join(path, "data.mdb")):
            raise CacheUnusable(no_cache_here(path))
        raise CacheUnusable(f"{path}: the cache has no stored capacity (its creation was "
                            "interrupted?); open it with Cache(path, capacity='...')")
    cap = capacity if capacity is not None else int(stored_cap or 0)
    if capacity is not None or stored_head is None:
        head = headroom_bytes(parse_headroom(headroom), cap)
    else:
        head = stored_head
    return cap, head, (stored_cap, stored_head) != (cap, head)


class Capacity:
    """The limits of one open cache.

    Args:
        env: the cache's LMDB environment.
        capacity_bytes: stored bytes to keep.
        headroom_bytes: extra bytes writers may use while leases pin the oldest samples.
    """

    def __init__(self, env: Env, capacity_bytes: int, headroom_bytes: int) -> None:
        self.env = env
        self.capacity_bytes = capacity_bytes
        self.headroom_bytes = headroom_bytes
        self.backoff = LoweredCapacity(env, capacity_bytes, headroom_bytes)

    def save(self, txn: lmdb.Transaction) -> None:
        """Store the format version, capacity and headroom (refusing another format)."""
        meta = self.env.dbs[DB_META]
        check_stored_format(self.env.path, txn.get(C_FORMAT, db=meta))
        txn.put(C_FORMAT, pack_u64(FORMAT_VERSION), db=meta)
        txn.put(_M_CAPACITY, pack_u64(self.capacity_bytes), db=meta)
        txn.put(_M_HEADROOM, pack_u64(self.headroom_bytes), db=meta)

    def fit_to_disk(self) -> None:
        """At open: lower the limit in force when the disk cannot hold capacity + headroom
        (and drop back-off state that earlier processes or versions left in the cache)."""
        self.backoff.fit_to_disk()

    @property
    def effective(self) -> int:
        """Capacity in force in this process: the configured one, lowered while the disk (or
        the LMDB map) is full."""
        return self.backoff.limit

    def lowered(self) -> dict[str, Any] | None:
        """The lowest limit in force in any live process (this one included), with its reason,
        as published for ``status``; None when no process runs lowered."""
        own = self.backoff.document()
        docs = [doc for doc in published(self.env) if own is None or doc["name"] != own["name"]]
        docs = sorted(docs + ([own] if own is not None else []), key=lambda d: int(d["limit"]))
        if not docs or int(docs[0]["limit"]) >= self.capacity_bytes:
            return None
        return docs[0]

    def headroom_for(self, limit: int) -> int:
        """Headroom scaled down with the capacity when the disk forced a lower one."""
        if limit >= self.capacity_bytes or self.capacity_bytes == 0:
            return self.headroom_bytes
        return int(self.headroom_bytes * limit / self.capacity_bytes)

    def lower(self, exc: Exception, incoming: int) -> None:
        """A write failed on a full disk or map, with nothing left to evict: lower the limit
        in force below what is stored (a back-off that `probe` lifts)."""
        with self.env.read() as txn:
            stored = Counters.load(txn, self.env.dbs[DB_META]).bytes
        self.backoff.lower(exc, stored, incoming)

    def probe(self) -> None:
        """Called before each write: raise a lowered limit when the disk has room again."""
        if self.backoff.state is not None:
            self.backoff.probe()

    def settle(self) -> None:
        """Called after each successful write: publish a lowered limit not published yet."""
        self.backoff.settle()

    def reset(self) -> None:
        """Forget a capacity lowered after a full disk (after space was freed)."""
        self.backoff.reset()

    def close(self) -> None:
        """Withdraw this process's published lowered limit, if any."""
        self.backoff.close()
