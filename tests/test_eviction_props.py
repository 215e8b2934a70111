"""Property-based test of eviction and lease bookkeeping (invariants 1-3).

A hypothesis state machine drives a real Cache through random put / snapshot / release / evict /
reopen steps and a plain Python model predicts, step by step, exactly which samples are present.
After every step it checks, against the raw records:

1. every sample of a held snapshot is present and reads back unchanged;
2. stored bytes never exceed capacity + headroom, and the counters match a recount;
3. the evicted samples are exactly the oldest that no lease protects (a snapshot's range, and
   everything newer than the newest non-empty snapshot), and no sample under a live lease was
   evicted.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field

import hypothesis.strategies as st
from common.cachecheck import assert_consistent, content_for, digest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from epochcache import Cache, CacheFull, Snapshot
from epochcache.store import store_of
from epochcache.store.plans import Releaser

KEYS = [f"k{i:02d}" for i in range(40)]  # a small pool, so keys repeat (dedupe)


@dataclass
class Model:
    """What the cache should hold: (seq, key, stored size) oldest first, and the live leases."""

    capacity: int
    headroom: int
    present: list[tuple[int, str, int]] = field(default_factory=list)
    next_seq: int = 0
    leases: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: plan leases: lease id -> (its lanes, each lane's read position)
    plans: dict[str, tuple[list[list[int]], list[int]]] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(size for _, _, size in self.present)

    def unread(self, lease_id: str) -> set[int]:
        lanes, positions = self.plans[lease_id]
        return {seq for lane, pos in zip(lanes, positions) for seq in lane[pos:]}

    def leased(self, seq: int) -> bool:
        """Protected by a lease: its whole range, or for a plan lease its unread samples."""
        return any(seq in self.unread(lease_id) if lease_id in self.plans else lo <= seq < hi
                   for lease_id, (lo, hi) in self.leases.items())

    def protected(self, seq: int) -> bool:
        frontier = max((hi for lo, hi in self.leases.values() if hi > lo), default=None)
        return self.leased(seq) or (frontier is not None and seq >= frontier)

    def evict_to(self, limit: int) -> None:
        """Oldest first among the unprotected samples."""
        i = 0
        while i < len(self.present) and self.bytes > limit:
            if self.protected(self.present[i][0]):
                i += 1
            else:
                self.present.pop(i)

    def put(self, batch: list[tuple[str, int]]) -> tuple[int, bool]:
        """Predict put_many(wait=False): (number inserted, whether CacheFull is raised)."""
        cached = {key for _, key, _ in self.present}
        fresh: list[tuple[str, int]] = []
        for key, size in batch:
            if key not in cached:
                cached.add(key)
                fresh.append((key, size))
        incoming = sum(size for _, size in fresh)
        full = False
        if self.bytes + incoming > self.capacity:
            self.evict_to(max(0, self.capacity - incoming))
            room = self.capacity + self.headroom - self.bytes
            if incoming > room:
                fits, used = 0, 0
                for _, size in fresh:
                    if used + size > room:
                        break
                    used += size
                    fits += 1
                fresh, full = fresh[:fits], True
        for key, size in fresh:
            self.present.append((self.next_seq, key, size))
            self.next_seq += 1
        return len(fresh), full

    def snapshot(self) -> list[int]:
        """The newest samples whose bytes fit the capacity."""
        skip, excess = 0, self.bytes - self.capacity
        while excess > 0 and skip < len(self.present):
            excess -= self.present[skip][2]
            skip += 1
        return [seq for seq, _, _ in self.present[skip:]]


@dataclass
class Held:
    snap: Snapshot
    digests: dict[int, str]
    releasers: list[Releaser] = field(default_factory=list)


class EvictionMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ec-props-")
        self.path = f"{self.dir}/cache"
        self.cache: Cache | None = None
        self.model: Model | None = None
        self.held: dict[str, Held] = {}
        self.size_of: dict[str, int] = {}

    @initialize(
        capacity=st.sampled_from([12_000, 25_000, 40_000]),
        headroom=st.sampled_from([0.0, 0.1, 0.5]),
    )
    def open_cache(self, capacity: int, headroom: float) -> None:
        self.cache = Cache(self.path, capacity, headroom=headroom, sync=False)
        self.model = Model(capacity, self.cache.headroom_bytes)
        for key in KEYS:
            self.size_of[key] = len(store_of(self.cache).encode(key, content_for(key)))

    def teardown(self) -> None:
        for held in self.held.values():
            held.snap.release()
        if self.cache is not None:
            self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- steps ------------------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def put(self, keys: list[str]) -> None:
        assert self.cache is not None and self.model is not None
        inserted, full = self.model.put([(key, self.size_of[key]) for key in keys])
        try:
            result = self.cache.put_many([(key, content_for(key)) for key in keys], wait=False)
        except CacheFull as exc:
            assert full, "CacheFull raised but the model had room"
            assert exc.result.inserted == inserted  # type: ignore[attr-defined]
        else:
            assert not full, "the model expected CacheFull"
            assert result.inserted == inserted
            # Duplicates inside one batch are dropped before the store sees them.
            assert result.inserted + result.skipped == len(set(keys))

    @rule(target=snapshots)
    def snapshot(self) -> str:
        assert self.cache is not None and self.model is not None
        snap = self.cache.snapshot()
        expected = self.model.snapshot()
        assert list(map(int, snap.seqs)) == expected
        if expected:
            self.model.leases[snap.lease_id] = (expected[0], expected[-1] + 1)
        else:
            self.model.leases[snap.lease_id] = (self.model.next_seq, self.model.next_seq)
        by_seq = {seq: key for seq, key, _ in self.model.present}
        values = self.cache.get_many(expected)
        for seq, value in zip(expected, values):
            assert value == content_for(by_seq[seq])
        self.held[snap.lease_id] = Held(snap, {s: digest(v) for s, v in zip(expected, values)})
        return snap.lease_id

    @rule(target=snapshots, lanes=st.integers(1, 3), seed=st.integers(0, 3), repeat=st.booleans())
    def planned_snapshot(self, lanes: int, seed: int, repeat: bool) -> str:
        """A snapshot with a release plan: its samples shuffled into ``lanes`` readers' lanes
        (each sample twice with ``repeat``, as an epoch that resamples)."""
        lease_id = self.snapshot()
        held = self.held[lease_id]
        seqs = [int(s) for s in held.snap.seqs]
        if not seqs:
            return lease_id
        import random

        order = seqs * 2 if repeat else list(seqs)
        random.Random(seed).shuffle(order)
        split = [order[i::lanes] for i in range(lanes)]
        assert self.cache is not None and self.model is not None
        self._set_plan(lease_id, split)
        return lease_id

    def _set_plan(self, lease_id: str, lanes: list[list[int]]) -> None:
        import numpy as np

        from epochcache.store.leases import write_lease

        assert self.cache is not None and self.model is not None
        cache = self.cache
        (lease,) = [lease for lease in cache.leases() if lease.lease_id == lease_id]
        lease.plan_parts = 1
        from epochcache.store import plans

        plans.write_seqs(cache.path, lease_id, np.array(sorted(set(sum(lanes, []))),
                                                        dtype=np.uint64))
        store_of(cache).write_plan_part(lease_id, 0, [np.array(lane, dtype=np.uint64) for lane in lanes])
        store_of(cache).env.write(lambda txn: write_lease(txn, store_of(cache).dbs[b"leases"], lease))
        self.model.plans[lease_id] = (lanes, [0] * len(lanes))
        self.held[lease_id].releasers = [Releaser(cache.path, lease_id, 0, i)
                                         for i in range(len(lanes))]

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        """A reader of a plan lease releases the next samples of its lane."""
        assert self.model is not None
        # In the order they were taken (lease ids are random: sorting them would make the
        # draws differ from one replay to the next).
        planned = [lease_id for lease_id in self.model.plans if lease_id in self.held]
        if not planned:
            return
        lease_id = data.draw(st.sampled_from(planned))
        lanes, positions = self.model.plans[lease_id]
        lane = data.draw(st.integers(0, len(lanes) - 1))
        positions[lane] = min(len(lanes[lane]), positions[lane] + data.draw(st.integers(1, 4)))
        self.held[lease_id].releasers[lane].release(positions[lane])

    @rule(lease_id=consumes(snapshots))
    def release(self, lease_id: str) -> None:
        assert self.model is not None
        held = self.held.pop(lease_id)
        held.snap.release()
        del self.model.leases[lease_id]
        self.model.plans.pop(lease_id, None)

    @rule(fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    def evict(self, fraction: float) -> None:
        assert self.cache is not None and self.model is not None
        limit = int(self.model.capacity * fraction)
        before = len(self.model.present)
        self.model.evict_to(limit)
        eviction = self.cache.evict(limit)
        assert eviction.count == before - len(self.model.present)

    @precondition(lambda self: not self.held)
    @rule()
    def reopen(self) -> None:
        assert self.cache is not None and self.model is not None
        self.cache.close()
        self.cache = Cache(self.path, sync=False)
        assert self.cache.capacity_bytes == self.model.capacity
        assert self.cache.headroom_bytes == self.model.headroom

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def matches_model_and_invariants(self) -> None:
        if self.cache is None or self.model is None:
            return
        state = assert_consistent(self.cache)  # counters == recount, contiguous, index ok
        model = self.model
        # Invariant 3 (and the model): exactly the predicted samples, oldest evicted first.
        assert [(s, k) for s, k, _ in model.present] == list(zip(state.seqs, state.keys))
        assert state.counters.next_seq == model.next_seq
        # Invariant 2.
        assert state.bytes == model.bytes
        assert state.bytes <= model.capacity + model.headroom
        # Leases in the store are exactly the held ones.
        assert {lease.lease_id for lease in state.leases} == set(self.held)
        # Invariant 1: every held snapshot reads back unchanged.
        present = set(state.seqs)
        for lease_id, held in self.held.items():
            seqs = list(held.digests)
            if lease_id in model.plans:  # released samples may be gone, unread ones may not
                seqs = sorted(model.unread(lease_id))
            assert set(seqs) <= present, "a leased sample was evicted"
            values = self.cache.get_many(seqs)
            assert {s: digest(v) for s, v in zip(seqs, values)} == {
                s: held.digests[s] for s in seqs}


EvictionMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEvictionProperties = EvictionMachine.TestCase
