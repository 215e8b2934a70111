"""The public [`Cache`][epochcache.Cache]: a cache directory as users hold it.

It holds the store layer's `SampleStore` (the LMDB environment, the
limits, the write path, leases, snapshots) and shows users what they call: put and read
samples, take snapshots, read the counters and the coverage, copy the cache, and the
training side, ``dataset()``, ``epochs()`` and ``stream()``, which import the data layer (and
torch) only when called, so ``import epochcache`` and sampler processes stay free of torch.

What the library's own layers call on a cache (taking a snapshot inside a transaction,
writing release-plan parts, heartbeats, side tables) is the store's, not this class's: it is
no part of the public surface and may change between releases. Code that needs it (tests,
tools) reaches it through `epochcache.store.store_of`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .options import ReaderOptions
from .store import PutResult, SampleStore, Snapshot
from .store.leases import DEFAULT_LEASE_TIMEOUT_S

if TYPE_CHECKING:
    from .data.dataset import EpochDataset
    from .data.epoch_loader import EpochLoader
    from .data.stream import CacheStream
    from .store.codec import RecordInfo, Value
    from .store.counters import Counters
    from .store.eviction import Eviction
    from .store.leases import Lease


class Cache:
    """A local sample cache bounded by ``capacity`` bytes, evicting its oldest samples first.

    Opening is cheap and safe in any process, DataLoader workers included; pickled, a cache
    travels as its path and settings and reopens on the other side.

    Args:
        path: the cache directory (created private to the user).
        capacity: stored bytes to keep, e.g. ``"200GiB"`` or ``10**9``. Required when creating
            a cache; when opening an existing one, None keeps its stored capacity. A different
            capacity (or headroom) replaces the stored one only when no other process has the
            cache open for writing; otherwise the stored limits are kept, with a warning.
        headroom: extra bytes writers may use while leases pin the oldest samples: a fraction
            of capacity (default 0.1) or a size. At capacity + headroom writers wait.
        compression: ``"zstd"`` or ``"none"``; incompressible samples are stored raw anyway.
        level: the zstd level.
        sync: fsync each commit (survives power loss as well as process crashes).
        readonly: open for reading only.
        max_map_size: cap on the LMDB map (defaults to a bound derived from capacity).
        lease_timeout_s: a lease owner whose liveness cannot be tested is presumed dead after
            this long without a heartbeat.
        eviction: what eviction takes first, by policy name: ``"oldest"`` (the default) or
            another registered one (`epochcache.registry`). It is stored in the cache, so
            every process evicts alike: None keeps the stored one (a new cache gets
            ``"oldest"``); a different one replaces it only when no other process has the
            cache open for writing, as capacity does.

    Raises:
        CacheError: the directory holds no cache and no capacity was given, or it cannot be
            opened.
        ValueError: ``eviction`` names no registered policy (the message lists them).
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
        self._store = SampleStore(path, capacity, headroom=headroom, compression=compression,
                                  level=level, sync=sync, readonly=readonly,
                                  max_map_size=max_map_size, lease_timeout_s=lease_timeout_s,
                                  eviction=eviction)

    # -- the cache ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The cache directory (resolved)."""
        return self._store.path

    @property
    def capacity_bytes(self) -> int:
        """Stored bytes the cache keeps to (eviction makes room past it)."""
        return self._store.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        """What writers may store beyond the capacity while leases pin the oldest samples."""
        return self._store.headroom_bytes

    @property
    def eviction(self) -> str:
        """The cache's eviction policy, by name (stored in the cache)."""
        return self._store.eviction

    @property
    def effective_capacity(self) -> int:
        """The capacity in force: lower than `capacity_bytes` while a full disk (or
        LMDB map) holds writers back."""
        return self._store.effective_capacity

    def stats(self) -> dict[str, Any]:
        """Counters, capacity, leases, daemon and sampler health, requests and turnover, as a
        JSON-able dict (what ``epochcache status --json`` prints)."""
        from .status import stats_with_coverage

        return stats_with_coverage(self._store)

    def counters(self) -> Counters:
        """The cache's counters: samples and bytes stored, inserted, evicted, quarantined."""
        return self._store.counters()

    def coverage(self) -> dict[str, Any]:
        """How much of each source training has seen: per source the samples listed, those
        trained at least once, a histogram of epochs per sample, the growth rate and the time
        to see every sample once (see `epochcache.coverage.report`)."""
        from .coverage.report import coverage

        return coverage(self._store)

    def record_trained(self, seqs: Sequence[int] | np.ndarray, *, epoch: int | None = None,
                       job: str = "") -> dict[str, Any]:
        """Count ``seqs`` as trained in one more epoch (once each) in the coverage ledger of
        their sources; call it when an epoch, or the part of one a checkpoint covers, is done
        (``epochcache run`` does). Returns ``{"trained", "new", "unattributed"}``."""
        from .coverage.ledger import record_trained

        return record_trained(self._store, np.asarray(seqs, dtype=np.uint64), epoch=epoch,
                              job=job)

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Stats history rows (what ``status`` rates and ``plot`` are drawn from), oldest
        first."""
        return self._store.history(limit)

    def quarantined(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest quarantine rows (key, reason, time, ...), oldest first."""
        return self._store.quarantined(limit)

    def file_bytes(self) -> int:
        """The size of the LMDB data file on disk."""
        return self._store.file_bytes()

    def copy_to(self, dst: str | os.PathLike[str]) -> dict[str, Any]:
        """Make a consistent, compacted copy of this cache in ``dst`` (new or empty), while
        its daemon and trainers go on: samples, limits, listings and coverage are kept;
        leases, plans and daemon state left behind (see `epochcache.store.copy_cache`).
        Returns what was copied (``samples``, ``bytes``, ``file_bytes``, ``seconds``, ...).

        Raises:
            CacheError: ``dst`` exists and is not an empty directory.
        """
        from .store.copy_cache import copy_cache

        return copy_cache(self._store, dst)

    # -- samples -----------------------------------------------------------------------------

    def put(self, key: str, value: Value, **kwargs: Any) -> PutResult:
        """Store one sample (see `put_many`)."""
        return self._store.put(key, value, **kwargs)

    def put_many(self, items: Iterable[tuple[str, Value]], *, wait: bool = True,
                 timeout_s: float | None = None) -> PutResult:
        """Store samples; samples whose key is already cached are skipped.

        Eviction makes room, oldest first. When leases pin too much to stay within capacity +
        headroom, the call waits (back-pressure) until space returns or ``timeout_s`` passes;
        with ``wait=False`` it raises [`CacheFull`][epochcache.CacheFull] at once. When the call
        returns, every sample is committed.

        Args:
            items: ``(key, value)`` pairs; a value is ``bytes`` or a dict of fields
                (``{"jpg": ..., "cls": ...}``).

        Raises:
            CacheFull: no room and ``wait`` is False, or the timeout passed (``.result`` says
                what was committed).
            SampleTooLarge: a sample could never fit the capacity.
            SampleRejected: a sample can never be stored otherwise.
        """
        return self._store.put_many(items, wait=wait, timeout_s=timeout_s)

    def __len__(self) -> int:
        """The samples cached now."""
        return len(self._store)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached."""
        return key in self._store

    def get(self, key: str | int) -> bytes | dict[str, bytes]:
        """The value of a sample (bytes, or a dict of fields), by its key, as ``key in cache``
        takes it, or by its sequence number (an int: [`seq_of`][epochcache.Cache.seq_of],
        a loader's ``seqs``).

        Raises:
            KeyError: no such sample (never stored, or evicted).
            TypeError: ``key`` is neither a key (str) nor a sequence number (int).
        """
        if isinstance(key, str):
            seq = self._store.seq_of(key)
            if seq is None:
                raise KeyError(f"{key!r}: not cached (never stored, or evicted)")
            return self._store.get(seq)
        return self._store.get(_seq(key, "get"))

    def get_many(self, seqs: Sequence[int] | np.ndarray) -> list[bytes | dict[str, bytes]]:
        """Values of several samples by sequence number, read in one transaction.

        Raises:
            KeyError: one of them is not cached.
            TypeError: one is not a sequence number (``cache.seq_of(key)`` gives a key's).
        """
        if not isinstance(seqs, np.ndarray):
            seqs = [_seq(seq, "get_many") for seq in seqs]
        return self._store.get_many(seqs)

    def seq_of(self, key: str) -> int | None:
        """The sequence number under which ``key`` is cached, or None."""
        return self._store.seq_of(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``key in cache`` for each key, in one read transaction."""
        return self._store.contains_many(keys)

    def info(self, seq: int) -> RecordInfo:
        """How sample ``seq`` is stored: its key, sizes, codec, checksum, time added."""
        return self._store.info(seq)

    def evict(self, limit_bytes: int | None = None) -> Eviction:
        """Evict the oldest samples no lease protects until at most ``limit_bytes`` (default:
        the capacity) remain."""
        return self._store.evict(limit_bytes)

    # -- snapshots and leases ----------------------------------------------------------------

    def snapshot(self, epoch: int | None = None, label: str = "") -> Snapshot:
        """Freeze the newest samples that fit the capacity under a lease, which protects
        them from eviction until [`Snapshot.release`][epochcache.Snapshot.release] (a context manager)."""
        return self._store.snapshot(epoch, label)

    def leases(self) -> list[Lease]:
        """The leases held now: each snapshot's range, owner and heartbeat."""
        return self._store.leases()

    def keep_for_resume(self, lease_id: str, grace_s: float) -> bool:
        """A checkpoint names this lease: if its owner stops or dies before the epoch ends,
        keep it ``grace_s`` seconds for a resumed run to adopt. Returns False if it is gone."""
        return self._store.keep_for_resume(lease_id, grace_s)

    def release_lease(self, lease_id: str) -> bool:
        """Release a lease this process holds; whether it was there."""
        return self._store.release_lease(lease_id)

    # -- training ----------------------------------------------------------------------------

    def dataset(self, epoch: int = 0, *, options: ReaderOptions | None = None,
                **reader: Any) -> EpochDataset:
        """A map-style Dataset over a fresh snapshot, which it holds until closed (a context
        manager); see [`EpochDataset`][epochcache.data.dataset.EpochDataset].

        Args:
            epoch: the epoch the snapshot is taken for.
            options: how samples are read ([`ReaderOptions`][epochcache.ReaderOptions]);
                ``**reader`` (its attribute names) overrides it.
        """
        from .data.dataset import EpochDataset

        return EpochDataset.from_cache(self._store, epoch=epoch, options=options, **reader)

    # stream() and epochs() forward their keywords as they are: the signatures (and each
    # default, from epochcache.options) are written once, where the work is done.

    def stream(self, **kwargs: Any) -> CacheStream:
        """A torch IterableDataset taking a fresh snapshot per epoch, for your own DataLoader
        (Lightning, Hugging Face, accelerate); see [`CacheStream`][epochcache.data.stream.CacheStream]
        for the arguments (``seed=``, ``shuffle=``, ``samples_per_epoch=``, ``split_ranks=``,
        ``release=``, ``resume_grace_s=``, ``options=`` and reader options by name)."""
        from .data.stream import CacheStream

        return CacheStream(self._store, **kwargs)

    def epochs(self, num_epochs: int, **kwargs: Any) -> Iterator[tuple[int, EpochLoader]]:
        """Yield ``(epoch, loader)`` for ``num_epochs`` epochs, each over a fresh snapshot,
        the next epoch's loader prepared while this one trains; see
        [`epochs`][epochcache.data.epochs.epochs] for the arguments (``batch_size=``,
        ``num_workers=``, ``seed=``, ``shuffle=``, ``resume=``, ...). ``**kwargs``: those,
        reader options by name (``fields=``, ``transform=``, ...) and DataLoader arguments."""
        from .data.epochs import epochs

        return epochs(self._store, num_epochs, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the cache in this process (its snapshots' leases go with it)."""
        self._store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._store).replace("SampleStore(", "Cache(", 1)

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self._store}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._store = state["store"]


def _seq(value: object, method: str) -> int:
    """``value`` as a sequence number, or a TypeError saying what ``cache.<method>`` takes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    wanted = "a key (str) or a sequence number (int)" if method == "get" else \
        "a sequence number (int)"
    raise TypeError(f"cache.{method}: expected {wanted}, got {type(value).__name__} {value!r}"
                    + ("; cache.get takes a key too, and cache.seq_of(key) gives its sequence "
                       "number" if isinstance(value, str) else ""))
