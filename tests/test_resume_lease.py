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


def test_why_each_lease_ended_is_kept_whichever_process_ended_it(tmp_path: Path) -> None:
    # note_end appends to the document it wrote last without parsing it again (issue 35):
    # an end noted by another process in between must be kept, and only the last 64.
    import subprocess
    import sys

    from epochcache.store.plumbing import lease_end

    path = tmp_path / "c"
    other = ("import sys\nfrom epochcache import Cache\n"
             "with Cache(sys.argv[1], sync=False) as cache:\n"
             "    snap = cache.snapshot(label='other')\n    snap.release()\n"
             "    print(snap.lease_id)\n")
    with Cache(path, "1MiB", sync=False) as cache:
        cache.put("k", b"x")
        ours = []
        for _ in range(3):
            snap = cache.snapshot()
            snap.release()
            ours.append(snap.lease_id)
        theirs = subprocess.run([sys.executable, "-c", other, str(path)], check=True,
                                capture_output=True, text=True, timeout=60).stdout.strip()
        for _ in range(61):
            snap = cache.snapshot()
            snap.release()
            ours.append(snap.lease_id)
        assert lease_end(cache, ours[0]) is None  # the 65th end pushed the first one out
        assert all("at the end of its epoch" in (lease_end(cache, lease) or "")
                   for lease in ours[1:])
        assert "released by its owner" in (lease_end(cache, theirs) or "")
