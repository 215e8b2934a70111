"""What the live leases protect, as one evicting process sees it: ranges and released samples.

A lease without a plan (``cache.dataset()``, or one whose plan is not complete yet) protects
its whole range ``[lo, hi)``. A lease with a plan (:mod:`epochcache.store.plans`) protects only
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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from .leases import Lease
from .plans import Part, part_path, read_seqs

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

    def index(self, seq: int) -> int:
        """The position of ``seq`` in the snapshot, or -1."""
        i = int(np.searchsorted(self.seqs, seq))
        return i if i < len(self.seqs) and int(self.seqs[i]) == seq else -1

    def protects(self, seq: int) -> bool:
        i = self.index(seq)
        return i >= 0 and self.remaining[i] > 0

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
            np.add.at(self.nfree, idx >> _SHIFT, 1)
            self.low = min(self.low, int(idx.min()) >> _SHIFT)

    def first_free(self) -> int:
        """The lowest free position, or -1."""
        blocks = np.flatnonzero(self.nfree[self.low :])
        if not len(blocks):
            self.low = len(self.nfree)
            return -1
        self.low += int(blocks[0])
        start = self.low << _SHIFT
        return start + int(np.argmax(self.state[start : start + (1 << _SHIFT)] == _FREE))

    def mark(self, i: int, state: int) -> None:
        """Position ``i`` is no candidate any more: ``_GONE`` (evicted) or ``_PROTECTED``
        (another lease still protects it)."""
        if self.state[i] == _FREE:
            self.nfree[i >> _SHIFT] -= 1
        self.state[i] = state

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

    def sync(self, leases: Sequence[Lease]) -> None:
        """Adopt the lease table read in the current transaction; take in new reads."""
        self.leases = list(leases)
        live = {lease.lease_id for lease in leases}
        ended = [lease_id for lease_id in self._planned if lease_id not in live]
        for lease_id in ended:
            del self._planned[lease_id]
        self._failed &= live
        if ended:
            for planned in self._planned.values():
                planned.refree()
        for lease in leases:
            if lease.plan_parts and lease.lease_id not in self._planned:
                self._load(lease)
        self._whole = [lease for lease in leases if lease.lease_id not in self._planned]
        for planned in self._planned.values():
            planned.advance()

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

    def in_ranges(self, seq: int) -> Lease | None:
        """The first lease whose range holds ``seq``, if any."""
        for lease in self.leases:
            if lease.lo <= seq < lease.hi:
                return lease
        return None

    def protector(self, seq: int) -> Lease | None:
        """The lease that keeps ``seq`` from eviction, if any."""
        for lease in self._whole:
            if lease.lo <= seq < lease.hi:
                return lease
        for planned in self._planned.values():
            if planned.lease.lo <= seq < planned.lease.hi and planned.protects(seq):
                return planned.lease
        return None

    def unranged_after(self, seq: int) -> tuple[int, int] | None:
        """The first interval ``[start, end)`` at or after ``seq`` that no lease's range
        covers and that lies before the frontier, or None."""
        frontier = self.frontier
        start = seq
        for lease in sorted(self.leases, key=lambda lease: lease.lo):
            if lease.hi <= start:
                continue
            if lease.lo > start:
                return start, lease.lo
            start = lease.hi
        if frontier is None:
            return start, 1 << 64
        return (start, frontier) if start < frontier else None

    def released_candidate(self) -> tuple[int, _Planned, int] | None:
        """The oldest released sample of any plan lease (``seq, lease, position``) that no
        other lease protects; candidates found protected are set aside until a lease ends."""
        while True:
            best: tuple[int, _Planned, int] | None = None
            for planned in self._planned.values():
                i = planned.first_free()
                if i >= 0 and (best is None or int(planned.seqs[i]) < best[0]):
                    best = (int(planned.seqs[i]), planned, i)
            if best is None:
                return None
            seq, owner, i = best
            if self._protected_elsewhere(seq, owner):
                owner.mark(i, _PROTECTED)
                continue
            return best

    def _protected_elsewhere(self, seq: int, owner: _Planned) -> bool:
        for lease in self._whole:
            if lease.lo <= seq < lease.hi:
                return True
        return any(planned is not owner and planned.protects(seq)
                   for planned in self._planned.values())

    def evicted(self, seq: int) -> None:
        """``seq`` left the cache: it is no candidate of any plan lease any more."""
        for planned in self._planned.values():
            i = planned.index(seq)
            if i >= 0:
                planned.mark(i, _GONE)
