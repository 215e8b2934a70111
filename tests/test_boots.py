"""A cache on another boot or host (issue 33, item 2).

A node reboots (``time.monotonic()`` starts again from zero) or a cache is copied to another
host; the state files and documents a daemon of the previous boot left in ``cache.dir`` must
not hold the new one back, and what they say about processes must not be believed of the new
boot's processes. Each test writes the state as a process of a previous boot would have: an
instant far ahead of this boot's monotonic clock, in the layout the previous version wrote, or
a file stamped with another clock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from common.daemonproc import cache_len, upload, wait_for, write_config

from epochcache import Cache
from epochcache.ingest.concurrency import Pace, SharedPaceState
from epochcache.ingest.requests import BUDGET_FILE, RequestBudget
from epochcache.paths import STALLS_DIR, process_start_ticks, read_stalls
from epochcache.status import collect_stats

if TYPE_CHECKING:
    from conftest import S3Env

pytestmark = pytest.mark.timeout(120)

#: Half an hour ahead of this boot's monotonic clock: a node that ran for a while before its
#: reboot leaves instants like this one (below the hour the earlier versions' guard allowed).
AHEAD_S = 1800.0


def test_a_daemon_after_a_reboot_fills_at_once(s3: S3Env, tmp_path: Path,
                                               start_daemon: Any) -> None:
    """The request budget and the throttling pace left by a daemon of the previous boot (the
    layout it wrote, instants of its clock): the new daemon ignores both, says so, and fills
    (before: every request waited for the old instant, 0 samples in half an hour)."""
    upload(s3.url, s3.storage_options, "reboot", 60, "files")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    ahead = time.monotonic() + AHEAD_S
    (cache_dir / BUDGET_FILE).write_bytes(struct.pack("<d", ahead))
    # the pace of the single `source:` after throttling: 50 requests/s, next free instant ahead
    (cache_dir / "pace-source").write_bytes(struct.pack("<6d", ahead, 50.0, ahead, ahead,
                                                        ahead, ahead))
    config = write_config(tmp_path / "cfg.yaml", url=s3.url("reboot"), cache_dir=cache_dir,
                          storage_options=s3.storage_options,
                          sampler={"processes": 1, "concurrency": 4, "batch_size": 8,
                                   "max_requests_per_s": 500})
    daemon = start_daemon(config)
    wait_for(lambda: cache_len(cache_dir) >= 40 or not daemon.alive(), 45,
             "the daemon to cache samples")
    assert cache_len(cache_dir) >= 40, daemon.logs()[-3000:]
    logs = daemon.logs()
    for name in (BUDGET_FILE, "pace-source"):
        assert f"{cache_dir / name}: written under another boot or host" in logs, logs[-3000:]


def test_state_files_keep_instants_of_this_boot_and_drop_those_of_another(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file stamped with this boot's clock is believed (its instant is waited for); the same
    file stamped by another boot (a cache copied from another host) is started afresh."""
    path = tmp_path / BUDGET_FILE
    budget = RequestBudget(path, 10.0)
    budget.reserve()
    budget.close()
    with RequestBudget(path, 10.0) as here:  # the same boot: the reservations go on
        assert here.reserve() == pytest.approx(0.0, abs=0.2)
        waits = [here.reserve() for _ in range(5)]
        assert waits[-1] > 0.15
    raw = bytearray(path.read_bytes())
    stamp = raw.find(bytes.fromhex(_clock_hex()))
    assert stamp >= 0  # the file names the clock its instants belong to
    raw[stamp: stamp + 16] = os.urandom(16)  # as a process of another boot stamped it
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.INFO, logger="epochcache")
    with RequestBudget(path, 10.0) as elsewhere:
        assert elsewhere.reserve() == 0.0
    assert f"{path}: written under another boot or host" in caplog.text

    pace_path = tmp_path / "pace-x"
    pace = Pace(SharedPaceState(pace_path))
    pace.decrease(0.5, first=2.0)  # throttled: paced at ~1.4 requests/s
    pace.reserve()
    assert pace.reserve() > 0.1  # ~0.7 s: the instant of this boot is waited for
    raw = bytearray(pace_path.read_bytes())
    at = raw.find(bytes.fromhex(_clock_hex()))
    raw[at: at + 16] = os.urandom(16)
    pace_path.write_bytes(bytes(raw))
    assert Pace(SharedPaceState(pace_path)).reserve() == 0.0  # not paced: the state was dropped


def _clock_hex() -> str:
    from epochcache.paths import clock_id

    return clock_id().hex()


def test_documents_of_another_boot_name_no_live_process(tmp_path: Path) -> None:
    """After a reboot a pid (and its start time in ticks since boot) may belong to a new
    process: a daemon's heartbeat, a job and a stall record written under another boot are
    not reported as alive, whatever process now has that pid."""
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    me = os.getpid()
    previous = {"pid": me, "host": socket.gethostname(), "start_ticks": process_start_ticks(me),
                "boot": "00000000-another-boot"}
    try:
        tables = cache.tables
        tables.put_state("daemon", {**previous, "heartbeat": time.time(), "stopped": False,
                                    "samplers": {}})
        tables.put_state(f"job/{socket.gethostname()}:{me}", {**previous, "run_dir": "runs/x",
                                                               "started": time.time()})
        stats = collect_stats(cache)
        assert stats["daemon"]["alive"] is False
        assert stats["jobs"] == []
    finally:
        cache.close()
    stalls = tmp_path / "cache" / STALLS_DIR
    stalls.mkdir()
    (stalls / f"{me}.json").write_text(json.dumps({**previous, "since": time.time()}))
    assert read_stalls(str(tmp_path / "cache")) == []
