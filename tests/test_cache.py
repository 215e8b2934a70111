"""The cache layer through its public surface: round trips, dedupe, capacity, age order,
back-pressure, counters, bounded side tables, capacity strings, reopening, file modes.

Every test re-derives the cache's state from the raw records (``common.cachecheck``) rather
than trusting the cache's own counters.

Internals: the side tables' bounds and the record framing (``cache.tables``,
``cache.writer.encode``, ``plumbing.append_history``) are what the daemon writes, which no
public call shows.
"""

from __future__ import annotations

import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from common.cachecheck import assert_consistent, content_for, digest

import epochcache.store.tables as cache_module
from epochcache import Cache, CacheError, CacheFull, SampleTooLarge
from epochcache.store.plumbing import append_history
from epochcache.store.records import HEADER, Codec, RecordFlags, pack_fields

MakeCache = Callable[..., Cache]


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[MakeCache]:
    """``make_cache(capacity, name="c", **kwargs)``: a Cache in tmp_path, closed at teardown."""
    opened: list[Cache] = []

    def make(capacity: Any = 64 * 1024, name: str = "c", **kwargs: Any) -> Cache:
        kwargs.setdefault("sync", False)
        cache = Cache(tmp_path / name, capacity, **kwargs)
        opened.append(cache)
        return cache

    yield make
    for cache in reversed(opened):
        cache.close()


def _record_size(cache: Cache, key: str, value: bytes | dict[str, bytes]) -> int:
    return len(cache.writer.encode(key, value))


# -- round trips ------------------------------------------------------------------------------


def test_round_trip_bytes_and_fields_with_the_codec_recorded(make_cache: MakeCache) -> None:
    cache = make_cache(10 * 1024 * 1024)
    rng = random.Random(1)
    text = b"the quick brown fox jumps over the lazy dog\n" * 4000
    noise = rng.randbytes(300_000)  # > 2 probe blocks: exercises the trial-compression path
    small_noise = rng.randbytes(5000)
    items: dict[str, bytes | dict[str, bytes]] = {
        "text.bin": text,
        "noise.bin": noise,
        "small-noise.bin": small_noise,
        "tiny.bin": b"x" * 10,  # below the compression threshold
        "empty.bin": b"",
        "fields-text": {"txt": text[:5000], "cls": b"3"},
        "fields-noise": {"jpg": small_noise, "cls": b"7", "json": b'{"a": 1}'},
        "fields-empty": {},
        "unicodé/kéy ✓.bin": b"payload",
    }
    result = cache.put_many(list(items.items()))
    assert result.inserted == len(items) and result.skipped == 0 and result.evicted == 0
    assert result.seqs == list(range(len(items)))

    expected_codec = {
        "text.bin": Codec.ZSTD,
        "noise.bin": Codec.RAW,
        "small-noise.bin": Codec.RAW,
        "tiny.bin": Codec.RAW,
        "empty.bin": Codec.RAW,
        "fields-text": Codec.ZSTD,
        "fields-noise": Codec.RAW,
        "unicodé/kéy ✓.bin": Codec.RAW,
    }
    values = cache.get_many(result.seqs)
    for seq, (key, value), got in zip(result.seqs, items.items(), values):
        assert got == value, key
        assert type(got) is type(value) or (isinstance(value, dict) and isinstance(got, dict))
        assert cache.get(seq) == value
        info = cache.info(seq)
        assert info.key == key
        assert cache.seq_of(key) == seq and key in cache
        raw_size = len(value) if isinstance(value, bytes) else len(pack_fields(value))
        assert info.raw_size == raw_size
        assert bool(info.flags & RecordFlags.FIELDS) == isinstance(value, dict)
        if key in expected_codec:
            assert info.codec == expected_codec[key], key
        if info.codec == Codec.ZSTD:
            assert info.stored_size < 0.95 * info.raw_size
    # Compression actually shrank the compressible sample; raw ones cost header + key only.
    assert cache.info(0).stored_size < len(text) // 10
    assert cache.info(1).stored_size == len(noise) + HEADER.size + len(b"noise.bin")
    state = assert_consistent(cache)
    assert state.keys == list(items)
    assert cache.counters().bytes == sum(state.sizes)
    assert "missing" not in cache and cache.seq_of("missing") is None
    with pytest.raises(KeyError):
        cache.get(len(items))
    with pytest.raises(KeyError):
        cache.get_many([0, 10_000])


def test_compression_none_stores_everything_raw(make_cache: MakeCache) -> None:
    cache = make_cache(1024 * 1024, compression="none")
    text = b"abc" * 10_000
    seq = cache.put("t", text).seqs[0]
    assert cache.info(seq).codec == Codec.RAW
    assert cache.get(seq) == text


def test_pre_encoded_records_round_trip(make_cache: MakeCache) -> None:
    cache = make_cache(1024 * 1024)
    items = [(f"k{i}", content_for(f"k{i}")) for i in range(20)]
    records = [(key, cache.writer.encode(key, value)) for key, value in items]
    result = cache.put_many(records, encoded=True)
    assert [digest(v) for v in cache.get_many(result.seqs)] == [digest(v) for _, v in items]
    assert_consistent(cache)


def test_get_values_are_copies_that_outlive_the_transaction(make_cache: MakeCache) -> None:
    cache = make_cache(1024 * 1024)
    seqs = cache.put_many([(f"k{i}", content_for(f"k{i}", 3000)) for i in range(30)]).seqs
    values = cache.get_many(seqs)
    cache.put_many([(f"z{i}", content_for(f"z{i}", 3000)) for i in range(30)])
    cache.evict(0)  # the pages the values came from are freed and may be reused
    cache.put_many([(f"y{i}", content_for(f"y{i}", 3000)) for i in range(30)])
    assert [digest(v) for v in values] == [digest(content_for(f"k{i}", 3000)) for i in range(30)]


def test_get_takes_a_key_as_in_does_or_a_sequence_number(make_cache: MakeCache) -> None:
    """``key in cache`` took a key and ``cache.get(key)`` failed with ``struct.error`` (it took
    only a sequence number): one key type across the API (issue 37, item 6)."""
    cache = make_cache(1024 * 1024)
    seq = cache.put_many([("a.bin", b"bytes"), ("b", {"npy": b"1", "cls": b"2"})]).seqs[0]
    assert "a.bin" in cache and cache.get("a.bin") == b"bytes" == cache.get(seq)
    assert cache.get("b") == {"npy": b"1", "cls": b"2"} == cache.get(cache.seq_of("b"))
    with pytest.raises(KeyError, match="'gone': not cached"):
        cache.get("gone")
    with pytest.raises(TypeError, match=r"cache.get: expected a key \(str\) or a sequence"):
        cache.get(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cache.get_many: .*cache.seq_of\(key\)"):
        cache.get_many(["a.bin"])  # type: ignore[list-item]


# -- dedupe -----------------------------------------------------------------------------------


def test_samples_already_cached_are_skipped(make_cache: MakeCache) -> None:
    cache = make_cache(1024 * 1024)
    first = cache.put_many([("a", b"first a" * 50), ("b", b"first b" * 50)])
    assert first.inserted == 2
    again = cache.put_many([("b", b"second b"), ("c", b"c" * 40), ("a", b"second a")])
    assert (again.inserted, again.skipped) == (1, 2)
    assert again.seqs == [2]
    # Duplicates inside one batch: the first value wins, stored once.
    dup = cache.put_many([("d", b"d1"), ("d", b"d2"), ("c", b"c again")])
    assert (dup.inserted, dup.skipped) == (1, 1)
    assert cache.get(cache.seq_of("a")) == b"first a" * 50
    assert cache.get(cache.seq_of("b")) == b"first b" * 50
    assert cache.get(cache.seq_of("d")) == b"d1"
    state = assert_consistent(cache)
    assert state.keys == ["a", "b", "c", "d"]
    assert cache.counters().inserted == 4


def test_an_evicted_key_can_be_cached_again(make_cache: MakeCache) -> None:
    cache = make_cache(10_000, headroom=0)
    cache.put_many([(f"k{i}", content_for(f"k{i}", 3000, compressible=False)) for i in range(3)])
    cache.put_many([(f"n{i}", content_for(f"n{i}", 3000, compressible=False)) for i in range(3)])
    assert "k0" not in cache
    result = cache.put("k0", b"back again")
    assert result.inserted == 1 and result.seqs == [6]
    assert cache.get(cache.seq_of("k0")) == b"back again"
    assert_consistent(cache)


# -- capacity and age order -------------------------------------------------------------------


def test_fill_past_capacity_evicts_exactly_the_oldest(make_cache: MakeCache) -> None:
    capacity = 60_000
    cache = make_cache(capacity)
    headroom = cache.headroom_bytes
    assert headroom == 6_000
    rng = random.Random(7)
    inserted: list[str] = []  # by seq
    size_of: dict[str, int] = {}
    n = 0
    for _round in range(40):  # about 10x capacity in total
        batch = []
        for _ in range(rng.randint(1, 12)):
            key = f"s{n}"
            n += 1
            value = content_for(key, rng.randint(200, 5000))
            batch.append((key, value))
            size_of[key] = _record_size(cache, key, value)
        result = cache.put_many(batch)
        assert result.inserted == len(batch)
        assert result.seqs == list(range(len(inserted), len(inserted) + len(batch)))
        inserted.extend(key for key, _ in batch)
        state = assert_consistent(cache)
        # Without leases, eviction makes room before inserting: never even into the headroom.
        assert state.bytes <= capacity
        # The present samples are the newest suffix of everything inserted...
        first = state.first_seq or 0
        assert state.keys == inserted[first:]
        assert state.counters.evicted == first
        # ...and no more was evicted than needed: the newest evicted one would not have fit.
        if first > 0:
            assert state.bytes + size_of[inserted[first - 1]] > capacity
    assert cache.counters().evicted > 3 * len(cache)
    assert cache.counters().evicted_bytes > 5 * capacity


def test_leased_samples_are_never_evicted_and_only_older_ones_are(make_cache: MakeCache) -> None:
    capacity = 40_000
    cache = make_cache(capacity, headroom=0.25)
    limit = capacity + cache.headroom_bytes
    n = 0

    def batch(count: int, size: int = 2000) -> list[tuple[str, bytes]]:
        nonlocal n
        keys = [f"s{i}" for i in range(n, n + count)]
        out = [(key, content_for(key, size, compressible=False)) for key in keys]
        n += count
        return out

    cache.put_many(batch(30))  # 60 KB through a 40 KB cache: the first ones are gone
    before = assert_consistent(cache)
    assert before.first_seq and before.first_seq > 0
    snap = cache.snapshot(epoch=1)
    leased = list(map(int, snap.seqs))
    assert leased == before.seqs  # everything present fits the capacity
    expected = {s: digest(v) for s, v in zip(leased, cache.get_many(leased))}

    # Write until back-pressure: the headroom fills, nothing leased goes.
    with pytest.raises(CacheFull) as info:
        for _ in range(20):
            cache.put_many(batch(3), wait=False)
    assert info.value.result is not None
    state = assert_consistent(cache)
    assert state.bytes <= limit
    assert set(leased) <= set(state.seqs)
    # Nothing older than the lease was left, nothing leased is gone.
    assert state.first_seq == leased[0]
    assert {s: digest(v) for s, v in zip(leased, cache.get_many(leased))} == expected

    # A snapshot taken now leaves out the oldest samples beyond capacity (headroom-only ones).
    snap2 = cache.snapshot(epoch=2)
    assert sum(state.sizes[state.seqs.index(int(snap2.seqs[0])) :]) <= capacity
    assert int(snap2.seqs[-1]) == state.seqs[-1]
    snap.release()
    assert snap.released
    # Released: the oldest samples (not under snap2) are evicted first, and writes proceed.
    cache.put_many(batch(4))
    after = assert_consistent(cache)
    assert after.first_seq is not None and after.first_seq > leased[0]
    assert after.first_seq <= int(snap2.seqs[0])
    assert set(map(int, snap2.seqs)) <= set(after.seqs)
    assert after.bytes <= limit
    snap2.release()
    cache.put_many(batch(2))
    final = assert_consistent(cache)
    assert final.bytes <= capacity
    assert cache.leases() == []


def test_explicit_evict_stops_at_a_lease(make_cache: MakeCache) -> None:
    cache = make_cache(100_000)
    cache.put_many([(f"a{i}", content_for(f"a{i}", 1000)) for i in range(10)])
    with cache.snapshot() as snap:
        cache.put_many([(f"b{i}", content_for(f"b{i}", 1000)) for i in range(10)])
        eviction = cache.evict(0)
        assert eviction.count == 0 and eviction.blocked_by is not None
        assert eviction.blocked_by.lease_id == snap.lease_id
        assert len(cache) == 20
    eviction = cache.evict(0)
    assert eviction.count == 20 and eviction.blocked_by is None
    state = assert_consistent(cache)
    assert state.seqs == [] and state.counters.evicted == 20


def test_lease_in_the_middle_pins_newer_samples_too(make_cache: MakeCache) -> None:
    """Eviction is strictly by age: a lease stops it, even if newer unleased samples exist."""
    cache = make_cache(100_000)
    cache.put_many([(f"a{i}", content_for(f"a{i}", 1000)) for i in range(5)])
    snap = cache.snapshot()
    cache.put_many([(f"b{i}", content_for(f"b{i}", 1000)) for i in range(5)])
    # A second, newer lease over everything; release the older one.
    snap_new = cache.snapshot()
    snap.release()
    eviction = cache.evict(0)
    assert eviction.blocked_by is not None and eviction.blocked_by.lease_id == snap_new.lease_id
    state = assert_consistent(cache)
    assert state.first_seq == int(snap_new.seqs[0]) == 0
    snap_new.release()


# -- back-pressure ----------------------------------------------------------------------------


def _fill_and_pin(cache: Cache, size: int = 2000) -> tuple[Any, int]:
    """Fill the cache to capacity + headroom with a lease on the capacity part."""
    i = 0
    while cache.counters().bytes + size + 100 <= cache.capacity_bytes:
        cache.put(f"p{i}", content_for(f"p{i}", size, compressible=False))
        i += 1
    snap = cache.snapshot()
    while True:
        try:
            cache.put(f"p{i}", content_for(f"p{i}", size, compressible=False), wait=False)
        except CacheFull:
            break
        i += 1
    return snap, i


def test_wait_false_raises_cache_full_and_commits_nothing_more(make_cache: MakeCache) -> None:
    cache = make_cache(30_000)
    snap, _ = _fill_and_pin(cache)
    before = assert_consistent(cache)
    assert before.bytes <= 33_000
    with pytest.raises(CacheFull, match="lease") as info:
        cache.put_many(
            [(k, content_for(k, 2000, compressible=False)) for k in ("x1", "x2")], wait=False
        )
    assert info.value.result.inserted == 0  # type: ignore[attr-defined]
    after = assert_consistent(cache)
    assert after.seqs == before.seqs and "x1" not in cache
    snap.release()
    assert cache.put_many([("x1", b"1" * 2000)], wait=False).inserted == 1


def test_cache_full_result_reports_a_partial_commit(make_cache: MakeCache) -> None:
    cache = make_cache(30_000, headroom=10_000)
    cache.put_many([(f"a{i}", content_for(f"a{i}", 2000, compressible=False)) for i in range(10)])
    snap = cache.snapshot()
    batch = [(f"b{i}", content_for(f"b{i}", 2000, compressible=False)) for i in range(12)]
    with pytest.raises(CacheFull) as info:
        cache.put_many(batch, wait=False)
    result = info.value.result
    assert 0 < result.inserted < len(batch)  # type: ignore[attr-defined]
    committed = [key for key, _ in batch[: result.inserted]]  # type: ignore[attr-defined]
    state = assert_consistent(cache)
    assert all(key in cache for key in committed)
    rest = batch[result.inserted :]  # type: ignore[attr-defined]
    assert not any(key in cache for key, _ in rest)
    assert state.bytes <= 40_000
    snap.release()


def test_wait_true_blocks_until_the_lease_is_released(
    make_cache: MakeCache, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache(30_000)
    snap, _ = _fill_and_pin(cache)
    blocked = threading.Event()

    class _Marker(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "writers wait" in record.getMessage():
                blocked.set()

    marker = _Marker(level=logging.INFO)
    logger = logging.getLogger("epochcache.cache")
    logger.addHandler(marker)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    released_at: list[float] = []

    def releaser() -> None:
        if blocked.wait(20):
            released_at.append(time.monotonic())
            snap.release()

    thread = threading.Thread(target=releaser)
    thread.start()
    try:
        late = content_for("late", 2000, compressible=False)
        result = cache.put_many([("late", late)], wait=True, timeout_s=30)
        returned_at = time.monotonic()
    finally:
        thread.join(30)
        logger.removeHandler(marker)
        logger.setLevel(old_level)
    assert blocked.is_set(), "put_many never reported waiting on the lease"
    assert released_at and returned_at >= released_at[0]
    assert result.inserted == 1 and "late" in cache
    state = assert_consistent(cache)
    assert state.bytes <= 33_000


def test_wait_true_times_out_with_cache_full(make_cache: MakeCache) -> None:
    cache = make_cache(30_000)
    snap, _ = _fill_and_pin(cache)
    start = time.monotonic()
    with pytest.raises(CacheFull):
        cache.put("late", content_for("late", 2000, compressible=False), timeout_s=0.3)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 60  # waited its timeout, and not for good
    assert "late" not in cache
    snap.release()


def test_stop_event_ends_the_wait(make_cache: MakeCache) -> None:
    cache = make_cache(30_000)
    snap, _ = _fill_and_pin(cache)
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(CacheFull):
            cache.put("late", content_for("late", 2000, compressible=False), stop=stop)
    finally:
        timer.cancel()
    assert time.monotonic() - start < 60  # the stop ended the wait (it has no timeout)
    snap.release()


def test_sample_too_large_commits_nothing_of_its_batch(make_cache: MakeCache) -> None:
    cache = make_cache(10_000)
    big = content_for("big", 20_000, compressible=False)
    with pytest.raises(SampleTooLarge, match="capacity") as info:
        cache.put_many([("ok", b"fine"), ("big", big)])
    assert isinstance(info.value, ValueError)
    assert len(cache) == 0 and "ok" not in cache
    # Compressible data is judged by its stored size: 20 KB of text fits a 10 KB cache.
    text = content_for("text", 20_000, compressible=True)
    assert cache.put("text", text).inserted == 1
    assert cache.get(cache.seq_of("text")) == text


# -- counters and side tables -----------------------------------------------------------------


def test_counters_match_a_recount_through_mixed_operations(make_cache: MakeCache) -> None:
    cache = make_cache(50_000)
    rng = random.Random(3)
    snaps = []
    for step in range(60):
        op = rng.random()
        if op < 0.6:
            keys = [f"k{rng.randint(0, 150)}" for _ in range(rng.randint(1, 6))]
            try:
                cache.put_many([(k, content_for(k)) for k in keys], wait=False)
            except CacheFull:
                pass
        elif op < 0.75:
            snaps.append(cache.snapshot(step))
        elif op < 0.9 and snaps:
            snaps.pop(rng.randrange(len(snaps))).release()
        else:
            cache.evict(rng.randint(0, 50_000))
        state = assert_consistent(cache)
        assert state.bytes <= 55_000
        stats = cache.counters()
        assert (stats.samples, stats.bytes) == (len(state.seqs), state.bytes)
    for snap in snaps:
        snap.release()


def test_history_and_quarantine_keep_only_the_newest_rows(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_module, "HISTORY_MAX_ROWS", 25)
    monkeypatch.setattr(cache_module, "QUARANTINE_MAX_ROWS", 30)
    cache = make_cache(50_000)
    for i in range(80):
        append_history(cache, {"step": i})
        cache.tables.quarantine(f"bad/{i}.pkl", "truncated gzip", size=i)
    history = cache.history()
    assert [row["step"] for row in history] == list(range(55, 80))
    assert all({"time", "samples", "bytes", "capacity"} <= set(row) for row in history)
    assert [row["time"] for row in history] == sorted(row["time"] for row in history)
    assert [row["step"] for row in cache.history(limit=3)] == [77, 78, 79]
    rows = cache.quarantined(limit=1000)
    assert [row["key"] for row in rows] == [f"bad/{i}.pkl" for i in range(50, 80)]
    assert rows[-1]["reason"] == "truncated gzip" and rows[-1]["size"] == 79
    assert cache.counters().quarantined == 80  # the counter counts every one
    assert_consistent(cache)


def test_the_quarantine_is_bounded_in_bytes_and_keeps_keys_cut(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quarantine rows kept untrusted keys whole (and twice more in the reason and URL) under
    a bound in rows only: 400 keys of 100 kB made 120 MB of rows next to a 1 MiB cache."""
    import hashlib
    import json

    from epochcache.store.records import QUARANTINE_MAX_BYTES

    assert QUARANTINE_MAX_BYTES == 1024**2
    monkeypatch.setattr(cache_module, "QUARANTINE_MAX_BYTES", 64 * 1024)  # ~80 rows of these
    cache = make_cache(1024**2)
    keys = [f"s.tar/{i:04d}" + "k" * 100_000 for i in range(400)]
    for key in keys:
        cache.tables.quarantine(key, f"{key}: not a valid .npy", url=f"file:///remote/{key}")
    rows = cache.quarantined(limit=100_000)
    assert sum(len(json.dumps(row)) for row in rows) <= 64 * 1024
    assert cache.counters().quarantined == 400  # every one counted...
    assert cache.tables.quarantine_dropped() == 400 - len(rows) > 0  # ... and every row dropped
    assert rows[-1]["key"].startswith("s.tar/0399kkk")  # the newest are kept
    last = keys[-1]
    assert rows[-1]["key_sha256"] == hashlib.sha256(last.encode()).hexdigest()[:16]
    assert rows[-1]["reason"].endswith(": not a valid .npy") and len(rows[-1]["reason"]) < 400
    assert rows[-1]["key_sha256"] in rows[-1]["url"]
    assert os.path.getsize(os.path.join(cache.path, "data.mdb")) < 8 * 1024**2
    assert_consistent(cache)


def test_history_rows_written_in_the_same_nanosecond_are_all_kept(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(50_000)
    monkeypatch.setattr(cache_module.time, "time_ns", lambda: 1_000_000)
    for i in range(5):
        append_history(cache, {"step": i})
    assert [row["step"] for row in cache.history()] == [0, 1, 2, 3, 4]


def test_state_documents_are_one_row_per_name(make_cache: MakeCache) -> None:
    cache = make_cache(50_000)
    for i in range(200):
        cache.tables.put_state(f"sampler/{i % 3}", {"position": i})
    cache.tables.put_state("daemon", {"pid": 1})
    assert cache.tables.states("sampler/") == {
        "sampler/0": {"position": 198},
        "sampler/1": {"position": 199},
        "sampler/2": {"position": 197},
    }
    assert cache.tables.get_state("daemon") == {"pid": 1}
    cache.tables.delete_state("daemon")
    assert cache.tables.get_state("daemon") is None
    with cache.env.read() as txn:
        assert txn.stat(cache.env.dbs[b"state"])["entries"] == 3


# -- capacity strings, reopening, file modes --------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        ("1MiB", 1024**2),
        ("1MB", 10**6),
        ("64KiB", 65536),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("2 GB", 2 * 10**9),
        (123_456, 123_456),
        ("500000", 500_000),
    ],
)
def test_capacity_accepts_sizes(make_cache: MakeCache, capacity: Any, expected: int) -> None:
    cache = make_cache(capacity)
    assert cache.capacity_bytes == expected
    assert cache.headroom_bytes == int(expected * 0.1)


@pytest.mark.parametrize("capacity", ["12 parsecs", "lots", -5, 0, "0GiB"])
def test_bad_capacity_is_a_value_error_naming_capacity(tmp_path: Path, capacity: Any) -> None:
    with pytest.raises(ValueError, match="capacity"):
        Cache(tmp_path / "c", capacity)


def test_headroom_as_fraction_or_size(make_cache: MakeCache) -> None:
    assert make_cache("1MiB", name="a", headroom=0.25).headroom_bytes == 262_144
    assert make_cache("1MiB", name="b", headroom="100KiB").headroom_bytes == 102_400
    assert make_cache("1MiB", name="c", headroom=0).headroom_bytes == 0


def test_reopen_keeps_capacity_and_headroom(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with Cache(path, "2MiB", headroom=0.2, sync=False) as cache:
        cache.put_many([(f"k{i}", content_for(f"k{i}")) for i in range(10)])
    with Cache(path, sync=False) as cache:
        assert cache.capacity_bytes == 2 * 1024**2
        assert cache.headroom_bytes == int(0.2 * 2 * 1024**2)
        assert len(cache) == 10
        assert cache.get(cache.seq_of("k3")) == content_for("k3")
        assert_consistent(cache)
    # A new capacity given on open replaces the stored one (and persists).
    with Cache(path, "1MiB", sync=False) as cache:
        assert cache.capacity_bytes == 1024**2
    with Cache(path, readonly=True) as cache:
        assert cache.capacity_bytes == 1024**2
        assert len(cache) == 10


def test_opening_a_missing_cache_without_capacity_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="capacity"):
        Cache(tmp_path / "nothing")
    with pytest.raises(CacheError):
        Cache(tmp_path / "nothing", readonly=True)


def test_readonly_cache_refuses_writes(tmp_path: Path) -> None:
    with Cache(tmp_path / "c", "1MiB", sync=False) as cache:
        cache.put("a", b"a")
    with Cache(tmp_path / "c", readonly=True) as cache:
        assert cache.get(0) == b"a"
        with pytest.raises(CacheError):
            cache.put("b", b"b")


def test_cache_directory_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with Cache(tmp_path / "deep" / "cache", "1MiB", sync=False) as cache:
            cache.put("a", b"secret sample")
            cache.snapshot().release()
    finally:
        os.umask(old)
    path = tmp_path / "deep" / "cache"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    files = list(path.rglob("*"))
    assert {f.name for f in files} >= {"data.mdb", "lock.mdb"}
    for f in files:  # and the owners/ directory of lease owner locks
        assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600), f
