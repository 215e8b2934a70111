"""Source keys of any length, and samples that can never be stored, at the store level.

LMDB keys are 1 to 511 bytes; S3 keys go to 1024 and a manifest may hold anything. The key
index stores such keys under a digest (the record keeps the full key), and ``put_many`` hands
a sample it can never store to ``on_reject`` instead of failing its whole batch.

Internals: ``plumbing.has_key_prefix`` is what samplers call for a tar shard's samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from common.cachecheck import assert_consistent, content_for, full_check

from epochcache import Cache, SampleRejected, SampleTooLarge
from epochcache.store.plumbing import has_key_prefix
from epochcache.store.records import MAX_KEY_BYTES, index_key


def test_index_key_is_the_key_when_lmdb_can_hold_it() -> None:
    short = b"dir/sample-000001.npy"
    assert index_key(short) == short
    assert index_key(b"k" * MAX_KEY_BYTES) == b"k" * MAX_KEY_BYTES
    long_a, long_b = b"p" * 600 + b"a", b"p" * 600 + b"b"
    assert len(index_key(long_a)) == MAX_KEY_BYTES
    assert index_key(b"").startswith(b"\xff")  # LMDB refuses an empty key
    assert index_key(long_a) != index_key(long_b)  # same 478-byte head, different digests
    assert index_key(long_a).startswith(b"p" * 478 + b"\xff")


def test_long_and_empty_keys_are_stored_found_evicted_and_verified(tmp_path: Path) -> None:
    path = tmp_path / "c"
    keys = ["", "x" * 511, "y" * 512, "s3/" + "z" * 1021, "s3/" + "z" * 1020 + "é", "ok"]
    cache = Cache(path, 40_000, sync=False)
    try:
        values = {key: content_for(f"v{len(key)}{key[-2:]}", 3000, compressible=False) for key in keys}
        assert cache.put_many(values.items()).inserted == len(keys)
        assert cache.put_many(values.items()).skipped == len(keys)  # found again: not duplicated
        for key, value in values.items():
            assert key in cache
            seq = cache.seq_of(key)
            assert seq is not None and cache.info(seq).key == key and cache.get(seq) == value
        assert "y" * 513 not in cache and cache.seq_of("s3/" + "z" * 1022) is None
        assert has_key_prefix(cache, "s3/")
        assert_consistent(cache)
        # Turn the cache over: eviction removes the digest entries of the long keys too.
        for i in range(40):
            cache.put(f"new-{i}", content_for(f"new-{i}", 3000, compressible=False))
        assert not any(key in cache for key in keys)
        assert_consistent(cache)
    finally:
        cache.close()
    full_check(str(path))


def test_on_reject_takes_what_can_never_be_stored_and_the_rest_commits(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", 10_000, sync=False)
    rejected: list[tuple[str, SampleRejected]] = []
    try:
        big = content_for("big", 20_000, compressible=False)
        result = cache.put_many([("a", b"fine"), ("big", big), ("b", b"also fine")],
                                on_reject=lambda key, exc: rejected.append((key, exc)))
        assert result.inserted == 2 and "a" in cache and "b" in cache and "big" not in cache
        assert [key for key, _ in rejected] == ["big"]
        assert isinstance(rejected[0][1], SampleTooLarge) and rejected[0][1].key == "big"
        assert "capacity" in str(rejected[0][1])
        # Without on_reject the whole batch is refused, as before.
        with pytest.raises(SampleTooLarge):
            cache.put_many([("c", b"x"), ("big", big)])
        assert "c" not in cache
        # A key longer than a record can hold is rejected by name, not with a bare ValueError.
        huge_key = "k" * 70_000
        with pytest.raises(SampleRejected, match="65535"):
            cache.put(huge_key, b"x")
        assert cache.put_many([(huge_key, b"x"), ("d", b"y")],
                                        on_reject=lambda key, exc: rejected.append((key, exc))).inserted == 1
        assert rejected[-1][0] == huge_key
        assert_consistent(cache)
    finally:
        cache.close()
