"""The Cache facade: a byte-bounded LMDB sample store that evicts its oldest samples.

Writers (the sampler processes) call :meth:`Cache.put_many`; trainers take a
:meth:`Cache.snapshot` per epoch (or use :meth:`Cache.dataset` / :meth:`Cache.epochs`), which
protects that epoch's samples from eviction until it is released. The parts live in their own
modules: record framing in ``codec``, LMDB handles in ``store``, counters, leases, eviction and
snapshots each in theirs. This module wires them together and owns the capacity policy.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from . import codec
from .counters import Counters
from .errors import CacheError
from .journal import JournalMixin
from .writer import WriterMixin
from .leases import DEFAULT_LEASE_TIMEOUT_S, Lease, delete_lease, read_leases, write_lease
from .schema import (
    C_EFFECTIVE_CAPACITY,
    C_FORMAT,
    DB_KEYS,
    DB_LEASES,
    DB_META,
    DB_SAMPLES,
    FORMAT_VERSION,
    pack_u64,
    seq_key,
    seq_keys,
    unpack_u64,
)
from .snapshot import Snapshot, select_snapshot
from .store import Store, map_bound
from .units import format_size, parse_size

if TYPE_CHECKING:
    from .dataset import EpochDataset

log = logging.getLogger(__name__)

Value = bytes | Mapping[str, bytes]

_M_CAPACITY = b"capacity"
_M_HEADROOM = b"headroom"
#: Keep this fraction of the disk's free space unused when sizing the cache to the disk.
_DISK_RESERVE = 0.05


def _parse_headroom(headroom: float | int | str, capacity: int) -> int:
    """A float is a fraction of capacity (0.1, 1.0 = 100%); "10%" too; ints and "2GiB" are sizes."""
    if isinstance(headroom, str) and headroom.strip().endswith("%"):
        headroom = float(headroom.strip()[:-1]) / 100
    if isinstance(headroom, float):
        if not 0 <= headroom <= 10:
            raise ValueError(f"headroom: a fraction of capacity must be in [0, 10], got {headroom!r}")
        return int(capacity * headroom)
    return parse_size(headroom, name="headroom")


class Cache(WriterMixin, JournalMixin):
    """A local sample cache bounded by ``capacity`` bytes, evicting oldest samples first.

    Opening is cheap and safe in any process: the LMDB environment opens lazily again after
    ``fork()``, so a Cache created in the parent can be used in DataLoader workers.

    Args:
        path: the cache directory (created private to the user).
        capacity: stored bytes to keep, e.g. ``"200GiB"`` or ``10**9``. Required when creating
            a cache; when opening an existing one, None keeps its stored capacity.
        headroom: extra bytes writers may use while leases pin the oldest samples: a fraction
            of capacity (default 0.1) or a size. At capacity + headroom writers wait.
        compression: ``"zstd"`` or ``"none"``; incompressible samples are stored raw anyway.
        level: the zstd level.
        sync: fsync each commit (survives power loss as well as process crashes).
        readonly: open for reading only (status, verify).
        max_map_size: cap on the LMDB map (defaults to a bound derived from capacity).
        lease_timeout_s: a lease holder on another host is presumed dead after this long
            without a heartbeat.

    Raises:
        CacheError: the directory holds no cache and no capacity was given, or it cannot be
            opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int | str | None = None,
        *,
        headroom: float | int | str = 0.1,
        compression: str = "zstd",
        level: int = 3,
        sync: bool = True,
        readonly: bool = False,
        max_map_size: int | str | None = None,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    ) -> None:
        if compression not in ("zstd", "none"):
            raise ValueError(f"compression: expected 'zstd' or 'none', got {compression!r}")
        self.path = os.path.realpath(os.fspath(path))
        self.compress = compression == "zstd"
        self.level = level
        self.lease_timeout_s = lease_timeout_s
        self._full_logged = 0.0
        self._lock = threading.Lock()
        cap = None if capacity is None else parse_size(capacity, name="capacity")
        if cap is not None and cap <= 0:
            raise ValueError(f"capacity: must be positive, got {capacity!r}")
        stored_cap, stored_head = self._peek_capacity()
        if cap is None and stored_cap is None:
            exists = os.path.exists(os.path.join(self.path, "data.mdb"))
            raise CacheError(
                f"{self.path}: "
                + ("the cache has no stored capacity (its creation was interrupted?)" if exists else "no cache here")
                + "; open it with Cache(path, capacity='...')"
            )
        self.capacity_bytes = cap if cap is not None else int(stored_cap or 0)
        if cap is not None or stored_head is None:
            self.headroom_bytes = _parse_headroom(headroom, self.capacity_bytes)
        else:
            self.headroom_bytes = stored_head
        limit = self.capacity_bytes + self.headroom_bytes
        max_map = parse_size(max_map_size, name="max_map_size") if max_map_size else None
        bound = max_map if max_map is not None else map_bound(limit)
        self._store = Store(
            self.path,
            map_size=min(bound, map_bound(limit)),
            max_map_size=bound,
            readonly=readonly,
            sync=sync,
        )
        self._disk_limit: int | None = None
        if not readonly:
            if (stored_cap, stored_head) != (self.capacity_bytes, self.headroom_bytes):
                self._store.write(self._init_meta)
            self._fit_to_disk()

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        """The sub-database handles of this process's environment (reopened after fork)."""
        self._store.env  # noqa: B018 - reopens the environment in a forked child
        return self._store.dbs

    # -- set-up -----------------------------------------------------------------------------

    def _peek_capacity(self) -> tuple[int | None, int | None]:
        if not os.path.exists(os.path.join(self.path, "data.mdb")):
            return None, None
        store = Store(self.path, readonly=True)
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

    def _init_meta(self, txn: lmdb.Transaction) -> None:
        meta = self.dbs[DB_META]
        version = txn.get(C_FORMAT, db=meta)
        if version is not None and unpack_u64(version) != FORMAT_VERSION:
            raise CacheError(
                f"{self.path}: cache format {unpack_u64(version)} is not supported by this "
                f"version (format {FORMAT_VERSION}); use a new cache directory"
            )
        txn.put(C_FORMAT, pack_u64(FORMAT_VERSION), db=meta)
        txn.put(_M_CAPACITY, pack_u64(self.capacity_bytes), db=meta)
        txn.put(_M_HEADROOM, pack_u64(self.headroom_bytes), db=meta)

    def _fit_to_disk(self) -> None:
        """Lower the effective capacity when the disk cannot hold capacity + headroom."""
        usage = shutil.disk_usage(self.path)
        room = int((usage.free + self._store.file_bytes()) * (1 - _DISK_RESERVE))
        need = self.capacity_bytes + self.headroom_bytes
        if need > room:
            fit = int(room * self.capacity_bytes / need)
            log.warning(
                "%s: capacity %s + headroom %s does not fit the %s free on this disk; "
                "using an effective capacity of %s (free space or lower cache.capacity)",
                self.path,
                format_size(self.capacity_bytes),
                format_size(self.headroom_bytes),
                format_size(usage.free),
                format_size(fit),
            )
            self._disk_limit = fit

    # -- capacity ---------------------------------------------------------------------------

    @property
    def effective_capacity(self) -> int:
        """Capacity in force: the configured one, lowered after a full disk."""
        limits = [self.capacity_bytes]
        if self._disk_limit is not None:
            limits.append(self._disk_limit)
        with self._store.read() as txn:
            lowered = txn.get(C_EFFECTIVE_CAPACITY, db=self.dbs[DB_META])
            if lowered is not None and unpack_u64(lowered) > 0:
                limits.append(unpack_u64(lowered))
        return min(limits)

    def _headroom_for(self, limit: int) -> int:
        """Headroom scaled down with the capacity when the disk forced a lower one."""
        if limit >= self.capacity_bytes or self.capacity_bytes == 0:
            return self.headroom_bytes
        return int(self.headroom_bytes * limit / self.capacity_bytes)

    def _lower_capacity(self, exc: Exception, incoming: int) -> None:
        with self._store.read() as txn:
            stored = Counters.load(txn, self.dbs[DB_META]).bytes
        new_limit = max(0, min(self.effective_capacity, stored) - max(incoming, stored // 10))
        log.warning(
            "%s: the disk or LMDB map is full (%s) with %s stored; lowering the effective "
            "capacity to %s. Free disk space, or lower cache.capacity, then restart.",
            self.path,
            type(exc).__name__,
            format_size(stored),
            format_size(new_limit),
        )
        self._disk_limit = new_limit
        try:
            self._store.write(
                lambda txn: txn.put(C_EFFECTIVE_CAPACITY, pack_u64(new_limit), db=self.dbs[DB_META])
            )
        except (lmdb.MapFullError, lmdb.DiskError):
            pass  # kept in memory for this process; the next full write lowers it again

    def reset_effective_capacity(self) -> None:
        """Forget a capacity lowered after a full disk (after space was freed)."""
        self._disk_limit = None
        self._store.write(lambda txn: txn.delete(C_EFFECTIVE_CAPACITY, db=self.dbs[DB_META]))
        self._fit_to_disk()

    # -- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._store.read() as txn:
            return Counters.load(txn, self.dbs[DB_META]).samples

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        with self._store.read() as txn:
            return txn.get(key.encode("utf-8"), db=self.dbs[DB_KEYS]) is not None

    def has_key_prefix(self, prefix: str) -> bool:
        """Whether any cached source key starts with ``prefix`` (a tar shard's samples)."""
        raw = prefix.encode("utf-8")
        with self._store.read() as txn:
            cursor = txn.cursor(db=self.dbs[DB_KEYS])
            return bool(cursor.set_range(raw)) and bytes(cursor.key()).startswith(raw)

    def get(self, seq: int) -> bytes | dict[str, bytes]:
        """The raw value of sample ``seq`` (bytes, or a dict of fields for tar samples).

        Raises:
            KeyError: the sample is not in the cache (evicted, or never written).
        """
        return self.get_many([seq])[0]

    def get_many(self, seqs: Sequence[int] | np.ndarray) -> list[bytes | dict[str, bytes]]:
        """Values of several samples, read in one transaction (the batched read path).

        Raises:
            KeyError: a sample is not in the cache (evicted, or never written).
        """
        keys = seq_keys(seqs)
        values = self._store.read_many(self.dbs[DB_SAMPLES], keys, codec.decode_payload)
        if None in values:
            missing = [int(s) for s, v in zip(seqs, values) if v is None]
            raise KeyError(
                f"samples {missing[:10]} are not in the cache at {self.path} (evicted: was their "
                "snapshot released?)"
            )
        return values  # type: ignore[return-value]

    def get_records(self, seqs: Sequence[int] | np.ndarray) -> list[bytes]:
        """Stored records (header, key, payload) as bytes, for readers that decode themselves."""
        samples_db = self.dbs[DB_SAMPLES]
        with self._store.read() as txn:
            out = []
            for seq in seqs:
                record = txn.get(seq_key(int(seq)), None, samples_db)
                if record is None:
                    raise KeyError(f"sample {seq} is not in the cache at {self.path}")
                out.append(bytes(record))
            return out

    def info(self, seq: int) -> codec.RecordInfo:
        """Metadata of sample ``seq``: source key, sizes, codec, checksum, time added."""
        with self._store.read() as txn:
            record = txn.get(seq_key(int(seq)), db=self.dbs[DB_SAMPLES])
            if record is None:
                raise KeyError(f"sample {seq} is not in the cache at {self.path}")
            return codec.read_info(record)

    def seq_of(self, key: str) -> int | None:
        """The sequence number under which source ``key`` is cached, or None."""
        with self._store.read() as txn:
            raw = txn.get(key.encode("utf-8"), db=self.dbs[DB_KEYS])
            return None if raw is None else unpack_u64(raw)

    def counters(self) -> Counters:
        with self._store.read() as txn:
            return Counters.load(txn, self.dbs[DB_META])

    # -- snapshots and leases ---------------------------------------------------------------

    def snapshot(self, epoch: int | None = None, label: str = "") -> Snapshot:
        """Freeze the newest samples that fit the capacity, under a lease.

        The snapshot's samples stay readable, unchanged, until it is released, however much
        is written meanwhile (invariant 1).
        """
        limit = self.effective_capacity

        def run(txn: lmdb.Transaction) -> tuple[np.ndarray, str]:
            self._reclaim(txn)
            counters = Counters.load(txn, self.dbs[DB_META])
            seqs = select_snapshot(txn, self.dbs[DB_SAMPLES], counters, limit)
            lo = int(seqs[0]) if len(seqs) else counters.next_seq
            hi = int(seqs[-1]) + 1 if len(seqs) else counters.next_seq
            name = label or (f"epoch {epoch}" if epoch is not None else "snapshot")
            lease = Lease.new(lo, hi, len(seqs), label=name)
            write_lease(txn, self.dbs[DB_LEASES], lease)
            return seqs, lease.lease_id

        seqs, lease_id = self._store.write(run)
        return Snapshot(self, seqs, lease_id, epoch)

    def leases(self) -> list[Lease]:
        with self._store.read() as txn:
            return read_leases(txn, self.dbs[DB_LEASES])

    def release_lease(self, lease_id: str) -> bool:
        return self._store.write(lambda txn: delete_lease(txn, self.dbs[DB_LEASES], lease_id))

    def heartbeat_lease(self, lease_id: str) -> None:
        def run(txn: lmdb.Transaction) -> None:
            raw = txn.get(lease_id.encode(), db=self.dbs[DB_LEASES])
            if raw is not None:
                lease = Lease.from_bytes(raw)
                lease.heartbeat_ns = time.time_ns()
                write_lease(txn, self.dbs[DB_LEASES], lease)

        self._store.write(run)

    def reclaim_leases(self) -> list[Lease]:
        """Delete leases whose holder died, then evict what they pinned beyond capacity."""
        dead = self._store.write(self._reclaim)
        if dead:
            self.evict()
        return dead

    # -- reporting and lifecycle ------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, capacity, leases and daemon health, as a JSON-able dict."""
        from .status import collect_stats

        return collect_stats(self)

    def dataset(self, epoch: int = 0, **kwargs: Any) -> EpochDataset:
        """A map-style Dataset over a fresh snapshot (see :class:`epochcache.EpochDataset`)."""
        from .dataset import EpochDataset  # torch stays out of sampler processes

        return EpochDataset.from_cache(self, epoch=epoch, **kwargs)

    def epochs(self, num_epochs: int, **kwargs: Any) -> Any:
        """Yield ``(epoch, loader)``; see :func:`epochcache.loader.epochs`."""
        from .loader import epochs

        return epochs(self, num_epochs, **kwargs)

    @property
    def store(self) -> Store:
        return self._store

    def file_bytes(self) -> int:
        return self._store.file_bytes()

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cache({self.path!r}, capacity={format_size(self.capacity_bytes)!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Pickle as a path: the receiving process opens its own environment.
        return {"path": self.path, "compression": "zstd" if self.compress else "none", "level": self.level}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], compression=state["compression"], level=state["level"])  # type: ignore[misc]
