"""Per-source counters (``sources:``): kept in the same transactions as the samples they count,
so they match the records through inserts, eviction by age, leases and quarantine.

Internals: the counters under test are the store's (``plumbing.register_sources``,
``plumbing.source_stats``, ``cache.env``, ``cache.tables``).
"""

from __future__ import annotations

from pathlib import Path

from common.cachecheck import recount
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochcache import Cache
from epochcache.errors import CacheFull
from epochcache.store.plumbing import register_sources, source_stats
from epochcache.store.records import DB_META
from epochcache.store.tables import registered_names


def actual(cache: Cache, names: list[str]) -> dict[str, dict[str, int]]:
    with cache.env.read() as txn:
        return recount(txn, cache.env.dbs, names)


def held(cache: Cache) -> dict[str, dict[str, int]]:
    return {name: {"samples": v["samples"], "bytes": v["bytes"]}
            for name, v in source_stats(cache).items()}


def test_single_source_cache_has_no_source_counters(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", capacity=10**6) as cache:
        cache.put_many([("dir/a.npy", b"x" * 10), ("b.npy", b"y" * 10)])
        assert source_stats(cache) == {}
        assert cache.stats()["sources"] == {}


def test_counts_follow_inserts_eviction_and_quarantine(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", capacity=4000, headroom=0, compression="none") as cache:
        cache.put_many([("a/0", b"p" * 100)])  # cached before "a" is registered: counted then
        assert register_sources(cache, ["a", "b"]) == ["a", "b"]
        assert register_sources(cache, ["b", "a"]) == []
        stats = source_stats(cache)
        assert stats["a"]["samples"] == 1 and stats["a"]["ingested"] == 1
        assert stats["b"] == {**stats["b"], "samples": 0, "bytes": 0, "ingested": 0}
        # the same source key in two sources: two samples; "c" is not registered
        cache.put_many([("a/k", b"1" * 500), ("b/k", b"2" * 500), ("c/k", b"3" * 500),
                        ("k", b"4" * 500)])
        assert held(cache) == actual(cache, ["a", "b"])
        assert source_stats(cache)["b"]["ingested"] == 1
        for i in range(20):  # turns the cache over: evicts oldest first across all sources
            cache.put_many([(f"{'ab'[i % 2]}/n{i}", bytes([i]) * 300)])
            assert held(cache) == actual(cache, ["a", "b"])
        stats = source_stats(cache)
        assert stats["a"]["evicted"] > 0 and stats["b"]["evicted"] > 0
        assert stats["a"]["inserted"] == 12 and stats["b"]["inserted"] == 11
        cache.tables.quarantine("b/bad", "corrupt")
        cache.tables.quarantine("zzz", "corrupt")
        assert source_stats(cache)["b"]["quarantined"] == 1
        assert cache.stats()["quarantined"] == 2
        assert cache.stats()["sources"]["b"]["quarantined"] == 1


def test_counters_survive_reopening(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", capacity=10**6) as cache:
        register_sources(cache, ["x"])
        cache.put_many([("x/1", b"a" * 10)])
    with Cache(tmp_path / "c", readonly=True) as cache:
        assert source_stats(cache)["x"]["samples"] == 1
        with cache.env.read() as txn:
            assert registered_names(txn, cache.env.dbs[DB_META]) == ["x"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "lease", "release"]),
                          st.integers(1, 900)), min_size=1, max_size=40))
def test_counters_match_the_records_through_leases(tmp_path: Path, ops: list[tuple[str, int]]) -> None:
    path = tmp_path / f"c{abs(hash(tuple(ops)))}"
    with Cache(path, capacity=3000, headroom=1000, compression="none") as cache:
        register_sources(cache, ["a", "b"])
        snaps = []
        for i, (op, size) in enumerate(ops):
            if op == "lease":
                snaps.append(cache.snapshot())
            elif op == "release" and snaps:
                snaps.pop(0).release()
            elif op in "abc":
                try:
                    cache.put_many([(f"{op}/{i}", b"z" * size)], wait=False)
                except CacheFull:
                    pass  # leases pin the cache: nothing was committed
            assert held(cache) == actual(cache, ["a", "b"])
        for snap in snaps:
            snap.release()

