"""The public [`Cache`][epochcache.Cache]: a cache directory as users hold it.

A `Cache` is the store layer's `SampleStore` (put and read samples, take snapshots, leases,
counters, limits: written and documented once, there) plus what needs the layers above the
store: the counters with the coverage and health (``stats``), the coverage ledger, copying a
cache, and the training side, ``dataset()``, ``epochs()`` and ``stream()``, which import the
data layer (and torch) only when called, so ``import epochcache`` and sampler processes stay
free of torch.

What the library's own layers call on a store (adopting a lease, a snapshot's sequence
numbers, per-source counters, the run history) are functions of `epochcache.store.plumbing`
over a store (release plans are `epochcache.store.reads` functions over its path), and its parts (``env``, ``tables``, ``capacity``, ``writer``) are attributes:
no part of the public surface, they may change between releases.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .options import ReaderOptions
from .store import SampleStore

if TYPE_CHECKING:
    from .data.dataset import EpochDataset
    from .data.epoch_loader import EpochLoader
    from .data.stream import CacheStream


class Cache(SampleStore):
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

    # -- the cache ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, capacity, leases, daemon and sampler health, requests and turnover, as a
        JSON-able dict (what ``epochcache status --json`` prints)."""
        from .status import stats_with_coverage

        return stats_with_coverage(self)

    def coverage(self) -> dict[str, Any]:
        """How much of each source training has seen: per source the samples listed, those
        trained at least once, a histogram of epochs per sample, the growth rate and the time
        to see every sample once (see `epochcache.coverage`)."""
        from .coverage import coverage

        return coverage(self)

    def record_trained(self, seqs: Sequence[int] | np.ndarray, *, epoch: int | None = None,
                       job: str = "") -> dict[str, Any]:
        """Count ``seqs`` as trained in one more epoch (once each) in the coverage ledger of
        their sources; call it when an epoch, or the part of one a checkpoint covers, is done
        (``epochcache run`` does). Returns ``{"trained", "new", "unattributed"}``."""
        from .coverage.ledger import record_trained

        return record_trained(self, np.asarray(seqs, dtype=np.uint64), epoch=epoch,
                              job=job)

    def copy_to(self, dst: str | os.PathLike[str]) -> dict[str, Any]:
        """Make a consistent, compacted copy of this cache in ``dst`` (new or empty), while
        its daemon and trainers go on: samples, limits, listings and coverage are kept;
        leases, plans and daemon state left behind (see `epochcache.store.copy_cache`).
        Returns what was copied (``samples``, ``bytes``, ``file_bytes``, ``seconds``, ...).

        Raises:
            CacheError: ``dst`` exists and is not an empty directory.
        """
        from .store.copy_cache import copy_cache

        return copy_cache(self, dst)

    # -- training ----------------------------------------------------------------------------

    def dataset(self, epoch: int = 0, *, options: ReaderOptions | None = None,
                **reader: Any) -> EpochDataset:
        """A map-style Dataset over a fresh snapshot, which it holds until closed (a context
        manager); see [`EpochDataset`][epochcache.data.dataset.EpochDataset].

        Args:
            epoch: the epoch the snapshot is taken for (its lease's label).
            options: how samples are read ([`ReaderOptions`][epochcache.ReaderOptions]);
                ``**reader`` (its attribute names: ``fields=("jpg;png", "cls")``,
                ``image="torch"``, ``transform=...``) overrides it.

        Raises:
            ValueError: an invalid option (the message names it).
            TypeError: a keyword that is no reader option.
        """
        from .data.dataset import EpochDataset

        return EpochDataset.from_cache(self, epoch=epoch, options=options, **reader)

    # stream() and epochs() forward their keywords as they are: the signatures (and each
    # default, from epochcache.options) are written once, where the work is done.

    def stream(self, **kwargs: Any) -> CacheStream:
        """A torch IterableDataset taking a fresh snapshot per epoch, for your own DataLoader
        (Lightning, Hugging Face, accelerate); see [`CacheStream`][epochcache.data.stream.CacheStream]
        for the arguments (``seed=``, ``shuffle=``, ``samples_per_epoch=``, ``split_ranks=``,
        ``release=``, ``resume_grace_s=``, ``options=`` and reader options by name)."""
        from .data.stream import CacheStream

        return CacheStream(self, **kwargs)

    def epochs(self, num_epochs: int, **kwargs: Any) -> Iterator[tuple[int, EpochLoader]]:
        """Yield ``(epoch, loader)`` for ``num_epochs`` epochs, each over a fresh snapshot,
        the next epoch's loader prepared while this one trains; see
        [`epochs`][epochcache.data.epochs.epochs] for the arguments (``batch_size=``,
        ``num_workers=``, ``seed=``, ``shuffle=``, ``resume=``, ...). ``**kwargs``: those,
        reader options by name (``fields=``, ``transform=``, ...) and DataLoader arguments."""
        from .data.epochs import epochs

        return epochs(self, num_epochs, **kwargs)
