"""Invariant 4 and lease reclaim with real processes and real signals.

* A writer process is SIGKILLed mid-stream at several seeded random moments, the same cache
  reused each time. The writer appends the keys of each batch to a report file right after
  ``put_many`` returns. Afterwards the cache opens, a full check is clean (counters recomputed
  from the records, every record's checksum, ``verify_cache``), and every reported key is
  present unless it was evicted, and eviction only ever took the oldest ones.
* A process holding a snapshot is SIGKILLed: its lease is reclaimed (by ``put_many`` under
  back-pressure, by ``reclaim_leases()``, by ``snapshot()``) and eviction proceeds.

Internals: the lease table (``cache.env``) and ``plumbing.reclaim_leases``, what the daemon runs
every few seconds, are the invariant under test.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from common.cachecheck import assert_consistent, content_for, full_check
from common.procs import Proc, spawn_script

from epochcache import Cache, CacheError, CacheFull
from epochcache.paths import process_stat
from epochcache.store.env import Env
from epochcache.store.plumbing import reclaim_leases

WRITER = """
import os, sys
from epochcache import Cache
from common.cachecheck import content_for

path, report_path, tag, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cache = Cache(path)  # the default: sync=True, like the daemon
fd = os.open(report_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
print("READY", flush=True)
i = 0
while True:
    keys = [f"{tag}-{j}" for j in range(i, i + batch)]
    result = cache.put_many([(k, content_for(k)) for k in keys])
    assert result.inserted == batch, result
    os.write(fd, ("\\n".join(keys) + "\\n").encode())  # one write: reported only once returned
    i += batch
"""

CAPACITY = 400_000
BATCH = 6


def _reported(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    return [line for line in lines[:-1] if line]  # a trailing partial line is not reported


def test_writer_killed_at_random_moments_loses_nothing_committed(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    Cache(path, CAPACITY).close()
    report = tmp_path / "committed.txt"
    rng = random.Random(20240601)
    reported_so_far: list[str] = []
    # Every key known to be committed, in commit order: each writer's reported keys, then the
    # batch it committed but was killed before reporting (if any). Such a batch stays in the
    # cache for the next writers' checks (until evicted as one of the oldest).
    committed: list[str] = []
    unreported_seen = 0
    for rep in range(5):
        tag = f"r{rep}"
        writer = spawn_script(tmp_path, f"writer{rep}", WRITER, path, str(report), tag, str(BATCH))
        try:
            if rep == 0:
                # Anywhere from interpreter start-up through opening the cache to writing.
                time.sleep(rng.uniform(0.0, 0.6))
            else:
                writer.wait_line("READY", 60)
                time.sleep(rng.uniform(0.0, 0.4))
            assert writer.popen.poll() is None, writer.stderr()
        finally:
            code = writer.kill9()
            writer.close()
        assert code == -signal.SIGKILL

        state = full_check(path)  # opens in this process as a fresh one would, verify is clean
        reported = _reported(report)
        new = reported[len(reported_so_far) :]
        assert reported[: len(reported_so_far)] == reported_so_far
        assert all(k.startswith(f"{tag}-") for k in new)
        reported_so_far = reported
        present = state.key_to_seq

        # Keys present but neither reported nor known: at most the one batch this writer
        # committed right before the kill, and then all of it (a batch is one transaction:
        # never torn).
        known = set(reported) | set(committed)
        extra = [k for k in state.keys if k not in known]
        if extra:
            unreported_seen += 1
            n_new = len(new)
            assert extra == [f"{tag}-{j}" for j in range(n_new, n_new + BATCH)], extra
        committed += new + extra
        # Every committed key is present, or was evicted as one of the oldest.
        missing = [k for k in committed if k not in present]
        assert missing == committed[: len(missing)], f"rep {rep}: a newer committed sample is gone"
        assert state.counters.evicted >= len(missing)
        # Present samples are the newest, in commit order, with the bytes that were written.
        assert state.keys == [k for k in committed if k in present]
        cache = Cache(path)
        try:
            for key, value in zip(state.keys, cache.get_many(state.seqs)):
                assert value == content_for(key), key
        finally:
            cache.close()
        assert state.bytes <= CAPACITY
    assert len(reported_so_far) > 10 * BATCH, "the writers hardly wrote anything before the kills"
    state = full_check(path)
    assert state.counters.evicted > 0, "eviction never ran across the crashes"


def test_cache_killed_during_creation_reopens_cleanly(tmp_path: Path) -> None:
    """A kill between creating the LMDB environment and writing the cache's settings."""
    path = str(tmp_path / "cache")
    Env(path).close()  # what Cache() has done before it writes capacity and headroom
    with Cache(path, "1MiB", sync=False) as cache:
        assert cache.capacity_bytes == 1024**2
        cache.put("a", b"a")
        assert_consistent(cache)


def test_half_created_cache_is_not_opened_with_capacity_zero(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    Env(path).close()  # killed before the capacity was written
    with pytest.raises(CacheError, match="capacity"):
        cache = Cache(path)
        cache.close()


# -- dead lease owners -----------------------------------------------------------------------

OWNER = """
import sys
from epochcache import Cache
cache = Cache(sys.argv[1])
snap = cache.snapshot(epoch=7)
print("SNAP", snap.lease_id, int(snap.seqs[0]), int(snap.seqs[-1]), flush=True)
sys.stdin.readline()  # hold the lease until killed
"""


def _fill(cache: Cache, prefix: str, nbytes: int) -> list[str]:
    keys = []
    i = 0
    while cache.counters().bytes + 2100 <= nbytes:
        key = f"{prefix}{i}"
        cache.put(key, content_for(key, 2000, compressible=False), wait=False)
        keys.append(key)
        i += 1
    return keys


def _pinned_cache(tmp_path: Path) -> tuple[Cache, Proc, str]:
    cache = Cache(tmp_path / "cache", 40_000, sync=False)
    _fill(cache, "old", 40_000)
    owner = spawn_script(tmp_path, "owner", OWNER, cache.path)
    lease_id = owner.wait_line("SNAP", 60).split()[1]
    [lease] = cache.leases()
    assert (lease.lease_id, lease.pid, lease.lo) == (lease_id, owner.pid, 0)
    # While the owner lives, its lease holds: the headroom fills, then back-pressure.
    with pytest.raises(CacheFull, match=str(owner.pid)):
        for i in range(50):
            cache.put(f"new{i}", content_for(f"new{i}", 2000, compressible=False), wait=False)
    assert reclaim_leases(cache) == []
    state = assert_consistent(cache)
    assert state.first_seq == 0 and state.bytes > 40_000
    return cache, owner, lease_id


@pytest.mark.parametrize("reclaimer", ["put_many", "reclaim_leases", "snapshot"])
def test_lease_of_a_killed_owner_is_reclaimed(tmp_path: Path, reclaimer: str) -> None:
    cache, owner, lease_id = _pinned_cache(tmp_path)
    try:
        assert owner.kill9() == -signal.SIGKILL
        before = assert_consistent(cache)
        if reclaimer == "put_many":
            cache.put("after", content_for("after", 2000, compressible=False), wait=False)
        elif reclaimer == "reclaim_leases":
            [dead] = reclaim_leases(cache)
            assert dead.lease_id == lease_id and dead.pid == owner.pid
        else:
            cache.snapshot().release()
            cache.put("after", content_for("after", 2000, compressible=False), wait=False)
        assert lease_id not in {lease.lease_id for lease in cache.leases()}
        after = assert_consistent(cache)
        assert after.first_seq is not None and after.first_seq > 0  # the oldest went
        assert after.counters.evicted > before.counters.evicted
        assert after.bytes <= 40_000 + (0 if reclaimer == "reclaim_leases" else 4_000)
    finally:
        owner.close()
        cache.close()


def test_lease_of_an_unreaped_zombie_owner_is_reclaimed(tmp_path: Path) -> None:
    cache, owner, lease_id = _pinned_cache(tmp_path)
    try:
        os.kill(owner.pid, signal.SIGKILL)  # not waited for: the owner stays a zombie
        deadline = time.monotonic() + 10
        while _proc_state(owner.pid) != "Z":
            assert time.monotonic() < deadline, "owner did not become a zombie"
            time.sleep(0.01)
        # The leader is a zombie once its own thread exited; the process's lock goes with its
        # last thread (the owner's heartbeat thread), a moment later.
        while not (reclaimed := reclaim_leases(cache)):
            assert time.monotonic() < deadline, "the zombie's lease was not reclaimed"
            time.sleep(0.01)
        [dead] = reclaimed
        assert dead.lease_id == lease_id
        assert assert_consistent(cache).bytes <= 40_000
    finally:
        owner.close()
        cache.close()


def test_live_lease_on_a_recycled_pid_is_not_confused(tmp_path: Path) -> None:
    """A lease of an older version (no owner lock: judged by pid on its host) whose pid now
    belongs to another process (different start time) is dead."""
    cache = Cache(tmp_path / "cache", 40_000, sync=False)
    try:
        _fill(cache, "old", 40_000)
        snap = cache.snapshot()
        # Rewrite the lease as if our pid had been recycled: same pid, another start time.
        from epochcache.store.leases import read_leases, write_lease
        from epochcache.store.records import DB_LEASES

        def age(txn):  # type: ignore[no-untyped-def]
            [lease] = read_leases(txn, cache.env.dbs[DB_LEASES])
            lease.start_ticks = (lease.start_ticks or 0) + 12345
            lease.owner = ""  # written by a version without owner locks
            write_lease(txn, cache.env.dbs[DB_LEASES], lease)

        cache.env.write(age)
        [dead] = reclaim_leases(cache)
        assert dead.lease_id == snap.lease_id
        snap.release()
    finally:
        cache.close()


def _proc_state(pid: int) -> str | None:
    stat = process_stat(pid)
    return None if stat is None else stat[0]
