"""A full disk lowers the effective capacity and warns; it never corrupts the cache (invariant 5,
and invariant 2 when the disk is smaller than the capacity).

Two real ways to run out of space: a small LMDB map (``max_map_size``, so ``MapFullError``) and a
small tmpfs (real ``ENOSPC`` from the kernel; needs root to mount, skipped otherwise).

Internals: a release plan (``reads.write_part``), the raw records (``cache.env``) and
``cache.capacity.reset()`` stand in for a loader and a cleared disk.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
from common.cachecheck import assert_consistent, content_for, digest, full_check
from common.tmpfs import mounted_tmpfs

from epochcache import Cache, CacheError, CacheFull, CacheIOError
from epochcache.store.reads import Releaser, write_part
from epochcache.store.records import DB_SAMPLES, seq_key

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
    # A lowered capacity is a back-off of the process that met the full map, never stored:
    # a reopen (a restarted sampler) starts at the configured capacity.
    with Cache(path, sync=False, max_map_size="1MiB") as cache:
        assert cache.effective_capacity == 4 * 1024**2
        assert cache.stats()["capacity_lowered"] is None
        cache.put_many(_batch("after-reopen"))
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


def test_a_full_map_that_undoes_an_eviction_leaves_the_released_samples_evictable(
    tmp_path: Path,
) -> None:
    """An epoch with progressive release has read all its samples while a writer keeps
    filling a cache whose map is about as large as its capacity: some commits evict the
    released samples and then meet the full map (pages an eviction frees are reused only after
    it commits), so LMDB undoes them. The writer used to record those samples as evicted all
    the same, and never evicted them while the lease lived: it reported a full cache "held by"
    the lease with 48 of its released samples still in the cache."""
    cache = Cache(tmp_path / "cache", 850_000, headroom=0.0, max_map_size="1MiB", sync=False)
    try:
        b = 0
        while cache.counters().bytes + 8 * SAMPLE <= cache.capacity_bytes:
            cache.put_many(_batch(f"a{b}"), wait=False)
            b += 1
        snap = cache.snapshot(plan_parts=1)
        write_part(cache.path, snap.lease_id, 0, [np.asarray(snap.seqs, dtype=np.uint64)])
        Releaser(cache.path, snap.lease_id, 0, 0).release(len(snap.seqs))  # all read
        written = 0
        with pytest.raises(CacheFull):  # once nothing released is left (newer samples stay)
            for k in range(200):
                written += cache.put_many(_batch(f"k{k}"), wait=False).inserted
        with cache.env.read() as txn:
            left = [int(s) for s in snap.seqs
                    if txn.get(seq_key(int(s)), db=cache.env.dbs[DB_SAMPLES]) is not None]
        assert left == [], f"{len(left)} released samples were never evicted: {left[:16]}"
        assert written >= len(snap.seqs) - 8
        snap.release()
        assert_consistent(cache)
    finally:
        cache.close()


def test_a_lowered_capacity_stored_by_an_older_version_is_ignored_and_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cache"
    with Cache(path, "4MiB", sync=False) as cache:
        cache.put_many(_batch("a"))
    # Earlier versions stored a lowered capacity in `meta` and used it for good.
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"effective_capacity", (64 * 1024).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with Cache(path, sync=False) as cache:
        assert cache.effective_capacity == 4 * 1024**2
        assert cache.stats()["capacity_lowered"] is None
        cache.put_many(_batch("b"))
        assert_consistent(cache)
    env = lmdb.open(str(path), max_dbs=16, readonly=True)
    with env.begin() as txn:
        assert txn.get(b"effective_capacity", db=env.open_db(b"meta", txn=txn)) is None
    env.close()


def _status_json(path: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "epochcache", "status", "--json", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _status_text(path: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "epochcache", "status", str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _write_until(cache: Cache, done: Any, tag: str, timeout_s: float = 30.0) -> int:
    """Write batches (epochcache's own errors allowed) until ``done()``; return batches written."""
    deadline = time.monotonic() + timeout_s
    b = 0
    while not done():
        assert time.monotonic() < deadline, f"not done after {b} batches"
        try:
            cache.put_many(_batch(f"{tag}{b}"), wait=False)
        except (CacheFull, CacheError) as exc:
            assert not isinstance(exc, CacheIOError), exc
        b += 1
        time.sleep(0.01)
    return b


def test_a_reader_pinning_the_map_makes_writers_wait_without_lowering_capacity(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A long read transaction (a verify in one transaction) pins every page freed while it
    lasts, so the map fills. Lowering the capacity would only evict more: writers wait (and
    nothing is lost), and once it ends they go on at the configured capacity."""
    caplog.set_level(logging.WARNING, logger="epochcache")
    path = tmp_path / "cache"
    cache = Cache(path, "1MiB", max_map_size="3MiB", sync=False)
    try:
        _write_until(cache, lambda: cache.counters().bytes > 0.9 * 1024**2, "a")
        reader = cache.env.lmdb_env.begin()  # pins the pages of everything stored now
        full: list[CacheFull] = []
        try:
            for b in range(200):
                try:
                    cache.put_many(_batch(f"p{b}"), wait=False)
                except CacheFull as exc:
                    full.append(exc)
                    if len(full) >= 3:
                        break
            assert full and "too full even to evict" in str(full[-1]), full
            assert "long read transaction" in str(full[-1])
            assert cache.effective_capacity == 1024**2 and not _full_warnings(caplog)
            state = assert_consistent(cache)
            assert state.bytes > 0.8 * 1024**2  # nothing evicted for nothing
        finally:
            reader.abort()
        before = cache.counters().inserted
        _write_until(cache, lambda: cache.counters().inserted >= before + 64, "r")
        state = assert_consistent(cache)
        assert state.bytes <= 1024**2 + cache.headroom_bytes
        assert cache.effective_capacity == 1024**2 and not _full_warnings(caplog)
    finally:
        cache.close()
    full_check(str(path))


def test_a_map_that_stays_full_is_probed_ever_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each probe lifts a map back-off (the map's room cannot be measured); when the map is
    still too small the limit is lowered again, and the next probe waits twice as long."""
    caplog.set_level(logging.INFO, logger="epochcache")
    monkeypatch.setenv("EPOCHCACHE_CAPACITY_PROBE_S", "0.1")
    path = tmp_path / "cache"
    cache = Cache(path, "4MiB", max_map_size="1MiB", sync=False)
    try:
        started = time.monotonic()
        b = 0
        while time.monotonic() - started < 3.0:
            cache.put_many(_batch(f"b{b}"), wait=False)  # never fails: no lease holds anything
            b += 1
        state = assert_consistent(cache)
        assert state.bytes <= cache.effective_capacity + cache.headroom_bytes
        lowerings = [r for r in caplog.records if "lowering the effective capacity" in r.getMessage()]
        recoveries = [r for r in caplog.records if "back to the configured" in r.getMessage()]
        # 3 s of probes every 0.1 s would be 30 lowerings; doubling intervals give about 5
        assert 2 <= len(lowerings) <= 7, [r.getMessage()[:100] for r in lowerings]
        assert len(recoveries) >= 1
        assert os.path.getsize(path / "data.mdb") <= 1024**2
    finally:
        cache.close()
    full_check(str(path))


# -- a small tmpfs: real ENOSPC ---------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (root only; skipped where mounting is not allowed)."""
    with mounted_tmpfs(tmp_path / "tmpfs") as mnt:
        yield mnt


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
        cache.capacity.reset()
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


def test_brief_enospc_recovers_to_the_configured_capacity_without_restart(
    tmpfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epochcache")
    monkeypatch.setenv("EPOCHCACHE_CAPACITY_PROBE_S", "0.2")
    path = tmpfs / "cache"
    cache = Cache(path, "3MiB")
    try:
        ballast = _ballast(tmpfs, 1024**2)  # another tenant fills the disk for a while
        _write_until(cache, lambda: cache.effective_capacity < 3 * 1024**2, "b")
        assert_consistent(cache)
        lowered = cache.effective_capacity
        # status shows the limit in force and why, in another process, as JSON and as text
        shown = _status_json(path)
        assert shown["capacity"] == 3 * 1024**2 and shown["effective_capacity"] == lowered
        assert "disk full" in shown["capacity_lowered"]["reason"]
        text = _status_text(path)
        assert "lowered from 3.0 MiB" in text and "disk full" in text, text
        ballast.unlink()  # ... and deletes its files again
        _write_until(cache, lambda: cache.effective_capacity == 3 * 1024**2, "r")
        assert any("back to" in r.getMessage() for r in caplog.records), caplog.text
        _write_until(cache, lambda: cache.counters().bytes > lowered + 256 * 1024, "s")
        state = assert_consistent(cache)
        assert state.bytes <= 3 * 1024**2 + cache.headroom_bytes
        shown = _status_json(path)
        assert shown["effective_capacity"] == 3 * 1024**2 and shown["capacity_lowered"] is None
        assert "lowered" not in _status_text(path)
    finally:
        cache.close()
    full_check(str(path))


def test_a_restart_after_enospc_starts_at_the_configured_capacity(tmpfs: Path) -> None:
    path = tmpfs / "cache"
    cache = Cache(path, "3MiB")
    ballast = _ballast(tmpfs, 1024**2)
    try:
        _write_until(cache, lambda: cache.effective_capacity < 3 * 1024**2, "b")
    finally:
        cache.close()
    ballast.unlink()
    with Cache(path) as cache:  # what a restarted sampler does
        assert cache.effective_capacity == 3 * 1024**2
        assert cache.stats()["capacity_lowered"] is None
    full_check(str(path))


# -- ext4 on a loop device, shut down: real EIO ----------------------------------------------

#: ioctl FS_IOC_SHUTDOWN (_IOR("X", 125, __u32)), flag EXT4_GOING_FLAGS_DEFAULT (flush, then shut down): every later
#: write to the filesystem fails with EIO, as after a failing disk.
_FS_IOC_SHUTDOWN = 0x8004587D
_FLUSH_ALL = 0


@dataclass
class Ext4:
    """A small ext4 filesystem on a loop device (see the ``ext4`` fixture)."""

    device: str
    mnt: Path

    def shut_down(self) -> None:
        """From now on every write to the filesystem fails with EIO, as on a failing disk."""
        fd = os.open(self.mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, _FS_IOC_SHUTDOWN, struct.pack("I", _FLUSH_ALL))
        finally:
            os.close(fd)

    def remount(self) -> None:
        """Unmount and mount again: the journal replays, as after a reboot."""
        subprocess.run(["umount", str(self.mnt)], check=True, capture_output=True)
        subprocess.run(["mount", self.device, str(self.mnt)], check=True, capture_output=True)


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Ext4]:
    """A 64 MiB ext4 filesystem on a loop device, mounted for this test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    if not (shutil.which("losetup") and shutil.which("mkfs.ext4")):
        pytest.skip("losetup and mkfs.ext4 are needed")
    image, mnt = tmp_path / "disk.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 * 1024**2)
    attach = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if attach.returncode != 0:
        pytest.skip(f"no loop device here: {attach.stderr.strip()}")
    device = attach.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", device], check=True, capture_output=True)
        mounted = subprocess.run(["mount", device, str(mnt)], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount ext4 here: {mounted.stderr.strip()}")
        try:
            yield Ext4(device, mnt)
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def test_eio_stops_the_writer_with_a_clear_message(
    ext4: Ext4, caplog: pytest.LogCaptureFixture
) -> None:
    """EIO is a failing disk, not a full one: the writer stops with a message that says so,
    the capacity is not lowered, and everything committed before is still there."""
    caplog.set_level(logging.WARNING, logger="epochcache")
    path = ext4.mnt / "cache"
    cache = Cache(path, "8MiB")
    committed = {}
    try:
        for b in range(8):
            batch = _batch(f"a{b}")
            cache.put_many(batch)
            committed.update({k: digest(v) for k, v in batch})
        ext4.shut_down()
        with pytest.raises(CacheIOError) as failed:
            cache.put_many(_batch("after"))
        message = str(failed.value)
        assert str(path) in message and "I/O error" in message and "disk" in message, message
        assert isinstance(failed.value, OSError)
        assert cache.effective_capacity == 8 * 1024**2  # not mistaken for a full disk
        assert not _full_warnings(caplog), caplog.text
    finally:
        cache.close()
    ext4.remount()
    full_check(str(path))
    with Cache(path) as again:
        assert again.effective_capacity == 8 * 1024**2
        for key, value in committed.items():
            assert digest(again.get(again.seq_of(key))) == value
