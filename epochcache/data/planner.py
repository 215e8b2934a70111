"""Planning an epoch, for both loaders: the node's snapshot, this rank's order, the release plan.

``epochs()`` (`epochs`) and ``stream()`` (`stream`) plan an epoch the same way, and
do it here, once:

1. **The snapshot is the node's.** The node's leader (local rank 0) takes it under a lease
   whose release plan has one *part* per rank of the node (`Planner.parts`; none with
   ``release="epoch"``), and shares its sequence numbers with the node's other ranks
   (`Planner.share`: one collective under DDP).
2. **The order is the seed's.** The epoch's order is a seeded permutation of the snapshot
   (`epoch_order`): every rank and worker that computes it, or a resume that
   computes it again, gets the same one. Each rank reads its disjoint slot of it
   (`Planner.rank_order`).
3. **What a rank reads is its part of the release plan.** Its lanes (the rank's loop, or each
   DataLoader worker of a stream) go into the part that rank owns
   (`write_release_part`), so eviction may take each sample once every lane that reads
   it is past it. A disk that cannot hold the plan leaves the snapshot protected whole.

What differs stays with each loader: ``epochs()`` agrees a batch count across ranks (and
resumes by node, `resume`), a stream agrees a sample count and publishes the epoch to
its DataLoader workers as a ticket (`epochcache.data.tickets`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..placement import Placement
from ..store.plans import Releaser
from ..store.plumbing import write_plan_part
from .schedule import epoch_order

if TYPE_CHECKING:
    from ..options import EpochOptions
    from ..store import SampleStore, Snapshot
    from .distributed import NodeSync

log = logging.getLogger(__name__)

#: ``take()`` of `Planner.share`: the snapshot's sequence numbers and lease id.
Take = Callable[[], "tuple[np.ndarray, str]"]


class Planner:
    """Plans the epochs of one loader on one rank (see the module docstring).

    Args:
        cache: the cache the loader reads.
        place: this rank's place in the job.
        sync: the node's collectives under DDP (None: this rank plans alone).
        options: the epoch order's and release's (seed, shuffle, samples_per_epoch, release).
        split_ranks: each rank of the node reads its own slot of the order (False: every
            rank reads all of it, for frameworks that split the data themselves).
    """

    def __init__(self, cache: SampleStore, place: Placement, sync: NodeSync | None,
                 options: EpochOptions, *, split_ranks: bool = True) -> None:
        self.cache, self.place, self.sync = cache, place, sync
        self.seed, self.shuffle = options.seed, bool(options.shuffle)
        self.samples_per_epoch, self.progressive = options.samples_per_epoch, options.progressive
        self.split_ranks = split_ranks

    @property
    def distributed(self) -> bool:
        return self.sync is not None

    @property
    def parts(self) -> int:
        """The parts of an epoch's release plan: one per rank of the node (0: no plan)."""
        if not self.progressive:
            return 0
        return self.place.local_world_size if self.distributed else 1

    @property
    def part(self) -> int:
        """The part of the release plan this rank writes."""
        return self.place.local_rank if self.distributed else 0

    @property
    def slot(self) -> tuple[int, int]:
        """``(slot, slots)``: which slice of the node's order this rank reads."""
        if self.split_ranks:
            return self.place.local_rank, self.place.local_world_size
        return 0, 1

    def snapshot(self, epoch: int, label: str) -> tuple[np.ndarray, str, Snapshot]:
        """Take the epoch's snapshot here (the node's leader): ``(seqs, lease_id, snapshot)``,
        under a lease whose release plan has `parts` parts."""
        snapshot = self.cache.snapshot(epoch=epoch, label=label, plan_parts=self.parts)
        return snapshot.seqs, snapshot.lease_id, snapshot

    def share(self, take: Take) -> tuple[np.ndarray, str]:
        """The node's snapshot: ``take()`` on the leader, shared with the node's ranks (one
        collective under DDP; every rank calls it together)."""
        if self.sync is None:
            return take()
        return self.sync.share_seqs(take if self.place.local_rank == 0 else None)

    def order(self, seqs: np.ndarray, epoch: int) -> np.ndarray:
        """The node's order of the epoch: the seeded permutation of its snapshot (the same on
        every process that computes it, a resume included)."""
        return epoch_order(seqs, epoch, self.seed, self.shuffle, self.samples_per_epoch)

    def split(self, order: np.ndarray) -> np.ndarray:
        """This rank's disjoint slot of the node's order (a strided view, no copy)."""
        slot, slots = self.slot
        return order if slots <= 1 else order[slot::slots]

    def rank_order(self, seqs: np.ndarray, epoch: int, samples: int = -1) -> np.ndarray:
        """This rank's order of the epoch, cut to ``samples`` (all when negative)."""
        return rank_order(seqs, epoch, self.seed, self.shuffle, self.samples_per_epoch,
                          *self.slot, samples)

    def release_part(self, lease_id: str, lanes: Sequence[np.ndarray],
                     lane: int = 0) -> Releaser | None:
        """Write this rank's part of the release plan (see `write_release_part`); None
        without release plans."""
        if not self.progressive:
            return None
        return write_release_part(self.cache, lease_id, self.part, lanes, lane)


def rank_order(seqs: np.ndarray, epoch: int, seed: int, shuffle: bool,
               samples_per_epoch: int | None, slot: int = 0, slots: int = 1,
               samples: int = -1) -> np.ndarray:
    """The epoch's seeded order over a snapshot, the ``slot`` of ``slots`` of it, cut to
    ``samples`` (all when negative)."""
    order = epoch_order(seqs, epoch, seed, shuffle, samples_per_epoch)
    if slots > 1:
        order = order[slot::slots]
    return order if samples < 0 else order[:samples]


def write_release_part(cache: SampleStore, lease_id: str, part: int,
                       lanes: Sequence[np.ndarray], lane: int = 0) -> Releaser | None:
    """Write ``part`` of a lease's release plan: the ``lanes`` its readers read, in order
    (the first reader to get here writes it; the lanes are the same for all), and return the
    releaser of ``lane``. None when there is nothing to plan, or when the disk cannot hold the
    plan (full or read-only): the snapshot then stays protected whole until it ends."""
    if not lease_id or not any(len(one) for one in lanes):
        return None
    try:
        write_plan_part(cache, lease_id, part, list(lanes))
    except OSError as exc:
        log.warning("%s: could not write the epoch's release plan (%s): its samples stay "
                    "protected until it ends", cache.path, exc)
        return None
    return Releaser(cache.path, lease_id, part, lane)
