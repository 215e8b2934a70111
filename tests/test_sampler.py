"""One sampler in this process (fetch loop, committer thread, a real cache) over ``memory://``.

A sampler holds at most ``sampler.max_bytes_in_flight`` between fetch and commit (issue 10,
item 7), counted in bytes from the listed sizes, not only in requests: followed from the moment
a fetch returns the bytes until their batch is finished with. And it stores samples the way the
config's ``cache`` section says.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest

from epochcache import Cache
from epochcache.config import EpochcacheConfig
from epochcache.ingest.sampler import Sampler

pytestmark = pytest.mark.timeout(120)

MiB = 1024**2


def _config(tmp_path: Path, name: str, **sampler: Any) -> EpochcacheConfig:
    config = EpochcacheConfig.model_validate({
        "source": {"url": f"memory://{name}", "pattern": "*.bin", "checks": []},
        "cache": {"dir": str(tmp_path / name), "capacity": "256MiB", "sync": False},
        "sampler": {"processes": 1, "concurrency": 8, "batch_size": 64, **sampler},
    })
    Cache(config.cache.dir, "256MiB").close()  # as the daemon creates it
    return config


def _run_until_cached(sampler: Sampler, stop: threading.Event, count: int) -> None:
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        while len(sampler.cache) < count and runner.is_alive():
            stop.wait(0.02)
    finally:
        stop.set()
        runner.join(60)
        sampler.close()
    assert not runner.is_alive()


def _peak_held(tmp_path: Path, name: str, limit: str | None) -> int:
    fs = fsspec.filesystem("memory")
    for i in range(24):  # incompressible: a batch's records hold as many bytes as its objects
        fs.pipe_file(f"/{name}/obj-{i:03d}.bin", random.Random(i).randbytes(MiB))
    config = _config(tmp_path, name, **({} if limit is None else {"max_bytes_in_flight": limit}))
    stop = threading.Event()
    sampler = Sampler(config, 0, stop)
    held, peak, lock = 0, 0, threading.Lock()
    fetch, done = sampler.source.fetch_with_retries, sampler._done

    def counting_fetch(refs: Any, **kwargs: Any) -> Any:
        nonlocal held, peak
        results = fetch(refs, **kwargs)
        with lock:
            held += sum(len(payload) for _, payload in results if isinstance(payload, bytes))
            peak = max(peak, held)
        return results

    def counting_done(batch: Any) -> None:
        nonlocal held
        with lock:
            held -= len(batch.keys) * MiB
        done(batch)

    sampler.source.fetch_with_retries = counting_fetch  # type: ignore[method-assign]
    sampler._done = counting_done  # type: ignore[method-assign]
    sampler.committer.done = counting_done
    _run_until_cached(sampler, stop, 24)
    return peak


def test_bytes_in_flight_stay_within_the_limit(tmp_path: Path) -> None:
    bounded = _peak_held(tmp_path, "bounded", "3MiB")
    unbounded = _peak_held(tmp_path, "default", None)  # 512 MiB: requests are the only bound
    assert bounded <= 3 * MiB, bounded / MiB
    assert unbounded > 3 * MiB, unbounded / MiB  # the measure can see more than the limit


def test_samplers_store_samples_with_the_configured_compression(tmp_path: Path) -> None:
    from epochcache.store.schema import Codec

    fs = fsspec.filesystem("memory")
    for i in range(10):
        fs.pipe_file(f"/plain/obj-{i:03d}.bin", b"compressible text " * 1000)
    config = _config(tmp_path, "plain")
    config.cache.compression = "none"  # the sampler used to ignore it (always zstd)
    stop = threading.Event()
    _run_until_cached(Sampler(config, 0, stop), stop, 10)
    with Cache(config.cache.dir, readonly=True) as cache:
        assert {cache.info(seq).codec for seq in range(10)} == {Codec.RAW}
