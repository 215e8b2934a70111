"""Resuming an interrupted epoch: its snapshot adopted, its order continued where it stopped.

A run that checkpoints mid-epoch saves [`EpochLoader.state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict]: the epoch, its lease, and
how far along this rank's lane (the epoch's order on this rank) the loop had trained. Its lease
outlives the dead run for ``cache.resume_grace_s`` (see `SampleStore.keep_for_resume`);
the resumed run adopts it, rebuilds the same order from the snapshot saved with the plan (or
from the lease's range), and reads the samples after that position. The run released only what
its checkpoints covered, so nothing after the position was evicted; anything that is gone
anyway (a lease reclaimed and taken again, a repaired cache) is skipped and counted.

Given every rank's states, the job may come back in another shape: each node's leader finds
the states whose lease its own cache holds (`adopt_node`), and its ranks read their part
of the node's rest (`epochcache.data.elastic`); what no node found is counted
(`log_resume`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..store import Snapshot
from ..store.records import DB_SAMPLES, seq_key
from ..units import format_count
from .elastic import NodeStates, RankLane, rank_lane
from .placement import Placement

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)


def resumed_snapshot(cache: SampleStore, state: dict[str, Any], epoch: int, *,
                     whole: bool = False, quiet: bool = False) -> Snapshot | None:
    """Adopt the lease of the interrupted epoch in ``state`` and return its snapshot, or None
    (logged unless ``quiet``) when the lease is gone. ``whole``: protect its whole range from
    now on (the rest is read by other lanes than its release plan's)."""
    lease_id = str(state["lease"])
    lease = cache.adopt_lease(lease_id, whole=whole)
    if lease is None:
        if not quiet:
            log.warning("epoch %d cannot continue where the checkpoint left it: its lease %s "
                        "is gone (%s); the epoch starts afresh on a new snapshot", epoch,
                        lease_id[:8], lease_gone_reason(cache, lease_id))
        return None
    seqs = cache.snapshot_seqs(lease_id, lease.lo, lease.hi, lease.count)
    return Snapshot(cache, np.array(seqs, dtype=np.uint64), lease_id, epoch)


def adopt_node(cache: SampleStore, groups: list[NodeStates], epoch: int,
               place: Placement) -> tuple[Snapshot | None, NodeStates | None]:
    """Find the node among ``groups`` whose epoch this cache holds, adopt its lease and return
    its snapshot and states; ``(None, None)`` when none is here (logged): a new or replaced
    node, or a lease gone (this cache recorded its end), starts the epoch afresh.

    Each node has its own cache, and only that cache holds its lease: the node is found by
    its lease, not by its GROUP_RANK, which a restarted job may number anew.
    """
    held = {lease.lease_id for lease in cache.leases()}
    # (One cache holding two nodes' leases: two simulated nodes on one directory. Its own
    # GROUP_RANK's first.)
    for group in sorted(groups, key=lambda g: g.node != place.node_rank):
        if group.lease and group.lease in held:
            whole = (group.local_world_size != place.local_world_size
                     or group.nested is not None)
            snapshot = resumed_snapshot(cache, {"lease": group.lease}, epoch, whole=whole,
                                        quiet=len(groups) > 1)
            if snapshot is not None:
                return snapshot, group
    ended = [group for group in groups if group.lease and cache.lease_end(group.lease)]
    if len(groups) == 1 or ended:
        lease_id = (ended or groups)[0].lease
        log.warning("epoch %d cannot continue where the checkpoint left it: its lease %s is "
                    "gone (%s); the epoch starts afresh on a new snapshot", epoch, lease_id[:8],
                    lease_gone_reason(cache, lease_id))
    else:
        log.warning("epoch %d: none of the %d nodes that ran it left its lease in %s (a new "
                    "or replaced node): this node starts the epoch on a fresh snapshot", epoch,
                    len(groups), cache.path)
    return None, None


def ended_lease(cache: SampleStore, groups: list[NodeStates]) -> str:
    """The lease of ``groups`` this cache recorded the end of ('' if none): that node's
    epoch is known here, though it cannot be continued."""
    return next((g.lease for g in groups if g.lease and cache.lease_end(g.lease)), "")


def lease_gone_reason(cache: SampleStore, lease_id: str) -> str:
    """Why a resumed epoch's lease is gone, as the cache recorded it when it ended."""
    return cache.lease_end(lease_id) or (
        "no record of its end: the cache was replaced, copied or repaired since, or the lease "
        "ended long ago")


@dataclass(frozen=True)
class Resumed:
    """What this rank reads of a resumed epoch: the samples of its lane after its position
    that are still cached (``rest``), each one's place in the lane (``offsets``: what
    releasing and later states count in), and how many were evicted (skipped)."""

    lane: RankLane
    rest: np.ndarray
    offsets: np.ndarray
    evicted: int


def resume_rank(cache: SampleStore, order: np.ndarray, group: NodeStates,
                place: Placement) -> Resumed:
    """This rank's part of its node's resumed epoch (see `rank_lane`)."""
    lane = rank_lane(order, group, place)
    rest, offsets = present_after(cache, lane.lane, lane.position)
    log.info("epoch %d resumes after sample %d of %d of this rank's lane%s", group.epoch,
             lane.position, len(lane.lane),
             f" (the rest of a node of {group.local_world_size} ranks, dealt anew)"
             if lane.regrouped else "")
    return Resumed(lane, rest, offsets, len(lane.lane) - lane.position - len(rest))


def present_after(cache: SampleStore, lane: np.ndarray,
                  position: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples of ``lane`` after ``position`` that are still cached, and for each its
    position in the lane."""
    rest = np.asarray(lane[position:], dtype=np.uint64)
    db = cache.dbs[DB_SAMPLES]
    with cache.env.read() as txn:
        get = txn.get
        present = np.fromiter((get(seq_key(int(seq)), None, db) is not None for seq in rest),
                              dtype=bool, count=len(rest))
    return rest[present], position + np.flatnonzero(present)


def log_resume(epoch: int, done: dict[str, int], groups: list[NodeStates],
               place: Placement) -> None:
    """Say once (global rank 0) what a resumed epoch continues and what it cannot."""
    layouts = sorted({g.local_world_size for g in groups})
    before = (f"{format_count(len(groups), 'node')} of {'/'.join(map(str, layouts))} "
              f"{'rank' if layouts == [1] else 'ranks'}{' each' if len(groups) > 1 else ''}")
    now = format_count(place.world_size, "rank") + (
        f", {place.local_world_size} per node" if place.world_size > place.local_world_size
        else "")
    log.info("epoch %d resumes: %s of the interrupted epoch continue%s in %s per rank on %s "
             "(it ran on %s)%s", epoch, format_count(done["resume_continued"], "sample"),
             "s" if done["resume_continued"] == 1 else "",
             format_count(done["resume_batches"], "batch", "batches"), now, before,
             f"; {format_count(done['resume_fresh_ranks'], 'rank')} start it on a fresh "
             "snapshot" if done["resume_fresh_ranks"] else "")
    if done["resume_evicted"]:
        log.warning("epoch %d: %d samples of the interrupted epoch were evicted before the "
                    "resume and are skipped", epoch, done["resume_evicted"])
    if done["resume_left_out"]:
        log.warning("epoch %d: %d samples of the interrupted epoch are left out: a rank has too "
                    "few for the batches the others need (every rank reads %d batches, none "
                    "empty)", epoch, done["resume_left_out"], done["resume_batches"])
    if done["resume_departed"] or done["resume_departed_nodes"]:
        log.warning("epoch %d: %d samples of the interrupted epoch were left on %s that "
                    "did not come back (no node of this job holds their lease: their cache is "
                    "gone) and are skipped", epoch, done["resume_departed"],
                    format_count(done["resume_departed_nodes"], "node"))
