"""One set of limits per cache: a refused daemon changes nothing, and a config's capacity replaces
the stored one only when no other process holds the cache (issue 10, item 4).

Writers are real processes: a daemon with its samplers, or a helper process with the cache
open as a trainer has it. Stored limits are read from the cache's own ``meta`` table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from common.daemonproc import upload, wait_running, write_config
from common.procs import spawn_script
from conftest import S3Env

from epochcache import Cache
from epochcache.store.capacity import stored_limits

pytestmark = pytest.mark.timeout(120)

MiB = 1024**2


def test_a_refused_daemon_changes_nothing(s3: S3Env, tmp_path: Path, start_daemon: Any) -> None:
    upload(s3.url, s3.storage_options, "ds", 100, "files")
    cache_dir = tmp_path / "cache"
    first_cfg = write_config(tmp_path / "first.yaml", url=s3.url("ds"), cache_dir=cache_dir,
                             storage_options=s3.storage_options, capacity="64MiB",
                             sampler={"bandwidth_limit": 100_000})
    second_cfg = write_config(tmp_path / "second.yaml", url=s3.url("ds"), cache_dir=cache_dir,
                              storage_options=s3.storage_options, capacity="8MiB",
                              cache={"headroom": "1MiB"})
    first = start_daemon(first_cfg)
    wait_running(first, cache_dir)
    before = stored_limits(str(cache_dir))
    assert before == (64 * MiB, int(6.4 * MiB))
    second = start_daemon(second_cfg, name="second")
    assert second.wait(30) == 1
    assert "already filling this cache" in second.logs()
    assert stored_limits(str(cache_dir)) == before
    with Cache(cache_dir, readonly=True) as cache:
        assert cache.stats()["capacity"] == 64 * MiB
    assert first.alive()
    assert first.terminate() == 0
    assert stored_limits(str(cache_dir)) == before


def test_a_daemon_keeps_the_stored_capacity_while_others_hold_the_cache(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    upload(s3.url, s3.storage_options, "ds", 50, "files")
    cache_dir = tmp_path / "cache"
    Cache(cache_dir, "64MiB").close()
    trainer = spawn_script(tmp_path, "trainer", """
        import sys
        from epochcache import Cache
        cache = Cache(sys.argv[1])  # as a trainer opens it: the stored capacity
        print("OPEN", cache.capacity_bytes, flush=True)
        sys.stdin.readline()
    """, str(cache_dir))
    try:
        trainer.wait_line("OPEN")
        config = write_config(tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
                              storage_options=s3.storage_options, capacity="16MiB")
        daemon = start_daemon(config)
        wait_running(daemon, cache_dir)
        assert stored_limits(str(cache_dir))[0] == 64 * MiB
        assert daemon.terminate() == 0
        logs = daemon.logs()
        assert "keeping capacity 64.0 MiB" in logs and "instead of 16.0 MiB" in logs, logs[-2000:]
    finally:
        trainer.close()
    # Alone now: the same config changes it, and says so.
    again = start_daemon(config, name="again")
    wait_running(again, cache_dir)
    assert stored_limits(str(cache_dir))[0] == 16 * MiB
    assert again.terminate() == 0
    assert "capacity 64.0 MiB -> 16.0 MiB" in again.logs()


def test_capacity_changes_only_when_no_other_process_has_the_cache_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epochcache")
    path = tmp_path / "cache"
    Cache(path, "64MiB").close()
    writer = spawn_script(tmp_path, "writer", """
        import sys
        from epochcache import Cache
        cache = Cache(sys.argv[1])
        print("OPEN", flush=True)
        sys.stdin.readline()
        cache.close()
        print("CLOSED", flush=True)
        sys.stdin.readline()
    """, str(path))
    try:
        writer.wait_line("OPEN")
        with Cache(path, "32MiB") as cache:
            assert cache.capacity_bytes == 64 * MiB  # kept: the writer works to 64 MiB
            assert cache.headroom_bytes == int(6.4 * MiB)
        assert stored_limits(str(path)) == (64 * MiB, int(6.4 * MiB))
        assert any("keeping capacity 64.0 MiB" in r.getMessage() and r.levelno == logging.WARNING
                   for r in caplog.records)
        with Cache(path, readonly=True) as cache:  # status, verify: not a writer
            writer.send("close")
            writer.wait_line("CLOSED")
            caplog.clear()
            with Cache(path, "32MiB") as changed:
                assert changed.capacity_bytes == 32 * MiB
        assert stored_limits(str(path)) == (32 * MiB, int(3.2 * MiB))
        assert any("capacity 64.0 MiB -> 32.0 MiB" in r.getMessage() for r in caplog.records)
        # The same process opening it twice is one writer: it may still change it.
        with Cache(path) as first, Cache(path, "16MiB") as second:
            assert second.capacity_bytes == 16 * MiB and first.capacity_bytes == 32 * MiB
    finally:
        writer.close()
