"""The lease of an interrupted epoch outlives its owner when a checkpoint names it, for
``cache.resume_grace_s``, so that a resumed run can adopt it and find the epoch's samples
(issue 21, item 4); without a checkpoint, or after the grace, it is reclaimed as before.

Internals: ``plumbing.adopt_lease`` and ``plumbing.reclaim_leases`` are what a resumed run and
the daemon call.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from common.cachecheck import content_for
from common.procs import spawn_script

from epochcache import Cache, CacheFull
from epochcache.store.plumbing import adopt_lease, reclaim_leases

OWNER = """
import sys
from epochcache import Cache
cache = Cache(sys.argv[1])
snap = cache.snapshot(epoch=2)
grace = float(sys.argv[2])
if grace:
    cache.keep_for_resume(snap.lease_id, grace)
print("SNAP", snap.lease_id, flush=True)
sys.stdin.readline()
"""


def _cache(tmp_path: Path) -> Cache:
    cache = Cache(tmp_path / "cache", 40_000, sync=False)
    cache.put_many([(f"k{i}", content_for(f"k{i}", 2000, compressible=False))
                    for i in range(18)])
    return cache


def _killed_owner(tmp_path: Path, cache: Cache, grace: float) -> str:
    owner = spawn_script(tmp_path, "owner", OWNER, cache.path, str(grace))
    try:
        lease_id = owner.wait_line("SNAP", 60).split()[1]
    finally:
        owner.close()  # SIGKILL: a node failure, a preemption without notice
    return lease_id


def test_a_checkpointed_lease_is_kept_for_its_grace_and_adopted(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    lease_id = _killed_owner(tmp_path, cache, grace=600.0)
    assert reclaim_leases(cache) == []  # its owner is dead, but a checkpoint names it
    with pytest.raises(CacheFull):  # writers get the headroom, and nothing is evicted
        cache.put_many([(f"new{i}", content_for(f"new{i}", 2000, compressible=False))
                        for i in range(8)], wait=False)
    assert cache.counters().evicted == 0
    lease = adopt_lease(cache, lease_id)
    assert lease is not None and lease.lease_id == lease_id
    (stored,) = [one for one in cache.leases() if one.lease_id == lease_id]
    assert stored.pid != 0 and stored.is_alive(time.time_ns(), cache_path=cache.path)
    assert reclaim_leases(cache) == []  # held by this process now
    assert cache.release_lease(lease_id)
    cache.close()


def test_a_checkpointed_lease_is_reclaimed_after_its_grace(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    lease_id = _killed_owner(tmp_path, cache, grace=0.5)
    time.sleep(0.8)
    assert [dead.lease_id for dead in reclaim_leases(cache)] == [lease_id]
    assert adopt_lease(cache, lease_id) is None
    cache.close()


def test_without_a_checkpoint_a_dead_owners_lease_goes_at_once(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    lease_id = _killed_owner(tmp_path, cache, grace=0.0)
    assert [dead.lease_id for dead in reclaim_leases(cache)] == [lease_id]
    cache.close()
