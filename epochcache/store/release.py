"""What the live leases protect, as one evicting process sees it: ranges and released samples.

A lease without a plan (``cache.dataset()``, or one whose plan is not complete yet) protects
its whole range ``[lo, hi)``. A lease with a plan (`epochcache.store.reads`) protects only
the samples its readers have not read yet: a sample is *released* once every occurrence of it
in the plan's lanes lies behind its lane's position. Eviction takes, oldest first, what nothing
protects, up to the end of the newest snapshot: samples newer than every snapshot have not
been trained on yet, so while a snapshot is held they are never evicted to make room for
newer ones (writers wait instead, as they always did at a lease).

Cost: each process tracks each plan lease with a count of unread occurrences per snapshot
sample and a state byte per sample (protected, free, gone), plus per block of 4096 samples the
number of free ones. A commit reads each lane's position (an integer in a shared mapping),
takes the newly read samples from the lane (only those), and finds the oldest free sample from
the block counts: O(new reads + evicted x log n) per commit, never a scan of the snapshot.
Loading a plan (once per lease and process) and a lease ending (once per epoch) cost O(n).

What eviction marks gone stands only once its transaction commits (`Protection.begin`,
`commit`, `rollback`): a transaction undone by a full map
or disk leaves its samples in the cache, and they must stay candidates, or this process would
never evict them while their lease lives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import numpy as np

from .leases import Lease
from .reads import Part, part_path, read_seqs

log = logging.getLogger("epochcache.cache")

_SHIFT = 12  # 4096 samples per block
_PROTECTED, _FREE, _GONE = 0, 1, 2


class _Planned:
    """One plan lease as this process tracks it (see the module docstring)."""

    def __init__(self, lease: Lease, seqs: np.ndarray, parts: list[Part]) -> None:
        self.lease = lease
        self.seqs = seqs
        self.parts = parts
        n = len(seqs)
        counts = np.zeros(n, dtype=np.int64)
        for part in parts:
            if len(part.data):
                counts += np.bincount(self._positions(part.data), minlength=n)
        self.remaining = counts
        self.state = np.where(counts == 0, _FREE, _PROTECTED).astype(np.uint8)
        blocks = (n >> _SHIFT) + 1
        self.nfree = np.bincount(np.flatnonzero(self.state == _FREE) >> _SHIFT,
                                 minlength=blocks).astype(np.int64)
        self.low = 0  # no free sample in blocks before this one
        self.seen = [np.zeros(part.lanes, dtype=np.int64) for part in parts]

    def _positions(self, values: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.seqs, values)
        np.minimum(idx, len(self.seqs) - 1, out=idx)
        if not np.array_equal(self.seqs[idx], values):
            raise ValueError(f"plan of lease {self.lease.lease_id[:8]} names samples outside "
                             "its snapshot")
        return idx

    def advance(self) -> None:
        """Take in what the readers read since the last call."""
        for part, seen in zip(self.parts, self.seen):
            positions = part.positions.astype(np.int64)  # one read of the shared words
            for lane in np.flatnonzero(positions > seen):
                lo, hi = int(seen[lane]), int(positions[lane])
                seen[lane] = hi
                read = self._positions(part.lane(int(lane))[lo:hi])
                np.subtract.at(self.remaining, read, 1)
                done = np.unique(read[self.remaining[read] == 0])
                self._free(done[self.state[done] == _PROTECTED])

    def _free(self, idx: np.ndarray) -> None:
        if len(idx):
            self.state[idx] = _FREE
            self._free_counted(idx)

    def free_positions(self, want: int) -> np.ndarray:
        """The lowest free positions, sorted: at least ``want`` of them if there are."""
        blocks = np.flatnonzero(self.nfree[self.low :]) + self.low
        if not len(blocks):
            self.low = len(self.nfree)
            return np.empty(0, dtype=np.int64)
        self.low = int(blocks[0])
        found: list[np.ndarray] = []
        total = 0
        for block in blocks:
            start = int(block) << _SHIFT
            found.append(np.flatnonzero(self.state[start : start + (1 << _SHIFT)] == _FREE)
                         + start)
            total += len(found[-1])
            if total >= want:
                break
        return np.concatenate(found)

    def mark(self, idx: np.ndarray, state: int) -> np.ndarray:
        """Positions ``idx`` are no candidates any more: ``_GONE`` (evicted) or
        ``_PROTECTED`` (another lease still protects them). Returns their states before, in
        the order of ``np.unique(idx)``, for `restore`."""
        if not len(idx):
            return np.empty(0, dtype=np.uint8)
        idx = np.unique(idx)
        before: np.ndarray = self.state[idx].copy()
        np.subtract.at(self.nfree, idx[before == _FREE] >> _SHIFT, 1)
        self.state[idx] = state
        return before

    def restore(self, idx: np.ndarray, before: np.ndarray) -> None:
        """Undo `mark` (``idx`` unique, ``before`` what it returned)."""
        back = idx[(before == _FREE) & (self.state[idx] != _FREE)]
        self.state[idx] = before
        self._free_counted(back)

    def _free_counted(self, idx: np.ndarray) -> None:
        if len(idx):
            np.add.at(self.nfree, idx >> _SHIFT, 1)
            self.low = min(self.low, int(idx.min()) >> _SHIFT)

    def unread(self, seqs: np.ndarray) -> np.ndarray:
        """Which of ``seqs`` (sorted or not) this plan still protects."""
        idx = np.minimum(np.searchsorted(self.seqs, seqs), len(self.seqs) - 1)
        found: np.ndarray = (self.seqs[idx] == seqs) & (self.remaining[idx] > 0)
        return found

    def positions_of(self, seqs: np.ndarray) -> np.ndarray:
        """The positions of those of ``seqs`` that are in the snapshot."""
        idx = np.minimum(np.searchsorted(self.seqs, seqs), len(self.seqs) - 1)
        found: np.ndarray = idx[self.seqs[idx] == seqs]
        return found

    def refree(self) -> None:
        """Another lease ended: what it alone kept from eviction is free again."""
        self._free(np.flatnonzero((self.remaining == 0) & (self.state == _PROTECTED)))


class Protection:
    """The live leases of one cache as this process evicts under them.

    Args:
        cache_path: the cache directory (where plans live).
    """

    def __init__(self, cache_path: str) -> None:
        self.cache_path = cache_path
        self._planned: dict[str, _Planned] = {}
        self._failed: set[str] = set()  # plans that could not be loaded (logged once)
        self.leases: list[Lease] = []
        self._whole: list[Lease] = []
        self._live: set[str] = set()  # every lease id of the last sync
        # What `evicted` marked gone in the write transaction under way, to undo if it
        # does not commit: (plan, positions, their states before).
        self._undo: list[tuple[_Planned, np.ndarray, np.ndarray]] = []
        #: What a policy asked to undo if the transaction does not commit (`on_rollback`).
        self._undo_calls: list[Callable[[], None]] = []

    # -- the write transaction's bookkeeping --------------------------------------------------

    def begin(self) -> None:
        """A write transaction that may evict starts. What an earlier attempt marked evicted
        and did not commit (a full map or disk undid it, or it is retried after the map grew)
        is a candidate again: those samples are still in the cache."""
        self.rollback()

    def commit(self) -> None:
        """The transaction committed: what it evicted is gone for good."""
        self._undo.clear()
        self._undo_calls.clear()

    def rollback(self) -> None:
        """The transaction did not commit: what it marked evicted is a candidate again."""
        undo, self._undo = self._undo, []
        for planned, idx, before in reversed(undo):
            planned.restore(idx, before)
        calls, self._undo_calls = self._undo_calls, []
        for call in reversed(calls):
            call()

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` if the write transaction under way does not commit: a policy that
        keeps state about what it took (samples it will not look at again) puts it back."""
        self._undo_calls.append(undo)

    def sync(self, leases: Sequence[Lease]) -> None:
        """Adopt the lease table read in the current transaction; take in new reads."""
        self.leases = list(leases)
        live = {lease.lease_id for lease in leases}
        any_ended = bool(self._live - live)
        self._live = live
        # A lease that lost its plan (adopted whole by a resumed run) is protected whole again.
        if self.preload(leases) or any_ended:
            # Candidates set aside because another lease (of either kind) protected them may
            # be free now (a plan loaded just now has set none aside).
            for planned in self._planned.values():
                planned.refree()
        self._whole = [lease for lease in leases if lease.lease_id not in self._planned]
        for planned in self._planned.values():
            planned.advance()

    def preload(self, leases: Sequence[Lease]) -> bool:
        """Load the plans of new leases now, outside any transaction: a plan of a million
        samples takes a fraction of a second to index, which the write lock should not wait
        for (`sync`, inside the writer's transaction, then finds them loaded).

        The plans of leases that ended are dropped here too, with their mappings and file
        descriptors: `sync` only runs when this process evicts, and a writer that never
        needs to (a sampler below capacity) kept every epoch's plan, about 25 MiB and two
        descriptors on deleted files per million-sample epoch, for as long as it lived.

        Returns whether it dropped a plan."""
        planned_live = {lease.lease_id for lease in leases if lease.plan_parts}
        ended = [lease_id for lease_id in self._planned if lease_id not in planned_live]
        for lease_id in ended:
            del self._planned[lease_id]
        self._failed &= planned_live
        for lease in leases:
            if lease.plan_parts and lease.lease_id not in self._planned:
                self._load(lease)
        return bool(ended)

    def _load(self, lease: Lease) -> None:
        if lease.lease_id in self._failed:
            return
        paths = [part_path(self.cache_path, lease.lease_id, p) for p in range(lease.plan_parts)]
        if not all(os.path.exists(path) for path in paths):
            return  # not complete yet: the whole range stays protected
        seqs = read_seqs(self.cache_path, lease.lease_id)
        try:
            if seqs is None:
                raise ValueError("its snapshot file is missing")
            self._planned[lease.lease_id] = _Planned(lease, seqs, [Part(p) for p in paths])
        except (OSError, ValueError) as exc:
            self._failed.add(lease.lease_id)
            log.warning("%s: the plan of lease %s cannot be read (%s): its whole snapshot "
                        "stays protected until it ends", self.cache_path, lease.lease_id[:8],
                        exc)

    @property
    def frontier(self) -> int | None:
        """Nothing at or past this sequence number is evicted: the end of the newest snapshot
        (None: no snapshot holds a sample, no limit)."""
        return max((lease.hi for lease in self.leases if lease.count), default=None)

    def gaps(self) -> list[tuple[int, int]]:
        """The intervals ``[start, end)`` no lease's range covers, below the frontier, oldest
        first."""
        frontier = self.frontier
        out: list[tuple[int, int]] = []
        start = 0
        for lease in sorted(self.leases, key=lambda lease: lease.lo):
            if lease.lo > start:
                out.append((start, lease.lo))
            start = max(start, lease.hi)
        end = (1 << 64) if frontier is None else frontier
        if start < end:
            out.append((start, end))
        return [(lo, min(hi, end)) for lo, hi in out if lo < end]

    def protector(self, seq: int) -> Lease | None:
        """The lease that keeps ``seq`` from eviction, if any."""
        for lease in self._whole:
            if lease.lo <= seq < lease.hi:
                return lease
        one = np.array([seq], dtype=np.uint64)
        for planned in self._planned.values():
            if planned.lease.lo <= seq < planned.lease.hi and planned.unread(one)[0]:
                return planned.lease
        return None

    def blocker(self, seq: int | None) -> Lease | None:
        """For the writers' message: the lease that keeps ``seq`` (the first sample eviction
        found protected), else the newest lease."""
        lease = None if seq is None else self.protector(seq)
        if lease is not None:
            return lease
        return max(self.leases, key=lambda lease: lease.hi, default=None)

    def protects(self, seqs: np.ndarray) -> np.ndarray:
        """Which of ``seqs`` (any order) may not be evicted now: those a lease without a plan
        holds in its range, those a plan lease has not released, and those at or past the
        frontier (invariants 1 and 3). Vectorised: O(len(seqs) x leases x log snapshot)."""
        seqs = np.asarray(seqs, dtype=np.uint64)
        out = np.zeros(len(seqs), dtype=bool)
        frontier = self.frontier
        if frontier is not None:
            out |= seqs >= frontier
        for lease in self._whole:
            out |= (seqs >= lease.lo) & (seqs < lease.hi)
        for planned in self._planned.values():
            if len(planned.seqs):
                out |= planned.unread(seqs)
        return out

    def released(self, want: int = 256) -> np.ndarray:
        """The oldest released samples of the plan leases that no other lease protects, at
        least ``want`` if there are: their sequence numbers, sorted. Candidates found
        protected by another lease are set aside until a lease ends
        (`_Planned.refree`)."""
        seqs: list[np.ndarray] = []
        for planned in self._planned.values():
            pos = planned.free_positions(want)
            if not len(pos):
                continue
            cand = planned.seqs[pos]
            kept = np.ones(len(pos), dtype=bool)
            for lease in self._whole:
                kept &= (cand < lease.lo) | (cand >= lease.hi)
            for other in self._planned.values():
                if other is not planned:
                    kept &= ~other.unread(cand)
            planned.mark(pos[~kept], _PROTECTED)
            seqs.append(cand[kept])
        if not seqs:
            return np.empty(0, dtype=np.uint64)
        return np.sort(np.concatenate(seqs), kind="stable")

    def evicted(self, seqs: np.ndarray) -> None:
        """``seqs`` left the cache in the write transaction under way: they are no candidates
        of any plan lease any more, once it commits (`commit`, `rollback`)."""
        if len(seqs):
            for planned in self._planned.values():
                idx = np.unique(planned.positions_of(seqs))
                if len(idx):
                    self._undo.append((planned, idx, planned.mark(idx, _GONE)))
