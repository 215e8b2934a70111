"""SampleStore: a byte-bounded LMDB sample store that evicts its oldest samples.

Writers (the sampler processes) call `SampleStore.put_many`; trainers take a
`SampleStore.snapshot` per epoch, which protects that epoch's samples from eviction until
it is released. The parts are objects of their own that the store holds: the LMDB environment
(``env``), the limits (``capacity``), the write path (``writer``) and the side tables
(``tables``); counters, leases, eviction and snapshots are modules of their own. Its public
methods are the storage half of the public [`epochcache.Cache`][epochcache.Cache], a subclass
that adds what needs the layers above (``dataset()``, ``epochs()``, ``stats()``, ...), so that
this layer never imports torch; what the layers call on a store besides is in `plumbing`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import lmdb
import numpy as np

from ..units import format_size, parse_size
from . import records
from .capacity import Capacity, resolve_limits, stored_limits
from .env import Env, map_bound
from .eviction import DEFAULT_POLICY, Eviction, policy_of
from .leases import (
    DEFAULT_LEASE_TIMEOUT_S,
    Lease,
    delete_lease,
    note_end,
    read_leases,
    write_lease,
)
from .origins import Origin
from .owners import end_lease, heartbeats
from .reads import record_reads, remove_plan, remove_reads, write_seqs
from .records import (
    DB_KEYS,
    DB_LEASES,
    DB_META,
    DB_SAMPLES,
    DB_STATE,
    M_EVICTION,
    Value,
    index_key,
    seq_key,
    seq_keys,
    unpack_u64,
)
from .snapshot import Snapshot, hold_lease, select_snapshot
from .tables import Counters, SideTables
from .writer import OnReject, PutResult, Writer

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

_Store = TypeVar("_Store", bound="SampleStore")


class SampleStore:
    """A local sample cache bounded by ``capacity`` bytes, evicting oldest samples first: the
    storage half of [`epochcache.Cache`][epochcache.Cache], whose docstring gives the
    arguments and what they raise.

    Opening is cheap and safe in any process. A forked child (a DataLoader worker) opens an
    LMDB environment of its own on first use (see `epochcache.store.env`), so a store
    opened in the parent can be read in workers; pickled, it travels as its path and reopens on the other side.
    A changed capacity, headroom or eviction policy is logged (``old -> new``), or kept with a
    warning while other processes have the cache open for writing; a stored policy that is
    not registered raises ValueError as an unknown ``eviction`` does. This process's open
    snapshots refresh their leases' heartbeat every quarter of ``lease_timeout_s`` (see
    `epochcache.store.owners`).
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
        eviction: str | None = None,
    ) -> None:
        if compression not in ("zstd", "none"):
            raise ValueError(f"compression: expected 'zstd' or 'none', got {compression!r}")
        if eviction is not None:
            policy_of(eviction)  # an unknown name raises before anything is created
        self._path = os.path.realpath(os.fspath(path))
        # What a copy in another process opens with (see __getstate__); the limits live in
        # the cache itself, so a copy keeps the ones in force.
        self._settings: dict[str, Any] = {
            "compression": compression, "level": level, "sync": sync, "readonly": readonly,
            "max_map_size": max_map_size, "lease_timeout_s": lease_timeout_s,
        }
        self.compress = compression == "zstd"
        self.level = level
        self.lease_timeout_s = lease_timeout_s
        cap = None if capacity is None else parse_size(capacity, name="capacity")
        if cap is not None and cap <= 0:
            raise ValueError(f"capacity: must be positive, got {capacity!r}")
        max_map = parse_size(max_map_size, name="max_map_size") if max_map_size else None

        def map_limits(capacity_bytes: int, headroom_bytes: int) -> tuple[int, int]:
            limit = capacity_bytes + headroom_bytes
            bound = max_map if max_map is not None else map_bound(limit)
            return min(bound, map_bound(limit)), bound

        # No cache and no capacity: this raises before anything is created.
        capacity_bytes, headroom_bytes, _ = resolve_limits(self.path, cap, headroom)
        map_size, bound = map_limits(capacity_bytes, headroom_bytes)
        self.env = Env(self.path, map_size=map_size, max_map_size=bound, readonly=readonly,
                           sync=sync)
        # Read the limits again now that this process holds the cache (see Env.alone).
        capacity_bytes, headroom_bytes, changed = resolve_limits(self.path, cap, headroom)
        if changed and not readonly:
            capacity_bytes, headroom_bytes = self._settle_limits(cap, headroom)
        self.env.set_map_limits(*map_limits(capacity_bytes, headroom_bytes))
        self.capacity = Capacity(self.env, capacity_bytes, headroom_bytes)
        self._eviction = self._settle_eviction(eviction)
        self.writer = Writer(self.env, self.capacity, compress=self.compress, level=level,
                             lease_timeout_s=lease_timeout_s,
                             eviction=DEFAULT_POLICY if readonly else self.eviction)
        self.tables = SideTables(self.env)
        if not readonly:
            self.capacity.fit_to_disk()

    def _settle_limits(self, capacity: int | None, headroom: float | int | str) -> tuple[int, int]:
        """Store the limits asked for if no other process holds the cache, else keep the
        stored ones (every process must work to the same limits); log either way."""
        with self.env.alone() as sole:
            cap, head, changed = resolve_limits(self.path, capacity, headroom)
            old_cap, old_head = stored_limits(self.path)
            if not changed:
                return cap, head
            if old_cap is None or sole:
                self.env.write(Capacity(self.env, cap, head).save)
                if old_cap is not None:
                    log.info("%s: capacity %s -> %s, headroom %s -> %s", self.path,
                             format_size(old_cap), format_size(cap),
                             format_size(old_head or 0), format_size(head))
                return cap, head
        kept_cap, kept_head, _ = resolve_limits(self.path, None, headroom)
        log.warning(
            "%s: keeping capacity %s (headroom %s) instead of %s (headroom %s): other processes "
            "have this cache open (a daemon, its samplers or trainers), and all must work to the "
            "same limits; stop them, then open it with the new capacity",
            self.path, format_size(kept_cap), format_size(kept_head), format_size(cap),
            format_size(head),
        )
        return kept_cap, kept_head

    def _settle_eviction(self, eviction: str | None) -> str:
        """The cache's policy: the one asked for, stored if no other process holds the cache
        (the rule of `_settle_limits`), else the stored one (a new cache: `DEFAULT_POLICY`).
        A changed policy starts with no read log."""
        stored = self._stored_eviction()
        current = stored or DEFAULT_POLICY
        wanted = eviction or current
        if self.env.readonly or (wanted == current and stored is not None):
            return current
        with self.env.alone() as sole:
            stored = self._stored_eviction()
            current = stored or DEFAULT_POLICY
            if wanted == current or sole:
                self.env.write(lambda txn: txn.put(M_EVICTION, wanted.encode(),
                                                     db=self.env.dbs[DB_META]))
                if wanted != current:
                    remove_reads(self.path)
                    log.info("%s: eviction %s -> %s", self.path, current, wanted)
                return wanted
        log.warning("%s: keeping eviction %s instead of %s: other processes have this cache "
                    "open (a daemon, its samplers or trainers), and all must evict alike; stop "
                    "them, then open it with the new policy", self.path, current, wanted)
        return current

    def _stored_eviction(self) -> str | None:
        with self.env.read() as txn:
            raw = txn.get(M_EVICTION, db=self.env.dbs[DB_META])
        return None if raw is None else bytes(raw).decode()

    # -- limits -----------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The cache directory (resolved)."""
        return self._path

    @property
    def eviction(self) -> str:
        """The cache's eviction policy, by name (stored in the cache: every writer evicts
        alike)."""
        return self._eviction

    @property
    def capacity_bytes(self) -> int:
        """Stored bytes the cache keeps to (eviction makes room past it)."""
        return self.capacity.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        """What writers may store beyond the capacity while leases pin the oldest samples."""
        return self.capacity.headroom_bytes

    @property
    def effective_capacity(self) -> int:
        """The capacity in force: lower than `capacity_bytes` while a full disk (or LMDB map)
        holds this process or another live writer back (see `Capacity.lowered`)."""
        lowered = self.capacity.lowered()
        own = self.capacity.effective
        return own if lowered is None else min(own, int(lowered["limit"]))

    # -- writing ----------------------------------------------------------------------------

    def put(self, key: str, value: Value, **kwargs: Any) -> PutResult:
        """Store one sample (see `put_many`)."""
        return self.put_many([(key, value)], **kwargs)

    def put_many(
        self,
        items: Iterable[tuple[str, Value]],
        *,
        encoded: bool = False,
        wait: bool = True,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
        on_reject: OnReject | None = None,
        origins: dict[str, Origin] | None = None,
    ) -> PutResult:
        """Store samples; samples whose key is already cached are skipped.

        Eviction makes room, oldest first. When leases pin too much to stay within capacity +
        headroom, the call waits (back-pressure) until space returns, ``timeout_s`` passes or
        ``stop`` is set; with ``wait=False`` it raises [`CacheFull`][epochcache.CacheFull] at once. Samples are
        committed in order, as many per transaction as fit; when the call returns, every
        sample is committed. A [`CacheFull`][epochcache.CacheFull] carries ``.result``, what was committed.

        Args:
            items: ``(source key, value)`` pairs; a value is ``bytes`` or a dict of fields. A
                key may be any length: keys LMDB cannot hold are indexed under a digest.
            encoded: the values are records already made by `encode`.
            on_reject: ``on_reject(key, error)`` for each sample that can never be stored
                ([`SampleRejected`][epochcache.SampleRejected]); the others are committed. Without it, such a sample
                raises before anything is committed.
            origins: where samples came from, by key (samplers give it; see
                `epochcache.store.origins`); samples without one are unattributed in
                `coverage`.

        Raises:
            CacheFull: no room and ``wait`` is False, the timeout passed, or ``stop`` was set.
            SampleTooLarge: a sample could never fit the capacity (and no ``on_reject``).
            SampleRejected: a sample can never be stored otherwise (and no ``on_reject``).
        """
        return self.writer.put_many(items, encoded=encoded, wait=wait, timeout_s=timeout_s,
                                    stop=stop, on_reject=on_reject, origins=origins)

    def evict(self, limit_bytes: int | None = None) -> Eviction:
        """Evict the samples no lease protects that the cache's policy takes first (the oldest,
        by default) until at most ``limit_bytes`` (default: the capacity) remain."""
        return self.writer.evict(limit_bytes)

    # -- reading ----------------------------------------------------------------------------

    def __len__(self) -> int:
        """The samples cached now."""
        return self.counters().samples

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached."""
        return isinstance(key, str) and self.seq_of(key) is not None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``key in cache`` for each key, in one read transaction."""
        db = self.env.dbs[DB_KEYS]
        with self.env.read() as txn:
            get = txn.get
            return [get(index_key(key.encode("utf-8")), db=db) is not None for key in keys]

    def get(self, key: str | int) -> bytes | dict[str, bytes]:
        """The value of a sample (bytes, or a dict of fields), by its key, as ``key in cache``
        takes it, or by its sequence number (an int: [`seq_of`][epochcache.Cache.seq_of],
        a loader's ``seqs``).

        Raises:
            KeyError: no such sample (never stored, or evicted).
            TypeError: ``key`` is neither a key (str) nor a sequence number (int).
        """
        if isinstance(key, str):
            seq = self.seq_of(key)
            if seq is None:
                raise KeyError(f"{key!r}: not cached (never stored, or evicted)")
            return self.get_many([seq])[0]
        return self.get_many([_seq(key, "get")])[0]

    def get_many(self, seqs: Sequence[int] | np.ndarray) -> list[bytes | dict[str, bytes]]:
        """Values of several samples by sequence number, read in one transaction (the batched
        read path).

        Raises:
            KeyError: one of them is not cached (evicted, or never written).
            TypeError: one is not a sequence number (``cache.seq_of(key)`` gives a key's).
        """
        if not isinstance(seqs, np.ndarray):
            seqs = [_seq(seq, "get_many") for seq in seqs]
        keys = seq_keys(seqs)
        values = self.env.read_many(self.env.dbs[DB_SAMPLES], keys, records.decode_payload)
        if None in values:
            missing = [int(s) for s, v in zip(seqs, values) if v is None]
            raise KeyError(
                f"samples {missing[:10]} are not in the cache at {self.path} (evicted: was their "
                "snapshot released?)"
            )
        return values  # type: ignore[return-value]

    def info(self, seq: int) -> records.RecordInfo:
        """How sample ``seq`` is stored: its key, sizes, codec, checksum, time added."""
        with self.env.read() as txn:
            record = txn.get(seq_key(int(seq)), db=self.env.dbs[DB_SAMPLES])
            if record is None:
                raise KeyError(f"sample {seq} is not in the cache at {self.path}")
            return records.read_info(record)

    def seq_of(self, key: str) -> int | None:
        """The sequence number under which ``key`` is cached, or None."""
        with self.env.read() as txn:
            raw = txn.get(index_key(key.encode("utf-8")), db=self.env.dbs[DB_KEYS])
            return None if raw is None else unpack_u64(raw)

    def counters(self) -> Counters:
        """The cache's counters: samples and bytes stored, inserted, evicted, quarantined."""
        with self.env.read() as txn:
            counters = Counters.load(txn, self.env.dbs[DB_META])
        counters.sources = None  # read lazily in its transaction: see source_stats()
        return counters

    # -- snapshots and leases ---------------------------------------------------------------

    def snapshot(self, epoch: int | None = None, label: str = "", *,
                 plan_parts: int = 0) -> Snapshot:
        """Freeze the newest samples that fit the capacity under a lease, which protects
        them from eviction until [`Snapshot.release`][epochcache.Snapshot.release] (a context
        manager).

        The snapshot's samples stay readable, unchanged, until it is released, however much
        is written meanwhile (invariant 1). With ``plan_parts`` (the loaders' own), its
        readers will release what they have read before that, progressively, through a plan
        of that many parts (`reads.write_part`; until every part is written the whole
        snapshot is protected).
        """
        name = label or (f"epoch {epoch}" if epoch is not None else "snapshot")
        limit = self.effective_capacity  # outside the write transaction: it may read the cache

        def run(txn: lmdb.Transaction, owner: str) -> tuple[np.ndarray, str]:
            return take_snapshot(self, txn, name, limit, owner=owner, plan_parts=plan_parts)

        seqs, lease_id = hold_lease(self, run, lambda taken: taken[1])
        return Snapshot(self, seqs, lease_id, epoch)

    def leases(self) -> list[Lease]:
        """The leases held now: each snapshot's range, owner and heartbeat."""
        with self.env.read() as txn:
            return read_leases(txn, self.env.dbs[DB_LEASES])

    def release_lease(self, lease_id: str, *, finished: bool = True,
                      reason: str = "") -> bool:
        """This process is done with the lease: delete it; whether it was there.

        ``finished=False`` says its epoch was abandoned before its end (a stop, an error, the
        process exiting): a lease a checkpoint named (`keep_for_resume`) is then *left*
        for the resumed run instead -- no longer refreshed nor held by this process, kept
        ``resume_grace_s`` past its last heartbeat -- as if its owner had been killed
        (invariant 10: every stop is a resume point). ``reason`` is recorded for a resume that
        finds it gone (`end_reason`).
        """
        ours = heartbeats().remove(self.path, lease_id)
        pid = os.getpid()

        def run(txn: lmdb.Transaction) -> tuple[bool, bool]:
            raw = txn.get(lease_id.encode(), db=self.env.dbs[DB_LEASES])
            if raw is None:
                return False, False
            lease = Lease.from_bytes(raw)
            if not finished and lease.resume_grace_s > 0:
                # Held by no process from now on (pid 0 is never alive), so the grace runs
                # from the stop, whether or not this process lives on.
                lease.owner, lease.pid, lease.start_ticks = "", 0, None
                lease.heartbeat_ns = time.time_ns()
                write_lease(txn, self.env.dbs[DB_LEASES], lease)
                return True, False
            delete_lease(txn, self.env.dbs[DB_LEASES], lease_id)
            record_reads(txn, self.env.dbs, self.path, lease_id)  # before its plan goes
            note_end(txn, self.env.dbs[DB_STATE], lease_id, reason or (
                f"released by its owner (pid {pid}) "
                + ("at the end of its epoch" if finished else
                   "when it stopped, before any checkpoint named the lease")))
            return True, True

        existed, deleted = self.env.write(run)
        if deleted:
            remove_plan(self.path, lease_id)  # a lease left for a resume keeps its plan
        elif existed:
            log.info("%s: lease %s left for a resume (cache.resume_grace_s)", self.path,
                     lease_id[:8])
        if ours:
            end_lease(self.path)  # after the lease is gone: it is never judged by a lost lock
        return existed

    def keep_for_resume(self, lease_id: str, grace_s: float) -> bool:
        """A checkpoint names this lease: if its owner dies, keep it ``grace_s`` seconds past
        its last heartbeat for a resumed run to adopt (0: reclaim it as soon as it is dead).
        Returns False if the lease is gone."""
        db = self.env.dbs[DB_LEASES]

        def run(txn: lmdb.Transaction) -> bool:
            raw = txn.get(lease_id.encode(), db=db)
            if raw is None:
                return False
            lease = Lease.from_bytes(raw)
            if lease.resume_grace_s != grace_s:
                lease.resume_grace_s = grace_s
                write_lease(txn, db, lease)
            return True

        return self.env.write(run)

    # -- side tables and reporting ----------------------------------------------------------

    def quarantined(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest quarantine rows (key, reason, time, ...), oldest first."""
        return self.tables.quarantined(limit)

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Stats history rows (what ``status`` rates and ``plot`` are drawn from), oldest first."""
        return self.tables.history(limit)

    # -- lifecycle --------------------------------------------------------------------------

    def file_bytes(self) -> int:
        """The size of the LMDB data file on disk."""
        return self.env.file_bytes()

    def close(self) -> None:
        """Close the cache in this process (its snapshots' leases go with it)."""
        self.capacity.close()
        self.env.close()

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, capacity={format_size(self.capacity_bytes)!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Pickle as a path and the settings: the receiving process opens its own environment,
        # read-only if this one is, with the same sync, lease timeout and compression.
        return {"path": self.path, **self._settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        settings = dict(state)
        self.__init__(settings.pop("path"), **settings)  # type: ignore[misc]


def take_snapshot(store: SampleStore, txn: lmdb.Transaction, label: str, limit: int, *,
                  owner: str = "", pid: int | None = None,
                  plan_parts: int = 0) -> tuple[np.ndarray, str]:
    """In ``txn``: select the newest samples that fit ``limit`` bytes (the effective
    capacity, read before the transaction) and write their lease, held by ``owner`` (this
    process's owner lock, see `begin_lease`) or else by ``pid`` on this host
    (default: this process); returns ``(seqs, lease_id)``. The caller owns the release.
    With ``plan_parts``, the snapshot's samples are saved for its release plan."""
    store.writer.reclaim(txn)
    counters = Counters.load(txn, store.env.dbs[DB_META])
    seqs = select_snapshot(txn, store.env.dbs[DB_SAMPLES], counters, limit)
    lo = int(seqs[0]) if len(seqs) else counters.next_seq
    hi = int(seqs[-1]) + 1 if len(seqs) else counters.next_seq
    lease = Lease.new(lo, hi, len(seqs), label=label, owner=owner,
                      timeout_s=store.lease_timeout_s if owner else 0.0, pid=pid,
                      plan_parts=plan_parts if len(seqs) else 0)
    if lease.plan_parts:
        write_seqs(store.path, lease.lease_id, seqs)  # before the lease names it
    write_lease(txn, store.env.dbs[DB_LEASES], lease)
    return seqs, lease.lease_id


def _seq(value: object, method: str) -> int:
    """``value`` as a sequence number, or a TypeError saying what ``cache.<method>`` takes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    wanted = "a key (str) or a sequence number (int)" if method == "get" else \
        "a sequence number (int)"
    raise TypeError(f"cache.{method}: expected {wanted}, got {type(value).__name__} {value!r}"
                    + ("; cache.get takes a key too, and cache.seq_of(key) gives its sequence "
                       "number" if isinstance(value, str) else ""))
