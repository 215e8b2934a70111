"""EpochDataset: a map-style torch Dataset over one epoch's snapshot of the cache.

Invariant 7: the dataset's index is the snapshot's ``uint64`` array (8 bytes per sample, no
Python object per sample), so forked workers do not copy it page by page through refcounts. The
dataset pickles as its `SampleReader` (the cache path and the
decoding options) and that array -- never an LMDB handle or the lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ..errors import SnapshotClosed
from ..options import ReaderOptions, resolve_options
from ..store import SampleStore, Snapshot
from .reader import SampleReader


def snapshot_gone(reader: SampleReader, lease_id: str, epoch: int | None,
                  error: KeyError) -> SnapshotClosed:
    """What a read that found a snapshot sample gone raises, naming the epoch: the lease no
    longer exists (released, or reclaimed by a process that took its owner for dead), or,
    with the lease still there (or unknown to this rank), the cache lost the sample."""
    if not lease_id or any(lease.lease_id == lease_id for lease in reader.cache.leases()):
        return SnapshotClosed(
            f"{reader.path}: a sample of the snapshot of epoch {epoch} is gone "
            f"({error.args[0] if error.args else error}) although "
            + ("its lease is held" if lease_id else "the node's leader holds its lease")
            + ": was the lease reclaimed and a new one taken, or the cache repaired? Run "
            "`epochcache verify` and take a new snapshot (a new dataset or epoch)")
    return SnapshotClosed(
        f"{reader.path}: the snapshot of epoch {epoch} lost its lease {lease_id[:8]} and its "
        f"samples are being evicted ({error.args[0] if error.args else error}): the lease was "
        "released, or reclaimed by another process that judged its owner dead (owner lock "
        "not held and no heartbeat within the lease timeout: a frozen or killed owner, or a "
        "cache shared across machines); take a new snapshot (a new dataset or epoch)")


class EpochDataset(Dataset[Any]):
    """Map-style Dataset over one epoch's snapshot: ``ds[i]`` is the i-th snapshot sample.

    Made by [`Cache.dataset`][epochcache.Cache.dataset] (see [`from_cache`][epochcache.data.dataset.EpochDataset.from_cache]). Use it as a context manager, or call
    [`close`][epochcache.data.dataset.EpochDataset.close], to release the snapshot's lease. Only the process that took the snapshot
    holds the lease; copies pickled into DataLoader workers read under it.

    Args:
        reader: reads and decodes samples.
        seqs: the snapshot's sequence numbers.
        epoch: the epoch number (for messages).
        snapshot: the lease-holding snapshot, released by [`close`][epochcache.data.dataset.EpochDataset.close].
    """

    def __init__(self, reader: SampleReader, seqs: np.ndarray, epoch: int | None = None,
                 snapshot: Snapshot | None = None, lease_id: str = "") -> None:
        self.reader = reader
        self.seqs = np.ascontiguousarray(seqs, dtype=np.uint64)
        self.epoch = epoch
        self._snapshot = snapshot
        # The lease that protects these samples (held here or by the node's leader): a read
        # that finds a sample gone says so, naming it, when the lease no longer exists.
        self.lease_id = snapshot.lease_id if snapshot is not None else lease_id
        #: Whether the epoch was read to its end: an unfinished one's lease is left for a
        #: resume when a checkpoint named it (see `close`). epochs() sets it.
        self.finished = True

    @classmethod
    def from_cache(
        cls,
        cache: SampleStore | Any,
        epoch: int = 0,
        *,
        snapshot: Snapshot | None = None,
        options: ReaderOptions | None = None,
        **reader: Any,
    ) -> EpochDataset:
        """Take a snapshot of ``cache`` (an [`epochcache.Cache`][epochcache.Cache] or its store)
        under a lease, or adopt ``snapshot``, one taken already, and wrap it: the other
        arguments and errors are [`Cache.dataset`][epochcache.Cache.dataset]'s."""
        opts = resolve_options("cache.dataset()", options, reader, epoch=False)[0]
        reader_ = SampleReader(cache.path, opts)
        reader_.bind(cache)
        snap = snapshot if snapshot is not None else cache.snapshot(epoch=epoch)
        return cls(reader_, snap.seqs, epoch, snap)

    def __len__(self) -> int:
        return int(self.seqs.shape[0])

    def _check(self) -> None:
        if self._snapshot is not None and self._snapshot.released:
            raise SnapshotClosed(f"dataset of epoch {self.epoch} was closed (its lease released); "
                                 "make a new one with cache.dataset(epoch)")

    def _seqs_at(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"indices out of range for a dataset of {len(self)} samples")
        return self.seqs[idx]

    def __getitem__(self, index: int) -> Any:
        """The decoded sample (None if it was skipped under ``on_error='skip'``).

        Raises:
            SnapshotClosed: the dataset was closed, or its lease was reclaimed and the sample
                evicted (the message names the lease).
        """
        snapshot = self._snapshot
        if snapshot is not None and snapshot.released:
            self._check()
        try:
            return self.reader.read(self.seqs.item(index))  # IndexError when out of range
        except KeyError as exc:
            raise snapshot_gone(self.reader, self.lease_id, self.epoch, exc) from exc

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Many samples in one read transaction (DataLoader's batched fetch)."""
        self._check()
        try:
            return self.reader.read_samples(self._seqs_at(indices))
        except KeyError as exc:
            raise snapshot_gone(self.reader, self.lease_id, self.epoch, exc) from exc

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        """A collated batch, decoded straight into one tensor when samples are fixed-shape."""
        self._check()
        try:
            return self.reader.read_batch(self._seqs_at(indices))
        except KeyError as exc:
            raise snapshot_gone(self.reader, self.lease_id, self.epoch, exc) from exc

    def key(self, index: int) -> str:
        """The source key of sample ``index``."""
        return self.reader.cache.info(int(self.seqs[index])).key

    @property
    def skipped(self) -> int:
        return self.reader.skipped

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def close(self) -> None:
        """Release the snapshot's lease (in the process that took it). Idempotent. The lease
        of an epoch not read to its end (`finished`) that a checkpoint named is left
        for its resume instead (`SampleStore.release_lease`)."""
        if self._snapshot is not None:
            self._snapshot.release(finished=self.finished)

    def __enter__(self) -> EpochDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # The lease stays with the process that took it; copies only read.
        return {"reader": self.reader, "seqs": self.seqs, "epoch": self.epoch, "_snapshot": None,
                "lease_id": self.lease_id}

    def __repr__(self) -> str:
        return (f"EpochDataset(epoch={self.epoch}, samples={len(self)}, cache={self.reader.path!r},"
                f" decode={self.reader.decode!r})")
