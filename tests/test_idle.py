"""An idle sampler costs the same whatever its keys (issue 22, item 2).

When every key is cached (or what is left cannot be fetched) a sampler used to scan its whole
key space again every second, forever. Now it looks up nothing until something changes: the
cache loses samples (eviction), its listing grows, or a key that failed is due for a retry,
and then only those keys. One sampler in this process over ``memory://`` and a real cache; the
keys it looks up in the cache are recorded as it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from common.daemonproc import wait_for

from epochcache import Cache
from epochcache.config import EpochcacheConfig
from epochcache.ingest.sampler import Sampler

pytestmark = pytest.mark.timeout(120)

KEYS = 300
#: how long a sampler with nothing to do is watched (the old loop scanned once a second)
WATCH_S = 3.5


def _sampler(tmp_path: Path, name: str, manifest: list[str] | None = None) -> Sampler:
    fs = fsspec.filesystem("memory")
    for i in range(KEYS):
        fs.pipe_file(f"/{name}/k{i:04d}.bin", b"x" * 100)
    source: dict[str, Any] = {"url": f"memory://{name}", "pattern": "*.bin", "checks": [],
                              "retries": 1}
    if manifest is not None:
        fs.pipe_file(f"/{name}/keys.txt", "\n".join(manifest).encode())
        source["manifest"] = f"memory://{name}/keys.txt"
    config = EpochcacheConfig.model_validate({
        "source": source,
        "cache": {"dir": str(tmp_path / name), "capacity": "64MiB", "sync": False},
        "sampler": {"processes": 1, "concurrency": 4, "batch_size": 32},
    })
    Cache(config.cache.dir, "64MiB").close()
    return Sampler(config, 0, threading.Event())


class Looked:
    """Every key the sampler looks up in the cache, as it runs in a thread."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler, self.keys, self.lock = sampler, [], threading.Lock()
        lookup = sampler.cache.contains_many

        def recording(keys: Any) -> list[bool]:
            with self.lock:
                self.keys.extend(keys)
            return lookup(keys)

        sampler.cache.contains_many = recording  # type: ignore[method-assign]
        self.thread = threading.Thread(target=sampler.run)

    def since(self, mark: int) -> list[str]:
        with self.lock:
            return list(self.keys[mark:])

    def mark(self) -> int:
        with self.lock:
            return len(self.keys)


@pytest.fixture
def running() -> Iterator[list[Looked]]:
    started: list[Looked] = []
    yield started
    for looked in started:
        looked.sampler.stop.set()
        looked.thread.join(60)
        looked.sampler.close()


def _start(sampler: Sampler, running: list[Looked]) -> Looked:
    looked = Looked(sampler)
    running.append(looked)
    looked.thread.start()
    return looked


def test_an_idle_sampler_looks_nothing_up_until_the_cache_loses_samples(
    tmp_path: Path, running: list[Looked]
) -> None:
    sampler = _sampler(tmp_path, "fits")
    looked = _start(sampler, running)
    wait_for(lambda: len(sampler.cache) == KEYS and sampler.health.idle == "complete", 60,
             "every key cached and the sampler idle")
    mark = looked.mark()
    time.sleep(WATCH_S)  # nothing changes: nothing is looked up (it used to be 300 a second)
    assert looked.since(mark) == []

    # Eviction takes 100 samples out: the sampler wakes, scans, fetches them again.
    sampler.cache.evict(limit_bytes=sampler.cache.counters().bytes * 2 // 3)
    assert len(sampler.cache) < KEYS
    wait_for(lambda: len(sampler.cache) == KEYS, 30, "the evicted samples fetched again")


def test_keys_that_fail_are_retried_alone(tmp_path: Path, running: list[Looked],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches of failing keys only read as an outage: the source rests a second, doubling to a
    # minute, before its next batch. Shortened here, so the first pass ends within seconds.
    monkeypatch.setattr("epochcache.ingest.feed.DOWN_FIRST_S", 0.05)
    monkeypatch.setattr("epochcache.ingest.feed.DOWN_MAX_S", 0.1)
    missing = [f"gone-{i:02d}.bin" for i in range(20)]  # listed; their reads fail
    # ...transiently (a reset connection: retried later). A key that is not there (404) is
    # quarantined instead, never asked for again (test_s3_refusals).
    from fsspec.implementations.memory import MemoryFileSystem

    cat_file = MemoryFileSystem.cat_file

    def resetting(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if "/gone-" in path:
            raise ConnectionResetError(f"{path}: connection reset")
        return cat_file(self, path, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", resetting)
    keys = [f"k{i:04d}.bin" for i in range(KEYS)] + missing
    sampler = _sampler(tmp_path, "failing", manifest=keys)
    looked = _start(sampler, running)
    wait_for(lambda: len(sampler.cache) == KEYS and sampler.health.idle == "failing", 60,
             "the fetchable keys cached and the sampler idle with failures")
    mark = looked.mark()
    time.sleep(WATCH_S)  # retries after 1 s, then 2 s: the failed keys only
    again = looked.since(mark)
    assert again and set(again) <= set(missing), sorted(set(again) - set(missing))[:5]
