"""Resume states of epochs() and how the rest of an interrupted epoch is dealt to the ranks
that resume it, on the layout that ran it or on another one (issue 28: elastic resume).

An epoch of ``epochs()`` is one order per node (the node's snapshot, shuffled by seed and
epoch) dealt to the node's ranks: rank ``r`` of ``W`` reads the *lane* ``order[r::W]`` cut to
its length. A rank's [`state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] names the
node's lease, the rank's place (``local_rank`` of ``local_world_size``), the length of its lane
and how far along it the loop had trained (``position``). The states of one node's ranks are a
`NodeStates`, found by their lease: each node has its own cache, and only that cache
holds the lease.

What a resumed node reads (see `rank_lane`):

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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .placement import Placement

KIND = "epochcache.epochs"
#: What a rank's order depends on besides the snapshot and the layout.
ORDER_KEYS = ("seed", "shuffle", "samples_per_epoch")


@dataclass
class NodeStates:
    """The states of one node's ranks in one interrupted epoch (they share its lease)."""

    lease: str
    epoch: int
    local_world_size: int
    states: dict[int, dict[str, Any]] = field(default_factory=dict)  # by local rank
    node: int | None = None  # GROUP_RANK, when the states name it

    @property
    def complete(self) -> bool:
        """Whether every rank of the node is here (what a re-split needs)."""
        return sorted(self.states) == list(range(self.local_world_size))

    @property
    def nested(self) -> dict[str, Any] | None:
        """The split of an earlier resume the lanes were dealt from (None: the epoch's own)."""
        first = next(iter(self.states.values()))
        nested = first.get("resumed")
        return dict(nested) if isinstance(nested, dict) else None

    def split(self) -> dict[str, Any]:
        """The node's layout, lanes and positions, as a new state's ``"resumed"`` records it."""
        ranks = range(self.local_world_size)
        return {"local_world_size": self.local_world_size,
                "lanes": [int(self.states[r]["lane"]) for r in ranks],
                "positions": [int(self.states[r]["position"]) for r in ranks],
                "resumed": self.nested}

    def remaining(self) -> int:
        """Samples of the node's lanes after their positions, as the states count them (what
        was still cached there is known only to the node's disk)."""
        return sum(max(0, int(s["lane"]) - int(s["position"])) for s in self.states.values())


def parse_states(resume: Any) -> list[dict[str, Any]]:
    """The states in ``resume``: one [`EpochLoader.state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict], a list of them, or a dict
    of them by rank (``epochcache run``'s mid-epoch checkpoint holds ``{rank: state}``).

    Raises:
        ValueError: none of these, or states of different epochs.
    """
    if isinstance(resume, Mapping) and resume.get("kind") == KIND:
        states = [dict(resume)]
    elif isinstance(resume, Mapping):
        states = [dict(one) if isinstance(one, Mapping) else one for one in resume.values()]
    elif isinstance(resume, Sequence) and not isinstance(resume, (str, bytes)):
        states = [dict(one) if isinstance(one, Mapping) else one for one in resume]
    else:
        states = [resume]
    bad = [type(one).__name__ for one in states
           if not isinstance(one, dict) or one.get("kind") != KIND]
    if not states or bad:
        raise ValueError(
            "resume: expected an EpochLoader.state_dict() (from a checkpoint), or a list or "
            f"dict of every rank's, got {type(resume).__name__}"
            + (f" holding {', '.join(sorted(set(bad)))}" if bad and states else ""))
    epochs = sorted({int(one["epoch"]) for one in states})
    if len(epochs) > 1:
        raise ValueError(f"resume: the states are of different epochs {epochs}: pass the "
                         "states of one checkpoint")
    return states


def group_states(states: list[dict[str, Any]]) -> list[NodeStates]:
    """The states by node (by lease), in node order.

    Raises:
        ValueError: one node's states disagree on its layout, or two name one rank.
    """
    groups: dict[str, NodeStates] = {}
    for state in states:
        lease = str(state.get("lease") or "")
        size, rank = int(state["local_world_size"]), int(state["local_rank"])
        group = groups.get(lease)
        if group is None:
            node = state.get("node")
            group = groups[lease] = NodeStates(lease, int(state["epoch"]), size,
                                               node=None if node is None else int(node))
        if size != group.local_world_size:
            raise ValueError(f"resume: the states of lease {lease[:8]} disagree on the node's "
                             f"ranks ({group.local_world_size} and {size})")
        if rank in group.states:
            raise ValueError(f"resume: two states of lease {lease[:8]} are local rank {rank}'s")
        group.states[rank] = state
    return sorted(groups.values(), key=lambda g: (g.node is None, g.node or 0, g.lease))


def check_groups(groups: list[NodeStates], wanted: dict[str, Any], place: Placement) -> None:
    """Refuse states this call cannot continue, naming what differs and what to do.

    Raises:
        ValueError: another seed, shuffle or samples_per_epoch; a single state of another
            rank or layout; a node whose states are incomplete where a re-split needs them all.
    """
    for group in groups:
        for state in group.states.values():
            for name in ORDER_KEYS:
                if state.get(name) != wanted[name]:
                    raise ValueError(
                        f"resume: the interrupted epoch ran with {name}={state.get(name)!r}, "
                        f"this epochs() call has {name}={wanted[name]!r}: its order cannot be "
                        f"continued; resume with the same {name}, or start the next epoch "
                        "instead (start_epoch)")
    incomplete = [group for group in groups if not group.complete]
    if not incomplete:
        return  # every node's states whole: any layout (each node's rest dealt anew)
    group = incomplete[0]
    if len(groups) == 1 and (place.local_rank in group.states
                             and group.local_world_size == place.local_world_size):
        return  # this rank's own state, on the layout that ran the epoch: as always
    if len(groups) == 1:
        ranks = sorted(group.states)
        raise ValueError(
            f"resume: the state{'s are' if len(ranks) > 1 else ' is'} of local rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of a node of "
            f"{group.local_world_size} ranks; this is local rank {place.local_rank} of "
            f"{place.local_world_size}: to go on with another number of ranks per node (or as "
            "another rank), pass every rank's state of the interrupted epoch (a list, or a "
            "dict by rank, as `epochcache run` checkpoints them), so the rest of the node's "
            "epoch can be dealt anew")
    missing = sorted(set(range(group.local_world_size)) - set(group.states))
    raise ValueError(
        f"resume: the states of lease {group.lease[:8]} (a node of {group.local_world_size} "
        f"ranks) lack local ranks {missing}: pass every rank's state of the interrupted epoch, "
        "or this rank's own alone")


def order_identity(*, seed: int, shuffle: bool, samples_per_epoch: int | None,
                   place: Placement) -> dict[str, Any]:
    """What a rank's epoch order depends on besides the snapshot, and where the rank sits:
    saved with its position, and compared on a resume."""
    return {"seed": seed, "shuffle": bool(shuffle), "samples_per_epoch": samples_per_epoch,
            "local_rank": place.local_rank, "local_world_size": place.local_world_size,
            "node": place.node_rank, "rank": place.rank}


def check_resume(resume: Any, *, seed: int, shuffle: bool, samples_per_epoch: int | None,
                 place: Placement) -> list[NodeStates]:
    """The states of ``epochs(resume=...)`` by node, refused (naming what differs) when the
    epoch's order cannot be rebuilt from them (see `epochcache.data.elastic`)."""
    groups = group_states(parse_states(resume))
    check_groups(groups, {"seed": seed, "shuffle": bool(shuffle),
                          "samples_per_epoch": samples_per_epoch}, place)
    return groups


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
