"""A sampler never stalls silently: per-sample write faults, a dying committer, a dead daemon.

Real daemons against moto's S3 server (``tests/common/daemonproc.py``): an object larger than
the cache, a key longer than LMDB's 511-byte key limit, a daemon killed while its samplers
wait for space behind a lease. The committer's own failures are provoked in real sampler
processes whose store raises (the only way to make a healthy LMDB fail on demand).
"""

from __future__ import annotations

import io
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs
from common.cachecheck import full_check
from common.daemonproc import (
    SAMPLE_BYTES,
    all_samplers,
    cache_len,
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

pytestmark = pytest.mark.timeout(120)


def _npy(num_bytes: int, seed: int = 0) -> bytes:
    """A valid, incompressible float32 ``.npy`` object of about ``num_bytes``."""
    values = np.random.default_rng(seed).standard_normal(num_bytes // 4).astype(np.float32)
    buffer = io.BytesIO()
    np.save(buffer, values)
    return buffer.getvalue()


def _quarantine_rows(cache_dir: Path) -> list[dict[str, Any]]:
    return read_cache(cache_dir, lambda c: c.quarantined()) or []


def test_sample_larger_than_capacity_is_quarantined_and_the_rest_commits(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    n = 40
    keys = upload(s3.url, s3.storage_options, "ds", n, "files")
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe_file(f"{s3.bucket}/ds/huge.npy", _npy(768 * 1024))  # capacity is 512 KiB
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, capacity="512KiB",
        storage_options=s3.storage_options,
    )
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, n, timeout_s=30)
    rows = wait_for(lambda: _quarantine_rows(cache_dir), 20, "the huge object to be quarantined")
    assert [row["key"] for row in rows] == ["huge.npy"]
    assert "capacity" in rows[0]["reason"], rows
    time.sleep(1.5)  # more passes go by: it is not fetched and quarantined again
    doc = daemon_state(cache_dir)
    assert doc is not None and all(s["restarts"] == 0 and s["alive"] for s in doc["samplers"].values()), doc
    wait_for(lambda: sum(h["quarantined"] for h in sampler_states(cache_dir).values()) == 1, 10,
             "the samplers' health to count the quarantined sample")
    assert daemon.terminate() == 0
    assert sum(h["quarantined"] for h in sampler_states(cache_dir).values()) == 1
    assert "huge.npy" in daemon.logs()
    state = full_check(str(cache_dir))
    assert sorted(state.keys) == keys
    assert state.counters.quarantined == 1


def test_key_longer_than_lmdb_allows_is_cached_under_a_digest(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    n = 40
    keys = upload(s3.url, s3.storage_options, "ds", n, "files")
    long_key = "long-" + "k" * 700 + ".npy"  # 709 bytes: S3 allows 1024, LMDB keys 511
    payload = _npy(SAMPLE_BYTES, seed=7)
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe_file(f"{s3.bucket}/ds/{long_key}", payload)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
        storage_options=s3.storage_options,
    )
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, n + 1, timeout_s=30)
    time.sleep(1.5)  # the whole pass is cached: nothing is fetched again, nothing quarantined
    assert daemon.terminate() == 0
    state = full_check(str(cache_dir))
    assert sorted(state.keys) == sorted([*keys, long_key])
    with Cache(cache_dir, readonly=True) as cache:
        assert long_key in cache
        seq = cache.seq_of(long_key)
        assert seq is not None
        assert cache.info(seq).key == long_key  # the full source key is in the record
        assert cache.get(seq) == payload
        assert cache.stats()["quarantined"] == 0
    healths = sampler_states(cache_dir)
    assert sum(h["fetched"] for h in healths.values()) == n + 1, healths


def test_samplers_die_with_their_daemon_while_waiting_for_space(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    upload(s3.url, s3.storage_options, "ds", 300, "files")
    cache_dir = tmp_path / "cache"
    capacity = 40 * (SAMPLE_BYTES + 200)
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, capacity=capacity,
        storage_options=s3.storage_options, sampler={"batch_size": 4},
    )
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir)
    samplers = [s["pid"] for s in state["samplers"].values()]
    wait_cached(daemon, cache_dir, 30)
    cache = Cache(cache_dir)
    try:
        snap = cache.snapshot(epoch=0)  # pins the oldest samples: writers fill the headroom, then wait
        wait_for(
            lambda: all_samplers(cache_dir, 2, lambda h: h.get("waiting_for_space")),
            30, "both samplers to wait for space",
        )
        assert cache.stats()["bytes"] <= capacity + capacity // 10
        daemon.kill9()
        killed = time.monotonic()
        wait_for(lambda: not any(pid_running(p) for p in samplers), 10,
                 f"the samplers {samplers} to exit after their daemon was killed")
        assert time.monotonic() - killed < 10
        snap.release()
    finally:
        cache.close()
    full_check(str(cache_dir))


def _sampler_script(tmp_path: Path, fault: str) -> Path:
    """A sampler process (``run_sampler``, as the daemon starts it) over 60 local files whose
    store's ``put_many`` fails as ``fault`` says."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(60):
        (data / f"s-{i:03d}.bin").write_bytes(bytes([i]) * 2000)
    script = tmp_path / "sampler.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, os, sys
        import lmdb
        from epochcache.store import SampleStore
        from epochcache.ingest.sampler import StopFlag, run_sampler

        real_put_many = SampleStore.put_many

        def put_many(self, items, **kwargs):
            items = list(items)
            if {fault!r} == "bug":
                raise RuntimeError("simulated committer bug")
            if any(key == "s-013.bin" for key, _ in items):
                raise lmdb.BadValsizeError("mdb_put: MDB_BAD_VALSIZE (simulated)")
            return real_put_many(self, items, **kwargs)

        SampleStore.put_many = put_many
        config = {{
            "source": {{"url": {str(data)!r}, "pattern": "*.bin", "checks": []}},
            "cache": {{"dir": {str(tmp_path / "cache")!r}, "capacity": "16MiB"}},
            "sampler": {{"processes": 1, "batch_size": 8}},
        }}
        if __name__ == "__main__":
            SampleStore(config["cache"]["dir"], capacity="16MiB").close()  # as the daemon does
            stop = StopFlag(multiprocessing.get_context("spawn"))
            if {fault!r} == "record":
                import threading
                threading.Timer(6.0, stop.set).start()
            run_sampler(config, 0, stop, os.getppid())
    """))
    return script


def test_committer_failure_makes_the_sampler_process_exit_nonzero(tmp_path: Path) -> None:
    import subprocess

    from common.daemonproc import REPO

    script = _sampler_script(tmp_path, "bug")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        _out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the sampler process hung after its committer died") from None
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "simulated committer bug" in err.decode(errors="replace")
    assert elapsed < 15


def test_a_per_record_write_error_quarantines_only_that_sample(tmp_path: Path) -> None:
    import subprocess

    from common.daemonproc import REPO

    script = _sampler_script(tmp_path, "record")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=60,
                          check=False)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err
    assert "s-013.bin" in err
    state = full_check(str(tmp_path / "cache"))
    assert sorted(state.keys) == sorted(f"s-{i:03d}.bin" for i in range(60) if i != 13)
    with Cache(tmp_path / "cache", readonly=True) as cache:
        rows = cache.quarantined()
        assert [row["key"] for row in rows] == ["s-013.bin"]
        assert "MDB_BAD_VALSIZE" in rows[0]["reason"]
    assert cache_len(tmp_path / "cache") == 59


def test_a_sampler_whose_committer_dies_is_restarted_and_counted(
    s3: S3Env, tmp_path: Path, start_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import subprocess

    n = 100
    keys = upload(s3.url, s3.storage_options, "ds", n, "files")
    # Fault injection into the daemon's real sampler processes: a sitecustomize that makes the
    # store's put_many fail (a systemic error, not a per-sample one) while `broken` exists.
    inject = tmp_path / "inject"
    inject.mkdir()
    broken = tmp_path / "broken"
    broken.touch()
    (inject / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import multiprocessing, os
        from epochcache.store import SampleStore
        real = SampleStore.put_many
        def put_many(self, items, **kwargs):
            in_sampler = multiprocessing.current_process().name.startswith("epochcache-sampler")
            if in_sampler and os.path.exists({str(broken)!r}):
                raise OSError(5, "simulated I/O error on every write")
            return real(self, items, **kwargs)
        SampleStore.put_many = put_many
    """))
    monkeypatch.setenv("PYTHONPATH", str(inject))
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
        storage_options=s3.storage_options, sampler={"processes": 1},
    )
    daemon = start_daemon(config)

    def restarted() -> bool:
        doc = daemon_state(cache_dir) or {}
        return bool(doc.get("samplers", {}).get("0", {}).get("restarts", 0) >= 1)

    wait_for(restarted, 20, "the daemon to restart the sampler whose committer died")
    assert daemon.alive()
    broken.unlink()  # the fault goes away: the restarted sampler fills the cache
    wait_cached(daemon, cache_dir, n, timeout_s=60)
    status = subprocess.run(
        [sys.executable, "-m", "epochcache", "status", str(cache_dir), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert status.returncode == 0, status.stderr
    sampler = json.loads(status.stdout)["daemon"]["samplers"]["0"]
    assert sampler["restarts"] >= 1 and sampler["alive"]
    assert daemon.terminate() == 0
    logs = daemon.logs()
    assert "simulated I/O error on every write" in logs and "exited with 1" in logs, logs[-3000:]
    assert sorted(full_check(str(cache_dir)).keys) == keys
