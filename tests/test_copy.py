"""``epochcache copy SRC DST`` (issue 28, item 4): a new node starts warm.

The copy is taken while the source's daemon fills it and a trainer holds a snapshot; it is
private, opens, verifies, holds no lease or daemon state, keeps the listing and the coverage,
and a daemon started on it with the same source config starts warm: no listing, and nothing
it holds fetched again.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.daemonproc import (
    all_samplers,
    cache_len,
    sampler_states,
    upload,
    wait_cached,
    wait_for,
    wait_running,
    write_config,
)

from epochcache import Cache

pytestmark = pytest.mark.timeout(180)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "500"}
    return subprocess.run([sys.executable, "-m", "epochcache", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_copy_of_a_live_cache_starts_a_daemon_warm(tmp_path: Path, start_daemon: Any) -> None:
    url = (tmp_path / "remote").as_uri()
    upload(lambda _p: url, {}, "", 300, "files")
    cfg = write_config(tmp_path / "cfg.yaml", url=url, cache_dir=tmp_path / "cache",
                       storage_options={}, sampler={"processes": 1, "concurrency": 2,
                                                    "batch_size": 8, "bandwidth_limit": "60KB"})
    daemon = start_daemon(cfg)
    wait_running(daemon, tmp_path / "cache")
    wait_cached(daemon, tmp_path / "cache", 100)
    trainer = Cache(tmp_path / "cache")
    try:
        with trainer.snapshot(epoch=3, label="a trainer's epoch") as snap:
            trainer.record_trained(snap.seqs[:40], epoch=0)  # some coverage to carry over
            copied = _cli("copy", str(tmp_path / "cache"), str(tmp_path / "node1"), "--json",
                          cwd=tmp_path)
            assert copied.returncode == 0, copied.stderr
            assert daemon.alive()  # the source's daemon went on meanwhile
    finally:
        trainer.close()
    daemon.terminate()
    report = json.loads(copied.stdout)
    copy = tmp_path / "node1"
    assert report["samples"] >= 100 and report["leases_left_behind"] == 1
    assert report["listings"] == 1 and report["ledgers"] == 1
    # private, as caches are
    assert stat.S_IMODE(copy.stat().st_mode) == 0o700
    for path in copy.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    verify = _cli("verify", str(copy), cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    status = json.loads(_cli("status", str(copy), "--json", cwd=tmp_path).stdout)
    assert status["leases"] == 0 and status["lease_details"] == [] and status["daemon"] is None
    assert status["samples"] == report["samples"] and status["jobs"] == []
    assert status["coverage"]["sources"][0]["covered"] == 40  # the ledger came along
    listing = next((copy / "listings").glob("*.keys"))
    listed_at = listing.stat().st_mtime_ns

    # A daemon on the copy (the same source config, the copy's dir): no listing, and the
    # samples the copy holds are not fetched again.
    config = yaml.safe_load(cfg.read_text())
    config["cache"]["dir"] = str(copy)
    config["sampler"].pop("bandwidth_limit")
    node1 = start_daemon(write_yaml(tmp_path / "node1.yaml", config), name="node1")
    wait_running(node1, copy)
    wait_for(lambda: all_samplers(copy, 1, lambda h: h.get("idle") == "complete"), 90,
             "the copy's daemon to cache the rest and go idle")
    assert cache_len(copy) == 300
    fetched = sum(int(h.get("fetched", 0)) for h in sampler_states(copy).values())
    assert fetched == 300 - report["samples"]
    assert listing.stat().st_mtime_ns == listed_at
    assert "the saved listing" in node1.logs()


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_copy_refuses_a_destination_that_is_not_empty(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    cache.put_many([("a", b"1")])
    cache.close()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep me")
    result = _cli("copy", "cache", "busy", cwd=tmp_path)
    assert result.returncode == 2
    assert "busy: the directory is not empty" in result.stderr
    assert "new or empty directory" in result.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["mine.txt"]
    (tmp_path / "afile").write_text("x")
    assert _cli("copy", "cache", "afile", cwd=tmp_path).returncode == 2


def test_copy_to_from_python(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    try:
        cache.put_many([(f"k{i}", os.urandom(1000)) for i in range(50)])
        with cache.snapshot():
            report = cache.copy_to(tmp_path / "copy")
    finally:
        cache.close()
    assert report["samples"] == 50 and report["leases_left_behind"] == 1
    copy = Cache(tmp_path / "copy")
    try:
        assert len(copy) == 50 and copy.leases() == []
        assert copy.capacity_bytes == 1024 * 1024
        assert copy.get(copy.seq_of("k7")) is not None  # type: ignore[arg-type]
    finally:
        copy.close()
