"""``epochcache daemon`` under faults: kill -9, a remote outage, corrupt objects, bad sources.

Real processes and signals against moto's S3 server; the cache is checked from the outside
(``full_check``: every record, the counters and ``verify_cache``) after each fault.

Internals: the daemon's state documents are read through ``cache.env``: what it wrote, which no
public call shows.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
import s3fs
from common.cachecheck import full_check
from common.daemonproc import (
    SAMPLE_BYTES,
    cache_len,
    daemon_state,
    pid_running,
    sampler_states,
    upload,
    wait_cached,
    wait_for,
    wait_running,
    write_config,
)
from common.s3server import S3ServerProcess
from conftest import S3Env, free_port, s3_options

from epochcache.demo import make_samples

pytestmark = pytest.mark.timeout(120)


def _throttled_daemon(s3: S3Env, tmp_path: Path, start_daemon: Any,
                      n: int) -> tuple[list[str], Path, Path, Any, dict[str, Any]]:
    """A daemon filling from ``n`` uploaded files, slowed down so that a test can act mid-way."""
    keys = upload(s3.url, s3.storage_options, "ds", n, "files")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir, storage_options=s3.storage_options,
        sampler={"bandwidth_limit": 600_000},
    )
    daemon = start_daemon(config)
    return keys, cache_dir, config, daemon, wait_running(daemon, cache_dir)


def test_sigkill_of_one_sampler_restarts_it_and_loses_nothing(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    n = 400
    keys, cache_dir, _config, daemon, state = _throttled_daemon(s3, tmp_path, start_daemon, n)
    victim = state["samplers"]["0"]["pid"]
    other = state["samplers"]["1"]["pid"]
    wait_cached(daemon, cache_dir, 60)
    os.kill(victim, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        doc = daemon_state(cache_dir)
        sampler = (doc or {}).get("samplers", {}).get("0", {})
        return doc if sampler.get("restarts") == 1 and sampler.get("alive") and sampler.get("pid") != victim else None

    doc = wait_for(restarted, 20, "the daemon to restart the killed sampler")
    assert doc["pid"] == daemon.pid and doc["samplers"]["1"]["pid"] == other
    assert doc["samplers"]["1"]["restarts"] == 0
    assert not pid_running(victim)
    wait_cached(daemon, cache_dir, n)
    assert daemon.terminate() == 0
    checked = full_check(str(cache_dir))
    assert sorted(checked.keys) == keys


def test_sigkill_of_the_daemon_leaves_no_orphans_and_a_clean_cache(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    n = 400
    keys, cache_dir, config, daemon, state = _throttled_daemon(s3, tmp_path, start_daemon, n)
    samplers = [s["pid"] for s in state["samplers"].values()]
    wait_cached(daemon, cache_dir, 60)
    assert len(daemon.session_pids()) >= 3  # daemon + 2 samplers (+ multiprocessing's tracker)
    daemon.kill9()
    # The samplers watch their parent and stop by themselves; nothing of the daemon survives.
    wait_for(lambda: not daemon.session_pids(), 20, f"the daemon's processes to exit: {daemon.session_pids()}")
    assert not any(pid_running(pid) for pid in samplers)
    partial = full_check(str(cache_dir))
    assert 0 < len(partial.keys) < n
    # The lock died with the daemon: a new one starts on the same cache and finishes the pass.
    again = start_daemon(config, name="again")
    wait_running(again, cache_dir)
    wait_cached(again, cache_dir, n)
    assert again.terminate() == 0
    assert sorted(full_check(str(cache_dir)).keys) == keys


@pytest.fixture
def private_s3(tmp_path: Path) -> Any:
    """A moto server process of our own, preloaded from ``tmp_path/objects/<bucket>/``."""
    objects = tmp_path / "objects"
    objects.mkdir()
    server = S3ServerProcess(free_port(), objects, tmp_path / "s3server.log")
    yield server
    server.kill()


def test_remote_outage_is_survived_and_filling_resumes(
    private_s3: S3ServerProcess, tmp_path: Path, start_daemon: Any
) -> None:
    n = 300
    payloads, _ = make_samples(n, sample_bytes=SAMPLE_BYTES)
    keys = [f"sample-{i:06d}.npy" for i in range(n)]
    root = private_s3.data_dir / "outage-bucket" / "ds"
    root.mkdir(parents=True)
    for key, payload in zip(keys, payloads):
        (root / key).write_bytes(payload)
    private_s3.start()
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url="s3://outage-bucket/ds", cache_dir=cache_dir,
        storage_options=s3_options(private_s3.endpoint),
        source={"timeout_s": 2, "connect_timeout_s": 1, "retries": 3},
        sampler={"bandwidth_limit": 300_000},  # about 70 samples/s: the outage comes mid-run
    )
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir)
    samplers = {name: s["pid"] for name, s in state["samplers"].items()}
    wait_cached(daemon, cache_dir, 60)
    private_s3.kill()  # every connection dies
    down_at = cache_len(cache_dir)
    wait_for(
        lambda: sum(h.get("errors", 0) for h in sampler_states(cache_dir).values()) > 0,
        30, "the samplers to report fetch errors",
    )
    time.sleep(2)  # the outage goes on for a while; the daemon keeps retrying
    assert daemon.alive()
    stalled = cache_len(cache_dir)
    assert stalled < n
    private_s3.start()  # the same objects on the same port
    wait_cached(daemon, cache_dir, n, timeout_s=60)
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["pid"] == daemon.pid
    # The samplers survived the outage (no restarts), and said what went wrong.
    assert {name: s["pid"] for name, s in doc["samplers"].items()} == samplers
    assert all(s["restarts"] == 0 for s in doc["samplers"].values())
    assert any("outage-bucket" in (h.get("last_error") or "") for h in sampler_states(cache_dir).values())
    assert daemon.terminate() == 0
    checked = full_check(str(cache_dir))
    assert sorted(checked.keys) == keys, (down_at, stalled)


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_corrupt_objects_are_quarantined_and_the_rest_is_cached(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    fs = s3fs.S3FileSystem(**s3.storage_options)
    # files layout with a manifest: three objects whose bytes do not match the manifest's checksum.
    n = 200
    keys = upload(s3.url, s3.storage_options, "files", n, "files")
    payloads, _ = make_samples(n, sample_bytes=SAMPLE_BYTES)
    bad_checksum = {keys[5], keys[77], keys[150]}
    lines = ["key,size,checksum"]
    for key, payload in zip(keys, payloads):
        digest = hashlib.sha256(payload if key not in bad_checksum else payload + b"x").hexdigest()
        lines.append(f"{key},{len(payload)},{digest}")
    fs.pipe_file(f"{s3.bucket}/files/bad-manifest.csv", ("\n".join(lines) + "\n").encode())
    # tar layout: shard 1's last sample has a member cut short (the shard ends inside it).
    shards = []
    for s in range(3):
        members = []
        for i in range(s * 20, s * 20 + 20):
            members += [(f"{i:06d}.npy", payloads[i]), (f"{i:06d}.cls", b"1")]
        data = _tar_bytes(members)
        if s == 1:
            with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                last = archive.getmember("000039.npy")
            data = data[: last.offset_data + 1000]  # the shard ends inside its last sample
        fs.pipe_file(f"{s3.bucket}/tar/shard-{s:06d}.tar", data)
        shards.append(data)

    files_dir, tar_dir = tmp_path / "files-cache", tmp_path / "tar-cache"
    files_cfg = write_config(
        tmp_path / "files.yaml", url=s3.url("files"), cache_dir=files_dir, storage_options=s3.storage_options,
        source={"manifest": s3.url("files") + "/bad-manifest.csv"},
    )
    tar_cfg = write_config(
        tmp_path / "tar.yaml", url=s3.url("tar"), layout="tar", cache_dir=tar_dir,
        storage_options=s3.storage_options,
    )
    files_daemon = start_daemon(files_cfg, name="files")
    tar_daemon = start_daemon(tar_cfg, name="tar")
    wait_cached(files_daemon, files_dir, n - len(bad_checksum))
    wait_cached(tar_daemon, tar_dir, 59)
    time.sleep(2)  # more passes go by: quarantined objects are not fetched and counted again
    assert files_daemon.terminate() == 0 and tar_daemon.terminate() == 0

    files_state = full_check(str(files_dir))
    assert sorted(files_state.keys) == sorted(set(keys) - bad_checksum)
    assert files_state.counters.quarantined == len(bad_checksum)
    tar_state = full_check(str(tar_dir))
    expected_tar = {f"shard-{i // 20:06d}.tar/{i:06d}" for i in range(60)} - {"shard-000001.tar/000039"}
    assert set(tar_state.keys) == expected_tar
    assert tar_state.counters.quarantined == 1

    from epochcache import Cache

    with Cache(files_dir, readonly=True) as cache:
        stats = cache.stats()
        rows = cache.quarantined()
    assert stats["quarantined"] == 3
    assert {row["key"] for row in rows} == bad_checksum
    assert all("sha256 mismatch" in row["reason"] for row in rows)
    for key in bad_checksum:
        assert key in files_daemon.logs()
    with Cache(tar_dir, readonly=True) as cache:
        rows = cache.quarantined()
    assert [row["key"] for row in rows] == ["shard-000001.tar/000039"]
    assert "truncated" in rows[0]["reason"], rows


@pytest.mark.parametrize("case", ["unreachable endpoint", "missing bucket", "empty prefix"])
def test_bad_source_fails_fast_with_the_url_and_starts_nothing(
    s3: S3Env, tmp_path: Path, start_daemon: Any, unreachable_endpoint: str, case: str
) -> None:
    upload(s3.url, s3.storage_options, "ds", 20, "files")
    options = dict(s3.storage_options)
    url = s3.url("ds")
    if case == "unreachable endpoint":
        options = s3_options(unreachable_endpoint)
    elif case == "missing bucket":
        url = "s3://no-such-bucket-here/ds"
    else:
        url = s3.url("nothing-under-here")
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=url, cache_dir=cache_dir, storage_options=options)
    start = time.monotonic()
    daemon = start_daemon(config)
    code = daemon.wait(30)
    elapsed = time.monotonic() - start
    logs = daemon.logs()
    assert code == 2, logs
    # Not the samplers' minutes of retries; includes interpreter start-up (seconds under load).
    assert elapsed < 60, f"took {elapsed:.1f}s to fail"
    assert url in logs, logs
    assert options["secret"] not in logs and options["key"] not in logs
    assert daemon.session_pids() == []  # no sampler was started
    assert daemon_state(cache_dir) is None
    assert sampler_states(cache_dir) == {}


def test_reader_opening_while_a_sampler_grows_the_map(tmp_path: Path) -> None:
    import threading

    from common.procs import spawn_script

    from epochcache import Cache

    cache_dir = tmp_path / "cache"
    # A writer (like a sampler committing a batch of large samples) holds a write transaction
    # that grows the data well past LMDB's 64 MiB default map of a newly opened reader.
    writer = spawn_script(
        tmp_path,
        "writer",
        """
        import sys
        from epochcache import Cache
        from epochcache.store.records import DB_STATE
        cache = Cache(sys.argv[1], capacity="1GiB")
        env = cache.env.lmdb_env
        txn = env.begin(write=True)
        for i in range(96):
            txn.put(b"filler-%03d" % i, bytes(1 << 20), db=cache.env.dbs[DB_STATE])
        print("READY", flush=True)
        sys.stdin.readline()
        txn.commit()
        print("COMMITTED", flush=True)
        sys.stdin.readline()
        """,
        str(cache_dir),
    )
    try:
        writer.wait_line("READY")
        outcome: list[BaseException | int] = []

        def read() -> None:
            try:
                with Cache(cache_dir, readonly=True) as cache:  # status, a trainer, a test poller
                    outcome.append(len(cache))
            except BaseException as exc:
                outcome.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)  # the reader has opened the environment and waits for the write lock
        assert reader.is_alive()
        writer.send("commit")
        writer.wait_line("COMMITTED")
        reader.join(30)
        assert outcome and not isinstance(outcome[0], BaseException), outcome
    finally:
        writer.close()
