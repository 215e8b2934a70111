"""Least-recently-read eviction (issue 36): after epochs that read only part of the cache, the
samples they did not read go first; the order survives a restart of the writers (the read log
is a file), and the policy is chosen from ``Cache(eviction=)`` or ``cache.eviction``.

Exact victims under random steps are checked by the eviction property machine
(``tests/test_eviction_props.py``, which runs every registered policy); here the behaviour users
asked for, end to end: real epochs (progressive release records the reads), real writer and
daemon processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from common.cachecheck import assert_consistent, content_for
from common.daemonproc import wait_for

import epochcache as ec
from epochcache import Cache
from epochcache.store.verify import verify_cache

LRR = "least-recently-read"
SIZE = 1000


def fill(cache: Cache, count: int, prefix: str = "k") -> None:
    cache.put_many([(f"{prefix}{i:03d}", content_for(f"{prefix}{i}", SIZE, compressible=False))
                    for i in range(count)])


def read_part(cache: Cache, batches: int | None = None) -> None:
    """One epoch in seq order (samples 0, 1, ... first), stopped once the loop is done with
    ``batches`` batches of 10 (None: read to its end)."""
    for _epoch, loader in cache.epochs(1, batch_size=10, num_workers=0, shuffle=False):
        for index, _batch in enumerate(loader):
            if index == batches:
                break


def missing(path: Path, below: int) -> list[int]:
    with Cache(path, readonly=True) as cache:
        present = set(assert_consistent(cache).seqs)
    return [seq for seq in range(below) if seq not in present]


@pytest.mark.parametrize("policy", ["oldest", LRR])
def test_after_epochs_that_reread_half_the_cache_the_other_half_goes_first(
        tmp_path: Path, policy: str) -> None:
    path = tmp_path / "cache"
    with Cache(path, 100 * (SIZE + 40), headroom=0.0, compression="none", sync=False,
               eviction=policy) as cache:
        fill(cache, 100)
        read_part(cache)  # every sample read once
        for _ in range(2):
            read_part(cache, 5)  # then only the older half, 0-49, twice
        fill(cache, 30, prefix="n")
    gone = missing(path, 100)
    assert len(gone) == 30
    if policy == LRR:
        assert gone == list(range(50, 80))  # the half not read again, oldest first
    else:
        assert gone == list(range(30))
    report = verify_cache(str(path))  # eviction far from a prefix: the counters still agree
    assert report.ok and not report.counter_mismatches, report


def test_a_restarted_writer_keeps_the_order(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with Cache(path, 60 * (SIZE + 40), headroom=0.0, compression="none", sync=False,
               eviction=LRR) as cache:
        fill(cache, 60)
        read_part(cache, 2)  # 0-19 read; 20-59 never
    code = ("import sys\n"
            "sys.path[:0] = [sys.argv[2], sys.argv[3]]\n"
            "import test_eviction_lrr as t\n"
            "with t.Cache(sys.argv[1], sync=False) as cache:\n"
            "    assert cache.eviction == t.LRR, cache.eviction\n"
            "    t.fill(cache, 10, prefix='n')\n")
    tests = Path(__file__).parent
    subprocess.run([sys.executable, "-c", code, str(path), str(tests), str(tests / "common")],
                   check=True, timeout=60)
    assert missing(path, 60) == list(range(20, 30))


def test_the_policy_chosen_in_the_config_rules_the_daemon_across_restarts(
        tmp_path: Path) -> None:
    from epochcache.demo import write_demo_data

    url = (tmp_path / "remote").as_uri()
    write_demo_data(f"{url}/old", 100, "files", sample_bytes=1024)
    write_demo_data(f"{url}/new", 20, "files", sample_bytes=1024)
    cache_dir = tmp_path / "cache"

    def config(pattern: str, capacity: int | str, **cache: object) -> dict[str, object]:
        return {
            "source": {"url": url, "pattern": pattern, "timeout_s": 5, "list_deadline_s": 3},
            "cache": {"dir": str(cache_dir), "capacity": capacity, "headroom": 0, **cache},
            "sampler": {"processes": 1, "concurrency": 4, "batch_size": 4},
        }

    def counters() -> ec.Counters:  # type: ignore[name-defined]
        with Cache(cache_dir, readonly=True) as cache:
            return cache.counters()

    # The first 100 samples, by a daemon that chooses the policy.
    with ec.Daemon(config("old/*.npy", "1MiB", eviction=LRR)):
        wait_for(lambda: counters().samples == 100, 60, "100 samples cached")
    stored = counters().bytes
    with Cache(cache_dir, sync=False) as cache:
        assert cache.eviction == LRR
        read_part(cache, 3)  # a trainer reads 0-29 between the daemon's runs
    # A daemon whose config leaves the policy out keeps it; its samplers evict by it.
    with ec.Daemon(config("new/*.npy", stored)):
        wait_for(lambda: counters().inserted == 120, 60, "20 new samples cached")
    with Cache(cache_dir, readonly=True) as cache:
        assert cache.eviction == LRR
    gone = missing(cache_dir, 100)
    assert 15 <= len(gone) <= 25 and gone == list(range(30, 30 + len(gone)))  # never read


def test_the_config_accepts_the_policy_by_name(tmp_path: Path) -> None:
    text = yaml.safe_dump({"cache": {"dir": str(tmp_path / "c"), "capacity": "1MiB",
                                     "eviction": LRR},
                           "source": {"url": (tmp_path / "data").as_uri()}})
    (tmp_path / "cfg.yaml").write_text(text)
    assert ec.load_config(str(tmp_path / "cfg.yaml")).cache.eviction == LRR
    (tmp_path / "bad.yaml").write_text(text.replace(LRR, "least-read"))
    with pytest.raises(ec.ConfigError, match=f"cache.eviction: expected one of oldest, {LRR}"):
        ec.load_config(str(tmp_path / "bad.yaml"))
