"""Resuming an interrupted epoch: its snapshot adopted, its order continued where it stopped.

A run that checkpoints mid-epoch saves :meth:`EpochLoader.state_dict`: the epoch, its lease, and
how far along this rank's lane (the epoch's order on this rank) the loop had trained. Its lease
outlives the dead run for ``cache.resume_grace_s`` (see :meth:`SampleStore.keep_for_resume`);
the resumed run adopts it, rebuilds the same order from the snapshot saved with the plan (or
from the lease's range), and reads the samples after that position. The run released only what
its checkpoints covered, so nothing after the position was evicted; anything that is gone
anyway (a lease reclaimed and taken again, a repaired cache) is skipped and counted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..store import Snapshot
from ..store.schema import DB_SAMPLES, seq_key

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)


def resumed_snapshot(cache: SampleStore, state: dict[str, Any], epoch: int) -> Snapshot | None:
    """Adopt the lease of the interrupted epoch in ``state`` and return its snapshot, or None
    (logged) when the lease is gone."""
    lease_id = str(state["lease"])
    lease = cache.adopt_lease(lease_id)
    if lease is None:
        log.warning("epoch %d cannot continue where the checkpoint left it: its lease %s is "
                    "gone (%s); the epoch starts afresh on a new snapshot", epoch, lease_id[:8],
                    lease_gone_reason(cache, lease_id))
        return None
    seqs = cache.snapshot_seqs(lease_id, lease.lo, lease.hi, lease.count)
    return Snapshot(cache, np.array(seqs, dtype=np.uint64), lease_id, epoch)


def lease_gone_reason(cache: SampleStore, lease_id: str) -> str:
    """Why a resumed epoch's lease is gone, as the cache recorded it when it ended."""
    return cache.lease_end(lease_id) or (
        "no record of its end: the cache was replaced, copied or repaired since, or the lease "
        "ended long ago")


def remaining_after(cache: SampleStore, lane: np.ndarray, position: int,
                    epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples of ``lane`` after ``position`` that are still cached, and for each its
    position in the lane (what releasing and later checkpoints count in)."""
    rest = np.asarray(lane[position:], dtype=np.uint64)
    db = cache.dbs[DB_SAMPLES]
    with cache.store.read() as txn:
        get = txn.get
        present = np.fromiter((get(seq_key(int(seq)), None, db) is not None for seq in rest),
                              dtype=bool, count=len(rest))
    missing = len(rest) - int(present.sum())
    log.info("epoch %d resumes after sample %d of %d on this rank", epoch, position, len(lane))
    if missing:
        log.warning("epoch %d: %d samples of the interrupted epoch were evicted before the "
                    "resume and are skipped", epoch, missing)
    return rest[present], position + np.flatnonzero(present)
