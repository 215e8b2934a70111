"""Every resume state format in one place: ``epochs()``' rank states and ``stream()``'s.

An epoch of ``epochs()`` is one order per node (the node's snapshot, shuffled by seed and
epoch) dealt to the node's ranks: rank ``r`` of ``W`` reads the *lane* ``order[r::W]`` cut to
its length. A rank's [`state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] names the
node's lease, the rank's place (``local_rank`` of ``local_world_size``), the length of its lane
and how far along it the loop had trained (``position``). The states of one node's ranks are a
`NodeStates`, found by their lease: each node has its own cache, and only that cache
holds the lease. A resume on another layout records the split its lanes were dealt from
(``"resumed"``); how the rest is dealt is `epochcache.data.resume`'s.

An epoch of [`CacheStream`][epochcache.data.stream.CacheStream] is one order over one snapshot, split
into *lanes*, one per reader (the main process, or each DataLoader worker: lane ``w`` is
``order[w::workers]``). Its state names the snapshot (lease and range), what the order
depends on (seed, shuffle, samples per epoch, this rank's slot), the number of lanes, and how
far each reader has yielded along its lane. It is a few numbers whatever the epoch's size, so
torchdata's ``StatefulDataLoader`` can take it at every step::

    {"kind": "epochcache.stream", "version": 1, "epoch": 3, "lease": "ab12...", "lo": 100,
     "hi": 900, "count": 800, "seed": 0, "shuffle": true, "samples_per_epoch": null,
     "slot": 0, "slots": 1, "samples": -1, "workers": 2, "positions": {"0": 120, "1": 118}}

A StatefulDataLoader keeps one such state per worker (each with its own position) and gives
each worker back its own, so a resumed loader with the same ``num_workers`` continues every
lane where it stopped: the rest of the epoch in the same order. Loaded whole into the stream
(``stream.load_state_dict(loader.state_dict())``), the workers' states merge into one with
every position, and the samples left in all lanes are dealt anew over any number of readers
(``"resumed"`` then holds the earlier split, so a second interruption resumes as well).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..placement import Placement

# -- epochs(): one state per rank, grouped by node ------------------------------------------

EPOCHS_KIND = "epochcache.epochs"
#: What a rank's order depends on besides the snapshot and the layout.
EPOCHS_ORDER_KEYS = ("seed", "shuffle", "samples_per_epoch")


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
    if isinstance(resume, Mapping) and resume.get("kind") == EPOCHS_KIND:
        states = [dict(resume)]
    elif isinstance(resume, Mapping):
        states = [dict(one) if isinstance(one, Mapping) else one for one in resume.values()]
    elif isinstance(resume, Sequence) and not isinstance(resume, (str, bytes)):
        states = [dict(one) if isinstance(one, Mapping) else one for one in resume]
    else:
        states = [resume]
    bad = [type(one).__name__ for one in states
           if not isinstance(one, dict) or one.get("kind") != EPOCHS_KIND]
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
            for name in EPOCHS_ORDER_KEYS:
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
    epoch's order cannot be rebuilt from them (see `epochcache.data.resume`)."""
    groups = group_states(parse_states(resume))
    check_groups(groups, {"seed": seed, "shuffle": bool(shuffle),
                          "samples_per_epoch": samples_per_epoch}, place)
    return groups


# -- stream(): one state per reader (a StatefulDataLoader's worker) ---------------------------

STREAM_KIND = "epochcache.stream"
#: What the epoch's order depends on: a resume must find the same.
STREAM_ORDER_KEYS = ("epoch", "lease", "lo", "hi", "count", "seed", "shuffle",
                     "samples_per_epoch", "slot", "slots", "samples")


def worker_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream states inside ``state``: ours, or a StatefulDataLoader's (its dataset
    state without workers, or one per worker)."""
    if state.get("kind") == STREAM_KIND:
        return [state]
    found: list[dict[str, Any]] = []
    dataset_state = state.get("dataset_state")
    if isinstance(dataset_state, dict):
        found.append(dataset_state)
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):
        for worker in (snapshot.get("_worker_snapshots") or {}).values():
            if isinstance(worker, dict) and isinstance(worker.get("dataset_state"), dict):
                found.append(worker["dataset_state"])
    ours = [one for one in found if one.get("kind") == STREAM_KIND]
    if not ours and found or not found:
        raise ValueError("load_state_dict: expected a cache.stream() state_dict() or a "
                         "StatefulDataLoader state_dict() of a loader over cache.stream(), "
                         f"got keys {sorted(state)[:8]}")
    return ours


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state with the positions of every reader in ``states`` (the same epoch's)."""
    current = [one for one in states if "epoch" in one]
    if not current:
        return {"kind": STREAM_KIND, "version": 1,
                "next_epoch": max(int(one.get("next_epoch", 0)) for one in states)}
    first = current[0]
    for other in current[1:]:
        for key in (*STREAM_ORDER_KEYS, "workers"):
            if other.get(key) != first.get(key):
                raise ValueError(f"load_state_dict: the workers' states disagree on {key} "
                                 f"({first.get(key)!r} and {other.get(key)!r})")
    positions: dict[str, int] = {}
    for one in current:
        positions.update({str(k): int(v) for k, v in one["positions"].items()})
    return {**first, "positions": positions}


def _lanes(order: np.ndarray, state: dict[str, Any]) -> list[np.ndarray]:
    """The lanes of the split ``state`` describes (an earlier one's leftovers, if resumed)."""
    workers = int(state["workers"])
    earlier = state.get("resumed")
    if earlier is not None:
        order = leftovers(order, earlier)
    return [order[w::workers] for w in range(workers)]


def leftovers(order: np.ndarray, state: dict[str, Any]) -> np.ndarray:
    """What the readers of ``state`` had not yielded yet: every lane after its position.

    Raises:
        ValueError: the state lacks a reader's position.
    """
    lanes = _lanes(order, state)
    positions = state["positions"]
    missing = [w for w in range(len(lanes)) if str(w) not in positions]
    if missing:
        raise ValueError(
            f"load_state_dict: the state has no position for readers {missing} of "
            f"{len(lanes)}; resuming with another num_workers needs every worker's: load the "
            "whole StatefulDataLoader state_dict() into the stream")
    parts = [lane[int(positions[str(w)]) :] for w, lane in enumerate(lanes)]
    return np.concatenate(parts) if parts else order[:0]


def resume_split(order: np.ndarray, state: dict[str, Any], workers: int, worker: int
                 ) -> tuple[dict[str, Any], np.ndarray, int]:
    """How reader ``worker`` of ``workers`` resumes the epoch of ``state``: the split it
    records in its state from now on (without positions), its lane and where in it to start.

    With as many readers as before, each continues its own lane (its own position suffices,
    as a StatefulDataLoader hands each worker its own state); with another number, what is
    left of every lane is dealt anew (every position is needed).
    """
    split: dict[str, Any] = {key: state[key] for key in ("workers", "resumed") if key in state}
    positions = state["positions"]
    before = int(state["workers"])
    if before == workers and str(worker) in positions:
        return split, _lanes(order, split)[worker], int(positions[str(worker)])
    if len(positions) < before:
        # One worker's state: what a StatefulDataLoader gives each of its workers back. It
        # checks nothing until its own assertion, after the workers started.
        raise ValueError(
            f"load_state_dict: this state was saved by a loader with num_workers={before}, and "
            f"holds the position of reader(s) {sorted(map(int, positions))} only; this loader "
            f"reads with num_workers={workers}. A StatefulDataLoader resumes only with the "
            "num_workers that saved its state (it hands each worker its own). To resume with "
            "another number, load the whole StatefulDataLoader state_dict() into the stream "
            "(stream.load_state_dict(state)) instead of into the new loader, or resume with "
            f"num_workers={before}")
    rest = leftovers(order, {**split, "positions": positions})
    fresh: dict[str, Any] = {"workers": workers, "resumed": {**split, "positions": positions}}
    return fresh, rest[worker::workers], 0
