"""Continuing an interrupted epoch: its snapshot adopted, the rest of its order dealt to the
ranks that resume it, on the layout that ran it or on another one (issue 28: elastic resume).

A run that checkpoints mid-epoch saves [`EpochLoader.state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict]: the epoch, its lease, and
how far along this rank's lane (the epoch's order on this rank) the loop had trained (its
format is in `epochcache.data.states`). Its lease outlives the dead run for
``cache.resume_grace_s`` (see `SampleStore.keep_for_resume`); the resumed run adopts it,
rebuilds the same order from the snapshot saved with the plan (or from the lease's range), and
reads the samples after that position. The run released only what its checkpoints covered, so
nothing after the position was evicted; anything that is gone anyway (a lease reclaimed and
taken again, a repaired cache) is skipped and counted.

Given every rank's states, the job may come back in another shape: each node's leader finds
the states whose lease its own cache holds (`adopt_node`), and its ranks read their part
of the node's rest; what no node found is counted (`log_resume`). What a resumed node reads
(see `rank_lane`):

* on the layout that ran the epoch, each rank continues its own lane after its position;
* on another number of ranks per node, the *rest* of the node's epoch -- for each old rank in
  order, its lane after its position -- is dealt anew: new rank ``r`` of ``W'`` reads
  ``rest[r::W']``. The split is recorded in the new states (``"resumed"``: the old layout,
  lane lengths and positions), so an epoch interrupted again is rebuilt the same way.

Samples evicted since are skipped (counted) where they are read; the lanes themselves never
depend on what is cached, so a second resume rebuilds the same lanes.

Every rank of the job then reads the same number of batches (`deal`): with nothing
resumed, the MIN over ranks of each one's batch count (as every epoch); with a resumed epoch,
the MAX over the resuming ranks of ``ceil(count / batch_size)``, so none of the rest is left
out, a rank with fewer samples spreading them over smaller batches; where a rank has fewer
samples than that many batches (a batch is never empty), the MIN again, and the samples beyond
it are left out and counted. With ``drop_last`` every batch stays whole: the MIN over ranks of
``count // batch_size``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..placement import Placement
from ..store import Snapshot
from ..store.plumbing import adopt_lease, lease_end, snapshot_seqs
from ..store.records import DB_SAMPLES, seq_key
from ..units import format_count
from .states import NodeStates

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)


def resumed_snapshot(cache: SampleStore, state: dict[str, Any], epoch: int, *,
                     whole: bool = False, quiet: bool = False) -> Snapshot | None:
    """Adopt the lease of the interrupted epoch in ``state`` and return its snapshot, or None
    (logged unless ``quiet``) when the lease is gone. ``whole``: protect its whole range from
    now on (the rest is read by other lanes than its release plan's)."""
    lease_id = str(state["lease"])
    lease = adopt_lease(cache, lease_id, whole=whole)
    if lease is None:
        if not quiet:
            log.warning("epoch %d cannot continue where the checkpoint left it: its lease %s "
                        "is gone (%s); the epoch starts afresh on a new snapshot", epoch,
                        lease_id[:8], lease_gone_reason(cache, lease_id))
        return None
    seqs = snapshot_seqs(cache, lease_id, lease.lo, lease.hi, lease.count)
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
    ended = [group for group in groups if group.lease and lease_end(cache, group.lease)]
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
    return next((g.lease for g in groups if g.lease and lease_end(cache, g.lease)), "")


def lease_gone_reason(cache: SampleStore, lease_id: str) -> str:
    """Why a resumed epoch's lease is gone, as the cache recorded it when it ended."""
    return lease_end(cache, lease_id) or (
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
    db = cache.env.dbs[DB_SAMPLES]
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


# -- the lanes of a resumed node, and the batches every rank reads ----------------------------


def lanes(order: np.ndarray, split: dict[str, Any]) -> list[np.ndarray]:
    """The lanes of the node's ranks that ``split`` describes, over the epoch's ``order``
    (dealt from an earlier split's rest when ``split`` was itself resumed)."""
    nested = split.get("resumed")
    base = order if nested is None else rest_of(order, nested)
    size = int(split["local_world_size"])
    return [base[r::size][: int(length)] for r, length in zip(range(size), split["lanes"])]


def rest_of(order: np.ndarray, split: dict[str, Any]) -> np.ndarray:
    """What the ranks of ``split`` had not read: each lane after its position, in rank order."""
    parts = [lane[int(position):] for lane, position in zip(lanes(order, split),
                                                               split["positions"])]
    return np.concatenate(parts) if parts else order[:0]


@dataclass(frozen=True)
class RankLane:
    """What a rank of a resumed node reads: its lane, where in it to start, and the split
    its states record (None: the epoch's own lanes)."""

    lane: np.ndarray
    position: int
    resumed: dict[str, Any] | None
    regrouped: bool  # dealt anew from the node's rest (another layout)


def rank_lane(order: np.ndarray, group: NodeStates, place: Placement) -> RankLane:
    """This rank's lane of the resumed epoch (see the module docstring)."""
    nested = group.nested
    mine = group.states.get(place.local_rank)
    if group.local_world_size == place.local_world_size and mine is not None:
        base = order if nested is None else rest_of(order, nested)
        lane = base[place.local_rank :: place.local_world_size][: int(mine["lane"])]
        return RankLane(lane, int(mine["position"]), nested, False)
    split = group.split()
    rest = rest_of(order, split)
    return RankLane(rest[place.local_rank :: place.local_world_size], 0, split, True)


@dataclass(frozen=True)
class Deal:
    """The agreed batches of an epoch: ``batches`` per rank, and how many samples a rank with
    ``count`` samples reads (`take`) in batches ending where `bounds` says."""

    batches: int
    batch_size: int
    drop_last: bool

    def take(self, count: int) -> int:
        return min(count, self.batches * self.batch_size)

    def bounds(self, count: int) -> np.ndarray:
        """The end of each batch in the rank's samples (a cumulative count, from 0): whole
        batches while the rank has enough samples for them, else spread as evenly as
        possible over ``batches`` (every batch at least one sample)."""
        k, size = self.batches, self.batch_size
        take = self.take(count)
        if k == 0:
            return np.zeros(1, dtype=np.int64)
        if take > (k - 1) * size:  # whole batches, the last one maybe short
            ends = np.minimum(np.arange(1, k + 1, dtype=np.int64) * size, take)
        else:
            small, extra = divmod(take, k)
            sizes = np.full(k, small, dtype=np.int64)
            sizes[:extra] += 1
            ends = np.cumsum(sizes)
        return np.concatenate([[0], ends]).astype(np.int64)


def deal(counts: Sequence[int], resumed: Sequence[bool], batch_size: int,
         drop_last: bool) -> Deal:
    """How many batches every rank reads, given each rank's sample count and whether it
    continues an interrupted epoch (see the module docstring)."""
    if not counts:
        return Deal(0, batch_size, drop_last)
    whole = [c // batch_size for c in counts]
    some = [math.ceil(c / batch_size) for c in counts]
    least = min(whole) if drop_last else min(some)
    if drop_last or not any(resumed):
        return Deal(least, batch_size, drop_last)
    most = max(n for n, r in zip(some, resumed) if r)
    if min(counts) < most:  # some rank cannot fill that many batches: the MIN, as always
        return Deal(least, batch_size, drop_last)
    return Deal(most, batch_size, drop_last)


def lease_tag(lease: str) -> int:
    """A lease id as a 60-bit integer (the tensors of a collective carry it)."""
    try:
        return int(lease[:15], 16) if lease else 0
    except ValueError:
        return 0


#: The columns of the row each rank contributes to an epoch's agreement (see `report`).
COUNT, RESUMED, TAG, EVICTED = range(4)


def report(groups: list[NodeStates], rows: np.ndarray, agreed: Deal) -> dict[str, int]:
    """What a resumed epoch continued and what it could not, over the whole job, from every
    rank's row (``COUNT`` samples it can read, ``RESUMED`` 1 where it continues the epoch,
    ``TAG`` the lease of the node's states it found, ``EVICTED`` samples gone since): the same
    on every rank.

    ``resume_departed`` counts the rest of the nodes whose states ``groups`` holds but whose
    lease no rank found (their disk is gone), as their states count it.
    """
    resumed = rows[:, RESUMED] == 1
    counts = rows[:, COUNT]
    taken = np.minimum(counts, agreed.batches * agreed.batch_size)
    found = {int(tag) for tag in rows[:, TAG] if tag}
    departed = [group for group in groups if lease_tag(group.lease) not in found]
    return {"resume_batches": agreed.batches,
            "resume_continued": int(taken[resumed].sum()),
            "resume_evicted": int(rows[resumed, EVICTED].sum()),
            "resume_left_out": int((counts - taken)[resumed].sum()),
            "resume_fresh_ranks": int((~resumed).sum()),
            "resume_departed": sum(group.remaining() for group in departed),
            "resume_departed_nodes": len(departed)}
