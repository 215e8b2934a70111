"""``gs://`` sources through gcsfs, against a GCS emulator (``gcp-storage-emulator``) on 127.0.0.1.

What a daemon does on S3 it does on GCS: it fills a cache smaller than the bucket, turns it
over (evicting the oldest for new samples), survives an outage of the remote (the emulator
killed, every connection with it) without losing a sampler, and goes on when it is back.
A shard streamed from GCS is read in ranged requests, each counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from common.cachecheck import full_check
from common.daemonproc import (
    SAMPLE_BYTES,
    daemon_state,
    read_cache,
    sampler_states,
    upload,
    wait_for,
    wait_running,
    write_config,
)
from common.gcsserver import GcsServerProcess
from conftest import free_port

from epochcache.demo import make_samples
from epochcache.ingest.layouts import SourceSpec, open_source
from epochcache.ingest.remote import open_fs

pytestmark = pytest.mark.timeout(180)

BUCKET = "epochcache-gcs"


@pytest.fixture
def gcs(tmp_path: Path) -> Iterator[GcsServerProcess]:
    """A running emulator with one bucket, its objects on disk (killed at teardown)."""
    data = tmp_path / "gcs-data"
    data.mkdir()
    server = GcsServerProcess(free_port(), data, tmp_path / "gcs.log", BUCKET)
    server.start()
    yield server
    server.kill()


def put_samples(gcs: GcsServerProcess, prefix: str, n: int) -> list[str]:
    """``n`` demo samples under ``prefix``, one request at a time (the emulator serves
    concurrent uploads slowly: fsspec's batched ``pipe`` took seconds)."""
    fs, _ = open_fs(f"gs://{BUCKET}/{prefix}", gcs.storage_options)
    payloads, _ = make_samples(n, sample_bytes=SAMPLE_BYTES)
    keys = [f"sample-{i:06d}.npy" for i in range(n)]
    for key, payload in zip(keys, payloads):
        fs.pipe_file(f"{BUCKET}/{prefix}/{key}", payload)
    return keys


def _inserted(cache_dir: Path) -> int:
    return read_cache(cache_dir, lambda c: c.counters().inserted) or 0


def test_a_daemon_fills_turns_over_and_survives_an_outage_of_gcs(
        gcs: GcsServerProcess, tmp_path: Path, start_daemon: Any) -> None:
    n = 120
    keys = put_samples(gcs, "ds", n)
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=f"gs://{BUCKET}/ds", cache_dir=cache_dir,
        storage_options=gcs.storage_options, capacity="240KiB",  # about 55 of the 120 samples
        source={"timeout_s": 2, "connect_timeout_s": 1, "retries": 2},
        sampler={"processes": 1, "concurrency": 4, "batch_size": 8})
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir, timeout_s=60)
    samplers = {name: s["pid"] for name, s in state["samplers"].items()}
    # full, and turning over: the oldest evicted for samples not cached yet
    wait_for(lambda: (read_cache(cache_dir, lambda c: c.counters().evicted) or 0) > 20, 90,
             "the cache to turn over")
    gcs.kill()  # every connection dies
    wait_for(lambda: sum(h.get("errors", 0) for h in sampler_states(cache_dir).values()) > 0,
             60, "the samplers to report fetch errors")
    time.sleep(1)  # the outage goes on a while; the daemon keeps retrying
    assert daemon.alive()
    gcs.start()  # the same objects on the same port
    back = _inserted(cache_dir)
    wait_for(lambda: _inserted(cache_dir) > back + 30, 90, "ingest to go on after the outage")
    states = sampler_states(cache_dir)
    assert any(BUCKET in (h.get("last_error") or "") for h in states.values())
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["pid"] == daemon.pid
    assert {name: s["pid"] for name, s in doc["samplers"].items()} == samplers
    assert all(s["restarts"] == 0 for s in doc["samplers"].values())
    # every sample read once at least, each read a counted GET (the counts follow the commits)
    requests = wait_for(lambda: (r := (read_cache(cache_dir, lambda c: c.stats()) or {})
                                 ["requests"]["source"]) and r["gets"] >= n and r, 30,
                        "the GETs counted")
    assert requests["lists"] >= 1 and requests["errors"] + requests["timeouts"] >= 1
    assert daemon.terminate() == 0
    checked = full_check(str(cache_dir))
    assert checked.keys and set(checked.keys) <= set(keys)


def test_a_shard_on_gcs_is_read_in_counted_ranged_requests(gcs: GcsServerProcess) -> None:
    upload(lambda p: f"gs://{BUCKET}/{p}", gcs.storage_options, "sh", 40, "tar",
           samples_per_shard=20)
    source = open_source(SourceSpec(url=f"gs://{BUCKET}/sh", layout="tar", pattern="*.tar",
                                    storage_options=gcs.storage_options, checks=("size",)))
    results = source.fetch_many(source.list_keys())
    assert len(results) == 40 and not [p for _, p in results if isinstance(p, BaseException)]
    assert source.gate.stats["gets"] == 2 and source.gate.stats["heads"] == 0
