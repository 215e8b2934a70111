"""The eviction policy as a cache setting (issue 36): chosen with ``Cache(eviction=)`` or
``cache.eviction``, stored in the cache so that every writer process evicts alike, changed
only by a process alone with the cache; reads recorded when a lease ends, for a policy that
orders by them; any registered policy keeps invariants 1-3 and a cache it evicted verifies.

The policies here are registered by the tests themselves (and removed after), as a user's own
policy would be: a newest-first one (eviction that is not a prefix of the sequence numbers) and
one that only looks at the read log it is given.

Internals: ``plumbing.reclaim_leases`` is what the daemon does every few seconds.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
import pytest
import yaml
from common.cachecheck import assert_consistent, content_for
from common.procs import spawn_script

from epochcache import Cache
from epochcache.registry import EVICTION, register_policy
from epochcache.store.eviction import (
    Eviction,
    EvictionPolicy,
    evict_oldest,
    prune_origins,
    take,
)
from epochcache.store.leases import Lease
from epochcache.store.plumbing import reclaim_leases
from epochcache.store.reads import ReadLog, Reads, load_reads, reads_path
from epochcache.store.records import DB_KEYS, DB_SAMPLES, seq_of
from epochcache.store.release import Protection
from epochcache.store.tables import Counters
from epochcache.store.verify import verify_cache

SIZE = 1000


class NewestFirst(EvictionPolicy):
    """The newest sample no lease protects: eviction far from a prefix."""

    name = "newest-first"

    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection, reads: Reads) -> Eviction:
        result = Eviction()
        protection.sync(leases)
        cursor = txn.cursor(db=dbs[DB_SAMPLES])
        seqs = [seq_of(bytes(key)) for key in cursor.iternext(keys=True, values=False)]
        free = np.array(seqs, np.uint64)[~protection.protects(np.array(seqs, np.uint64))]
        for seq in free[::-1]:
            if counters.bytes <= limit_bytes:
                break
            cursor.set_key(int(seq).to_bytes(8, "big"))
            take(txn, cursor, dbs[DB_KEYS], counters, result)
        if counters.bytes > limit_bytes:
            result.blocked_by = max(protection.leases, key=lambda lease: lease.hi, default=None)
        if result.count:
            prune_origins(txn, dbs, leases)
        return result


class ReadsProbe(EvictionPolicy):
    """Oldest first, keeping the read log each pass was given."""

    name = "reads-probe"
    uses_reads = True
    seen: list[ReadLog] = []

    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection, reads: Reads) -> Eviction:
        ReadsProbe.seen.append(reads.current(txn, dbs))
        return evict_oldest(txn, dbs, counters, limit_bytes, leases, protection)


@pytest.fixture(autouse=True)
def policies() -> Iterator[None]:
    register_policy(NewestFirst.name, NewestFirst, "tests: newest first")
    register_policy(ReadsProbe.name, ReadsProbe, "tests: oldest first, reads seen")
    ReadsProbe.seen = []
    try:
        yield
    finally:
        EVICTION.pop(NewestFirst.name, None)
        EVICTION.pop(ReadsProbe.name, None)


def fill(cache: Cache, count: int, prefix: str = "k") -> None:
    cache.put_many([(f"{prefix}{i:03d}", content_for(f"{prefix}{i}", SIZE, compressible=False))
                    for i in range(count)])


def read_part(cache: Cache, batches: int) -> None:
    """One epoch in seq order, stopped after ``batches`` batches of 10."""
    for _epoch, loader in cache.epochs(1, batch_size=10, num_workers=0, shuffle=False):
        for index, _batch in enumerate(loader):
            if index == batches:
                break


def present(cache: Cache) -> list[int]:
    return assert_consistent(cache).seqs


def test_a_new_cache_stores_oldest_and_a_chosen_policy_is_kept_and_followed(
        tmp_path: Path) -> None:
    with Cache(tmp_path / "plain", "1MiB", sync=False) as cache:
        assert cache.eviction == "oldest"
    with Cache(tmp_path / "c", 30 * SIZE, headroom=0.0, compression="none", sync=False,
               eviction="newest-first") as cache:
        fill(cache, 25)
        assert cache.eviction == "newest-first"
    with Cache(tmp_path / "c", sync=False) as cache:  # None keeps the stored policy
        assert cache.eviction == "newest-first"
        fill(cache, 10, prefix="n")  # room for 10 more: the newest samples before them go
        seqs = present(cache)
    evicted = 35 - len(seqs)
    assert evicted > 0 and seqs == list(range(25 - evicted)) + list(range(25, 35))
    report = verify_cache(str(tmp_path / "c"))  # the counter check without a prefix
    assert report.ok and not report.counter_mismatches, report


def test_an_unknown_policy_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eviction: expected one of oldest.*got 'nope'"):
        Cache(tmp_path / "c", "1MiB", eviction="nope")
    assert not (tmp_path / "c").exists()


def test_the_policy_changes_only_when_no_other_process_has_the_cache_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="epochcache")
    path = tmp_path / "cache"
    Cache(path, "1MiB").close()
    writer = spawn_script(tmp_path, "writer", """
        import sys
        from epochcache import Cache
        cache = Cache(sys.argv[1])
        print("OPEN", cache.eviction, flush=True)
        sys.stdin.readline()
        cache.close()
        print("CLOSED", flush=True)
        sys.stdin.readline()
    """, str(path))
    try:
        writer.wait_line("OPEN oldest")
        with Cache(path, eviction="newest-first") as cache:
            assert cache.eviction == "oldest"  # kept: the writer evicts oldest first
        assert any("keeping eviction oldest instead of newest-first" in r.getMessage()
                   for r in caplog.records)
        writer.send("close")
        writer.wait_line("CLOSED")
        with Cache(path, eviction="newest-first") as cache:
            assert cache.eviction == "newest-first"
        assert any("eviction oldest -> newest-first" in r.getMessage() for r in caplog.records)
    finally:
        writer.close()


def test_reads_are_recorded_when_a_lease_ends_and_outlive_the_process(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, 60 * SIZE, headroom=0.0, compression="none", sync=False,
               eviction="reads-probe") as cache:
        fill(cache, 50)
        read_part(cache, 3)  # 30 samples read, then the epoch is abandoned
        read_part(cache, 2)
    log = load_reads(str(path))
    assert list(log.seqs) == list(range(30)) and list(log.bounds) == [50, 50]
    assert list(log.stamps) == [2] * 20 + [1] * 10  # each sample's newest read
    # Another writer process, started later, gets the log when it evicts.
    subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "sys.path[:0] = [sys.argv[2], sys.argv[3]]\n"
        "import test_eviction_setting as t\n"
        "from epochcache import Cache\n"
        "from epochcache.registry import register_policy\n"
        "register_policy('reads-probe', t.ReadsProbe)\n"
        "with Cache(sys.argv[1], sync=False) as cache:\n"
        "    t.fill(cache, 20, prefix='n')\n"
        "log = t.ReadsProbe.seen[-1]\n"
        "print(log.generation, list(log.seqs[:3]), list(log.stamps[:3]))\n"
        "assert log.generation == 2 and len(log.seqs) == 30, log\n"
    ), str(path), str(Path(__file__).parent), str(Path(__file__).parent / "common")],
        check=True, timeout=60)


def test_a_killed_trainers_reads_are_recorded_when_its_lease_is_reclaimed(
        tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, "1MiB", sync=False, eviction="reads-probe") as cache:
        fill(cache, 50)
    trainer = spawn_script(tmp_path, "trainer", """
        import sys
        import test_eviction_setting as t
        from epochcache import Cache
        from epochcache.registry import register_policy
        register_policy(t.ReadsProbe.name, t.ReadsProbe)
        cache = Cache(sys.argv[1], sync=False)
        for _epoch, loader in cache.epochs(1, batch_size=10, num_workers=0, shuffle=False):
            for index, _batch in enumerate(loader):
                if index == 2:  # done with two batches
                    print("READ", flush=True)
                    sys.stdin.readline()
    """, str(path))
    try:
        trainer.wait_line("READ", timeout_s=60)
        trainer.kill9()  # its lease stays until another process reclaims it
    finally:
        trainer.close()
    assert not Path(reads_path(str(path))).exists()
    with Cache(path, sync=False) as cache:
        (dead,) = reclaim_leases(cache)  # what the daemon does every few seconds
    log = load_reads(str(path))
    assert list(log.seqs) == list(range(20)) and list(log.bounds) == [50], dead


@pytest.mark.parametrize("damage", [b"PK\x03\x04 cut short", b"not a log at all", b""])
def test_a_damaged_read_log_is_ignored_and_written_anew(tmp_path: Path, damage: bytes,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cache"
    with Cache(path, 60 * SIZE, headroom=0.0, compression="none", sync=False,
               eviction="reads-probe") as cache:
        fill(cache, 40)
        read_part(cache, 1)
        Path(reads_path(cache.path)).write_bytes(damage)
        fill(cache, 30, prefix="n")  # evicts: the policy gets an empty log
        assert ReadsProbe.seen and not len(ReadsProbe.seen[-1].seqs)
        assert "the read log cannot be read" in caplog.text
        read_part(cache, 2)  # the next lease end writes it anew
    log = load_reads(str(path))
    assert len(log.seqs) == 20 and log.stamps.max() == 2


def test_no_read_log_is_kept_for_a_policy_that_does_not_order_by_reads(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", "1MiB", sync=False) as cache:
        fill(cache, 30)
        read_part(cache, 2)
    assert not Path(reads_path(str(tmp_path / "c"))).exists()
    with Cache(tmp_path / "c", sync=False, eviction="reads-probe") as cache:
        read_part(cache, 1)
        assert Path(reads_path(cache.path)).exists()
    with Cache(tmp_path / "c", sync=False, eviction="oldest"):
        pass  # a changed policy starts with no read log
    assert not Path(reads_path(str(tmp_path / "c"))).exists()


def test_protection_answers_for_any_sample(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", 100 * SIZE, compression="none", sync=False) as cache:
        fill(cache, 40)
        snap = cache.snapshot()  # protects 0..39 whole, and everything newer (the frontier)
        fill(cache, 5, prefix="n")
        protection = Protection(cache.path)
        protection.sync(cache.leases())
        seqs = np.array([0, 20, 39, 40, 44, 1000], np.uint64)
        assert protection.protects(seqs).all()
        snap.release()
        protection.sync(cache.leases())
        assert not protection.protects(seqs).any()  # no lease: no frontier either


def test_a_refused_eviction_in_the_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    config = {"cache": {"dir": str(tmp_path / "c"), "capacity": "1MiB", "eviction": "newest"},
              "source": {"url": (tmp_path / "data").as_uri()}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "epochcache", "config", "cfg.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cache.eviction: expected one of oldest" in done.stderr
    assert "got 'newest'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "c").exists()
