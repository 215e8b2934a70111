"""The state of a stream's epoch, for StatefulDataLoader, Lightning and resumed runs.

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

from typing import Any

import numpy as np

KIND = "epochcache.stream"
#: What the epoch's order depends on: a resume must find the same.
ORDER_KEYS = ("epoch", "lease", "lo", "hi", "count", "seed", "shuffle", "samples_per_epoch",
              "slot", "slots", "samples")


def worker_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream states inside ``state``: ours, or a StatefulDataLoader's (its dataset
    state without workers, or one per worker)."""
    if state.get("kind") == KIND:
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
    ours = [one for one in found if one.get("kind") == KIND]
    if not ours and found or not found:
        raise ValueError("load_state_dict: expected a cache.stream() state_dict() or a "
                         "StatefulDataLoader state_dict() of a loader over cache.stream(), "
                         f"got keys {sorted(state)[:8]}")
    return ours


def merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state with the positions of every reader in ``states`` (the same epoch's)."""
    current = [one for one in states if "epoch" in one]
    if not current:
        return {"kind": KIND, "version": 1,
                "next_epoch": max(int(one.get("next_epoch", 0)) for one in states)}
    first = current[0]
    for other in current[1:]:
        for key in (*ORDER_KEYS, "workers"):
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
