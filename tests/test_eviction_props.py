"""Property-based test of eviction and lease bookkeeping (invariants 1-3), for every
registered eviction policy.

A hypothesis state machine drives a real Cache through random put / snapshot / read / release /
evict / reopen steps and a plain Python model predicts, step by step, which samples are
present. After every step it checks, against the raw records:

1. every sample of a held snapshot is present and reads back unchanged;
2. stored bytes never exceed capacity + headroom, and the counters match a recount;
3. eviction took only samples no lease protects (a snapshot's range or, with a plan, its
   unread samples, and everything newer than the newest non-empty snapshot), stopped as soon as
   the limit was met and only short of it when everything left was protected (back-pressure);
   for a policy whose order the model knows (`ORDERS`), the evicted samples are exactly the
   first ones in that order.

The model records reads as the cache does when a lease ends (its lanes' read prefixes, one
generation per lease; `epochcache.store.reads`), for orders that use them. A policy with no
order in `ORDERS` is checked on invariants 1-3 alone. Policies other than the default run
fewer examples by default; ``-m slow`` runs them all as long.

Internals: the model checks record sizes (``cache.writer.encode``), plans
(``reads.write_part``) and the lease table (``cache.env``) against the store.
"""

from __future__ import annotations

import bisect
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
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
from test_eviction_setting import NewestFirst

from epochcache import Cache, CacheFull, Snapshot
from epochcache.registry import EVICTION, policy_names, register_policy
from epochcache.store.reads import Releaser, write_part

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
    #: The eviction order among the present samples (None: the policy's is not modelled;
    #: bytes are then predicted oldest first, which decides the same whether a put fits).
    order: Callable[[Model], list[int]] | None = None
    #: The read log: each read sample's newest generation, and next_seq at each generation.
    reads: dict[int, int] = field(default_factory=dict)
    bounds: list[int] = field(default_factory=list)
    #: Bytes the last put brought in (after dropping the keys cached already).
    incoming: int = 0

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
        """In the policy's order (oldest first if not modelled) among the unprotected
        samples."""
        order = self.order(self) if self.order else [seq for seq, _, _ in self.present]
        size = {seq: size for seq, _, size in self.present}
        total, gone = self.bytes, set()
        for seq in order:
            if total <= limit:
                break
            if not self.protected(seq):
                gone.add(seq)
                total -= size[seq]
        self.present = [item for item in self.present if item[0] not in gone]

    def end_lease(self, lease_id: str) -> None:
        """A lease ends: with a plan, what its lanes read is recorded as a generation."""
        del self.leases[lease_id]
        lanes, positions = self.plans.pop(lease_id, ([], []))
        read = {seq for lane, pos in zip(lanes, positions) for seq in lane[:pos]}
        if read:
            self.bounds.append(self.next_seq)
            for seq in read:
                self.reads[seq] = len(self.bounds)

    def put(self, batch: list[tuple[str, int]]) -> tuple[int, bool]:
        """Predict put_many(wait=False): (number inserted, whether CacheFull is raised)."""
        cached = {key for _, key, _ in self.present}
        fresh: list[tuple[str, int]] = []
        for key, size in batch:
            if key not in cached:
                cached.add(key)
                fresh.append((key, size))
        incoming = sum(size for _, size in fresh)
        self.incoming = incoming
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


def oldest_order(model: Model) -> list[int]:
    return [seq for seq, _, _ in model.present]


def least_recently_read_order(model: Model) -> list[int]:
    """By the generation of the newest read (never read: the one current at insertion, the
    bounds at or below its seq), then oldest first."""
    def stamp(seq: int) -> int:
        return model.reads.get(seq, bisect.bisect_right(model.bounds, seq))

    return sorted((seq for seq, _, _ in model.present), key=lambda seq: (stamp(seq), seq))


#: The eviction order of each policy the model knows, among the present samples.
ORDERS: dict[str, Callable[[Model], list[int]]] = {
    "oldest": oldest_order, "least-recently-read": least_recently_read_order}
#: A policy of the tests' own (registered while a machine runs): eviction far from a prefix.
TEST_POLICIES = {NewestFirst.name: NewestFirst}


class EvictionMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")
    #: The cache's eviction policy (a subclass per registered policy, below).
    policy = "oldest"

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
        if self.policy in TEST_POLICIES:
            register_policy(self.policy, TEST_POLICIES[self.policy])
        self.cache = Cache(self.path, capacity, headroom=headroom, sync=False,
                           eviction=self.policy)
        assert self.cache.eviction == self.policy
        self.model = Model(capacity, self.cache.headroom_bytes, order=ORDERS.get(self.policy))
        for key in KEYS:
            self.size_of[key] = len(self.cache.writer.encode(key, content_for(key)))

    def teardown(self) -> None:
        for held in self.held.values():
            held.snap.release()
        if self.cache is not None:
            self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.policy in TEST_POLICIES:
            EVICTION.pop(self.policy, None)

    # -- steps ------------------------------------------------------------------------------

    def _before(self) -> tuple[list[tuple[int, str, int]], set[int]]:
        """The present samples and those protected, before a step that may evict."""
        assert self.model is not None
        present = list(self.model.present)
        return present, {seq for seq, _, _ in present if self.model.protected(seq)}

    def _check_eviction(self, before: tuple[list[tuple[int, str, int]], set[int]],
                        target: int) -> None:
        """For a policy the model does not order: eviction took only unprotected samples,
        enough to reach ``target`` bytes (of the samples there before) and no more, or all it
        could; then the model follows the cache."""
        assert self.cache is not None and self.model is not None
        if self.model.order is not None:
            return
        present, protected = before
        state = assert_consistent(self.cache)
        now = set(state.seqs)
        gone = [(seq, size) for seq, _, size in present if seq not in now]
        assert not {seq for seq, _ in gone} & protected, "a protected sample was evicted"
        left = [(seq, size) for seq, _, size in present if seq in now]
        kept = sum(size for _, size in left)
        if gone:  # before the last one went, the limit was not met
            assert kept + max(size for _, size in gone) > target, "evicted past the limit"
        assert kept <= target or all(seq in protected for seq, _ in left), (
            "eviction stopped short of the limit while unprotected samples were left")
        self.model.present = list(zip(state.seqs, state.keys, state.sizes))

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6))
    def put(self, keys: list[str]) -> None:
        assert self.cache is not None and self.model is not None
        before = self._before()
        old_bytes = self.model.bytes
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
        incoming = self.model.incoming
        if old_bytes + incoming > self.model.capacity:
            self._check_eviction(before, max(0, self.model.capacity - incoming))
        elif self.model.order is None:
            self._check_eviction(before, old_bytes)  # nothing was to be evicted

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
        from epochcache.store import reads as plans

        plans.write_seqs(cache.path, lease_id, np.array(sorted(set(sum(lanes, []))),
                                                        dtype=np.uint64))
        write_part(cache.path, lease_id, 0, [np.array(lane, dtype=np.uint64) for lane in lanes])
        cache.env.write(lambda txn: write_lease(txn, cache.env.dbs[b"leases"], lease))
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
        self.model.end_lease(lease_id)

    @rule(fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    def evict(self, fraction: float) -> None:
        assert self.cache is not None and self.model is not None
        limit = int(self.model.capacity * fraction)
        before = self._before()
        self.model.evict_to(limit)
        eviction = self.cache.evict(limit)
        self._check_eviction(before, limit)
        assert eviction.count == len(before[0]) - len(self.model.present)

    @precondition(lambda self: not self.held)
    @rule()
    def reopen(self) -> None:
        assert self.cache is not None and self.model is not None
        self.cache.close()
        self.cache = Cache(self.path, sync=False)
        assert self.cache.eviction == self.policy  # stored in the cache
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


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


EvictionMachine.TestCase.settings = _settings(150)
TestEvictionProperties = EvictionMachine.TestCase


def _machine(policy: str) -> type[EvictionMachine]:
    return type(f"EvictionMachine_{policy}", (EvictionMachine,), {"policy": policy})


# Every other registered policy: a representative run by default, the full one with -m slow.
for _policy in [*policy_names(), *TEST_POLICIES]:
    if _policy == EvictionMachine.policy:
        continue
    _name = "".join(part.title() for part in _policy.replace("_", "-").split("-"))
    for _suffix, _examples in (("", 30), ("Full", 150)):
        _case = _machine(_policy).TestCase
        _case.settings = _settings(_examples)
        _case.__name__ = _case.__qualname__ = f"TestEvictionProperties{_name}{_suffix}"
        globals()[_case.__name__] = pytest.mark.slow(_case) if _suffix else _case
