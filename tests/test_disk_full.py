"""A full disk lowers the effective capacity and warns; it never corrupts the cache (invariant 5,
and invariant 2 when the disk is smaller than the capacity).

Two real ways to run out of space: a small LMDB map (``max_map_size``, so ``MapFullError``) and a
small tmpfs (real ``ENOSPC`` from the kernel; needs root to mount, skipped otherwise).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from common.cachecheck import assert_consistent, content_for, digest, full_check
from epochcache import Cache, CacheError, CacheFull

SAMPLE = 4000  # incompressible: one LMDB overflow page each


def _batch(tag: str, n: int = 8) -> list[tuple[str, bytes]]:
    return [(f"{tag}-{i}", content_for(f"{tag}-{i}", SAMPLE, compressible=False)) for i in range(n)]


def _full_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and "full" in r.getMessage()
        and r.name.startswith("epochcache")
    ]


# -- a small LMDB map -------------------------------------------------------------------------


def test_small_map_lowers_capacity_warns_and_keeps_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="epochcache")
    path = tmp_path / "cache"
    cache = Cache(path, "4MiB", max_map_size="1MiB", sync=False)
    try:
        assert cache.effective_capacity == 4 * 1024**2
        for b in range(60):  # ~1.9 MB through a 1 MiB map
            batch = _batch(f"b{b}")
            result = cache.put_many(batch, wait=False)
            assert result.inserted == len(batch)
            state = assert_consistent(cache)
            assert state.bytes <= cache.effective_capacity + cache.headroom_bytes
        warnings = _full_warnings(caplog)
        assert warnings and "MapFullError" in warnings[0]
        assert "lowering the effective capacity" in warnings[0]
        lowered = cache.effective_capacity
        assert 0.3 * 1024**2 < lowered < 1024**2
        assert state.counters.evicted > 0
        assert state.bytes <= lowered  # no lease: eviction keeps it within the lowered capacity
        # Writes kept landing: the newest samples are all there, intact.
        newest = [f"b59-{i}" for i in range(8)]
        assert [digest(cache.get(cache.seq_of(k))) for k in newest] == [
            digest(v) for _, v in _batch("b59")
        ]
        assert os.path.getsize(path / "data.mdb") <= 1024**2
        with cache.snapshot() as snap:
            assert len(snap) == len(state.seqs)
    finally:
        cache.close()
    full_check(str(path))
    # The lowered capacity is remembered across a reopen, until reset.
    with Cache(path, sync=False) as cache:
        assert cache.effective_capacity == lowered
        cache.reset_effective_capacity()
        assert cache.effective_capacity == 4 * 1024**2
        cache.put_many(_batch("after-reset"))
        assert_consistent(cache)


def _fill_map_under_a_lease(cache: Cache) -> tuple[object, dict[int, str]]:
    for b in range(15):
        cache.put_many(_batch(f"a{b}"), wait=False)
    snap = cache.snapshot()
    leased = {int(s): digest(v) for s, v in zip(snap.seqs, cache.get_many(snap.seqs))}
    errors = []
    for b in range(20):  # the map fills while the lease pins everything
        try:
            cache.put_many(_batch(f"k{b}"), wait=False)
        except (CacheFull, CacheError) as exc:
            errors.append(exc)
        state = assert_consistent(cache)
        assert set(leased) <= set(state.seqs)
        assert state.bytes <= cache.capacity_bytes + cache.headroom_bytes
    assert errors, "the map never filled"
    return snap, leased


def test_small_map_full_under_a_lease_keeps_the_leased_samples(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="epochcache")
    cache = Cache(tmp_path / "cache", "4MiB", max_map_size="1MiB", sync=False)
    try:
        snap, leased = _fill_map_under_a_lease(cache)
        assert _full_warnings(caplog)
        assert {s: digest(v) for s, v in zip(leased, cache.get_many(list(leased)))} == leased
        snap.release()  # type: ignore[attr-defined]
    finally:
        cache.close()
    full_check(str(tmp_path / "cache"))


def test_small_map_full_under_a_lease_recovers_after_release(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", "4MiB", max_map_size="1MiB", sync=False)
    try:
        snap, _ = _fill_map_under_a_lease(cache)
        snap.release()  # type: ignore[attr-defined]
        for b in range(10):
            cache.put_many(_batch(f"after{b}"), wait=False)
        state = assert_consistent(cache)
        assert state.counters.evicted > 0
        assert cache.effective_capacity > 256 * 1024  # lowered, not collapsed
        with cache.snapshot() as again:
            assert len(again) >= 60
    finally:
        cache.close()


# -- a small tmpfs: real ENOSPC ---------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (root only; skipped where mounting is not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _ballast(mnt: Path, leave_free: int) -> Path:
    """Fill the filesystem until only ``leave_free`` bytes are free (another tenant's files)."""
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    ballast = mnt / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free - leave_free))
    return ballast


def test_cache_larger_than_the_disk_is_sized_to_it_at_open(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="epochcache")
    with Cache(tmpfs / "cache", "64MiB", sync=False) as cache:
        assert any("does not fit" in m for m in (r.getMessage() for r in caplog.records))
        assert cache.effective_capacity < 8 * 1024**2
        for b in range(64):  # 16 MB through an 8 MiB disk
            cache.put_many(_batch(f"b{b}", 64), wait=False)
            state = assert_consistent(cache)
            assert state.bytes <= cache.effective_capacity
        assert state.counters.evicted > 0
    full_check(str(tmpfs / "cache"))


def test_enospc_never_corrupts_and_writes_resume_when_space_returns(tmpfs: Path) -> None:
    path = tmpfs / "cache"
    cache = Cache(path, "3MiB")  # fits the empty 8 MiB disk
    try:
        assert cache.effective_capacity == 3 * 1024**2
        ballast = _ballast(tmpfs, 1024**2)  # then the disk fills up under it
        outcomes = []
        for b in range(50):  # 1.6 MB into 1 MiB of free space
            batch = _batch(f"b{b}")
            try:
                cache.put_many(batch, wait=False)
                outcomes.append("ok")
            except (CacheFull, CacheError, lmdb.Error) as exc:
                outcomes.append(type(exc).__name__)
            state = assert_consistent(cache)  # whatever happened, nothing is torn
            assert state.bytes <= cache.capacity_bytes + cache.headroom_bytes
            present = [cache.seq_of(key) for key, _ in batch]
            assert all(s is None for s in present) or None not in present  # all or nothing
            if present[0] is not None:
                assert cache.get_many(present) == [value for _, value in batch]
        # The full disk lowers the effective capacity and eviction makes room: writes go on,
        # and anything that fails does so with epochcache's own errors, never a raw lmdb one.
        assert outcomes[0] == "ok" and "Error" not in outcomes, outcomes
        assert cache.effective_capacity < 3 * 1024**2
        # Space comes back: forget any lowered capacity and writes go on, with eviction.
        ballast.unlink()
        cache.reset_effective_capacity()
        for b in range(50, 150):
            cache.put_many(_batch(f"b{b}"), wait=False)
        state = assert_consistent(cache)
        assert state.counters.evicted > 0 and state.bytes <= 3 * 1024**2
        assert cache.get(cache.seq_of("b149-7")) == _batch("b149")[7][1]
    finally:
        cache.close()
    full_check(str(path))


def test_enospc_lowers_capacity_and_warns(tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="epochcache")
    cache = Cache(tmpfs / "cache", "6MiB")
    try:
        assert not _full_warnings(caplog)
        _ballast(tmpfs, 1024**2)
        for b in range(50):
            try:
                cache.put_many(_batch(f"b{b}"), wait=False)
            except (CacheFull, CacheError):
                pass  # epochcache's own errors are fine; a raw lmdb.Error is not
        assert _full_warnings(caplog)
        assert cache.effective_capacity < 6 * 1024**2
        assert_consistent(cache)
    finally:
        cache.close()


def test_enospc_writes_continue_with_eviction(tmpfs: Path) -> None:
    path = tmpfs / "cache"
    cache = Cache(path, "6MiB")
    try:
        _ballast(tmpfs, 1024**2)
        inserted = 0
        for b in range(60):
            try:
                inserted += cache.put_many(_batch(f"b{b}"), wait=False).inserted
            except CacheFull:
                pass  # back-pressure is fine; a raw lmdb error is not
        state = assert_consistent(cache)
        assert state.counters.evicted > 0, "nothing was evicted to make room on the full disk"
        assert inserted >= 30 * 8
        assert state.bytes <= cache.effective_capacity + cache.headroom_bytes
    finally:
        cache.close()


def test_disk_fitted_capacity_back_pressures_before_the_disk_fills(tmpfs: Path) -> None:
    cache = Cache(tmpfs / "cache", "64MiB")
    try:
        b = 0
        while cache.counters().bytes + 40_000 < cache.effective_capacity:
            cache.put_many(_batch(f"a{b}"), wait=False)
            b += 1
        with cache.snapshot():
            with pytest.raises(CacheFull):
                for k in range(100):
                    cache.put_many(_batch(f"k{k}"), wait=False)
        assert_consistent(cache)
    finally:
        cache.close()
