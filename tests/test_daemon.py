"""``epochcache daemon`` against a real S3 endpoint (moto's server through s3fs), as real processes.

Each test runs the CLI in a subprocess and watches it only through what it writes to the cache
(state ``daemon`` and ``sampler/<i>``, counters, records), the way ``epochcache status`` does.
Faults (kill -9, outages, corrupt objects, bad sources) are in ``test_daemon_faults.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from common.cachecheck import full_check, scan
from common.daemonproc import (
    SAMPLE_BYTES,
    daemon_state,
    pid_running,
    read_cache,
    sampler_states,
    upload,
    wait_cached,
    wait_for,
    wait_running,
    write_config,
)
from conftest import S3Env

from epochcache import Cache
from epochcache.ingest.keyorder import KeyOrder

pytestmark = pytest.mark.timeout(120)

def stats(cache_dir: Path) -> dict[str, Any]:
    result = read_cache(cache_dir, lambda c: c.stats())
    assert result is not None
    return result


@pytest.mark.parametrize("layout", ["files", "tar"])
def test_fills_from_s3_and_fetches_each_sample_once(
    s3: S3Env, tmp_path: Path, start_daemon: Any, layout: str
) -> None:
    n = 300
    keys = upload(s3.url, s3.storage_options, "ds", n, layout, samples_per_shard=50)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), layout=layout, cache_dir=cache_dir,
        storage_options=s3.storage_options,
    )
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, n)
    # A whole pass is cached: the samplers go idle instead of fetching anything again.
    time.sleep(1.5)
    assert daemon.terminate() == 0, daemon.logs()
    state = full_check(str(cache_dir))
    assert sorted(state.keys) == sorted(keys)
    healths = sampler_states(cache_dir)
    assert len(healths) == 2
    assert sum(h["fetched"] for h in healths.values()) == n, healths
    assert sum(h["committed"] for h in healths.values()) == n
    assert all(h["errors"] == 0 and h["quarantined"] == 0 for h in healths.values())
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["stopped"] is True and doc["pid"] == daemon.pid
    with Cache(cache_dir, readonly=True) as cache:
        value = cache.get(cache.seq_of(keys[7]))  # type: ignore[arg-type]
    if layout == "files":
        assert isinstance(value, bytes) and value.startswith(b"\x93NUMPY")
    else:
        assert isinstance(value, dict) and set(value) == {"npy", "cls"} and value["cls"] == b"3"


def test_at_capacity_turns_over_oldest_first_within_headroom(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    n = 400
    upload(s3.url, s3.storage_options, "ds", n, "files")
    cache_dir = tmp_path / "cache"
    capacity = 80 * (SAMPLE_BYTES + 200)  # about 80 samples: the dataset is 5x the cache
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, capacity=capacity,
        storage_options=s3.storage_options,
    )
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    limit = capacity + capacity // 10

    def sample_until(done: Any, timeout_s: float) -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []

        def check() -> bool:
            s = stats(cache_dir)
            seen.append(s)
            assert s["bytes"] <= limit, f"stored {s['bytes']} > capacity + headroom {limit}"
            assert daemon.alive(), daemon.logs()[-3000:]
            return bool(done(s))

        wait_for(check, timeout_s, "the cache to turn over")
        return seen

    seen = sample_until(lambda s: s["evicted"] >= 200, 60)
    assert seen[-1]["samples"] > 50

    # A trainer holds a snapshot (all it can hold: the newest capacity's worth): writers fill
    # the headroom, then wait (back-pressure) instead of evicting its samples.
    cache = Cache(cache_dir)
    try:
        snap = cache.snapshot(epoch=0)
        held = list(snap.seqs)
        before = [cache.get(int(s)) for s in held]
        sample_until(
            lambda s: any(h.get("waiting_for_space") for h in sampler_states(cache_dir).values()),
            30,
        )
        assert [cache.get(int(s)) for s in held] == before
        assert stats(cache_dir)["bytes"] <= limit
        snap.release()
        after = stats(cache_dir)["evicted"]
        sample_until(lambda s: s["evicted"] >= after + 100, 60)
        with pytest.raises(KeyError):
            cache.get(int(held[0]))  # released: the oldest went first
    finally:
        cache.close()
    assert daemon.terminate() == 0
    state = full_check(str(cache_dir))  # contiguous seqs [evicted, next_seq): oldest-first eviction
    assert state.counters.evicted >= 300
    assert state.bytes <= limit


def _expected_keys(keys: list[str], processes: int, positions: dict[int, tuple[int, int]], start: dict[int, int] | None = None) -> set[str]:
    """Keys each sampler process took from pass 0, from ``start`` (default its first) to ``positions``."""
    out: set[str] = set()
    for p in range(processes):
        order = KeyOrder(len(keys), seed=0, process_index=p, num_processes=processes)
        pass_index, offset = positions[p]
        assert pass_index == 0, "the test must stay within the first pass"
        lo = p if start is None else start[p]
        out |= {keys[int(i)] for i in order.pass_order(0)[lo:offset:processes]}
    return out


def test_restarted_daemon_continues_its_permutation(s3: S3Env, tmp_path: Path, start_daemon: Any) -> None:
    n = 600
    keys = upload(s3.url, s3.storage_options, "ds", n, "files")
    cache_dir = tmp_path / "cache"
    capacity = 60 * (SAMPLE_BYTES + 200)  # the first samples are evicted before the restart
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, capacity=capacity,
        storage_options=s3.storage_options, sampler={"batch_size": 8, "bandwidth_limit": 800_000},
    )
    first = start_daemon(config)
    wait_running(first, cache_dir)
    wait_for(lambda: stats(cache_dir)["evicted"] >= 40, 60, "the first samples to be evicted")
    assert first.terminate() == 0
    run1 = sampler_states(cache_dir)
    pos1 = {int(name.split("/")[1]): (h["position"]["pass_index"], h["position"]["offset"]) for name, h in run1.items()}
    with Cache(cache_dir, readonly=True) as cache:
        inserted1 = cache.counters().inserted
        present1 = set(scan(cache).keys)
    fetched1 = _expected_keys(keys, 2, pos1)
    assert len(fetched1) == inserted1  # every sample taken before the stop was committed once
    assert present1 <= fetched1

    second = start_daemon(config)
    wait_running(second, cache_dir)
    wait_for(lambda: stats(cache_dir)["inserted"] >= inserted1 + 100, 60, "100 more samples")
    assert second.terminate() == 0
    run2 = sampler_states(cache_dir)
    pos2 = {int(name.split("/")[1]): (h["position"]["pass_index"], h["position"]["offset"]) for name, h in run2.items()}
    with Cache(cache_dir, readonly=True) as cache:
        state = scan(cache)
    new_keys = {k for k, seq in state.key_to_seq.items() if seq >= inserted1}
    inserted2 = state.counters.inserted - inserted1
    # The new samples are exactly the continuation of each process's permutation ...
    assert new_keys == _expected_keys(keys, 2, pos2, start={p: pos1[p][1] for p in pos1}) or (
        inserted2 > len(new_keys)  # some new ones were already evicted again
        and new_keys <= _expected_keys(keys, 2, pos2, start={p: pos1[p][1] for p in pos1})
    )
    # ... so none of the first run's samples (evicted or not) was fetched again.
    assert not (new_keys & fetched1)
    fetched_total = sum(h["fetched"] for h in run2.values())
    assert fetched_total == state.counters.inserted, (fetched_total, state.counters.inserted)
    assert "offset=0)" not in second.logs()


def test_second_daemon_on_the_same_cache_refuses(s3: S3Env, tmp_path: Path, start_daemon: Any) -> None:
    upload(s3.url, s3.storage_options, "ds", 200, "files")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, storage_options=s3.storage_options,
        sampler={"bandwidth_limit": 100_000},
    )
    first = start_daemon(config)
    wait_running(first, cache_dir)
    second = start_daemon(config, name="second")
    code = second.wait(30)
    assert code != 0
    assert f"pid {first.pid}" in second.logs(), second.logs()
    assert first.alive()
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["pid"] == first.pid and not doc["stopped"]
    assert first.terminate() == 0


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_stops_gracefully_and_commits_the_batch_in_flight(
    s3: S3Env, tmp_path: Path, start_daemon: Any, sig: str
) -> None:
    import signal

    n = 400
    upload(s3.url, s3.storage_options, "ds", n, "files")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, storage_options=s3.storage_options,
        sampler={"bandwidth_limit": 600_000},  # about 150 samples/s: it is mid-run when stopped
    )
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir)
    sampler_pids = [s["pid"] for s in state["samplers"].values()]
    wait_cached(daemon, cache_dir, 60)
    daemon.signal(getattr(signal, sig))
    assert daemon.wait(30) == 0, daemon.logs()[-3000:]
    assert not any(pid_running(pid) for pid in sampler_pids)
    # multiprocessing's resource tracker exits once the daemon's end of its pipe closes: give
    # it a moment under load, but nothing may stay.
    deadline = time.monotonic() + 10
    while daemon.session_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.session_pids() == []
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["stopped"] is True
    checked = full_check(str(cache_dir))
    assert 0 < len(checked.keys) < n, "stopped mid-run"
    healths = sampler_states(cache_dir)
    # Everything fetched was committed: no batch in flight was dropped.
    assert sum(h["fetched"] for h in healths.values()) == len(checked.keys), healths
    assert sum(h["committed"] for h in healths.values()) == len(checked.keys)


def test_credentials_never_leave_storage_options(s3: S3Env, tmp_path: Path, start_daemon: Any) -> None:
    key_id, secret = "AKIDLEAKCANARY7Q3Z", "sEcReT-LeakCanary-9f8e7d6c5b4a"
    options = {**s3.storage_options, "key": key_id, "secret": secret}
    upload(s3.url, s3.storage_options, "ds", 200, "files")
    # A corrupt object and a missing one: quarantine rows and error messages carry URLs.
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe_file(f"{s3.bucket}/ds/sample-000003.npy", b"\x93NUMPY truncated")
    manifest = "key\n" + "".join(f"sample-{i:06d}.npy\n" for i in range(200)) + "sample-999999.npy\n"
    fs.pipe_file(f"{s3.bucket}/ds/keys.csv", manifest.encode())
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, storage_options=options,
        source={"manifest": s3.url("ds") + "/keys.csv"},
    )
    daemon = start_daemon(config, args=("-v",))
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, 199)
    wait_for(lambda: stats(cache_dir)["quarantined"] >= 1, 30, "the corrupt object to be quarantined")
    wait_for(lambda: any(h["errors"] for h in sampler_states(cache_dir).values()), 30, "the 404 to be counted")
    assert daemon.terminate() == 0
    outputs = {"daemon logs": daemon.logs()}
    for extra in ((), ("--json",)):
        result = subprocess.run(
            [sys.executable, "-m", "epochcache", "status", str(cache_dir), *extra],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
        )
        assert result.returncode == 0, result.stderr
        outputs[f"status {extra}"] = result.stdout + result.stderr
        if extra:
            status = json.loads(result.stdout)
    assert status["quarantined"] >= 1 and status["daemon"]["pid"] == daemon.pid
    assert "sample-000003.npy" in outputs["daemon logs"]  # the logs are there, just not the secret
    for name, text in outputs.items():
        assert key_id not in text and secret not in text, f"credential in {name}"
    import gzip

    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert any(p.name == "data.mdb" for p in files)
    for path in files:
        data = path.read_bytes()
        blobs = [data]
        if data[:2] == b"\x1f\x8b":
            blobs.append(gzip.decompress(data))
        for blob in blobs:
            for value in (key_id, secret):
                assert value.encode() not in blob, f"credential in {path}"
